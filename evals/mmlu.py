"""MMLU loading: the hendrycks CSV layout, the cais/mmlu layout, or the Hugging Face dataset.

Drift numbers are only as good as the data under them, so the loader is strict: every subject file must
parse, have the expected columns and an answer in A-D / 0-3, all 57 subjects must be present (unless a subset
was asked for), and every problem is reported in one line naming the file (and row) and the fix. The sha256 of
the files read is recorded so an eval result can be tied to the exact data it used.

Layouts:
- hendrycks: `DIR/dev/{subject}_dev.csv` and `DIR/test/{subject}_test.csv`, with or without a header row
  (`question,choice0..3,answer` or `question,A,B,C,D,answer`), answer as a letter or 0-3.
- cais: parquet or CSV files whose names contain `dev` / `test` (e.g. `all/test-00000-of-00001.parquet`),
  columns `question, subject, choices, answer`.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantize.common.errors import QpackError

SUBJECTS: tuple[str, ...] = (
    "abstract_algebra", "anatomy", "astronomy", "business_ethics", "clinical_knowledge", "college_biology",
    "college_chemistry", "college_computer_science", "college_mathematics", "college_medicine", "college_physics",
    "computer_security", "conceptual_physics", "econometrics", "electrical_engineering", "elementary_mathematics",
    "formal_logic", "global_facts", "high_school_biology", "high_school_chemistry",
    "high_school_computer_science", "high_school_european_history", "high_school_geography",
    "high_school_government_and_politics", "high_school_macroeconomics", "high_school_mathematics",
    "high_school_microeconomics", "high_school_physics", "high_school_psychology", "high_school_statistics",
    "high_school_us_history", "high_school_world_history", "human_aging", "human_sexuality", "international_law",
    "jurisprudence", "logical_fallacies", "machine_learning", "management", "marketing", "medical_genetics",
    "miscellaneous", "moral_disputes", "moral_scenarios", "nutrition", "philosophy", "prehistory",
    "professional_accounting", "professional_law", "professional_medicine", "professional_psychology",
    "public_relations", "security_studies", "sociology", "us_foreign_policy", "virology", "world_religions",
)  # fmt: skip
LETTERS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class Item:
    subject: str
    index: int
    question: str
    choices: tuple[str, str, str, str]
    answer: int

    @property
    def key(self) -> str:
        return f"{self.subject}/{self.index}"


@dataclass
class MMLUData:
    test: list[Item]
    dev: dict[str, list[Item]]
    layout: str
    source: str
    sha256: str
    subjects: list[str] = field(default_factory=list)

    def by_subject(self) -> dict[str, list[Item]]:
        return by_subject(self.test)


def by_subject(items: list[Item]) -> dict[str, list[Item]]:
    """Items grouped by subject, each group and the subjects in the items' order."""
    grouped: dict[str, list[Item]] = defaultdict(list)
    for item in items:
        grouped[item.subject].append(item)
    return dict(grouped)


def _answer(value: Any, where: str) -> int:
    text = str(value).strip()
    if text.upper() in LETTERS:
        return LETTERS.index(text.upper())
    if text in ("0", "1", "2", "3"):
        return int(text)
    raise QpackError(f"bad MMLU answer {text!r} at {where}; answers must be A-D or 0-3")


def _read_hendrycks_csv(path: Path, subject: str, digest: Any) -> list[Item]:
    data = path.read_bytes()
    digest.update(path.name.encode())
    digest.update(data)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise QpackError(f"MMLU file {path} is not UTF-8; re-download it") from None
    rows = list(csv.reader(io.StringIO(text, newline="")))
    if rows and [c.strip().lower() for c in rows[0][:1]] == ["question"]:
        header = [c.strip().lower() for c in rows[0]]
        if len(header) != 6:
            raise QpackError(
                f"MMLU file {path} has columns {', '.join(header)}; expected question,choice0,choice1,choice2,"
                "choice3,answer"
            )
        rows = rows[1:]
    items: list[Item] = []
    for number, row in enumerate(rows, start=2):
        if not row:
            continue
        if len(row) != 6:
            raise QpackError(f"MMLU file {path} row {number} has {len(row)} columns, expected 6; fix the CSV")
        items.append(
            Item(
                subject,
                len(items),
                row[0],
                (row[1], row[2], row[3], row[4]),
                _answer(row[5], f"{path}:{number}"),
            )
        )
    return items


def _load_hendrycks(root: Path, wanted: list[str]) -> MMLUData:
    digest = hashlib.sha256()
    dev: dict[str, list[Item]] = {}
    test: list[Item] = []
    missing = []
    for subject in wanted:
        dev_path = root / "dev" / f"{subject}_dev.csv"
        test_path = root / "test" / f"{subject}_test.csv"
        if not dev_path.is_file() or not test_path.is_file():
            missing.append(subject)
            continue
        dev[subject] = _read_hendrycks_csv(dev_path, subject, digest)
        test.extend(_read_hendrycks_csv(test_path, subject, digest))
    if missing:
        raise QpackError(
            f"MMLU directory {root} is missing {len(missing)} subjects ({', '.join(missing[:6])}"
            f"{', ...' if len(missing) > 6 else ''}); expected dev/{{subject}}_dev.csv and test/{{subject}}_test.csv"
        )
    return MMLUData(test, dev, "hendrycks", str(root), digest.hexdigest(), list(wanted))


