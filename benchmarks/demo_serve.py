"""The last step of `make demo`: serve an artifact on loopback, ask it one chat question, stream the answer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from serve.engine.config import CacheConfig, EngineConfig
from serve.http import BackgroundServer
from serve.loading import build_engine, describe, load_for_serving
from serve.openai import ServerInfo


def main() -> None:
    artifact = Path(sys.argv[1] if len(sys.argv) > 1 else "out/artifact")
    loaded = load_for_serving(str(artifact))
    engine = build_engine(loaded, EngineConfig(cache=CacheConfig(memory="256MB")))
    print(describe(engine))
    with BackgroundServer(engine, ServerInfo(loaded.name, loaded.version)) as url:
        print(f"serving {loaded.name} v{loaded.version} at {url}")
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 48,
            "temperature": 0,
            "stream": True,
        }
        print("> What is the capital of France?\n< ", end="", flush=True)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                    print(delta, end="", flush=True)
        print()
        metrics = httpx.get(f"{url}/metrics").text
        used = [line for line in metrics.splitlines() if line.startswith("qpack_kv_blocks_used")]
        print("after the request:", used[0] if used else "")


if __name__ == "__main__":
    main()
