"""Shared fixtures: tiny models built from configs (fast), the shared stories260k model and MMLU data."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("QPACK_SHARED_DIR", REPO.parent / "shared"))
STORIES = SHARED / "models" / "stories260k"
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_model(arch: str = "llama", seed: int = 0, **config: Any) -> Any:
    """A tiny randomly initialised Llama or Qwen2 (eval mode): `TINY` with `config` changed or added."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    values = {**TINY, **config}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**values))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**values))
    return model.eval()


def save_with_stories_tokenizer(model: Any, path: Path, **save: Any) -> Path:
    """`model` saved at `path` with the shared stories260k tokenizer (and a chat template)."""
    from transformers import AutoTokenizer

    model.save_pretrained(str(path), **save)
    tokenizer = AutoTokenizer.from_pretrained(str(STORIES))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def _save_tiny(path: Path, arch: str, tie: bool, seed: int) -> Path:
    return save_with_stories_tokenizer(tiny_model(arch, seed, tie_word_embeddings=tie), path)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.fail(f"shared model missing at {STORIES}; set QPACK_SHARED_DIR")
    return STORIES


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", tie=True, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama-untied"), "llama", tie=False, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", tie=False, seed=2)


@pytest.fixture(scope="session")
def mmlu_dir() -> Path:
    path = Path(os.environ.get("QPACK_MMLU_DIR", SHARED / "data" / "mmlu"))
    if not (path / "test").is_dir():
        pytest.fail(f"MMLU data missing at {path}; set QPACK_MMLU_DIR")
    return path


@pytest.fixture()
def copy_dir(tmp_path: Path):
    def _copy(src: Path, name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return _copy


QUERY_TEMPLATES = (
    "Once upon a time there was a {adj} {noun} who wanted to {verb}.",
    "Tell me a story about a {adj} {noun} that likes to {verb} every day.",
    "Why does the {noun} {verb} when it is {adj}?",
    "Write a short poem about a {noun} and a {adj} friend who {verb}.",
)
WORDS = {
    "adj": ("little", "happy", "big", "sleepy", "brave", "red", "tiny", "kind"),
    "noun": ("girl", "dog", "cat", "bird", "boy", "tree", "ball", "fish"),
    "verb": ("play", "jump", "sing", "run", "swim", "read", "dance", "fly"),
}


def write_queries(path: Path, n: int = 200, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    lines = []
    for i in range(n):
        template = QUERY_TEMPLATES[i % len(QUERY_TEMPLATES)]
        text = template.format(**{k: rng.choice(v) for k, v in WORDS.items()})
        lines.append(f"{text} Then the {rng.choice(WORDS['noun'])} said number {i}.")
    path.write_text("\n".join(lines))
    return path


def calibrate_for(model_dir: Path, out: Path, n: int = 96, queries: Path | None = None) -> Path:
    from calibrate import CalibrationConfig, run_calibration

    queries = queries or write_queries(out.parent / f"{out.name}-queries.txt")
    run_calibration(
        CalibrationConfig(
            output=out, model=str(model_dir), queries=(str(queries),), num_samples=n, heldout_fraction=0.25
        )
    )
    return out


@pytest.fixture(scope="session")
def tiny_llama_calibration(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return calibrate_for(tiny_llama, tmp_path_factory.mktemp("cal-llama") / "cal")


@pytest.fixture(scope="session")
def tiny_qwen2_calibration(tiny_qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return calibrate_for(tiny_qwen2, tmp_path_factory.mktemp("cal-qwen2") / "cal")


@pytest.fixture(scope="session")
def stories_calibration(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return calibrate_for(stories_dir, tmp_path_factory.mktemp("cal-stories") / "cal", n=160)


@pytest.fixture()
def make_calibration():
    """calibrate_for(model_dir, out, n=...) for tests that need their own calibration directory."""
    return calibrate_for


@pytest.fixture()
def queries_file(tmp_path: Path) -> Path:
    return write_queries(tmp_path / "queries.txt")


@pytest.fixture(scope="session")
def tiny_qwen2_artifact(tiny_qwen2_calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 (q/k/v biases, untied head) artifact mixing int8, int4, bf16 and a linear kept FP32."""
    from quantize.config import QuantizeConfig
    from quantize.pipeline import quantize_model
    from quantize.sensitivity.settings import SensitivityConfig

    out = tmp_path_factory.mktemp("qwen2-artifact") / "art"
    from quantize.formats.schemes import BF16, Int4, Int8

    overrides = {
        "_default": Int8(),
        "re:.*up_proj": Int4(32),
        "re:.*v_proj": BF16(),
        "model.layers.1.mlp.down_proj": None,
    }
    quantize_model(
        QuantizeConfig(
            output=out,
            calibration=tiny_qwen2_calibration,
            overrides=overrides,
            sensitivity=SensitivityConfig(num_tokens=64),
            calib_tokens=512,
            eval_tokens=256,
        )
    )
    return out


@pytest.fixture(params=["torch", "native"])
def kernel_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Which kernels a test's quantized modules run on, forced for its duration: torch's ops, or qpack's native
    kernels in this machine's build (tests/quantize/test_native.py forces each build). A test that takes this
    fixture never inherits the path from whatever an earlier test loaded."""
    from quantize.runtime.kernels import ops

    target = None
    if request.param == "native":
        if ops.enable() is None:
            pytest.fail(f"native kernels unavailable: {ops.unavailable_reason()}")
        target = ops.isa()
    with ops.forced(target):
        yield request.param


@pytest.fixture(autouse=True)
def _eval_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reference-score caches go to a per-test folder, never into the user's cache."""
    import evals.pipeline

    folder = tmp_path_factory.mktemp("eval-cache")
    monkeypatch.setattr(evals.pipeline, "cache_dir", lambda: folder)
