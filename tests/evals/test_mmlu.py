from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from evals.mmlu import SUBJECTS, load_mmlu, stratified_limit
from quantize.common.errors import QpackError


def test_shared_hendrycks_layout(mmlu_dir: Path) -> None:
    data = load_mmlu(mmlu_dir)
    assert data.layout == "hendrycks" and len(data.by_subject()) == 57
    assert len(data.test) == 14042 and sum(len(v) for v in data.dev.values()) == 285
    assert all(0 <= item.answer <= 3 and len(item.choices) == 4 for item in data.test)
    assert len(data.sha256) == 64


def test_limit_is_stratified_and_deterministic(mmlu_dir: Path) -> None:
    a = load_mmlu(mmlu_dir, limit=5, seed=1)
    b = load_mmlu(mmlu_dir, limit=5, seed=1)
    c = load_mmlu(mmlu_dir, limit=5, seed=2)
    assert len(a.test) == 285 and [i.key for i in a.test] == [i.key for i in b.test]
    assert [i.key for i in a.test] != [i.key for i in c.test]
    assert all(len(v) == 5 for v in a.by_subject().values())
    subset = load_mmlu(mmlu_dir, subjects="anatomy,virology", limit=3)
    assert sorted(subset.by_subject()) == ["anatomy", "virology"] and len(subset.test) == 6


def _mini_hendrycks(root: Path, header: bool, answer: str) -> Path:
    for split in ("dev", "test"):
        (root / split).mkdir(parents=True)
        for subject in SUBJECTS:
            lines = (["question,choice0,choice1,choice2,choice3,answer"] if header else []) + [
                f'"What is {subject} {i}?",a,b,c,"d, e",{answer}' for i in range(3)
            ]
            (root / split / f"{subject}_{split}.csv").write_text("\n".join(lines) + "\n")
    return root


def test_headerless_letters_and_header_digits(tmp_path: Path) -> None:
    letters = load_mmlu(_mini_hendrycks(tmp_path / "a", header=False, answer="C"))
    assert letters.test[0].answer == 2 and letters.test[0].choices[3] == "d, e"
    digits = load_mmlu(_mini_hendrycks(tmp_path / "b", header=True, answer="1"))
    assert digits.test[0].answer == 1 and len(digits.test) == 3 * 57


def test_cais_layout(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "all").mkdir()
    for split in ("dev", "test"):
        rows = [
            {"question": f"q {s} {i}", "subject": s, "choices": ["w", "x", "y", "z"], "answer": i % 4}
            for s in SUBJECTS
            for i in range(2)
        ]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "all" / f"{split}-00000-of-00001.parquet")
    data = load_mmlu(tmp_path)
    assert data.layout == "cais" and len(data.test) == 114 and data.test[1].answer == 1


def test_broken_inputs_are_one_line_errors(tmp_path: Path, mmlu_dir: Path) -> None:
    with pytest.raises(QpackError, match="does not exist"):
        load_mmlu(tmp_path / "missing")
    partial = tmp_path / "partial"
    shutil.copytree(mmlu_dir, partial)
    (partial / "test" / "virology_test.csv").unlink()
    (partial / "dev" / "anatomy_dev.csv").unlink()
    with pytest.raises(QpackError, match=r"missing 2 subjects \(anatomy, virology\)"):
        load_mmlu(partial)
    bad = _mini_hendrycks(tmp_path / "bad", header=True, answer="E")
    with pytest.raises(
        QpackError, match=r"bad MMLU answer 'E' at .*abstract_algebra_dev.csv:2; answers must be A-D or 0-3"
    ):
        load_mmlu(bad)
    cols = _mini_hendrycks(tmp_path / "cols", header=True, answer="A")
    (cols / "test" / "anatomy_test.csv").write_text("question,a,b,answer\nq,1,2,A\n")
    with pytest.raises(QpackError, match="has columns question, a, b, answer"):
        load_mmlu(cols, subjects="anatomy")
    with pytest.raises(QpackError, match="unknown MMLU subject"):
        load_mmlu(mmlu_dir, subjects="astrology")
    (tmp_path / "empty").mkdir()
    with pytest.raises(QpackError, match="neither the hendrycks layout"):
        load_mmlu(tmp_path / "empty")
    with pytest.raises(QpackError, match="`limit` must be at least 1"):
        stratified_limit([], 0, 0)
