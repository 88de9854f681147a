from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibrate.sources import Message, default_queries_path, iter_json_array, read_source
from quantize.common.errors import QpackError


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_autodetects_prompt_and_counts_broken_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "q.jsonl",
        '{"prompt": "hello"}\nnot json\n{"prompt": "world", "x": 1}\n\n{"other": 3}\n{"prompt": "trunc',
    )
    data = read_source(path)
    assert [c[0].content for c in data.conversations] == ["hello", "world"]
    assert data.report.field == "prompt"
    assert data.report.num_records == 2
    assert data.report.num_malformed == 3  # "not json", the record without the field, the truncated tail
    assert data.report.truncated


@pytest.mark.parametrize("key", ["query", "text", "input", "question"])
def test_jsonl_text_fields(tmp_path: Path, key: str) -> None:
    path = _write(tmp_path / "q.jsonl", json.dumps({key: "a question", "id": 1}) + "\n")
    assert read_source(path).conversations == [(Message("user", "a question"),)]


def test_jsonl_openai_messages_with_content_parts(tmp_path: Path) -> None:
    record = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "image_url"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "content": "ignored"},
        ]
    }
    data = read_source(_write(tmp_path / "q.jsonl", json.dumps(record) + "\n"))
    assert data.conversations == [
        (Message("system", "be brief"), Message("user", "part one"), Message("assistant", "ok"))
    ]
    assert data.report.field == "messages"


def test_json_array_sharegpt_roles_and_truncated_tail(tmp_path: Path) -> None:
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "second"}]},
    ]
    text = json.dumps(records, indent=2)
    truncated = text[:-1].rstrip() + ',\n  {"id": "c", "conversations": [{"from": "human", "val'
    data = read_source(_write(tmp_path / "q.json", truncated))
    assert len(data.conversations) == 2
    assert data.conversations[0] == (Message("user", "hi"), Message("assistant", "hello"))
    assert data.report.truncated and data.report.num_malformed == 1
    assert "truncated: incomplete record" in data.report.notes[0]


def test_iter_json_array_complete() -> None:
    assert iter_json_array(' [ {"a": 1} , "x", 3 ] ') == ([{"a": 1}, "x", 3], None)
    elements, stopped = iter_json_array('[{"a": 1}, {"b": ')
    assert elements == [{"a": 1}] and stopped == 11


def test_json_object_with_data_list_and_explicit_field(tmp_path: Path) -> None:
    path = _write(tmp_path / "q.json", json.dumps({"data": [{"req": {"body": "nested"}}]}))
    assert read_source(path, field_name="req.body").conversations == [(Message("user", "nested"),)]


def test_csv_and_tsv(tmp_path: Path) -> None:
    csv_path = _write(tmp_path / "q.csv", 'id,Prompt\n1,"hello, world"\n2,"multi\nline"\n')
    data = read_source(csv_path)
    assert [c[0].content for c in data.conversations] == ["hello, world", "multi\nline"]
    assert data.report.field == "Prompt"
    tsv_path = _write(tmp_path / "q.tsv", "user_text\tscore\nfirst\t1\nsecond\t2\n")
    assert [c[0].content for c in read_source(tsv_path, field_name="user_text").conversations] == [
        "first",
        "second",
    ]


def test_csv_without_query_column_names_the_columns(tmp_path: Path) -> None:
    path = _write(tmp_path / "q.csv", "a,b\n1,2\n")
    with pytest.raises(QpackError, match=r"no query column found .*columns: a, b.*set `field`"):
        read_source(path)
    with pytest.raises(QpackError, match="column 'c' not in"):
        read_source(path, field_name="c")


def test_txt_one_query_per_line(tmp_path: Path) -> None:
    data = read_source(_write(tmp_path / "q.txt", "first\n\nsecond\n"))
    assert [c[0].content for c in data.conversations] == ["first", "", "second"]


def test_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "messages": [[{"role": "user", "content": "from parquet"}], [{"role": "user", "content": "two"}]],
            "n": [1, 2],
        }
    )
    pq.write_table(table, tmp_path / "q.parquet")
    data = read_source(tmp_path / "q.parquet")
    assert [c[-1].content for c in data.conversations] == ["from parquet", "two"]


def test_saved_datasets_folder(tmp_path: Path) -> None:
    import datasets

    dataset = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"prompt": ["d1", "d2"]}),
            "test": datasets.Dataset.from_dict({"prompt": ["t1"]}),
        }
    )
    dataset.save_to_disk(str(tmp_path / "ds"))
    data = read_source(tmp_path / "ds")
    assert [c[0].content for c in data.conversations] == ["d1", "d2"]
    assert any("train" in note for note in data.report.notes)


def test_bad_inputs_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(QpackError, match="does not exist"):
        read_source(tmp_path / "missing.jsonl")
    with pytest.raises(QpackError, match=r"unknown query file format '\.xml'.*set `format`"):
        read_source(_write(tmp_path / "q.xml", "<a/>"))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(QpackError, match=r"not UTF-8 \(byte 0xe9 at line 1\)"):
        read_source(latin)
    with pytest.raises(QpackError, match=r"no usable queries .*3 malformed"):
        read_source(_write(tmp_path / "broken.jsonl", "{\n[1,\nnope\n"))
    with pytest.raises(QpackError, match="no query field found"):
        read_source(_write(tmp_path / "nofield.jsonl", '{"a": 1}\n'))
    with pytest.raises(QpackError, match="not a saved `datasets` folder") as excinfo:
        read_source(tmp_path)
    assert "\n" not in str(excinfo.value)


def test_default_sharegpt_is_found() -> None:
    path = default_queries_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json" and path.is_file()


def test_mixed_completion_and_chat_records_are_both_read(tmp_path: Path) -> None:
    """Real logs mix completion calls (`prompt`) and chat calls (`messages`): each record's own field is used, and
    what is skipped is counted with where the first one is."""
    lines = [
        {"prompt": "first completion"},
        {"messages": [{"role": "user", "content": "first chat"}]},
        {"prompt": "second completion"},
        {"id": 7, "latency_ms": 12},
        {"messages": 42},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "second chat"}]},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    data = read_source(path)
    users = [m.content for c in data.conversations for m in c if m.role == "user"]
    assert users == ["first completion", "first chat", "second completion", "second chat"]
    report = data.report
    assert report.fields == {"prompt": 2, "messages": 2} and report.field == "prompt (2), messages (2)"
    assert report.num_records == 4 and report.num_malformed == 2
    assert any("1 records lack any query field" in n and "line 4" in n for n in report.notes), report.notes
    assert any("no query text or message list" in n and "line 5" in n for n in report.notes), report.notes
    forced = read_source(path, field_name="prompt").report
    assert forced.num_records == 2 and any(
        "4 records lack a 'prompt' field, e.g. line 2" in n for n in forced.notes
    )
