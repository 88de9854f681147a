"""Big-model machinery on a small synthetic model saved the way 7B checkpoints are: bf16, in several shards.

Memory bounds are counted, not timed: the streamed model counts the decoder blocks it holds at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantize.algorithms import AutoRound
from quantize.common.errors import QpackError
from quantize.config import QuantizeConfig
from quantize.formats.schemes import Int4
from quantize.io.artifact import INDEX_FILE, load_artifact, read_manifest, verify_artifact
from quantize.io.checkpoint import Checkpoint
from quantize.pipeline import quantize_model
from quantize.planning.presets import PRESETS
from quantize.sensitivity.settings import SensitivityConfig
from quantize.sequential.streamed import StreamedModel


@pytest.fixture(scope="module")
def sharded_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import save_with_stories_tokenizer, tiny_model

    model = tiny_model(seed=3, intermediate_size=160, num_hidden_layers=6, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("sharded") / "model"
    save_with_stories_tokenizer(model.to(torch.bfloat16), path, max_shard_size="150KB")
    return path


def test_a_sharded_bf16_checkpoint_is_read_tensor_by_tensor_in_its_dtype(sharded_bf16: Path) -> None:
    checkpoint = Checkpoint(sharded_bf16)
    assert (sharded_bf16 / "model.safetensors.index.json").is_file()
    assert len({ref.path for ref in checkpoint.refs.values()}) > 2  # really sharded
    name = "model.layers.3.mlp.down_proj.weight"
    assert checkpoint.read(name).dtype == torch.bfloat16  # 16 bit on disk stays 16 bit when read
    assert checkpoint.read(name, torch.float32).dtype == torch.float32
    streamed = StreamedModel(sharded_bf16)
    assert streamed.materialized == 0
    assert all(p.is_meta for p in streamed.layers.parameters())
    with streamed.block(2) as block, streamed.block(2):
        assert block.mlp.down_proj.weight.dtype == torch.float32 and streamed.materialized == 1
    assert streamed.materialized == 0 and all(p.is_meta for p in streamed.layers[2].parameters())


def test_calibrate_and_quantize_hold_at_most_two_blocks_and_write_shards(
    sharded_bf16: Path, tmp_path: Path, make_calibration
) -> None:
    cal = make_calibration(sharded_bf16, tmp_path / "cal", n=48)
    art = tmp_path / "art"
    config = QuantizeConfig(
        output=art,
        calibration=cal,
        preset=PRESETS["int4"],
        schemes=(Int4(32),),
        sensitivity=SensitivityConfig(num_tokens=64),
        calib_tokens=256,
        eval_tokens=128,
        max_shard_size=60_000,
    )
    result = quantize_model(config)
    memory = result.manifest["memory"]
    assert memory["peak_blocks_materialized"] <= 2 and memory["block_loads"] == 6  # each block read once
    manifest = read_manifest(art)
    weights = manifest["weights"]
    assert len(weights) > 2 and all((art / w).is_file() for w in weights) and (art / INDEX_FILE).is_file()
    assert weights[0] == f"model-00001-of-{len(weights):05d}.safetensors"
    index = json.loads((art / INDEX_FILE).read_text())["weight_map"]
    assert set(index.values()) == set(weights)
    owners = {}
    for name, shard in index.items():  # a module's tensors never straddle two shards
        owners.setdefault(name.rpartition(".")[0], set()).add(shard)
    assert all(len(shards) == 1 for shards in owners.values())
    verify_artifact(art)
    loaded = load_artifact(art)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.inference_mode():
        assert torch.isfinite(loaded.model(input_ids=ids).logits).all()


def test_autoround_streams_block_by_block_too(sharded_bf16: Path, tmp_path: Path, make_calibration) -> None:
    cal = make_calibration(sharded_bf16, tmp_path / "cal", n=48)
    config = QuantizeConfig(
        output=tmp_path / "art",
        calibration=cal,
        preset=PRESETS["int4"],
        schemes=(Int4(32),),
        algorithm=AutoRound(iters=4, batch_tokens=128),
        sensitivity=SensitivityConfig(num_tokens=64),
        calib_tokens=256,
        eval_tokens=128,
    )
    result = quantize_model(config)
    memory = result.manifest["memory"]
    assert memory["peak_blocks_materialized"] <= 2 and memory["block_loads"] == 6
    info = result.manifest["quantization"]["module_info"]
    assert sum("autoround_best_loss" in v for v in info.values()) == 6 * 7
    verify_artifact(tmp_path / "art")


def test_a_tampered_shard_is_refused_and_one_file_artifacts_still_load(
    sharded_bf16: Path, tmp_path: Path, make_calibration, copy_dir
) -> None:
    cal = make_calibration(sharded_bf16, tmp_path / "cal", n=48)
    art = tmp_path / "art"
    base = dict(
        calibration=cal, preset=PRESETS["int4"], schemes=(Int4(32),), calib_tokens=256, eval_tokens=128
    )
    quantize_model(QuantizeConfig(output=art, max_shard_size=60_000, **base))
    tampered = copy_dir(art, "tampered")
    shard = tampered / read_manifest(tampered)["weights"][1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(data)
    with pytest.raises(QpackError, match="failed verification: model-00002-of-"):
        load_artifact(tampered)
    one = tmp_path / "one"
    quantize_model(QuantizeConfig(output=one, **base))
    manifest = read_manifest(one)
    assert manifest["weights"] == ["model.safetensors"] and not (one / INDEX_FILE).exists()
    manifest["format_version"] = 1  # the format before shards: no weights list, one model.safetensors
    del manifest["weights"]
    (one / "manifest.json").write_text(json.dumps(manifest))
    old = load_artifact(one)
    sharded = load_artifact(art)
    ids = torch.tensor([[1, 9, 8, 7, 6]])
    with torch.inference_mode():
        torch.testing.assert_close(old.model(input_ids=ids).logits, sharded.model(input_ids=ids).logits)


def test_a_memory_limit_below_one_block_is_refused_with_what_would_fit(sharded_bf16: Path) -> None:
    from quantize.sequential.streamed import check_memory

    streamed = StreamedModel(sharded_bf16)
    needed = streamed.needed_bytes(1000)
    assert needed > streamed.resident_bytes() + 2 * streamed.block_bytes(0)
    assert check_memory(streamed, 1000, needed + 1) == needed + 1
    with pytest.raises(
        QpackError, match=r"needs about .* GiB to be processed block by block .* raise `max_memory`"
    ):
        check_memory(streamed, 1000, needed - 1)
