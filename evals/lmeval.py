"""An lm-evaluation-harness model backed by a qpack artifact, so any lm-eval task runs on qpack's kernels.

lm-eval has no plugin hook for models: a model class must be registered in the process that runs it. So qpack
ships `qpack-lm-eval`, lm-eval's own command line with the `qpack` model registered (and lm-eval's built-in
models still available):

    qpack-lm-eval run --model qpack --model_args artifact=out/int8 --tasks mmlu --num_fewshot 5

(`prefill_dtype=int8` in --model_args scores prompts on int8 activations, as `qpack serve --prefill-dtype int8`
serves them; the results' `config.qpack_numerics` says which kernels scored.)

or, from Python, `lm_eval.simple_evaluate(model=QpackLM(artifact=...), ...)`. Requires the `lmeval` extra.

Log-likelihoods go through the same scorer as `qpack evaluate` (`evals.scoring.Scorer`: one forward per padded
batch under a token budget, the vocabulary projection only at scored positions), with lm-eval's own
tokenization of each (context, continuation) pair, so the two tools give the same log-probs for the same
prompt. `add_bos_token` defaults to True, as in `qpack evaluate` (tokenizers without a BOS add nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models: it loads them only into an empty registry)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from evals.mmlu import LETTERS, MMLUData
from evals.scoring import Request, Scorer
from quantize.common.errors import QpackError
from quantize.common.fileio import write_bytes


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes")


@register_model("qpack")
class QpackLM(TemplateLM):
    """lm-eval `LM` over a qpack artifact (or, for comparison, any model spec qpack can load in FP32)."""

    def __init__(
        self,
        artifact: str | None = None,
        batch_tokens: int | str = 4096,
        max_length: int | str | None = None,
        add_bos_token: bool | str = True,
        max_gen_toks: int | str = 256,
        prefill_dtype: str = "float32",
        **_ignored: Any,
    ) -> None:
        super().__init__()
        if not artifact:
            raise QpackError("--model_args needs artifact=DIR (a qpack artifact or model spec)")
        self.model, self.tokenizer = _load(str(artifact))
        from quantize.runtime.modules import set_prefill_dtype

        try:
            set_prefill_dtype(self.model, str(prefill_dtype))
        except ValueError as error:
            raise QpackError(f"--model_args prefill_dtype: {error}") from None
        self._max_length = (
            int(max_length)
            if max_length
            else int(getattr(self.model.config, "max_position_embeddings", 2048))
        )
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _flag(add_bos_token)
        self.scorer = Scorer(self.model, self.tokenizer, int(batch_tokens))

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval adds to its results' `config`: how the artifact computed (prefill dtype, native kernel
        build, the kernels prompts ran on), as `qpack evaluate` records it."""
        from quantize.runtime.modules import numerics

        return {"qpack_numerics": numerics(self.model)}

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None and self.add_bos_token else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return list(self.tokenizer(string, add_special_tokens=special)["input_ids"])

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return str(self.tokenizer.decode(tokens))

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        scored = []
        for index, (_strings, context, continuation) in enumerate(requests):
            tokens = (context + continuation)[-(self.max_length + 1) :][:-1]
            start = len(tokens) - len(continuation)
            scored.append(Request(str(index), tokens, list(continuation), list(range(start, len(tokens)))))
        results = self.scorer.run_detailed([], scored)
        return [(float(results[i][0].double().sum()), bool(results[i][1].all())) for i in range(len(scored))]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args
            ids = self.tok_encode(text, add_special_tokens=False)
            total = 0.0
            window = self.max_length
            for start in range(0, len(ids), window):
                chunk = ids[start : start + window]
                first = self.prefix_token_id if start == 0 else ids[start - 1]
                tokens = [first, *chunk[:-1]]  # lm-eval's disjoint windows: each predicts its own tokens
                positions = list(range(len(tokens)))
                results = self.scorer.run_detailed([], [Request("rolling", tokens, chunk, positions)])
                total += float(results[0][0].double().sum())
            out.append(total)
        return out

    @torch.inference_mode()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            context, options = request.args
            until = [u for u in (options or {}).get("until", []) if u]
            limit = int((options or {}).get("max_gen_toks", self._max_gen_toks))
            ids = torch.tensor([self.tok_encode(context)[-(self.max_length - limit) :]])
            generated = self.model.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=limit,
                do_sample=False,
                pad_token_id=self.eot_token_id,
            )
            text = self.tok_decode(generated[0, ids.shape[1] :].tolist())
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def _load(target: str) -> tuple[torch.nn.Module, Any]:
    from quantize.io.artifact import load_artifact
    from quantize.model.sources import load_model, load_tokenizer, resolve_model

    path = Path(target).expanduser()
    if (path / "manifest.json").is_file():
        from quantize.runtime.kernels import ops as kernels

        kernels.enable()  # as `qpack evaluate` and a server run the artifact (built once per machine)
        loaded = load_artifact(path)
        return loaded.model, load_tokenizer(path, loaded.manifest.get("tokenizer_class"))
    source = resolve_model(target)
    return load_model(source), load_tokenizer(source)


def write_mmlu_tasks(folder: Path, data: MMLUData) -> list[str]:
    """lm-eval task files for MMLU from qpack's loader (any layout it reads, no Hub): one task per subject,
    lm-eval's standard `mmlu` prompt (description, first-n dev shots, "A. ..." choices, "Answer:"), its questions
    as JSON lines so no CSV type guessing changes a choice. Returns the task names (`qpack_mmlu_{subject}`)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for subject, items in data.by_subject().items():
        name = f"qpack_mmlu_{subject}"
        files = {}
        for split, rows in (("test", items), ("dev", data.dev[subject])):
            lines = [
                json.dumps({"question": i.question, "choices": list(i.choices), "answer": i.answer})
                for i in rows
            ]
            files[split] = folder / f"{subject}_{split}.jsonl"
            write_bytes(files[split], ("\n".join(lines) + "\n").encode())
        title = subject.replace("_", " ")
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {split: str(path) for split, path in files.items()}},
            "test_split": "test",
            "fewshot_split": "dev",
            "fewshot_config": {"sampler": "first_n"},
            "output_type": "multiple_choice",
            "description": f"The following are multiple choice questions (with answers) about {title}.\n\n",
            "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\n"
            "D. {{choices[3]}}\nAnswer:",
            "doc_to_choice": list(LETTERS),
            "doc_to_target": "answer",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        }
        write_bytes(folder / f"{name}.yaml", json.dumps(config, indent=1).encode())  # JSON is YAML
        names.append(name)
    return names


def main() -> None:
    """`qpack-lm-eval`: lm-eval's command line with the `qpack` model registered beside its own."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
