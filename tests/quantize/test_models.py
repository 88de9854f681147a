from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantize.common.errors import QpackError
from quantize.model.sources import (
    check_architecture,
    load_model,
    load_tokenizer,
    resolve_model,
    weights_sha256,
)


def test_local_folders_resolve(tiny_llama: Path, tiny_qwen2: Path) -> None:
    llama = resolve_model(str(tiny_llama))
    assert (llama.kind, llama.model_type, llama.architecture) == ("folder", "llama", "LlamaForCausalLM")
    qwen = resolve_model(str(tiny_qwen2))
    assert qwen.model_type == "qwen2"
    model = load_model(qwen)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert load_tokenizer(qwen).chat_template
    assert len(weights_sha256(llama)) == 64


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(QpackError, match=r"'GPT2LMHeadModel' \(model_type 'gpt2'\).*not supported.*llama"):
        check_architecture({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "x")
    with pytest.raises(QpackError, match="not a causal LM"):
        check_architecture({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}, "x")


def test_bad_model_inputs(tmp_path: Path, tiny_llama: Path, copy_dir) -> None:
    with pytest.raises(QpackError, match=r"model './nope' not found"):
        resolve_model("./nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(QpackError, match=r"has no config\.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(QpackError, match=r"is a file but not a \.gguf"):
        resolve_model(str(tmp_path / "weights.bin"))

    pickled = copy_dir(tiny_llama, "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(QpackError, match=r"no \*\.safetensors weights .*pytorch_model.bin.*never loaded"):
        resolve_model(str(pickled))

    truncated = copy_dir(tiny_llama, "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(QpackError, match="corrupt or truncated"):
        resolve_model(str(truncated))

    gpt2 = copy_dir(tiny_llama, "gpt2")
    config = json.loads((gpt2 / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (gpt2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(QpackError, match="GPT2LMHeadModel"):
        resolve_model(str(gpt2))

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF but not really")
    with pytest.raises(QpackError, match="corrupt or not a GGUF"):
        resolve_model(str(fake))


def test_offline_hub_id_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(QpackError) as excinfo:
        resolve_model("some-org/some-model-that-is-not-cached")
    message = str(excinfo.value)
    assert "Hugging Face Hub could not provide it" in message and "\n" not in message
    assert "smollm2-135m" in message


def test_plain_model_loading_is_strict(tiny_llama: Path, copy_dir) -> None:
    """Weights the config does not describe, or that it needs and the files lack, are an error: transformers
    alone would fill missing ones with random values and serve nonsense."""
    from safetensors.torch import load_file, save_file

    for name, change, expected in (
        ("a", lambda t: t.pop("model.layers.0.mlp.up_proj.weight"), "missing from the weights"),
        (
            "b",
            lambda t: t.__setitem__("model.layers.0.extra.weight", t["model.norm.weight"].clone()),
            "not part of the architecture",
        ),
    ):
        folder = copy_dir(tiny_llama, name)
        weights = folder / "model.safetensors"
        tensors = load_file(str(weights))
        change(tensors)
        save_file(tensors, str(weights), metadata={"format": "pt"})
        with pytest.raises(QpackError, match=f"does not match its config.json: 1 tensors {expected}"):
            load_model(resolve_model(str(folder)))


def test_an_artifact_without_its_manifest_is_not_a_model(tiny_qwen2_artifact: Path, copy_dir) -> None:
    folder = copy_dir(tiny_qwen2_artifact, "damaged")
    (folder / "manifest.json").unlink()
    with pytest.raises(QpackError, match=r"qpack-quantized tensors .* no manifest.json.*damaged artifact"):
        resolve_model(str(folder))
