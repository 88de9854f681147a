"""The engine core: one step of continuous batching at a time, schedule, run, commit.

`Engine.step()` schedules under a lock (HTTP handlers add and abort requests from other threads), runs the model
without it, then commits progress and samples, handing each row's token to the output processor
(`serve.engine.output`: detokenizing, stop strings, delivery). An aborted or timed-out request frees its KV blocks
immediately; if it was in the batch being computed, its result is dropped when the step commits. `run()` loops on
a background thread until told to stop. The parts (pool, runner, KV cache manager, scheduler, KV offload,
speculator) are built from the nested config by `serve.engine.builder`; what the engine counts is
`serve.engine.accounting`.

Failures are isolated per request where they can be: a row whose own numbers fail (its sampling, stop matching
or detokenizing raises) finishes that request alone with finish_reason "error"; only a failure every row shares
(the model run) fails every request (`fail_all`). /metrics counts the two by `scope`.

With speculative decoding (`serve/speculative`), a step of few decodes first gets proposals (prompt lookup under
the lock, a draft model's steps outside it), the runner verifies them as extra rows, and the tokens each request
keeps are emitted together, its KV settled to them. The thread around the step is `serve.engine.loop`; the
controller's view of the engine is `serve.engine.controls`.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from quantize.runtime.modules import numerics, set_prefill_dtype
from serve.core.request import Owner, Request, SamplingParams, SharedChain
from serve.core.sampler import RowError, sample
from serve.core.scheduler import Scheduled, SchedulerOutput
from serve.engine.accounting import Accounting
from serve.engine.builder import build
from serve.engine.config import EngineConfig
from serve.engine.output import Callback, OutputProcessor, RequestOutput, Stream, eos_ids, merge
from serve.metrics import Metrics

_log = logging.getLogger("qpack.serve")

__all__ = ["Engine", "QueueFull"]


class QueueFull(Exception):
    """The waiting queue is at --max-queue: the caller should retry later (HTTP 429)."""


class Engine:
    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        config: EngineConfig = EngineConfig(),
        metrics: Metrics | None = None,
        draft: nn.Module | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics or Metrics()
        set_prefill_dtype(model, config.prefill_dtype)  # before the runner fuses q/k/v and gate/up
        parts = build(model, config, self.metrics, draft)
        model_config: Any = model.config  # a Hugging Face (or skeleton) config
        self.vocab_size = int(model_config.vocab_size)
        self.kv_bytes = parts.kv_bytes
        self.kv_bytes_per_token = parts.layout.bytes_per_token
        self.max_model_len = parts.max_model_len
        self.namespace = parts.namespace
        self.pool = parts.pool
        self.runner = parts.runner
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.offload = parts.offload
        self.speculator = parts.speculator
        self.output = OutputProcessor(tokenizer, eos_ids(model, tokenizer))
        self.accounting = Accounting(self.metrics, self.scheduler)
        self.stats = self.accounting.stats
        self.lock = threading.RLock()
        self.wakeup = threading.Condition(self.lock)
        self.paused = threading.Event()  # set: the loop stops stepping (maintenance; tests hold work queued)
        self.defer_to: Callable[[], bool] | None = None  # while True no step starts here (`prioritize`)

    @property
    def numeric_identity(self) -> str:
        return self.config.numeric_identity

    def numerics(self) -> dict[str, str | bool | None]:
        """How this engine computes (reported by `/v1/models` and benchmarks)."""
        return {**numerics(self.model), "batch_invariant": self.config.batch_invariant}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def streams(self) -> dict[str, Stream]:
        return self.output.streams

    # ------------------------------------------------------------------ requests (any thread)

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        callback: Callback,
        priority: int = 0,
        timeout: float | None = None,
        cache_salt: bytes = b"",
        owner: Owner = Owner(),
        shared: tuple[str, int] | None = None,
        resume_ids: list[int] | None = None,
        resume_chars: int = 0,
    ) -> None:
        """Queue a request. `owner`: its tenant and tier (from its API key) and the user and session it names
        inside that tenant; prefix-cache blocks are shared only within the tenant (and the `cache_salt`, and the
        user with `isolate_users`), except the leading tokens `shared` names, (a shared prefix's name, its token
        count), which tenants the tenants file lists together share. `resume_ids`/`resume_chars`: continue an
        answer another engine started (a fleet worker taking over from a dead one): those output tokens join the
        context, count as completion tokens, and the text of the first `resume_chars` characters is not sent
        again; `params.max_tokens` is what is left to generate."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        resumed = list(resume_ids or [])
        prompt_ids = [*prompt_ids, *resumed]
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens"
            )
        request = Request(
            request_id,
            list(prompt_ids),
            params,
            priority=priority,
            cache_salt=self.prefix_salt(owner, cache_salt),
            owner=owner,
            shared=(
                SharedChain(self._salt(b"shared", shared[0].encode()), shared[1])
                if shared is not None and not cache_salt
                else None
            ),
        )
        request.sample_offset = len(resumed)
        if timeout is not None:
            request.deadline = time.monotonic() + timeout
        stream = self.output.stream(request, resumed, resume_chars)
        with self.wakeup:
            if request_id in self.output.streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            if not self.scheduler.add(request):
                self.metrics.rejected.inc()
                raise QueueFull(f"the queue holds {self.scheduler.num_waiting} requests (--max-queue)")
            self.output.open(stream, callback)
            self.accounting.arrived(request)
            shed = self._take_shed()
            self.wakeup.notify()
        self._deliver(shed)

    def prefix_salt(self, owner: Owner, cache_salt: bytes = b"") -> bytes:
        """The salt of a request's own prefix chain: its tenant, its `cache_salt`, and its user when
        `isolate_users` is on. Requests share cached blocks only under one salt."""
        user = (owner.user or "").encode() if self.config.cache.isolate_users else b""
        return self._salt(b"tenant", owner.tenant.encode(), cache_salt, user)

    def _salt(self, *parts: bytes) -> bytes:
        """The root of a prefix chain: this engine's namespace and `parts`, each length-prefixed (no two lists
        of parts make the same salt)."""
        return self.namespace + b"".join(struct.pack("<I", len(part)) + part for part in parts)

    def _take_shed(self) -> list[RequestOutput]:
        """The final outputs of requests the scheduler let go for a higher tier's (finish reason `shed`)."""
        outputs = []
        for request in self.scheduler.shed:
            stream = self.output.streams.pop(request.request_id, None)
            if stream is not None:
                self.accounting.finished(request, "shed")
                outputs.append(self.output.output(stream, "", [], True))
        self.scheduler.shed.clear()
        return outputs

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Finish a request now and free its blocks; False if it was not running."""
        with self.wakeup:
            stream = self.output.streams.get(request_id)
            self.output.callbacks.pop(request_id, None)
            if stream is None:
                return False
            self._finish(stream, reason)
            self.accounting.gauges()
        return True

    def has_work(self) -> bool:
        with self.lock:
            return self.scheduler.has_work()

    def awaiting_first_token(self) -> list[Request]:
        """Queued requests and seated ones still in prefill (under the lock)."""
        pending = list(self.scheduler.waiting)
        return pending + [r for r in self.scheduler.running if r.first_token_time is None]

    # ------------------------------------------------------------------ the step (engine thread)

    def step(self) -> bool:
        """One scheduling iteration; False when there was nothing to run."""
        with self.lock:
            outputs = self._expire()
            scheduled: SchedulerOutput = self.scheduler.schedule()
            self.accounting.admitted(scheduled)
            self.accounting.gauges()
            plan = self.speculator.plan(scheduled, self.scheduler.running)
            batch = (
                self.runner.prepare(scheduled.scheduled) if scheduled.scheduled and not plan.wanted else None
            )
        if plan.wanted:
            self.speculator.draft(plan)
            with self.lock:
                self.speculator.attach(plan, self.scheduler)
                scheduled.scheduled = [i for i in scheduled.scheduled if not i.request.finished]
                batch = self.runner.prepare(scheduled.scheduled) if scheduled.scheduled else None
        self._deliver(outputs)
        if batch is None:
            return bool(outputs)
        started = time.perf_counter()
        logits = self.runner.run(batch)
        seconds = time.perf_counter() - started
        self.speculator.observe_step(scheduled, seconds)
        prefill_tokens = scheduled.num_tokens - batch.num_decode
        if self.offload is not None and prefill_tokens >= 4 * self.config.cache.block_size:
            self.offload.prefill_per_token.add(seconds / scheduled.num_tokens)
        with self.lock:
            self.scheduler.commit(scheduled)
            outputs += self._sample(scheduled, logits)
            self.accounting.gauges()
            self.accounting.stepped(scheduled)
        self._deliver(outputs)
        return True

    def _sample(self, scheduled: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        """Under the lock, after `commit`: each sampling request's next token, or the tokens a verifying request
        keeps of its proposal (then its KV is settled to them); their outputs, one per request."""
        plain: list[tuple[int, Scheduled]] = []
        verifying: list[tuple[int, Scheduled]] = []
        row = 0
        for item in self.runner.ordered(scheduled.scheduled):
            live = not item.request.finished and item.request.request_id in self.output.streams
            if live:
                (verifying if item.proposal else plain).append((row, item))
            row += 1 + len(item.proposal)
        outputs: list[RequestOutput] = []
        tokens = sample(logits[[r for r, _ in plain]], [i.request for _, i in plain]) if plain else []
        for (_row, item), token in zip(plain, tokens, strict=True):
            stream = self.output.streams[item.request.request_id]
            output = self._per_row(stream, partial(self._advance_sampled, stream, token))
            if output is not None:
                outputs.append(output)
        for row, item in verifying:
            stream = self.output.streams[item.request.request_id]
            rows = logits[row : row + 1 + len(item.proposal)]
            output = self._per_row(stream, partial(self._advance_verified, stream, item, rows))
            if output is not None:
                outputs.append(output)
        return outputs

    def _per_row(self, stream: Stream, work: Callable[[], RequestOutput | None]) -> RequestOutput | None:
        """`work` on one request's row of a step; if it raises (its own sampling, stop matching or decoding),
        that request alone finishes with 'error' and the step goes on."""
        try:
            return work()
        except Exception as error:
            request = stream.request
            message = f"{type(error).__name__}: {error}"
            _log.warning("request %s failed alone: %s", request.request_id, message)
            self.stats.extra["last_request_error"] = message
            self.accounting.failed("request")
            if request.finished:  # it failed after finishing: its final output still has to go out
                self.output.close(request.request_id)
                request.finish_reason = "error"
                return self.output.output(stream, "", [], True)
            return self._finish(stream, "error")

    def _advance_sampled(self, stream: Stream, token: int | RowError) -> RequestOutput | None:
        if isinstance(token, RowError):
            raise token
        return self._advance(stream, token)

    def _advance_verified(self, stream: Stream, item: Scheduled, rows: torch.Tensor) -> RequestOutput | None:
        """The tokens a verifying request keeps of its proposal, emitted; its KV settled to them."""
        request = stream.request
        verdict = self.speculator.verify(item, rows)
        emitted = []
        for index, token in enumerate(verdict.tokens):
            if request.finished:
                break
            # the tokens before this one are computed (the proposals the target kept): registered before
            # this one is emitted, as plain decoding registers them before sampling the next
            self.kv.settle(request, item.start + 1 + index, trim=False)
            emitted.append(self._advance(stream, token))
        self.kv.settle(request, item.start + 1 + verdict.accepted)
        return merge([o for o in emitted if o is not None])

    def _advance(self, stream: Stream, token: int) -> RequestOutput | None:
        """A sampled token through the output processor; the request finishes here when it says so."""
        request = stream.request
        now = time.monotonic()
        emitted = self.output.emits(request, token)
        self.accounting.token(request, now, emitted)
        reason = self.output.append(stream, token, self.max_model_len)
        finished = reason is not None
        delta = self.output.unsent(stream, finished)
        if reason is not None:
            self.scheduler.finish(request, reason)
            self.output.close(request.request_id)
            self.accounting.finished(request, reason)
            self.accounting.completed(request, now)
        new_ids = [token] if emitted else []
        if not delta and not finished and not new_ids:
            return None
        return self.output.output(stream, delta, new_ids, finished)

    def _finish(self, stream: Stream, reason: str) -> RequestOutput:
        """End a request early (abort, timeout, error): drop its stream, free its blocks, count it."""
        self.output.close(stream.request.request_id)
        self.scheduler.finish(stream.request, reason)
        self.accounting.finished(stream.request, reason)
        return self.output.output(stream, "", [], True)

    def _expire(self) -> list[RequestOutput]:
        now = time.monotonic()
        return [
            self._finish(stream, "timeout")
            for stream in list(self.output.streams.values())
            if stream.request.deadline is not None and now > stream.request.deadline
        ]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self.output.deliver(outputs, self.lock)

    def fail_all(self, message: str) -> None:
        """Finish every request with finish_reason 'error' (their blocks are freed) after a failed step."""
        with self.lock:
            self.stats.extra["last_error"] = message
            outputs = [self._finish(stream, "error") for stream in list(self.output.streams.values())]
            self.accounting.failed("step", len(outputs))
            self.accounting.gauges()
        self._deliver(outputs)

    def wake(self) -> None:
        with self.wakeup:
            self.wakeup.notify_all()

    # ------------------------------------------------------------------ stored sessions (any thread)

    def forget_sessions(
        self,
        tenant: str,
        user: str | None = None,
        session_id: str | None = None,
        before: float | None = None,
    ) -> int | None:
        """Delete a tenant's session's (or user's) stored KV from every offload store; the number of blocks
        removed, None when the tenant has no such session (what another tenant's session looks like too). Finding
        and deleting the stored blocks never takes the engine lock; only unregistering them from the pool's prefix
        cache does, briefly (call it off the event loop: it may wait for a step to end). `before`: only sessions
        last used before then (a deletion replayed after a restart)."""
        if self.offload is None:
            return None
        return self.offload.forget(tenant, user, session_id, self.lock, before)

    def close(self) -> None:
        """Write out what the KV offload still has queued (a draining server calls this last)."""
        if self.offload is not None:
            self.offload.manager.close()
