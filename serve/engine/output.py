"""The output processor: a request's sampled tokens turned into the text its client is sent, and delivered.

The engine's step hands it one token at a time per request. It detokenizes incrementally (`detokenizer`), ends
a request at EOS, at `max_tokens` or the context, or at a stop string, and holds back the last characters a stop
string could still complete, so a client never receives text that a stop string would have cut. Delivery calls
each request's callback outside the engine lock (a callback may block on a slow client's queue). The engine
decides what a finished request frees; this module only says that, and why, it finished.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serve.core.request import Request
from serve.engine.detokenizer import IncrementalDetokenizer, Vocabulary


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


Callback = Callable[[RequestOutput], None]


@dataclass
class Stream:
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


def merge(outputs: list[RequestOutput]) -> RequestOutput | None:
    """One output for the tokens a request emitted in one step (a verifying step may emit several)."""
    if len(outputs) <= 1:
        return outputs[0] if outputs else None
    last = outputs[-1]
    return dataclasses.replace(
        last,
        text="".join(o.text for o in outputs),
        token_ids=[t for o in outputs for t in o.token_ids],
    )


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokens that end an answer: the model's generation config's and the tokenizer's EOS ids."""
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for source in (getattr(generation, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return ids


class OutputProcessor:
    """The open streams and their callbacks (mutated under the engine lock), and the text each token adds."""

    def __init__(self, tokenizer: Any, eos: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocabulary = Vocabulary.of(tokenizer)
        self.eos_ids = eos
        self.streams: dict[str, Stream] = {}
        self.callbacks: dict[str, Callback] = {}

    def stream(self, request: Request, resumed: list[int], resume_chars: int) -> Stream:
        """A new request's stream; `resumed`: output tokens another engine delivered (their text, up to
        `resume_chars` characters, is not sent again)."""
        stream = Stream(
            request,
            IncrementalDetokenizer(self.tokenizer, self.vocabulary),
            sent=resume_chars,
            max_stop=max((len(s) for s in request.params.stop), default=0),
            resumed=resumed,
        )
        stream.text = stream.detokenizer.add(resumed)
        return stream

    def open(self, stream: Stream, callback: Callback) -> None:
        """Start delivering a queued request's outputs (its id checked unused before it was queued)."""
        request_id = stream.request.request_id
        self.streams[request_id] = stream
        self.callbacks[request_id] = callback

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def emits(self, request: Request, token: int) -> bool:
        """Whether `token` joins the request's output (EOS ends it instead, unless it ignores EOS)."""
        return request.params.ignore_eos or token not in self.eos_ids

    def append(self, stream: Stream, token: int, max_model_len: int) -> str | None:
        """Add a sampled token to the request and its text; the reason it finished, if it did (stop, length)."""
        request = stream.request
        params = request.params
        reason = None
        if not self.emits(request, token):
            reason = "stop"
        else:
            request.output_ids.append(token)
            stream.text += stream.detokenizer.add([token])
            if len(request.output_ids) >= params.max_tokens or request.num_tokens >= max_model_len:
                reason = "length"
        if reason is not None:
            stream.text += stream.detokenizer.flush()
        if params.stop and self._stopped(stream):
            reason = "stop"
        return reason

    @staticmethod
    def _stopped(stream: Stream) -> bool:
        """Whether the text holds one of the request's stop strings (a stop string can begin in the last
        `max_stop` characters sent); if so the text ends before the first."""
        start = max(0, stream.sent - stream.max_stop - stream.base)
        hits = [stream.text.find(stop, start) for stop in stream.request.params.stop]
        hits = [pos for pos in hits if pos >= 0]
        if hits:
            stream.text = stream.text[: min(hits)]
        return bool(hits)

    @staticmethod
    def unsent(stream: Stream, finished: bool) -> str:
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

    @staticmethod
    def output(stream: Stream, text: str, ids: list[int], finished: bool) -> RequestOutput:
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

    def deliver(self, outputs: list[RequestOutput], lock: threading.RLock) -> None:
        """Each output to its request's callback, outside `lock` (a finished request's callback is dropped)."""
        for output in outputs:
            with lock:
                if output.finished:
                    callback = self.callbacks.pop(output.request_id, None)
                else:
                    callback = self.callbacks.get(output.request_id)
            if callback is not None:
                callback(output)
