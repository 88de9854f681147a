"""compressed-tensors export: exact round trip through compressed-tensors' own decompressor, and loading in
transformers for the symmetric schemes (transformers cannot load asymmetric pack-quantized checkpoints yet:
vllm-project/llm-compressor#1618)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantize.common.errors import QpackError
from quantize.config import QuantizeConfig
from quantize.formats.schemes import Int4, Scheme
from quantize.io.artifact import load_artifact
from quantize.io.compressed_tensors import export_compressed_tensors
from quantize.pipeline import quantize_model
from quantize.planning.plan import Plan, PlanRules
from quantize.planning.presets import PRESETS
from quantize.runtime.handlers import handler_for
from quantize.sensitivity.settings import SensitivityConfig

pytest.importorskip("compressed_tensors")

FAST = dict(sensitivity=SensitivityConfig(num_tokens=64), calib_tokens=512, eval_tokens=128)


def _artifact(cal: Path, out: Path, overrides: dict[str, Scheme | None]) -> Path:
    quantize_model(
        QuantizeConfig(
            output=out,
            calibration=cal,
            preset=PRESETS["int4"],
            schemes=(Int4(32),),
            overrides=overrides,
            **FAST,
        )
    )
    return out


def test_round_trip_is_exact(tiny_llama_calibration: Path, tmp_path: Path) -> None:
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    art = _artifact(
        tiny_llama_calibration,
        tmp_path / "art",
        PlanRules.parse(["re:.*down_proj=int8", "re:.*o_proj=bf16", "re:.*up_proj=w8a8"]),
    )
    out = tmp_path / "ct"
    summary = export_compressed_tensors(art, out)
    assert summary["groups"] == {"int4-g32": 8, "int8": 2, "w8a8": 2}
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "mixed-precision"
    assert set(config["ignore"]) == {
        "lm_head",
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.o_proj",
    }
    exported = load_file(str(out / "model.safetensors"))
    original = load_file(str(art / "model.safetensors"))
    manifest = json.loads((art / "manifest.json").read_text())
    plan = Plan.from_json(manifest["modules"])
    checked = 0
    for group in config["config_groups"].values():
        scheme = QuantizationScheme(**group)
        compressor = BaseCompressor.get_value_from_registry(group["format"])
        for fqn in group["targets"]:
            state = {k.rsplit(".", 1)[1]: v for k, v in exported.items() if k.rsplit(".", 1)[0] == fqn}
            weight = compressor.decompress(state, scheme)["weight"]
            ours = plan.schemes[fqn]
            tensors = {n: original[f"{fqn}.{n}"] for n in manifest["tensors"][fqn]}
            torch.testing.assert_close(
                weight.float(), handler_for(ours).dequantize(ours, tensors), rtol=0, atol=1e-6
            )
            checked += 1
    assert checked == 12


def test_symmetric_export_loads_in_transformers(tiny_llama_calibration: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    art = _artifact(
        tiny_llama_calibration, tmp_path / "art", PlanRules.parse(["_default=int8", "re:.*gate_proj=w8a8"])
    )
    export_compressed_tensors(art, tmp_path / "ct")
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct"), dtype=torch.float32)
    ours = load_artifact(art).model
    ids = torch.tensor([[1, 30, 31, 32, 33, 34]])
    with torch.inference_mode():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert ((a - b).norm() / a.norm()) < 2e-2


def test_unexpressible_layers_are_named(tiny_llama_calibration: Path, tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    art = _artifact(tiny_llama_calibration, tmp_path / "art", PlanRules.parse(["re:.*q_proj=bnb-nf4"]))
    with pytest.raises(
        QpackError, match=r"cannot export 2 layers.*self_attn.q_proj \(bnb-nf4\): bitsandbytes"
    ):
        export_compressed_tensors(art, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_a_rotated_artifact_exports_as_the_model_it_is(stories_calibration: Path, tmp_path: Path) -> None:
    """Every rotation qpack writes is absorbed into the weights (no runtime op), so compressed-tensors carries it
    as plain weights: the exported model computes the artifact's logits, its untied head included."""
    from transformers import AutoModelForCausalLM

    art = tmp_path / "art"
    quantize_model(
        QuantizeConfig(
            output=art,
            calibration=stories_calibration,
            preset=PRESETS["int8"],
            rotate="hadamard",
            **FAST,
        )
    )
    export_compressed_tensors(art, tmp_path / "ct")
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct"), dtype=torch.float32)
    assert theirs.config.tie_word_embeddings is False
    assert theirs.lm_head.weight.data_ptr() != theirs.model.embed_tokens.weight.data_ptr()
    ours = load_artifact(art).model
    # a prompt's worth of rows: without native kernels, decode-sized rows round activations to bf16 (~2e-3 here)
    ids = torch.arange(1, 65)[None] * 7 % 500 + 1
    with torch.inference_mode():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert ((a - b).norm() / a.norm()) < 1e-3  # measured 3e-5; the head tied back to the embedding: 0.47
    assert torch.equal(a.argmax(-1), b.argmax(-1))

    manifest = json.loads(
        (art / "manifest.json").read_text()
    )  # as an artifact with an online transform reads
    manifest["quantization"]["rotation"]["online"] = {"before": "down_proj", "hadamard": "172"}
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(QpackError, match=r"online transform at run time.*weights only"):
        export_compressed_tensors(art, tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()
    with pytest.raises(QpackError, match=r"cannot load artifact .*online transform"):
        load_artifact(art)
