"""The serving engine: scheduler + model runner + sampling + detokenization, one step at a time.

`Engine.step()` is one iteration of continuous batching: schedule (under a lock, since HTTP handlers add and
abort requests from other threads), run the model without the lock, then commit progress, sample, detokenize
incrementally, apply stop conditions and hand each request its new text through its callback. An aborted or
timed-out request frees its KV blocks immediately; if it was in the batch being computed, its result is
dropped when the step commits. `run()` loops on a background thread until told to stop.

Failures are isolated per request where they can be: a row whose own numbers fail (its sampling, stop matching
or detokenizing raises) finishes that request alone with finish_reason "error"; only a failure every row shares
(the model run) fails every request (`_fail_all`). /metrics counts the two by `scope`.

With speculative decoding (`serve/speculative`), a step of few decodes first gets proposals (prompt lookup under
the lock, a draft model's steps outside it), the runner verifies them as extra rows, and the tokens each request
keeps are emitted together, its KV settled to them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize.runtime.kernels import ops as kernels
from quantize.runtime.modules import numerics, set_prefill_dtype
from serve.block_pool import BlockPool
from serve.control.controller import Knobs, Load
from serve.detokenizer import IncrementalDetokenizer, Vocabulary
from serve.kv_cache import KVLayout, parse_memory
from serve.metrics import Metrics
from serve.request import Owner, Request, SamplingParams, SharedChain
from serve.runner import ModelRunner
from serve.sampler import RowError, sample
from serve.scheduler import Scheduled, Scheduler, SchedulerConfig, SchedulerOutput
from serve.speculative.draft import DraftModel
from serve.speculative.policy import SpeculationPolicy
from serve.speculative.speculator import Speculator
from serve.tiers.adapter import TierAdapter
from serve.tiers.codec import BlockLayout
from serve.tiers.stores import DiskStore, HostStore
from serve.tiers.tiered import TieredKV

_log = logging.getLogger("qpack.serve")


class QueueFull(Exception):
    """The waiting queue is at --max-queue: the caller should retry later (HTTP 429)."""


def write_queue_bytes(kv_host_memory: int) -> int:
    """Room for the write-through queue's block copies: 5% of the host tier, at least 16 MiB. With the writer's
    own few blocks in flight this keeps a large T1 within --kv-host-memory + 10%; a T1 under ~320 MiB pays the
    16 MiB floor above that."""
    return max(16 * 2**20, kv_host_memory // 20)


@dataclass(frozen=True)
class EngineConfig:
    # 8-token blocks: a sequence's unfilled last block (the KV waste) averages 3.5 slots, under 4% of the
    # allocation at ShareGPT lengths (16-token blocks measured 4.4-4.7% at peak).
    block_size: int = 8
    kv_memory: str | float | int = "512MB"
    kv_dtype: torch.dtype = torch.float32
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 32
    max_queue: int = 256
    prefill_chunk: int | None = None  # prompt tokens one request prefills per step (None: the step budget)
    admission_wait: float = 0.0  # seconds an arriving request may be held to batch it with later ones
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    device: str = "cpu"
    # torch.compile the decode step (minutes of warm-up, fewer per-op overheads) for the decode steps the fused
    # native step doesn't cover (more than kernels.max_rows() sequences, layers it can't run, no native kernels)
    compile: bool = False
    # every token through the fused native step and the native LM head, so that a token's KV and logits don't
    # depend on the batch or on whether its prefix was reused (serve/runner.py); prefill is slower
    batch_invariant: bool = False
    # the precision of prefill-sized GEMMs of int8/int4 linears (quantize.runtime.modules.PREFILL_DTYPES): float32 on every
    # CPU unless asked; bfloat16 prefills faster where the CPU has AMX-BF16/AVX512-BF16, at a measured KL cost
    prefill_dtype: str = "float32"
    # tiers below the pool (serve/tiers): host memory and a directory, each bounded in bytes (0: off)
    kv_host_memory: int = 0
    kv_disk: str | None = None
    kv_disk_size: int = 0
    kv_codec: str = "zstd"
    session_ttl: float | None = None
    isolate_users: bool = False  # salt every request's prefix chain with its `user`
    model_hash: str = ""  # the artifact's content hash: stored blocks of another version are never read
    # speculative decoding (serve/speculative): off, ngram (prompt lookup), draft (a draft model), auto (both)
    speculative: str = "off"
    speculative_k: int = 8  # most tokens proposed per step
    speculative_max_batch: int = 4  # decoding sequences above which a step doesn't speculate
    draft_kv_memory: str | float | int = "128MB"


@dataclass
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass
class _Stream:
    """A request's output text as it streams: `text` is the decoded text from character `base` on (what is not
    sent yet, and the last `max_stop` characters sent, where a stop string may begin); `sent` counts the
    characters sent so far."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    base: int = 0
    sent: int = 0
    max_stop: int = 0
    resumed: list[int] = field(default_factory=list)  # output tokens another engine already delivered


