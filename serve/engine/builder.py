"""The engine's parts, built from its nested config: the paged pool and its geometry, the model runner, the KV
cache manager and the scheduler over them, the KV offload below the pool, and the speculator.

One function per part, each reading only its own config, so that what a setting does is found in one place.
The numeric identity (model content, prefill precision, batch invariance) salts every prefix chain and keys every
stored block: a server never reuses KV another numeric path computed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from serve.core.block_pool import BlockPool
from serve.core.kv_cache import KV_DTYPES, KVLayout, parse_memory
from serve.core.kv_cache_manager import KVCacheManager
from serve.core.runner import ModelRunner
from serve.core.scheduler import Scheduler
from serve.engine.config import EngineConfig, OffloadConfig
from serve.metrics import Metrics
from serve.offload.adapter import OffloadAdapter
from serve.offload.codec import BlockLayout
from serve.offload.manager import OffloadManager
from serve.offload.stores import DiskStore, HostStore
from serve.speculative.draft import DraftModel
from serve.speculative.policy import SpeculationPolicy
from serve.speculative.speculator import Speculator


def write_queue_bytes(kv_host_memory: int) -> int:
    """Room for the write-through queue's block copies: 5% of the host store, at least 16 MiB. With the writer's
    own few blocks in flight this keeps a large host store within --kv-host-memory + 10%; one under ~320 MiB
    pays the 16 MiB floor above that."""
    return max(16 * 2**20, kv_host_memory // 20)


@dataclass
class EngineParts:
    layout: KVLayout
    kv_bytes: int  # the pool's memory
    max_model_len: int  # the context: the model's positions, the config's cap, what the pool holds
    namespace: bytes  # the root of every prefix chain (the numeric identity, the KV format)
    pool: BlockPool
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    offload: OffloadAdapter | None
    speculator: Speculator


def build(model: nn.Module, config: EngineConfig, metrics: Metrics, draft: nn.Module | None) -> EngineParts:
    """Every part of an engine serving `model` (whose prefill precision is already set)."""
    device = torch.device(config.device)
    cache = config.cache
    model_config: Any = model.config  # a Hugging Face (or skeleton) config, not the Module torch types it as
    layout = KVLayout.of(model_config, KV_DTYPES[cache.dtype])
    kv_bytes = parse_memory(cache.memory, device)
    num_blocks = layout.blocks_within(kv_bytes, cache.block_size)
    if num_blocks < 2:
        raise ValueError(
            f"--kv-memory {cache.memory} holds {num_blocks} blocks of {cache.block_size} tokens "
            f"({layout.bytes_per_token} bytes per token); give it more memory"
        )
    position_limit = int(getattr(model_config, "max_position_embeddings", 2048))
    max_model_len = min(config.max_model_len or position_limit, position_limit, num_blocks * cache.block_size)
    pool = BlockPool(num_blocks, enable_caching=cache.prefix_caching)
    runner = ModelRunner(
        model,
        layout,
        num_blocks,
        cache.block_size,
        device,
        config.compile,
        batch_invariant=config.batch_invariant,
    )
    namespace = hashlib.sha256(
        f"qpack-kv-v1|{config.numeric_identity}|{layout.dtype}|{cache.block_size}".encode()
    ).digest()
    offload = _offload(config, layout, pool, runner, metrics) if config.offload.enabled else None
    kv = KVCacheManager(
        pool,
        cache.block_size,
        offload.fetch if offload is not None else None,
        offload.on_register if offload is not None else None,
    )
    scheduler = Scheduler(config.scheduler, kv)
    speculator = _speculator(config, draft, device, runner, max_model_len, metrics)
    return EngineParts(
        layout, kv_bytes, max_model_len, namespace, pool, runner, kv, scheduler, offload, speculator
    )


def _offload(
    config: EngineConfig, layout: KVLayout, pool: BlockPool, runner: ModelRunner, metrics: Metrics
) -> OffloadAdapter:
    """The host-memory and disk stores as configured, keyed under the engine's numeric identity."""
    offload: OffloadConfig = config.offload
    block_layout = BlockLayout(
        hashlib.sha256(config.numeric_identity.encode()).digest(),
        layout.dtype,
        config.cache.block_size,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
    )
    host = HostStore(offload.host_memory) if offload.host_memory else None
    disk = DiskStore(Path(offload.disk), offload.disk_size) if offload.disk else None
    manager = OffloadManager(
        block_layout,
        host,
        disk,
        offload.codec,
        queue_bytes=write_queue_bytes(offload.host_memory),
        session_ttl=offload.session_ttl,
        on_event=metrics.offload_event,
    )
    return OffloadAdapter(manager, pool, runner, config.cache.block_size)


def _speculator(
    config: EngineConfig,
    draft: nn.Module | None,
    device: torch.device,
    runner: ModelRunner,
    max_model_len: int,
    metrics: Metrics,
) -> Speculator:
    """Speculative decoding as the config asks (off: a speculator that never proposes)."""
    speculation = config.speculation
    return Speculator(
        SpeculationPolicy(speculation.mode, k_max=speculation.k, max_batch=speculation.max_batch),
        DraftModel(
            draft,
            parse_memory(speculation.draft_kv_memory, device),
            config.cache.block_size,
            KV_DTYPES[config.cache.dtype],
        )
        if draft is not None and speculation.mode in ("draft", "auto")
        else None,
        runner.exact_rows(),
        max_model_len,
        metrics,
    )
