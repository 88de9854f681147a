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
from fastapi.responses import JSONResponse, Response, StreamingResponse


def create_naive_app(model: torch.nn.Module, tokenizer: Any, name: str) -> FastAPI:
    from transformers import TextIteratorStreamer

    app = FastAPI(title="naive HF generate server")
    lock = asyncio.Lock()

    def ids_for(body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(tokenizer(body["prompt"], add_special_tokens=True)["input_ids"])

    def generate_kwargs(body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        max_new = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        kwargs: dict[str, Any] = {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "max_new_tokens": max_new,
            "do_sample": temperature > 0,
            "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        }
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=float(body.get("top_p", 1.0)))
        if body.get("ignore_eos"):
            kwargs.update(min_new_tokens=max_new, eos_token_id=None)
        return kwargs

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(await request.json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(await request.json(), chat=True)

    async def handle(body: dict[str, Any], chat: bool) -> Response:
        ids = ids_for(body)
        kwargs = generate_kwargs(body, ids)
        request_id = uuid.uuid4().hex
        kind = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            async with lock:
                out = await asyncio.to_thread(lambda: model.generate(**kwargs))
            new = out[0, len(ids) :].tolist()
            text = tokenizer.decode(new, skip_special_tokens=True)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            usage = {
                "prompt_tokens": len(ids),
                "completion_tokens": len(new),
                "total_tokens": len(ids) + len(new),
            }
            return JSONResponse(
                {
                    "id": request_id,
                    "object": kind,
                    "model": name,
                    "choices": [{**choice, "finish_reason": "length"}],
                    "usage": usage,
                }
            )

        async def events() -> AsyncIterator[str]:
            async with lock:
                streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
                holder: dict[str, Any] = {}

                def work() -> None:
                    with torch.inference_mode():
                        holder["out"] = model.generate(**kwargs, streamer=streamer)

                thread = threading.Thread(target=work, daemon=True)
                thread.start()
                iterator = iter(streamer)
                while True:
                    piece = await asyncio.to_thread(next, iterator, None)
                    if piece is None:
                        break
                    if piece:
                        choice = (
                            {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                        )
                        yield f"data: {json.dumps({'id': request_id, 'object': kind, 'model': name, 'choices': [choice]})}\n\n"
                await asyncio.to_thread(thread.join)
            completion = int(holder["out"].shape[1]) - len(ids)
            usage = {
                "prompt_tokens": len(ids),
                "completion_tokens": completion,
                "total_tokens": len(ids) + completion,
            }
            yield f"data: {json.dumps({'id': request_id, 'object': kind, 'model': name, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "naive"}]}

    return app


def main() -> None:
    import uvicorn

    from quantize.models import load_model, load_tokenizer, resolve_model

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
