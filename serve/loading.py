"""From a target on the command line to a running engine: load an artifact (or a plain model), size the KV pool,
build the engine and say what it holds.

Shared by every role that computes (a single server, a fleet worker) and by the benchmarks, which build engines
the way `qpack serve` does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize.common.config import one_of
from quantize.common.errors import QpackError
from quantize.common.sizes import parse_size
from serve.core.config import SchedulerConfig
from serve.engine import loop
from serve.engine.config import CacheConfig, EngineConfig, OffloadConfig, SpeculationConfig
from serve.engine.core import Engine
from serve.options import MODEL_DTYPES, ServeOptions
from serve.variants import Served, Variants


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    name: str
    version: str
    source: str
    content_hash: str = ""  # what stored KV blocks are keyed by: a new version never reads old blocks
    kl: float = 0.0  # its measured next-token KL against the model it was built from (0: that model itself)
    reference: str = ""  # the sha256 of the weights it was built from: variants of one model share it
    reference_name: str = ""  # that model's name


def load_for_serving(
    target: str, dtype: str = "float32", device: str = "cpu", prefill_dtype: str = "float32"
) -> LoadedModel:
    """An artifact directory (quantized modules) or any `--model` spec (FP32/BF16, for comparison). An
    artifact's KL is the held-out KL its manifest records for the prompt path `prefill_dtype` selects (int8: the
    int8 prompt path's, where measured)."""
    from quantize.model.sources import load_model, load_tokenizer, resolve_model, weights_sha256

    path = Path(target).expanduser()
    if (path / "manifest.json").is_file():
        from quantize.io.artifact import content_sha256, load_artifact

        loaded = load_artifact(path, device=device, skeleton=True)
        tokenizer = load_tokenizer(path, loaded.manifest.get("tokenizer_class"))
        content = content_sha256(loaded.manifest)
        source = loaded.manifest.get("source") or {}
        quality = loaded.manifest.get("quality") or {}
        if prefill_dtype == "int8" and quality.get("prompt_int8"):
            quality = quality["prompt_int8"]
        return LoadedModel(
            loaded.model,
            tokenizer,
            loaded.name,
            loaded.version,
            str(loaded.path),
            content,
            float(quality.get("kl") or 0.0),
            str(source.get("weights_sha256") or content),
            str(source.get("model_id") or loaded.name).rstrip("/").rsplit("/", 1)[-1],
        )
    if dtype not in MODEL_DTYPES:
        raise QpackError(f"`dtype` {one_of(dtype, MODEL_DTYPES)}")
    source = resolve_model(target)
    model = load_model(source, dtype=getattr(torch, dtype), device=device)
    name = source.model_id.rsplit("/", 1)[-1]
    weights = weights_sha256(source)
    return LoadedModel(
        model, load_tokenizer(source), name, dtype, source.model_id, weights + dtype, 0.0, weights, name
    )


def load_draft(spec: str, loaded: LoadedModel) -> nn.Module:
    """The draft model `spec` names for `loaded`: int4 or int4:G (re-quantized from it at load time), or an
    artifact directory of the same model (same source weights, same vocabulary)."""
    from quantize.formats.schemes import Int4
    from serve.speculative.draft import quantize_head, quantized_copy

    if spec == "int4" or spec.startswith("int4:"):
        group = spec.partition(":")[2] or "64"
        if not group.isdigit() or int(group) not in Int4.GROUP_SIZES:
            raise QpackError(
                f"`draft` {spec}: the group size must be one of {', '.join(map(str, Int4.GROUP_SIZES))}"
            )
        draft, replaced = quantized_copy(loaded.model, Int4(group_size=int(group)))
        if replaced == 0:
            raise QpackError(
                f"`draft` {spec}: no linear of {loaded.name} can be re-quantized; use a draft artifact"
            )
        return draft
    if not (Path(spec).expanduser() / "manifest.json").is_file():
        raise QpackError(f"`draft` {spec} is neither int4[:G] nor an artifact directory (no manifest.json)")
    other = load_for_serving(spec)
    problems = []
    if other.reference != loaded.reference:
        problems.append(f"it was built from {other.reference_name}, not from {loaded.reference_name}")
    vocab = (int(getattr(m.model.config, "vocab_size", 0)) for m in (other, loaded))
    if len(set(vocab)) != 1:
        problems.append("its vocabulary differs")
    if problems:
        raise QpackError(f"`draft` {spec} can't draft for {loaded.name}: {'; '.join(problems)}")
    quantize_head(other.model, Int4(group_size=64)) or quantize_head(other.model, Int4(group_size=32))
    return other.model


def build_engine(loaded: LoadedModel, config: EngineConfig, draft: nn.Module | None = None) -> Engine:
    """The engine, with the heap trimmed after it is built (fusing q/k/v and gate/up frees the unfused copies)."""
    from quantize.common.memory import trim_heap

    config = dataclasses.replace(config, model_hash=config.model_hash or loaded.content_hash)
    try:
        engine = Engine(loaded.model, loaded.tokenizer, config, draft=draft)
    except ValueError as exc:
        raise QpackError(str(exc)) from None
    trim_heap()
    return engine


