"""The serving skeleton: the Hugging Face module tree and RoPE, without transformers' modeling code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantize.common.errors import QpackError
from quantize.io.artifact import load_artifact
from quantize.runtime.skeleton import RotaryEmbedding, SkeletonConfig

ROOT = Path(__file__).resolve().parents[2]
ROPES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
def test_rotary_matches_transformers(tiny_llama: Path, rope: dict[str, object]) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    data = json.loads((tiny_llama / "config.json").read_text()) | {"rope_parameters": rope}
    theirs = LlamaRotaryEmbedding(LlamaConfig(**data))
    ours = RotaryEmbedding(SkeletonConfig.from_dict(data, "test"))
    x = torch.zeros(1, 1, 64)
    for last in (20, 300, 40):  # past max_position_embeddings (512 here: dynamic grows) and back
        positions = torch.arange(last)[None]
        for a, b in zip(ours(x, positions), theirs(x, positions), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_skeleton_holds_the_hf_tree_and_weights(tiny_qwen2_artifact: Path) -> None:
    hf = load_artifact(tiny_qwen2_artifact).model
    lean = load_artifact(tiny_qwen2_artifact, skeleton=True).model
    ours = {name: type(m).__name__ for name, m in lean.named_modules() if not list(m.children())}
    theirs = {name: type(m).__name__ for name, m in hf.named_modules() if not list(m.children())}
    assert ours.keys() == theirs.keys()
    quantized = {n: t for n, t in theirs.items() if t in ("Int8Linear", "Int4Linear", "HalfLinear", "Linear")}
    assert {n: ours[n] for n in quantized} == quantized
    assert {"Int8Linear", "Int4Linear", "HalfLinear", "Linear"} <= set(quantized.values())
    state = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    for name, tensor in list(lean.named_parameters()) + list(lean.named_buffers()):
        assert torch.equal(tensor, state[name]), name
    assert lean.model.layers[0].self_attn.q_proj.bias is not None
    assert lean.model.layers[0].self_attn.o_proj.bias is None
    assert lean.config.num_key_value_heads == hf.config.num_key_value_heads
    assert lean.generation_config.eos_token_id == hf.generation_config.eos_token_id


def test_serving_load_imports_no_modeling_code(tiny_qwen2_artifact: Path) -> None:
    """transformers' modeling code drags torch._dynamo, torch.distributed.tensor and torchao into the server."""
    code = f"""
import sys
from serve.loading import build_engine, load_for_serving
from serve.engine.config import CacheConfig, EngineConfig
build_engine(load_for_serving({str(tiny_qwen2_artifact)!r}), EngineConfig(cache=CacheConfig(memory="4MB", block_size=4)))
heavy = ("torch._dynamo", "torch.distributed.tensor", "torchao", "transformers.models.qwen2.modeling_qwen2")
print([m for m in heavy if m in sys.modules])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_the_served_tokenizer_is_the_one_autotokenizer_resolves(tiny_qwen2_artifact: Path) -> None:
    """The artifact records the class AutoTokenizer picked (Qwen2Tokenizer for this generic tokenizer.json)."""
    from transformers import AutoTokenizer

    from quantize.io.artifact import read_manifest
    from quantize.model.sources import load_tokenizer

    recorded = read_manifest(tiny_qwen2_artifact)["tokenizer_class"]
    theirs = AutoTokenizer.from_pretrained(str(tiny_qwen2_artifact))
    ours = load_tokenizer(tiny_qwen2_artifact, recorded)
    assert recorded == type(theirs).__name__ == type(ours).__name__ == "Qwen2Tokenizer"
    messages = [{"role": "user", "content": "Why does the tiny cat sing? Answer: A"}]
    for text in ("hello world", " A", "Answer: A\n"):
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(
        messages, tokenize=False
    )
    assert ours.eos_token_id == theirs.eos_token_id
    assert (
        type(load_tokenizer(tiny_qwen2_artifact, "NoSuchTokenizer")).__name__ == "Qwen2Tokenizer"
    )  # falls back


def test_unservable_configs_name_every_problem() -> None:
    with pytest.raises(QpackError) as caught:
        SkeletonConfig.from_dict(
            {"hidden_size": 8, "hidden_act": "mish", "rope_parameters": 3}, "art/config.json"
        )
    message = str(caught.value)
    assert message.startswith("config art/config.json cannot be served")
    for fragment in (
        "intermediate_size missing",
        "vocab_size missing",
        "hidden_act 'mish'",
        "rope_parameters is not",
    ):
        assert fragment in message


def test_an_artifact_from_a_legacy_config_is_served_from_its_complete_config(
    tiny_llama: Path, tmp_path: Path, copy_dir, make_calibration
) -> None:
    """A transformers 4 config.json (rope_theta at the top, no head_dim): the artifact writes the config as
    transformers reads it, complete, so the skeleton needs no config class."""
    from quantize.config import QuantizeConfig
    from quantize.pipeline import quantize_model
    from quantize.planning.presets import PRESETS
    from quantize.sensitivity.settings import SensitivityConfig

    legacy = copy_dir(tiny_llama, "legacy")
    data = json.loads((legacy / "config.json").read_text())
    theta = data.pop("rope_parameters")["rope_theta"]
    data.pop("head_dim", None)
    data.pop("rms_norm_eps")
    (legacy / "config.json").write_text(json.dumps({**data, "rope_theta": theta, "rope_scaling": None}))
    cal = make_calibration(legacy, tmp_path / "cal", n=32)
    out = tmp_path / "art"
    quantize_model(
        QuantizeConfig(
            output=out,
            calibration=cal,
            preset=PRESETS["int8"],
            sensitivity=SensitivityConfig(num_tokens=32),
            eval_tokens=64,
        )
    )
    written = json.loads((out / "config.json").read_text())
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": theta}
    assert written["head_dim"] == 16 and written["rms_norm_eps"] == 1e-6
    lean = load_artifact(out, skeleton=True).model
    hf = load_artifact(out).model
    x, positions = torch.zeros(1, 1, 16), torch.arange(9)[None]
    for a, b in zip(lean.model.rotary_emb(x, positions), hf.model.rotary_emb(x, positions), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert lean.model.norm.variance_epsilon == hf.model.norm.variance_epsilon == 1e-6
