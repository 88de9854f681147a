"""The lm-eval adapter: same log-probs as `qpack evaluate`, and a local lm-eval MMLU task runs on an artifact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from evals.mmlu import LETTERS, load_mmlu
from evals.scoring import letter_block, letter_prefix, score
from quantize.io.artifact import load_artifact
from quantize.model.sources import load_tokenizer

SUBJECT = "anatomy"
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def adapter(tiny_qwen2_artifact: Path):
    from evals.lmeval import QpackLM

    return QpackLM(artifact=str(tiny_qwen2_artifact), batch_tokens=2048, max_length=4096)  # prompts > its 512


def test_adapter_log_probs_equal_qpack_evaluate(adapter, tiny_qwen2_artifact: Path, mmlu_dir: Path) -> None:
    from lm_eval.api.instance import Instance

    data = load_mmlu(mmlu_dir, subjects=SUBJECT, limit=3)
    shots = data.dev[SUBJECT][:2]
    requests = [
        Instance(
            "loglikelihood", {}, (letter_prefix(SUBJECT, shots) + letter_block(item, False), f" {letter}"), i
        )
        for item in data.test
        for i, letter in enumerate(LETTERS)
    ]
    results = adapter.loglikelihood(requests, disable_tqdm=True)
    model = load_artifact(tiny_qwen2_artifact).model
    expected = score(model, load_tokenizer(tiny_qwen2_artifact), "letter", data.by_subject(), data.dev, 2)
    got = torch.tensor([logp for logp, _greedy in results], dtype=torch.float64).view(-1, 4)
    for row, item in enumerate(data.test):
        torch.testing.assert_close(got[row], expected[item.key], rtol=1e-4, atol=1e-5)


def test_local_mmlu_task_runs_on_an_artifact(
    adapter, tiny_qwen2_artifact: Path, mmlu_dir: Path, tmp_path: Path
) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from evals.lmeval import write_mmlu_tasks

    (name,) = write_mmlu_tasks(tmp_path, load_mmlu(mmlu_dir, subjects=SUBJECT))
    out = lm_eval.simple_evaluate(
        model=adapter,
        tasks=[name],
        num_fewshot=2,
        limit=6,
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = out["samples"][name]
    assert len(samples) == 6
    data = load_mmlu(mmlu_dir, subjects=SUBJECT)
    first = {item.index: item for item in data.test[:6]}
    model = load_artifact(tiny_qwen2_artifact).model
    picked = type(data)(list(first.values()), data.dev, data.layout, data.source, data.sha256)
    expected = score(model, load_tokenizer(tiny_qwen2_artifact), "letter", picked.by_subject(), data.dev, 2)
    for sample in samples:
        item = first[sample["doc_id"]]
        lm_eval_scores = torch.tensor([float(r[0]) for r in sample["filtered_resps"]], dtype=torch.float64)
        torch.testing.assert_close(lm_eval_scores, expected[item.key], rtol=1e-4, atol=1e-5)
    assert (
        out["config"]["qpack_numerics"]["prefill_dtype"] == "float32"
    )  # which kernels scored, in the results
    accuracy = out["results"][name]["acc,none"]
    assert accuracy == pytest.approx(
        sum(int(torch.argmax(expected[k])) == first[int(k.split("/")[1])].answer for k in expected) / 6
    )


def test_rolling_log_likelihood_and_generation(adapter, tiny_qwen2_artifact: Path) -> None:
    from lm_eval.api.instance import Instance

    text = "Once upon a time there was a little dog."
    (rolling,) = adapter.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = [adapter.prefix_token_id, *adapter.tok_encode(text, add_special_tokens=False)]
    model = load_artifact(tiny_qwen2_artifact).model
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    assert rolling == pytest.approx(
        float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum()), abs=1e-3
    )
    (generated,) = adapter.generate_until(
        [Instance("generate_until", {}, ("Once upon", {"until": ["\n"], "max_gen_toks": 5}), 0)]
    )
    assert isinstance(generated, str) and "\n" not in generated


def test_the_adapter_scores_on_the_native_kernels_as_evaluate_does(adapter) -> None:
    """What lm-eval scores is what is served: loading an artifact loads qpack's native kernels, as `qpack
    evaluate` and `qpack serve` do (where this machine can build them)."""
    from quantize.runtime.kernels import ops as kernels

    assert kernels.ready() or kernels.unavailable_reason() is not None
    if kernels.unavailable_reason() is None:
        assert kernels.isa() is not None


def test_the_adapter_takes_the_prefill_dtype_as_a_server_does(tiny_qwen2_artifact: Path) -> None:
    """`prefill_dtype=int8` in --model_args scores prompts on int8 activations (as `serve --prefill-dtype int8`),
    says so in the results' config, and a bad value is one clear error."""
    from evals.lmeval import QpackLM
    from quantize.common.errors import QpackError

    int8 = QpackLM(artifact=str(tiny_qwen2_artifact), prefill_dtype="int8")
    assert int8.get_model_info()["qpack_numerics"]["prefill_dtype"] == "int8"
    with pytest.raises(
        QpackError, match="prefill_dtype: prefill dtype must be one of float32, bfloat16, int8"
    ):
        QpackLM(artifact=str(tiny_qwen2_artifact), prefill_dtype="fp8")
