"""qpack quantize end to end on tiny models built from configs, and on the real FP32 stories260k."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from quantize.algorithms import AWQ, GPTQ, RTN, Algorithm, AutoRound
from quantize.common.config import ConfigError
from quantize.common.errors import QpackError
from quantize.config import QuantizeConfig
from quantize.formats.schemes import BF16, W8A8, BnbInt8, BnbNF4, Int4, Int8, Scheme
from quantize.io.artifact import load_artifact, read_manifest, update_manifest, verify_artifact
from quantize.pipeline import quantize_model
from quantize.planning.presets import PRESETS
from quantize.runtime.modules import BnbLinear, HalfLinear, Int4Linear, Int8Linear, W8A8Linear
from quantize.sensitivity.settings import SensitivityConfig

FAST = dict(sensitivity=SensitivityConfig(num_tokens=64), calib_tokens=512, eval_tokens=256)


def _config(cal: Path, out: Path, **kwargs) -> QuantizeConfig:
    return QuantizeConfig(output=out, calibration=cal, **{**FAST, **kwargs})


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(
    ("scheme", "module_type", "max_kl"),
    [
        (Int8(), Int8Linear, 1e-3),
        (Int4(32), Int4Linear, 5e-2),
        (W8A8(), W8A8Linear, 5e-3),
        (BF16(), HalfLinear, 1e-4),
        (BnbInt8(), BnbLinear, 1e-2),
        (BnbNF4(), BnbLinear, 1e-1),
    ],
    ids=lambda v: v.label() if isinstance(v, Scheme) else "",
)
def test_each_scheme_on_a_tiny_tied_llama(
    scheme, module_type, max_kl, tiny_llama, tiny_llama_calibration, tmp_path
):
    if scheme.type.startswith("bnb"):
        pytest.importorskip("bitsandbytes")
    result = quantize_model(_config(tiny_llama_calibration, tmp_path / "art", overrides={"_default": scheme}))
    model = load_artifact(tmp_path / "art").model
    swapped = {n for n, m in model.named_modules() if isinstance(m, module_type)}
    assert len(swapped) == 14  # 2 blocks x 7 linears; the head stays FP32
    assert (
        isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    )
    assert result.quality.kl < max_kl and result.manifest["quality"]["kl"] == result.quality.kl
    assert "kept FP32: lm_head, embed_tokens, norms" in result.manifest["quantization"]["summary"]


def _remeasured(
    artifact: Path, calibration: Path, model_dir: Path, prefill_dtype: str = "float32"
) -> dict[str, float]:
    """The held-out quality of the artifact as loaded from disk (prompts in `prefill_dtype`), against the FP32
    model loaded whole: an independent answer to what the streaming quantize pass measured while it wrote the
    artifact."""
    from quantize.io.calibration import CalibrationData
    from quantize.model.sources import load_model, resolve_model
    from quantize.quality import compare_to_reference, eval_packs, reference_hidden
    from quantize.runtime.modules import set_prefill_dtype

    packs = eval_packs(CalibrationData.load(calibration), FAST["eval_tokens"], 0)
    reference = load_model(resolve_model(str(model_dir)))
    model = load_artifact(artifact).model
    set_prefill_dtype(model, prefill_dtype)
    return compare_to_reference(model, packs, reference_hidden(reference, packs), reference.lm_head).to_json()


@pytest.mark.parametrize("preset", ["int8", "int4", "mixed", "w8a8"])
def test_presets_save_load_same_quality(preset, tiny_qwen2, tiny_qwen2_calibration, tmp_path):
    out = tmp_path / preset
    quantize_model(_config(tiny_qwen2_calibration, out, preset=PRESETS[preset], name="tiny", version="2.0"))
    manifest = read_manifest(out)
    assert manifest["name"] == "tiny" and manifest["version"] == "2.0" and manifest["evals"] == {}
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json", "sensitivity.png"}
    assert manifest["source"]["model_type"] == "qwen2"
    loaded = load_artifact(out)
    assert loaded.model.model.layers[0].self_attn.q_proj.bias is not None
    assert manifest["size"]["ratio_to_fp32"] < 1.0
    again = _remeasured(out, tiny_qwen2_calibration, tiny_qwen2)
    quality = manifest["quality"]
    assert again["kl"] == pytest.approx(quality["kl"], rel=1e-3, abs=1e-7)
    assert again["ppl"] == pytest.approx(quality["ppl"], rel=1e-4)
    assert again["ppl_reference"] == pytest.approx(quality["ppl_reference"], rel=1e-5)
    if preset == "w8a8":
        assert quality["prompt_int8"] is None  # no int8/int4 weight-only linears: no int8 prompt path
        return
    int8 = _remeasured(out, tiny_qwen2_calibration, tiny_qwen2, "int8")
    recorded = quality["prompt_int8"]
    assert int8["kl"] == pytest.approx(recorded["kl"], rel=1e-3, abs=1e-7)
    assert recorded["tokens"] == quality["tokens"] and recorded["kl"] != quality["kl"]


def test_mixed_plan_respects_budget_and_reuses_sensitivity(
    tiny_llama, tiny_llama_calibration, tmp_path, copy_dir
):
    cal = copy_dir(tiny_llama_calibration, "cal")
    (cal / "sensitivity.json").unlink(missing_ok=True)
    first = quantize_model(_config(cal, tmp_path / "a", preset=PRESETS["mixed"], target_bits=6.0))
    assert first.plan.bits() <= 6.0 + 1e-6
    assert first.manifest["quantization"]["plan_info"]["sensitivity_cache_hits"] == 0
    second = quantize_model(_config(cal, tmp_path / "b", preset=PRESETS["mixed"], target_bits=5.0))
    assert second.manifest["quantization"]["plan_info"]["sensitivity_cache_hits"] > 0
    assert second.plan.bits() <= 5.0 + 1e-6
    rows = second.manifest["sensitivity"]["rows"]
    assert {r["how"] for r in rows} == {"measured", "derived"}


def test_overrides_and_forced_head(tiny_llama_untied, tmp_path, make_calibration):
    cal = make_calibration(tiny_llama_untied, tmp_path / "cal", n=48)
    overrides = {"lm_head": Int8(), "re:.*down_proj": BF16(), "model.layers.0.self_attn.q_proj": None}
    result = quantize_model(
        _config(cal, tmp_path / "art", preset=PRESETS["int4"], schemes=(Int4(32),), overrides=overrides)
    )
    assert any("lm_head forced to int8" in w for w in result.warnings)
    model = load_artifact(tmp_path / "art").model
    assert isinstance(model.lm_head, Int8Linear)
    assert all(isinstance(layer.mlp.down_proj, HalfLinear) for layer in model.model.layers)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[1].self_attn.q_proj, Int4Linear)
    sources = result.manifest["modules"]
    assert sources["model.layers.0.mlp.down_proj"]["source"] == "override re:.*down_proj"
    assert sources["model.layers.1.mlp.gate_proj"]["source"] == "preset int4"
    again = _remeasured(tmp_path / "art", cal, tiny_llama_untied)
    assert again["kl"] == pytest.approx(result.manifest["quality"]["kl"], rel=1e-3, abs=1e-7)


def test_tampered_and_pickled_artifacts_are_refused(tiny_llama, tiny_llama_calibration, tmp_path):
    out = tmp_path / "art"
    quantize_model(_config(tiny_llama_calibration, out, preset=PRESETS["int8"]))
    verify_artifact(out)
    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    weights = tampered / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(QpackError, match=r"failed verification: model\.safetensors"):
        load_artifact(tampered)
    pickled = tmp_path / "pickled"
    shutil.copytree(out, pickled)
    (pickled / "extra.bin").write_bytes(b"\x80\x04")
    with pytest.raises(QpackError, match="never pickles"):
        load_artifact(pickled)
    future = tmp_path / "future"
    shutil.copytree(out, future)
    manifest = json.loads((future / "manifest.json").read_text())
    manifest["format_version"] = 99
    (future / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(QpackError, match="format_version 99"):
        load_artifact(future)
    with update_manifest(out) as update:
        update.commit({**update.manifest, "evals": {"mmlu": {"summary": "ok"}}})
    assert read_manifest(out)["evals"]["mmlu"]["summary"] == "ok"
    verify_artifact(out)


def test_bad_plans_are_clear_errors_naming_the_field(
    tiny_llama, tiny_llama_calibration, tiny_qwen2_calibration, tmp_path
):
    cal = tiny_llama_calibration
    with pytest.raises(
        QpackError, match=r"12 layers cannot use their planned scheme: int4-g128: in_features 64"
    ):
        quantize_model(_config(cal, tmp_path / "b", overrides={"_default": Int4(128)}))
    with pytest.raises(
        ConfigError, match=r"invalid QuantizeConfig: target_bits 3\.0 is an impossible size budget"
    ):
        quantize_model(_config(cal, tmp_path / "c", target_bits=3.0))
    with pytest.raises(ConfigError, match=r"overrides pattern.* match no linear layer"):
        quantize_model(_config(cal, tmp_path / "d", overrides={"re:.*nothing_here": Int8()}))
    with pytest.raises(ConfigError, match=r"overrides model\.embed_tokens: embeddings are not linears"):
        quantize_model(_config(cal, tmp_path / "e", overrides={"model.embed_tokens": Int8()}))
    with pytest.raises(QpackError, match="was built for model"):
        quantize_model(_config(tiny_qwen2_calibration, tmp_path / "f", model=str(tiny_llama)))
    with pytest.raises(ConfigError) as every:
        quantize_model(
            _config(
                cal,
                tmp_path / "g",
                schemes=(Int4(48),),
                overrides={"re:([": Int8()},
                algorithm=GPTQ(damp=2.0),
                target_bits=40.0,
            )
        )
    assert {p.field for p in every.value.problems} == {
        "schemes",
        "overrides",
        "algorithm.damp",
        "target_bits",
    }
    assert "schemes int4 group size must be one of (32, 64, 128) (got 48)" in str(every.value)
    assert not any(tmp_path.iterdir())


def test_gptq_and_awq_beat_rtn_on_real_fp32_weights(stories_calibration, tmp_path):
    kl = {}
    algorithms: list[Algorithm] = [RTN(), GPTQ(), AWQ()]
    for algorithm in algorithms:
        result = quantize_model(
            _config(
                stories_calibration,
                tmp_path / algorithm.name,
                preset=PRESETS["int4"],
                schemes=(Int4(32),),
                algorithm=algorithm,
                eval_tokens=512,
            )
        )
        kl[algorithm.name] = result.quality.kl
        assert result.manifest["quantization"]["algorithm"] == algorithm.to_json()
        if isinstance(algorithm, AWQ):
            info = result.manifest["quantization"]["module_info"]
            assert any("awq_alpha" in v for v in info.values())
    assert kl["gptq"] < 0.8 * kl["rtn"], kl
    assert kl["awq"] < kl["rtn"], kl


def test_autoround_beats_gptq_end_to_end_and_records_its_training(stories_calibration, tmp_path):
    kl = {}
    algorithms: list[Algorithm] = [GPTQ(), AutoRound(iters=40, batch_tokens=1024)]
    for algorithm in algorithms:
        out = tmp_path / algorithm.name
        result = quantize_model(
            _config(
                stories_calibration,
                out,
                preset=PRESETS["int4"],
                schemes=(Int4(32),),
                algorithm=algorithm,
                overrides={"re:.*down_proj": Int8()},
                eval_tokens=512,
            )
        )
        kl[algorithm.name] = result.quality.kl
        assert result.manifest["quantization"]["algorithm"] == algorithm.to_json()
        verify_artifact(out)
    info = result.manifest["quantization"]["module_info"]
    learned = {fqn: v for fqn, v in info.items() if "autoround_best_loss" in v}
    assert any("down_proj" in fqn for fqn in learned) and any("q_proj" in fqn for fqn in learned)
    assert all(v["autoround_best_loss"] <= v["autoround_initial_loss"] for v in learned.values())
    assert kl["autoround"] < 0.7 * kl["gptq"], kl


def test_planner_spends_bits_where_sensitivity_is(stories_calibration, tmp_path):
    uniform = quantize_model(
        _config(
            stories_calibration, tmp_path / "u", preset=PRESETS["int4"], schemes=(Int4(32),), algorithm=RTN()
        )
    )
    mixed = quantize_model(
        _config(
            stories_calibration,
            tmp_path / "m",
            schemes=(Int4(32), Int8()),
            target_bits=6.0,
            algorithm=RTN(),
            sensitivity=SensitivityConfig(num_tokens=128),
        )
    )
    assert mixed.plan.bits() <= 6.0 + 1e-6
    assert mixed.manifest["quality"]["kl"] < 0.85 * uniform.manifest["quality"]["kl"]
    rows = {(r["module"], r["scheme"]): r["value"] for r in mixed.manifest["sensitivity"]["rows"]}
    upgraded = [
        f
        for f, s in mixed.plan.schemes.items()
        if s is not None and s.label() == "int8" and (f, "int4-g32") in rows
    ]
    kept = [f for f, s in mixed.plan.schemes.items() if s is not None and s.label() == "int4-g32"]
    gain = lambda f: rows[(f, "int4-g32")] - rows.get((f, "int8"), 0.0)  # noqa: E731
    assert upgraded and kept
    assert sum(gain(f) for f in upgraded) / len(upgraded) > sum(gain(f) for f in kept) / len(kept)


def test_an_impossible_size_budget_fails_before_any_sensitivity_is_measured(
    tiny_llama, tiny_llama_calibration, tmp_path, monkeypatch
):
    """The reachable range depends on layer shapes and candidates only: no minutes of sensitivity first."""
    import quantize.planning.build as planning

    def measured(*_args, **_kwargs):
        raise AssertionError("sensitivity measured before the budget was checked")

    monkeypatch.setattr(planning, "measure_sensitivity", measured)
    with pytest.raises(
        ConfigError,
        match=r"target_bits 4\.0 is an impossible size budget: .* 8\.\d+ bits .*reachable: 8\.\d+ to 16\.\d+",
    ):
        quantize_model(
            _config(tiny_llama_calibration, tmp_path / "a", preset=PRESETS["int8"], target_bits=4.0)
        )
    assert not any(tmp_path.iterdir())


def test_loading_a_model_imports_no_peer_backend(tiny_llama):
    """transformers imports any installed quantization backend it knows while loading a model; torchao (a peer
    benchmark's dependency) then prints native-library failures and torch warnings on every command."""
    import importlib.util
    import subprocess
    import sys

    assert importlib.util.find_spec("torchao") is not None, "the peers extra is part of the test set-up"
    check = (
        "import sys; from quantize.model.sources import load_model, resolve_model; "
        f"load_model(resolve_model({str(tiny_llama)!r})); assert 'torchao' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Failed to load" not in proc.stderr and "Enum subclass" not in proc.stderr


def test_distill_lowers_gptqs_heldout_kl_training_only_the_scales(stories_calibration, tmp_path):
    """GPTQ int4 on the genuinely FP32 stories260k, then the same run with --distill: the held-out KL (measured
    on the artifact's runtime modules, queries never trained or validated on) falls, only scales changed, and
    the manifest and PNG carry the curve."""
    from quantize.distill import Distill

    results = {}
    for name, distill in (("gptq", None), ("distilled", Distill(minutes=2.0, eval_every=4, lr=5e-3))):
        results[name] = quantize_model(
            _config(
                stories_calibration,
                tmp_path / name,
                preset=PRESETS["int4"],
                schemes=(Int4(32),),
                algorithm=GPTQ(),
                calib_tokens=4096,
                eval_tokens=512,
                distill=distill,
            )
        )
        verify_artifact(tmp_path / name)
    before, after = results["gptq"].quality.kl, results["distilled"].quality.kl
    section = results["distilled"].manifest["quantization"]["distill"]
    assert section["heldout_kl_before"] == pytest.approx(before)
    int8_prompts = results["distilled"].manifest["quality"]["prompt_int8"]  # measured again after training
    assert int8_prompts["tokens"] == results["distilled"].quality.tokens
    assert int8_prompts["kl"] != results["gptq"].manifest["quality"]["prompt_int8"]["kl"]
    assert after < 0.9 * before, (before, after, section)
    assert section["validation_kl"] < section["validation_kl_before"]
    assert section["curve"][0]["step"] == 0 and len(section["curve"]) >= 2
    assert (tmp_path / "distilled" / "distill.png").stat().st_size > 1000
    plain, trained = load_artifact(tmp_path / "gptq"), load_artifact(tmp_path / "distilled")
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    b = load_file(str(tmp_path / "distilled" / "model.safetensors"))
    assert a.keys() == b.keys()
    changed = {name.rsplit(".", 1)[1] for name in a if not torch.equal(a[name], b[name])}
    assert changed == {"scale"}, changed
    del plain, trained