def _rows_from_table(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8-sig", newline="") as handle:
        return list(csv.DictReader(handle))


def _load_cais(root: Path, wanted: list[str]) -> MMLUData:
    import json

    digest = hashlib.sha256()
    splits: dict[str, list[dict[str, Any]]] = {"dev": [], "test": []}
    files = sorted(p for p in root.rglob("*") if p.suffix in (".parquet", ".csv") and p.is_file())
    for path in files:
        split = "dev" if "dev" in path.name else "test" if "test" in path.name else None
        if split is None:
            continue
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
        rows = _rows_from_table(path)
        if rows and not {"question", "choices", "answer"} <= set(rows[0]):
            raise QpackError(
                f"MMLU file {path} has columns {', '.join(rows[0])}; the cais layout needs question, subject, "
                "choices, answer"
            )
        subject_from_dir = path.parent.name if path.parent != root else None
        for number, row in enumerate(rows):
            subject = str(row.get("subject") or subject_from_dir or "")
            choices = row["choices"]
            if isinstance(choices, str):
                try:
                    choices = json.loads(choices)
                except json.JSONDecodeError:
                    raise QpackError(f"MMLU file {path} row {number}: choices is not a list") from None
            if not isinstance(choices, list | tuple) or len(choices) != 4:
                raise QpackError(f"MMLU file {path} row {number}: choices must be a list of 4 strings")
            splits[split].append(
                {
                    "subject": subject,
                    "question": row["question"],
                    "choices": tuple(str(c) for c in choices),
                    "answer": _answer(row["answer"], f"{path}:{number}"),
                }
            )
    dev = by_subject(_items(splits["dev"], wanted))
    test = _items(splits["test"], wanted)
    tested = {item.subject for item in test}
    missing = [s for s in wanted if s not in tested or s not in dev]
    if missing:
        raise QpackError(
            f"MMLU data in {root} lacks dev or test rows for {len(missing)} subjects ({', '.join(missing[:6])}); "
            "pass a complete cais/mmlu download"
        )
    return MMLUData(test, dev, "cais", str(root), digest.hexdigest(), list(wanted))


def _load_hub(wanted: list[str]) -> MMLUData:
    try:
        import datasets

        dataset = datasets.load_dataset("cais/mmlu", "all")
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise QpackError(
            f"no `mmlu` directory and QPACK_MMLU_DIR is unset, and the Hub dataset cais/mmlu is unavailable "
            f"({first}); give `mmlu` (a hendrycks or cais layout directory)"
        ) from None
    digest = hashlib.sha256(str(dataset).encode())
    dev = by_subject(_items(dataset["dev"], wanted))
    test = _items(dataset["test"], wanted)
    return MMLUData(test, dev, "hub:cais/mmlu", "cais/mmlu", digest.hexdigest(), list(wanted))


def _items(rows: Iterable[Mapping[str, Any]], wanted: list[str]) -> list[Item]:
    """The rows (subject, question, choices, answer) of the wanted subjects as items, numbered within their
    subject in row order."""
    numbers: dict[str, int] = defaultdict(int)
    items = []
    for row in rows:
        subject = row["subject"]
        if subject in wanted:
            items.append(
                Item(subject, numbers[subject], row["question"], tuple(row["choices"]), int(row["answer"]))
            )
            numbers[subject] += 1
    return items


def parse_subjects(text: str | None) -> list[str]:
    if not text:
        return list(SUBJECTS)
    wanted = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SUBJECTS]
    if unknown:
        raise QpackError(f"unknown MMLU subject(s) {', '.join(unknown)}; names look like high_school_physics")
    return wanted


def stratified_limit(test: list[Item], limit: int | None, seed: int) -> list[Item]:
    """At most `limit` questions per subject, a deterministic random sample (kept in original order)."""
    if limit is None:
        return test
    if limit < 1:
        raise QpackError(f"`limit` must be at least 1 (got {limit})")
    grouped = by_subject(test)
    chosen: list[Item] = []
    for subject in grouped:
        items = grouped[subject]
        rng = random.Random(f"{seed}:{subject}")
        picked = sorted(rng.sample(range(len(items)), min(limit, len(items))))
        chosen.extend(items[i] for i in picked)
    return chosen


def load_mmlu(
    path: Path | str | None = None, subjects: str | None = None, limit: int | None = None, seed: int = 0
) -> MMLUData:
    wanted = parse_subjects(subjects)
    source = path or os.environ.get("QPACK_MMLU_DIR")
    if source is None:
        data = _load_hub(wanted)
    else:
        root = Path(source).expanduser()
        if not root.is_dir():
            raise QpackError(f"MMLU directory {root} does not exist; fix `mmlu` or set QPACK_MMLU_DIR")
        if (root / "dev").is_dir() and (root / "test").is_dir() and any((root / "test").glob("*_test.csv")):
            data = _load_hendrycks(root, wanted)
        elif any(root.rglob("*.parquet")) or any(root.rglob("*test*.csv")):
            data = _load_cais(root, wanted)
        else:
            raise QpackError(
                f"{root} is neither the hendrycks layout (dev/ and test/ with *_dev.csv, *_test.csv) nor the cais "
                "layout (parquet/csv with question, subject, choices, answer)"
            )
    short_dev = [s for s in wanted if len(data.dev.get(s, [])) < 1]
    if short_dev:
        raise QpackError(
            f"MMLU subjects without dev examples: {', '.join(short_dev)}; few-shot prompts need them"
        )
    data.test = stratified_limit(data.test, limit, seed)
    return data