@dataclass
class EngineStats:
    peak_kv_waste: float = 0.0
    peak_kv_allocated: int = 0
    peak_running: int = 0
    steps: int = 0
    finished: int = 0  # requests finished so far, however they ended
    tokens: int = 0  # tokens computed so far (prompt chunks and decodes)
    served: int = 0  # finished requests that ran (were seated)
    served_tokens: int = 0  # their prompt and output tokens
    extra: dict[str, Any] = field(default_factory=dict)


def _merge(outputs: list[RequestOutput]) -> RequestOutput | None:
    """One output for the tokens a request emitted in one step (a verifying step may emit several)."""
    if len(outputs) <= 1:
        return outputs[0] if outputs else None
    last = outputs[-1]
    return dataclasses.replace(
        last,
        text="".join(o.text for o in outputs),
        token_ids=[t for o in outputs for t in o.token_ids],
    )


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
        device = torch.device(config.device)
        model_config: Any = (
            model.config
        )  # a Hugging Face (or skeleton) config, not the Module torch types it as
        self.vocab_size = int(model_config.vocab_size)
        layout = KVLayout.of(model_config, config.kv_dtype)
        per_token = layout.bytes_per_token
        self.kv_bytes = parse_memory(config.kv_memory, device)
        num_blocks = layout.blocks_within(self.kv_bytes, config.block_size)
        if num_blocks < 2:
            raise ValueError(
                f"--kv-memory {config.kv_memory} holds {num_blocks} blocks of {config.block_size} tokens "
                f"({per_token} bytes per token); give it more memory"
            )
        self.kv_bytes_per_token = per_token
        position_limit = int(getattr(model_config, "max_position_embeddings", 2048))
        self.max_model_len = min(
            config.max_model_len or position_limit, position_limit, num_blocks * config.block_size
        )
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.runner = ModelRunner(
            model,
            layout,
            num_blocks,
            config.block_size,
            device,
            config.compile,
            batch_invariant=config.batch_invariant,
        )
        self.namespace = hashlib.sha256(
            f"qpack-kv-v1|{self.numeric_identity}|{config.kv_dtype}|{config.block_size}".encode()
        ).digest()
        self.tiers = self._tiers(layout)
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=config.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_queue=config.max_queue,
                max_model_len=self.max_model_len,
                prefill_chunk=config.prefill_chunk,
                admission_wait=config.admission_wait,
            ),
            self.pool,
            self.tiers.fetch if self.tiers is not None else None,
            self.tiers.on_register if self.tiers is not None else None,
        )
        self.speculator = self._speculator(draft, device)
        self.eos_ids = self._eos_ids()
        self.vocabulary = Vocabulary.of(tokenizer)
        self.streams: dict[str, _Stream] = {}
        self._callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self.stats = EngineStats()
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self.paused = threading.Event()  # set: the loop stops stepping (maintenance; tests hold work queued)
        self.defer_to: Callable[[], bool] | None = None  # while True no step starts here (`prioritize`)
        self.metrics.kv_blocks_total.set(num_blocks)

    def _speculator(self, draft: nn.Module | None, device: torch.device) -> Speculator:
        """Speculative decoding as the config asks (off: a speculator that never proposes)."""
        config = self.config
        return Speculator(
            SpeculationPolicy(
                config.speculative, k_max=config.speculative_k, max_batch=config.speculative_max_batch
            ),
            DraftModel(
                draft, parse_memory(config.draft_kv_memory, device), config.block_size, config.kv_dtype
            )
            if draft is not None and config.speculative in ("draft", "auto")
            else None,
            self.runner.exact_rows(),
            self.max_model_len,
            self.metrics,
        )

    @property
    def numeric_identity(self) -> str:
        """What a KV block's bits depend on besides its tokens: the model's content and the numeric path (prefill
        dtype, batch-invariant mode). Cached and stored blocks are keyed by it, so a server never reuses blocks
        another path computed."""
        config = self.config
        return f"{config.model_hash}|prefill={config.prefill_dtype}|invariant={int(config.batch_invariant)}"

    def numerics(self) -> dict[str, str | bool | None]:
        """How this engine computes (reported by `/v1/models` and benchmarks)."""
        return {**numerics(self.model), "batch_invariant": self.config.batch_invariant}

    def _tiers(self, layout: KVLayout) -> TierAdapter | None:
        """T1 (host memory) and T2 (disk) when configured, keyed under this engine's namespace."""
        config = self.config
        if not config.kv_host_memory and not config.kv_disk:
            return None
        block_layout = BlockLayout(
            hashlib.sha256(self.numeric_identity.encode()).digest(),
            config.kv_dtype,
            config.block_size,
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
        )
        host = HostStore(config.kv_host_memory) if config.kv_host_memory else None
        disk = DiskStore(Path(config.kv_disk), config.kv_disk_size) if config.kv_disk else None
        tiers = TieredKV(
            block_layout,
            host,
            disk,
            config.kv_codec,
            queue_bytes=write_queue_bytes(config.kv_host_memory),
            session_ttl=config.session_ttl,
            on_event=self.metrics.tier_event,
        )
        return TierAdapter(tiers, self.pool, self.runner, config.block_size)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        generation = getattr(self.model, "generation_config", None)
        for source in (
            getattr(generation, "eos_token_id", None),
            getattr(self.tokenizer, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list | tuple):
                ids.update(int(i) for i in source)
        return ids

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # ------------------------------------------------------------------ requests (any thread)

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        callback: Callable[[RequestOutput], None],
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
        stream = _Stream(
            request,
            IncrementalDetokenizer(self.tokenizer, self.vocabulary),
            sent=resume_chars,
            max_stop=max((len(s) for s in params.stop), default=0),
            resumed=resumed,
        )
        stream.text = stream.detokenizer.add(resumed)
        with self._wake:
            if request_id in self.streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            if not self.scheduler.add(request):
                self.metrics.rejected.inc()
                raise QueueFull(f"the queue holds {self.scheduler.num_waiting} requests (--max-queue)")
            self.streams[request_id] = stream
            self._callbacks[request_id] = callback
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            self.metrics.tenants.tokens.labels(owner.tenant, owner.tier, "prompt").inc(len(prompt_ids))
            shed = self._take_shed()
            self._wake.notify()
        self._deliver(shed)

    def prefix_salt(self, owner: Owner, cache_salt: bytes = b"") -> bytes:
        """The salt of a request's own prefix chain: its tenant, its `cache_salt`, and its user when
        `isolate_users` is on. Requests share cached blocks only under one salt."""
        user = (owner.user or "").encode() if self.config.isolate_users else b""
        return self._salt(b"tenant", owner.tenant.encode(), cache_salt, user)

    def _take_shed(self) -> list[RequestOutput]:
        """The final outputs of requests the scheduler let go for a higher tier's (finish reason `shed`)."""
        outputs = []
        for request in self.scheduler.shed:
            stream = self.streams.pop(request.request_id, None)
            if stream is not None:
                self._count_finished(request, "shed")
                outputs.append(self._output(stream, "", [], True))
        self.scheduler.shed.clear()
        return outputs

    def configure(self, knobs: Knobs) -> None:
        """Set the scheduler's knobs (a controller's decision), from the next step on."""
        with self._wake:
            self.scheduler.config = dataclasses.replace(
                self.scheduler.config,
                max_num_seqs=knobs.max_num_seqs,
                max_num_batched_tokens=knobs.max_num_batched_tokens,
                prefill_chunk=knobs.prefill_chunk,
                admission_wait=knobs.admission_wait,
                top_tier_tokens=knobs.top_tier_tokens,
            )
            self.speculator.enabled = knobs.speculate and self.speculator.policy.mode != "off"
            self._wake.notify()

    def load(self) -> Load:
        """What a controller reads of this engine: per tier, the requests still waiting for their first token
        (queued, or seated but still prefilling: a batch of many seats hides a queue of prompts) and how long the
        oldest of them has waited; running requests; how many wait for a seat (saturation); and counts so far, which the controller takes differences
        of: requests finished, tokens computed, requests served and their tokens."""
        now = time.monotonic()
        with self._lock:
            waiting: dict[str, int] = {}
            oldest: dict[str, float] = {}
            for request in self._awaiting_first_token():
                tier = request.owner.tier
                waiting[tier] = waiting.get(tier, 0) + 1
                oldest[tier] = max(oldest.get(tier, 0.0), now - request.arrival_time)
            stats = self.stats
            return Load(
                waiting,
                len(self.scheduler.running),
                stats.finished,
                oldest,
                stats.tokens,
                stats.served,
                stats.served_tokens,
                queued=self.scheduler.num_waiting,
            )

    def _salt(self, *parts: bytes) -> bytes:
        """The root of a prefix chain: this engine's namespace and `parts`, each length-prefixed (no two lists
        of parts make the same salt)."""
        return self.namespace + b"".join(struct.pack("<I", len(part)) + part for part in parts)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Finish a request now and free its blocks; False if it was not running."""
        with self._wake:
            stream = self.streams.get(request_id)
            self._callbacks.pop(request_id, None)
            if stream is None:
                return False
            self._finish(stream, reason)
            self._update_gauges()
        return True

    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work()

    # ------------------------------------------------------------------ the loop (engine thread)

    def _finish(self, stream: _Stream, reason: str) -> RequestOutput:
        """End a request early (abort, timeout, error): drop its stream, free its blocks, count it."""
        self.streams.pop(stream.request.request_id, None)
        self.scheduler.finish(stream.request, reason)
        self._count_finished(stream.request, reason)
        return self._output(stream, "", [], True)

    def _count_finished(self, request: Request, reason: str) -> None:
        self.stats.finished += 1
        if request.admitted_time is not None:
            self.stats.served += 1
            self.stats.served_tokens += len(request.prompt_ids) + len(request.output_ids)
        owner = request.owner
        self.metrics.requests.labels(finish_reason=reason).inc()
        self.metrics.tenants.tokens.labels(owner.tenant, owner.tier, "completion").inc(
            len(request.output_ids)
        )

    def _expire(self) -> list[RequestOutput]:
        now = time.monotonic()
        return [
            self._finish(stream, "timeout")
            for stream in list(self.streams.values())
            if stream.request.deadline is not None and now > stream.request.deadline
        ]

    def _output(self, stream: _Stream, text: str, ids: list[int], finished: bool) -> RequestOutput:
        request = stream.request
        return RequestOutput(
            request_id=request.request_id,
            text=text,
            token_ids=ids,
            finished=finished,
            finish_reason=request.finish_reason,
            prompt_tokens=len(request.prompt_ids) - len(stream.resumed),
            completion_tokens=len(stream.resumed) + len(request.output_ids),
            cached_tokens=request.cached_prompt_tokens,
        )

    def _update_gauges(self) -> None:
        allocated, unused = self.scheduler.kv_waste()
        ratio = unused / allocated if allocated else 0.0
        if allocated > self.stats.peak_kv_allocated:
            self.stats.peak_kv_allocated = allocated
            self.stats.peak_kv_waste = ratio
        self.metrics.kv_waste.set(ratio)
        self.metrics.queue_depth.set(self.scheduler.num_waiting)
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.kv_blocks_used.set(self.pool.num_used)
        self.metrics.prefix_hit_rate.set(self.pool.hit_rate)
        self.stats.peak_running = max(self.stats.peak_running, len(self.scheduler.running))

    def _advance(self, stream: _Stream, token: int) -> RequestOutput | None:
        request = stream.request
        now = time.monotonic()
        params = request.params
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.ttft.observe(now - request.arrival_time)
            self.metrics.cached_prompt_tokens.inc(request.cached_prompt_tokens)
        request.last_token_time = now
        reason = None
        if not params.ignore_eos and token in self.eos_ids:
            reason = "stop"
        else:
            request.output_ids.append(token)
            self.metrics.generated_tokens.inc()
            stream.text += stream.detokenizer.add([token])
            if len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            stream.text += stream.detokenizer.flush()
        if params.stop and self._stopped(stream):
            reason = "stop"
        finished = reason is not None
        delta = self._unsent(stream, finished)
        if finished:
            self.scheduler.finish(request, reason)  # type: ignore[arg-type]
            self.streams.pop(request.request_id, None)
            self._count_finished(request, reason)  # type: ignore[arg-type]
            self.metrics.e2e.observe(now - request.arrival_time)
            if len(request.output_ids) > 1 and request.first_token_time is not None:
                self.metrics.tpot.observe((now - request.first_token_time) / (len(request.output_ids) - 1))
        new_ids = [token] if (params.ignore_eos or token not in self.eos_ids) else []
        if not delta and not finished and not new_ids:
            return None
        return self._output(stream, delta, new_ids, finished)

    @staticmethod
    def _stopped(stream: _Stream) -> bool:
        """Whether the text holds one of the request's stop strings (a stop string can begin in the last
        `max_stop` characters sent); if so the text ends before the first."""
        start = max(0, stream.sent - stream.max_stop - stream.base)
        hits = [stream.text.find(stop, start) for stop in stream.request.params.stop]
        hits = [pos for pos in hits if pos >= 0]
        if hits:
            stream.text = stream.text[: min(hits)]
        return bool(hits)

    @staticmethod
    def _unsent(stream: _Stream, finished: bool) -> str:
        """The text to send now: all of it when finished, else all but the last max_stop - 1 characters (a stop
        string may still complete there); the text is then cut to what a later stop string could touch."""
        end = stream.base + len(stream.text)
        limit = end if finished or not stream.max_stop else end - stream.max_stop + 1
        limit = max(limit, stream.sent)
        delta = stream.text[stream.sent - stream.base : limit - stream.base]
        stream.sent = limit
        cut = max(0, min(len(stream.text), stream.sent - stream.max_stop - stream.base))
        stream.text, stream.base = stream.text[cut:], stream.base + cut
        return delta

    def step(self) -> bool:
        """One scheduling iteration; False when there was nothing to run."""
        with self._lock:
            outputs = self._expire()
            scheduled: SchedulerOutput = self.scheduler.schedule()
            if scheduled.preempted:
                self.metrics.preemptions.inc(len(scheduled.preempted))
            self._count_admitted(scheduled)
            self._update_gauges()
            plan = self.speculator.plan(scheduled, self.scheduler.running)
            batch = (
                self.runner.prepare(scheduled.scheduled) if scheduled.scheduled and not plan.wanted else None
            )
        if plan.wanted:
            self.speculator.draft(plan)
            with self._lock:
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
        if self.tiers is not None and prefill_tokens >= 4 * self.config.block_size:
            self.tiers.prefill_per_token.add(seconds / scheduled.num_tokens)
        with self._lock:
            self.scheduler.commit(scheduled)
            outputs += self._sample(scheduled, logits)
            self._update_gauges()
            self.stats.steps += 1
            self.stats.tokens += scheduled.num_tokens
            self.metrics.steps.inc()
        self._deliver(outputs)
        return True

    def _sample(self, scheduled: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        """Under the lock, after `commit`: each sampling request's next token, or the tokens a verifying request
        keeps of its proposal (then its KV is settled to them); their outputs, one per request."""
        plain: list[tuple[int, Scheduled]] = []
        verifying: list[tuple[int, Scheduled]] = []
        row = 0
        for item in self.runner.ordered(scheduled.scheduled):
            live = not item.request.finished and item.request.request_id in self.streams
            if live:
                (verifying if item.proposal else plain).append((row, item))
            row += 1 + len(item.proposal)
        outputs: list[RequestOutput] = []
        tokens = sample(logits[[r for r, _ in plain]], [i.request for _, i in plain]) if plain else []
        for (_row, item), token in zip(plain, tokens, strict=True):
            stream = self.streams[item.request.request_id]
            output = self._per_row(stream, partial(self._advance_sampled, stream, token))
            if output is not None:
                outputs.append(output)
        for row, item in verifying:
            stream = self.streams[item.request.request_id]
            rows = logits[row : row + 1 + len(item.proposal)]
            output = self._per_row(stream, partial(self._advance_verified, stream, item, rows))
            if output is not None:
                outputs.append(output)
        return outputs

    def _per_row(self, stream: _Stream, work: Callable[[], RequestOutput | None]) -> RequestOutput | None:
        """`work` on one request's row of a step; if it raises (its own sampling, stop matching or decoding),
        that request alone finishes with 'error' and the step goes on."""
        try:
            return work()
        except Exception as error:
            request = stream.request
            message = f"{type(error).__name__}: {error}"
            _log.warning("request %s failed alone: %s", request.request_id, message)
            self.stats.extra["last_request_error"] = message
            self.metrics.request_errors.labels(scope="request").inc()
            if request.finished:  # it failed after finishing: its final output still has to go out
                self.streams.pop(request.request_id, None)
                request.finish_reason = "error"
                return self._output(stream, "", [], True)
            return self._finish(stream, "error")

    def _advance_sampled(self, stream: _Stream, token: int | RowError) -> RequestOutput | None:
        if isinstance(token, RowError):
            raise token
        return self._advance(stream, token)

    def _advance_verified(self, stream: _Stream, item: Scheduled, rows: torch.Tensor) -> RequestOutput | None:
        """The tokens a verifying request keeps of its proposal, emitted; its KV settled to them."""
        request = stream.request
        verdict = self.speculator.verify(item, rows)
        emitted = []
        for index, token in enumerate(verdict.tokens):
            if request.finished:
                break
            # the tokens before this one are computed (the proposals the target kept): registered before
            # this one is emitted, as plain decoding registers them before sampling the next
            self.scheduler.settle(request, item.start + 1 + index, trim=False)
            emitted.append(self._advance(stream, token))
        self.scheduler.settle(request, item.start + 1 + verdict.accepted)
        return _merge([o for o in emitted if o is not None])

    def _count_admitted(self, scheduled: SchedulerOutput) -> None:
        """Queue time, per tenant and tier, of the requests that got their first seat this step."""
        now = time.monotonic()
        for item in scheduled.scheduled:
            request = item.request
            if request.admitted_time is None:
                request.admitted_time = now
                owner = request.owner
                self.metrics.tenants.queue.labels(owner.tenant, owner.tier).observe(
                    now - request.arrival_time
                )

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._lock:
                if output.finished:
                    callback = self._callbacks.pop(output.request_id, None)
                else:
                    callback = self._callbacks.get(output.request_id)
            if callback is not None:
                callback(output)

    def top_tier_pending(self, waited: float = 0.0) -> bool:
        """Whether a request of the top tier (rank 0) has waited `waited` seconds or more here for its first
        token."""
        since = time.monotonic() - waited
        with self._lock:
            return any(
                r.owner.tier_rank == 0 and r.arrival_time <= since for r in self._awaiting_first_token()
            )

    def _awaiting_first_token(self) -> list[Request]:
        """Queued requests and seated ones still in prefill (under the lock)."""
        pending = list(self.scheduler.waiting)
        return pending + [r for r in self.scheduler.running if r.first_token_time is None]

    def run(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        deferred: float | None = None  # since when this loop has given way to `defer_to`
        while not stop.is_set():
            if self.paused.is_set():
                time.sleep(idle_wait)
                continue
            if self.defer_to is not None and self.defer_to():
                deferred = deferred if deferred is not None else time.monotonic()
                if time.monotonic() - deferred < 1.0:  # never starved: at most a second at a time
                    time.sleep(0.002)
                    continue
            deferred = None
            try:
                progressed = self.step()
            except Exception as error:  # the loop must outlive one bad step: fail its requests, go on
                _log.exception("engine step failed")
                self._fail_all(f"{type(error).__name__}: {error}")
                progressed = True
            if not progressed:
                with self._wake:
                    if not self.scheduler.has_work() and not stop.is_set():
                        self._wake.wait(timeout=idle_wait)

    def warmup(self) -> None:
        """Run one short request alone, then two together, then more than the fused native step takes, before
        traffic arrives: a compiled decode step builds its graphs (batch 1 and batch > 1) here instead of
        stalling the first users."""
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        crowd = [f"warmup-crowd-{i}" for i in range(kernels.max_rows() + 1)]
        for group in (["warmup-0"], ["warmup-1", "warmup-2"], crowd):
            for request_id in group:
                self.add(request_id, [1, 2, 3, 4, 5], params, lambda _output: None)
            while self.has_work():
                self.step()

    def _fail_all(self, message: str) -> None:
        """Finish every request with finish_reason 'error' (their blocks are freed) after a failed step."""
        with self._lock:
            self.stats.extra["last_error"] = message
            outputs = [self._finish(stream, "error") for stream in list(self.streams.values())]
            self.metrics.request_errors.labels(scope="step").inc(len(outputs))
            self._update_gauges()
        self._deliver(outputs)

    def forget_sessions(
        self,
        tenant: str,
        user: str | None = None,
        session_id: str | None = None,
        before: float | None = None,
    ) -> int | None:
        """Delete a tenant's session's (or user's) stored KV from every tier; the number of blocks removed, None
        when the tenant has no such session (what another tenant's session looks like too). Finding and deleting
        the stored blocks never takes the engine lock; only unregistering them from the pool's prefix cache
        does, briefly (call it off the event loop: it may wait for a step to end). `before`: only sessions last used
        before then (a deletion replayed after a restart)."""
        if self.tiers is None:
            return None
        return self.tiers.forget(tenant, user, session_id, self._lock, before)

    def close(self) -> None:
        """Write out what the tiers still have queued (a draining server calls this last)."""
        if self.tiers is not None:
            self.tiers.tiers.close()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify_all()