def describe(engine: Engine) -> str:
    from quantize.runtime.kernels import ops as kernels

    tokens = engine.num_blocks * engine.config.cache.block_size
    decode_kernels = (
        f"native ({(kernels.isa() or '').upper().replace('AVX512', 'AVX-512 VNNI')})"
        if kernels.ready()
        else f"torch ({kernels.unavailable_reason() or 'not built'})"
    )
    cache, offload = engine.config.cache, engine.config.offload
    stores = []
    if offload.host_memory:
        stores.append(f"host memory {offload.host_memory / 2**20:.0f} MiB")
    if offload.disk:
        stores.append(f"disk {offload.disk} ({offload.disk_size / 2**30:.1f} GiB)")
    return (
        f"KV cache: {engine.num_blocks:,} blocks x {cache.block_size} tokens = {tokens:,} tokens "
        f"({engine.kv_bytes / 2**20:.0f} MiB {cache.dtype}, "
        f"{engine.kv_bytes_per_token / 1024:.1f} KiB/token); "
        f"max context {engine.max_model_len:,} tokens; decode kernels: {decode_kernels}"
        + (
            f"; stored KV for returning conversations: {', '.join(stores)} ({offload.codec})"
            if stores
            else ""
        )
    )


def start_engine(
    options: ServeOptions, log: Callable[[str], None], target: str | None = None
) -> tuple[LoadedModel, Engine]:
    """The model (`target`, else the options') and its engine as `options` ask (compiled and warmed up with
    `--compile`), progress to `log`."""
    if options.threads:
        torch.set_num_threads(options.threads)
    loaded = load_for_serving(
        target or options.target or "", options.dtype, prefill_dtype=options.prefill_dtype
    )
    draft = load_draft(options.draft, loaded) if options.draft and options.speculative != "off" else None
    log("loading the native decode kernels (built once per machine: ~1 min the first time)...")
    engine = build_engine(loaded, engine_config(options), draft)
    if options.compile:
        log("compiling the decode step (torch.compile)...")
        loop.warmup(engine)
    log(f"qpack serve {loaded.name} v{loaded.version} ({loaded.source})")
    log(describe(engine))
    return loaded, engine


def reference_name(target: str) -> str:
    """The name of the model an artifact was built from, from its manifest alone (no weights are read); a plain
    model's own name."""
    manifest = Path(target).expanduser() / "manifest.json"
    try:
        data = json.loads(manifest.read_text()) if manifest.is_file() else {}
    except (OSError, ValueError) as exc:
        raise QpackError(f"{manifest} cannot be read ({exc}); fix `target`") from None
    source = (data.get("source") or {}).get("model_id") if isinstance(data, dict) else None
    return str(source or target).rstrip("/").rsplit("/", 1)[-1]


def start_variants(options: ServeOptions, log: Callable[[str], None]) -> Variants:
    """`target` and every one of `variants`, each with its own engine (and KV pool of `kv_memory`), served under
    one name. They must be variants of one model: their manifests name the same source weights."""
    loaded = [start_engine(options, log, target) for target in (options.target or "", *options.variants)]
    if len(loaded) == 1:
        model, engine = loaded[0]
        return Variants.single(engine, options.model_name or model.name, model.version, model.content_hash)
    first = loaded[0][0]
    strangers = [m.source for m, _engine in loaded if m.reference != first.reference]
    if strangers:
        raise QpackError(
            f"`variants` must be built from the model `target` was built from ({first.reference_name}): "
            f"{', '.join(strangers)} came from another; serve it on its own"
        )
    served = [Served(m.name, m.version, m.kl, m.content_hash, engine) for m, engine in loaded]
    variants = Variants(options.model_name or first.reference_name, first.version, served)
    log(
        "variants: "
        + ", ".join(f"{s.name} (KL {s.kl:.5f})" for s in variants)
        + f", served as {variants.model}"
    )
    return variants


def engine_config(options: ServeOptions) -> EngineConfig:
    """The engine's config for what `qpack serve` was asked: the one place the command line's options are mapped
    onto the engine's nested configs."""
    return EngineConfig(
        scheduler=SchedulerConfig(
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            prefill_chunk=options.prefill_chunk,
            admission_wait=options.admission_wait,
            max_queue=options.max_queue,
        ),
        cache=CacheConfig(
            block_size=options.block_size,
            memory=options.kv_memory,
            dtype=options.kv_dtype,
            prefix_caching=options.prefix_caching,
            isolate_users=options.isolate_users,
        ),
        offload=OffloadConfig(
            host_memory=parse_size(options.kv_host_memory, "kv_host_memory"),
            disk=options.kv_disk,
            disk_size=parse_size(options.kv_disk_size, "kv_disk_size"),
            codec=options.kv_codec,
            session_ttl=options.session_ttl,
        ),
        speculation=SpeculationConfig(
            mode=options.speculative,
            k=options.speculative_k,
            max_batch=options.speculative_max_batch,
            draft_kv_memory=options.draft_kv_memory,
        ),
        max_model_len=options.max_model_len,
        compile=options.compile,
        batch_invariant=options.batch_invariant,
        prefill_dtype=options.prefill_dtype,
    )
