"""The baseline users would build by hand: Hugging Face `generate`, one request at a time, same HTTP API.

It speaks the same OpenAI subset as `qpack serve` (completions and chat, streaming with usage, greedy or
sampled, `ignore_eos`), so the load generator drives both identically and the ratio measures the engine, not
the protocol. Requests queue on a lock: that serialisation is exactly what continuous batching removes.

    python -m qpack.bench.naive --model smollm2-135m --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from serve.core.request import GREEDY_TEMPERATURE


class NaiveGenerator:
    """One `generate` call per request, one request at a time (the lock), streamed or whole."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, name: str) -> None:
        from transformers import GenerationMixin

        if not isinstance(model, GenerationMixin):
            raise TypeError(f"the naive server runs `generate`, which {type(model).__name__} lacks")
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.lock = asyncio.Lock()

    def ids_for(self, body: dict[str, Any]) -> list[int]:
        tokenizer = self.tokenizer
        if "messages" in body:
            text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(tokenizer(body["prompt"], add_special_tokens=True)["input_ids"])

    def generate_kwargs(self, body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        max_new = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        pad = self.tokenizer.pad_token_id
        kwargs: dict[str, Any] = {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "max_new_tokens": max_new,
            "do_sample": temperature >= GREEDY_TEMPERATURE,
            "pad_token_id": pad if pad is not None else 0,
        }
        if temperature >= GREEDY_TEMPERATURE:
            kwargs.update(temperature=temperature, top_p=float(body.get("top_p", 1.0)))
        if body.get("ignore_eos"):
            kwargs.update(min_new_tokens=max_new, eos_token_id=None)
        return kwargs

    def _body(self, request_id: str, chat: bool, **fields: Any) -> str:
        kind = "chat.completion" if chat else "text_completion"
        return json.dumps({"id": request_id, "object": kind, "model": self.name, **fields})

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def complete(self, body: dict[str, Any], chat: bool) -> Response:
        ids = self.ids_for(body)
        kwargs = self.generate_kwargs(body, ids)
        async with self.lock:
            out = await asyncio.to_thread(lambda: self.model.generate(**kwargs))
        new = out[0, len(ids) :].tolist()
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text}
        )
        body_text = self._body(
            uuid.uuid4().hex,
            chat,
            choices=[{**choice, "finish_reason": "length"}],
            usage=self._usage(len(ids), len(new)),
        )
        return Response(body_text, media_type="application/json")

    async def stream(self, body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        from transformers import TextIteratorStreamer

        ids = self.ids_for(body)
        kwargs = self.generate_kwargs(body, ids)
        request_id = uuid.uuid4().hex
        async with self.lock:
            streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
            holder: dict[str, Any] = {}

            def work() -> None:
                with torch.inference_mode():
                    holder["out"] = self.model.generate(**kwargs, streamer=streamer)

            thread = threading.Thread(target=work, daemon=True)
            thread.start()
            iterator = iter(streamer)
            while (piece := await asyncio.to_thread(next, iterator, None)) is not None:
                if piece:
                    choice = (
                        {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                    )
                    yield f"data: {self._body(request_id, chat, choices=[choice])}\n\n"
            await asyncio.to_thread(thread.join)
        completion = int(holder["out"].shape[1]) - len(ids)
        yield f"data: {self._body(request_id, chat, choices=[], usage=self._usage(len(ids), completion))}\n\n"
        yield "data: [DONE]\n\n"


def create_naive_app(model: torch.nn.Module, tokenizer: Any, name: str) -> FastAPI:
    app = FastAPI(title="naive HF generate server")
    generator = NaiveGenerator(model, tokenizer, name)

    async def handle(request: Request, chat: bool) -> Response:
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(generator.stream(body, chat), media_type="text/event-stream")
        return await generator.complete(body, chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, chat=True)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "naive"}]}

    return app


def main() -> None:
    import uvicorn

    from quantize.model.sources import load_model, load_tokenizer, resolve_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    source = resolve_model(args.model)
    model, tokenizer = load_model(source), load_tokenizer(source)
    uvicorn.run(
        create_naive_app(model, tokenizer, source.model_id),
        host=args.host,
        port=args.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
