from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from calibrate import CalibrationConfig, run_calibration
from quantize.common.config import ConfigError
from quantize.common.errors import QpackError
from quantize.io.calibration import CalibrationData
from quantize.model.sources import load_tokenizer

PII = [
    "bob@example.com",
    "555-123-4567",
    "4111 1111 1111 1111",
    "10.20.30.40",
    "sk-abcdefghijklmnopqrstuvwxyz0123",
]


def messy_jsonl(path: Path, n: int = 60) -> Path:
    lines = []
    for i in range(n):
        words = " ".join(f"word{j}" for j in range(i % 17 + 3))
        lines.append(json.dumps({"prompt": f"Question {i}: tell me about {words}"}))
    lines.append(json.dumps({"prompt": "Question 0: tell me about word0 word1 word2"}))  # exact duplicate
    lines.append(
        json.dumps({"prompt": "  question 1: TELL me about word0 word1 word2 word3!  "})
    )  # normalised dup
    lines.append(json.dumps({"prompt": ""}))
    lines.append("{this is not json")
    lines.append(json.dumps({"unrelated": 1}))
    for i, secret in enumerate(PII):
        lines.append(json.dumps({"prompt": f"Please contact {secret} about ticket {i} and more words here"}))
    lines.append(json.dumps({"prompt": "x" * 4000}))  # too long
    text = "\n".join(lines) + '\n{"prompt": "truncated at the ta'
    path.write_text(text)
    return path


def test_messy_jsonl_counts_and_no_pii(tmp_path: Path, tiny_llama: Path) -> None:
    queries = messy_jsonl(tmp_path / "messy.jsonl")
    config = CalibrationConfig(
        output=tmp_path / "cal",
        model=str(tiny_llama),
        queries=(str(queries),),
        num_samples=40,
        max_tokens=256,
        seed=3,
        keep_text=True,
    )
    result = run_calibration(config)
    manifest = result.manifest
    (source,) = manifest["inputs"]
    assert source["records"] == 60 + 3 + 5 + 1
    assert source["malformed"] == 3 and source["truncated"]
    cleaning = manifest["cleaning"]
    assert cleaning["samples"] == 69
    assert cleaning["empty"] == 1
    assert cleaning["stripped"] == 1
    assert cleaning["exact_duplicates"] == 1
    assert cleaning["normalized_duplicates"] == 1
    assert cleaning["pii_samples"] == 5
    assert cleaning["pii"] == {"credit_card": 1, "email": 1, "ip": 1, "phone": 1, "secret": 1}
    assert cleaning["too_long"] == 1
    assert cleaning["kept"] == 65
    assert manifest["sampling"]["train"] == 36 and manifest["sampling"]["heldout"] == 4
    assert manifest["extraction"]["chat_template"] is True

    data = CalibrationData.load(result.output)
    assert len(data.train) == 36 and len(data.heldout) == 4
    assert data.stats["model.layers.0.self_attn.q_proj"].num_tokens == sum(len(s) for s in data.train)
    assert set(data.stats) >= {"lm_head", "model.layers.1.mlp.down_proj"}

    tokenizer = load_tokenizer(tiny_llama)
    stored_text = (result.output / "texts.jsonl").read_text()
    decoded = " ".join(tokenizer.decode(s) for s in data.train + data.heldout)
    for secret in PII:
        assert secret not in stored_text and secret not in decoded
        assert secret.replace(" ", "") not in decoded.replace(" ", "")
    assert not list(tmp_path.glob(".cal.*"))


def test_same_seed_same_output(tmp_path: Path, tiny_llama: Path) -> None:
    queries = messy_jsonl(tmp_path / "q.jsonl")

    def run(name: str, seed: int) -> dict:
        config = CalibrationConfig(
            output=tmp_path / name, model=str(tiny_llama), queries=(str(queries),), num_samples=20, seed=seed
        )
        run_calibration(config)
        return load_file(str(tmp_path / name / "tokens.safetensors"))

    a, b, c = run("a", 1), run("b", 1), run("c", 2)
    assert all((a[k] == b[k]).all() for k in a)
    assert not (
        a["train.input_ids"].shape == c["train.input_ids"].shape
        and (a["train.input_ids"] == c["train.input_ids"]).all()
    )


def test_turns_all_and_no_template(tmp_path: Path, tiny_qwen2: Path) -> None:
    path = tmp_path / "chats.json"
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"hello {i}"},
                {"role": "assistant", "content": "hi"},
                {"role": "user", "content": f"follow-up {i} question"},
            ]
        }
        for i in range(10)
    ]
    path.write_text(json.dumps(chats))
    base = dict(model=str(tiny_qwen2), queries=(str(path),), num_samples=100, heldout_fraction=0.0)
    result = run_calibration(CalibrationConfig(output=tmp_path / "all", turns="all", **base))
    assert result.manifest["cleaning"]["samples"] == 20 and result.manifest["sampling"]["train"] == 20
    raw = run_calibration(CalibrationConfig(output=tmp_path / "raw", chat_template=False, **base))
    assert raw.manifest["extraction"]["chat_template"] is False
    assert raw.manifest["lengths"]["train"]["max"] < result.manifest["lengths"]["train"]["max"]


def test_coverage_warns_on_mismatched_reference(tmp_path: Path, tiny_llama: Path) -> None:
    prose = tmp_path / "prose.txt"
    prose.write_text(
        "\n".join(
            f"Once upon a time there was a little girl number {i} who liked the park." for i in range(40)
        )
    )
    code = tmp_path / "code.txt"
    code.write_text(
        "\n".join(f"def f{i}(x): return [y**{i} for y in range(x) if y % 7 == {i % 7}]" for i in range(40))
    )
    base = dict(model=str(tiny_llama), queries=(str(prose),), num_samples=30)
    matched = run_calibration(CalibrationConfig(output=tmp_path / "m", reference=(str(prose),), **base))
    assert matched.manifest["coverage"]["covered"] is True
    mismatched = run_calibration(CalibrationConfig(output=tmp_path / "x", reference=(str(code),), **base))
    coverage = mismatched.manifest["coverage"]
    assert coverage["covered"] is False and coverage["token_js"] > 0.45
    assert coverage["warnings"]


def test_bad_configs_and_outputs(tmp_path: Path, tiny_llama: Path) -> None:
    queries = messy_jsonl(tmp_path / "q.jsonl")
    with pytest.raises(
        ConfigError,
        match=r"invalid CalibrationConfig: turns must be one of first, all \(got 'some'\); num_samples must be "
        r"at least 1",
    ):
        run_calibration(CalibrationConfig(output=tmp_path / "o", turns="some", num_samples=0))
    (tmp_path / "exists").mkdir()
    with pytest.raises(QpackError, match="already exists; set `overwrite`"):
        run_calibration(
            CalibrationConfig(output=tmp_path / "exists", model=str(tiny_llama), queries=(str(queries),))
        )
    with pytest.raises(ConfigError, match=r"queries were all filtered out .* shorter than `min_tokens` 400"):
        run_calibration(
            CalibrationConfig(
                output=tmp_path / "none",
                model=str(tiny_llama),
                queries=(str(queries),),
                min_tokens=400,
                max_tokens=500,
            )
        )
    assert not (tmp_path / "none").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "q.jsonl"]


def test_tampered_calibration_is_refused(tmp_path: Path, tiny_llama: Path) -> None:
    queries = messy_jsonl(tmp_path / "q.jsonl")
    result = run_calibration(
        CalibrationConfig(
            output=tmp_path / "cal", model=str(tiny_llama), queries=(str(queries),), num_samples=10
        )
    )
    stats = result.output / "stats.safetensors"
    stats.write_bytes(stats.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(QpackError, match=r"calibration directory .* failed verification: stats\.safetensors"):
        CalibrationData.load(result.output)
