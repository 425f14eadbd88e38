"""Tests of eogp_index.data.readers: every shard format, malformed lines, globbing and shard names."""

from __future__ import annotations

import gzip
import os

import pytest

from eogp_index.data.readers import (
    ParseError,
    RawRecord,
    detect_format,
    expand_shards,
    iter_raw_records,
    location_of,
    shard_names,
)
from eogp_index.errors import InputError
from ingest.records import Example, RecordSpec, iter_examples

ROWS = [
    {"text": "hello world", "source": "web", "n": 1},
    {"text": "the quick brown fox", "source": "books", "n": 2},
    {"text": "tell me a joke", "source": "chat", "n": 3},
]


@pytest.mark.parametrize("name", ["a.jsonl", "a.json", "a.ndjson", "a.jsonl.gz", "a.jsonl.zst", "a.JSONL"])
def test_jsonl_formats(tmp_path, jsonl_writer, name):
    path = jsonl_writer(tmp_path / name, ROWS)
    records = list(iter_raw_records(path))
    assert records == [RawRecord(name, i, row) for i, row in enumerate(ROWS)]


def test_zstd_with_several_frames(tmp_path, jsonl_writer):
    import zstandard

    from_first = jsonl_writer(tmp_path / "part.jsonl", ROWS[:2]).read_bytes()
    from_second = jsonl_writer(tmp_path / "part.jsonl", ROWS[2:]).read_bytes()
    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "multi.jsonl.zst"
    path.write_bytes(compressor.compress(from_first) + compressor.compress(from_second))
    assert [r.record for r in iter_raw_records(path)] == ROWS


def test_parquet_reads_in_batches(tmp_path, parquet_writer):
    rows = [{"text": f"doc {i}", "n": i, "ids": [i, i + 1]} for i in range(2500)]
    path = parquet_writer(tmp_path / "big.parquet", rows, row_group_size=700)
    records = list(iter_raw_records(path))
    assert len(records) == 2500
    assert records[0] == RawRecord("big.parquet", 0, rows[0])
    assert records[2499] == RawRecord("big.parquet", 2499, rows[2499])
    assert [r.position for r in records] == list(range(2500))


def test_parquet_nulls_count_as_absent(tmp_path, parquet_writer, tokenizer):
    # A Parquet file mixing text and pre-tokenized rows has nulls in the unused column.
    rows = [{"text": "hello world", "input_ids": None}, {"text": None, "input_ids": [1, 5, 6]}]
    path = parquet_writer(tmp_path / "mixed.parquet", rows)
    examples = list(iter_examples([path], RecordSpec(), tokenizer))
    assert [e.position for e in examples] == [0, 1]
    assert examples[1].input_ids == (1, 5, 6)


def test_hf_save_to_disk_dataset(tmp_path, hf_writer):
    path = hf_writer(tmp_path / "hfdata", ROWS)
    assert detect_format(path) == ("hf", None)
    records = list(iter_raw_records(path))
    assert records == [RawRecord("hfdata", i, row) for i, row in enumerate(ROWS)]


def test_hf_dataset_dict_needs_a_split(tmp_path):
    import datasets

    path = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(path))
    with pytest.raises(InputError, match=r"DatasetDict with splits \[train, test\]; pick one .*::<split>"):
        list(iter_raw_records(path))
    test_records = list(iter_raw_records(f"{path}::test"))
    assert test_records == [RawRecord("dd::test", 0, ROWS[0])]
    with pytest.raises(InputError, match=r"has no split 'dev'; its splits are \[train, test\]"):
        list(iter_raw_records(f"{path}::dev"))
    assert expand_shards([f"{path}::train"]) == [type(path)(f"{path}::train")]


def test_malformed_lines_do_not_stop_reading(tmp_path, jsonl_writer):
    path = jsonl_writer(
        tmp_path / "m.jsonl",
        [ROWS[0], "{not json", "", "   ", '"a string"', ROWS[1]],
    )
    # Invalid UTF-8 on its own line, appended as line 7.
    path.write_bytes(path.read_bytes() + b'{"text": "\xff\xfe"}\n' + b'{"text": "end"}\n')
    records = list(iter_raw_records(path))
    assert [r.position for r in records] == [0, 1, 4, 5, 6, 7]  # blank lines 2, 3 skipped
    assert records[0].record == ROWS[0]
    bad = records[1].record
    assert isinstance(bad, ParseError)
    assert bad.location == "m.jsonl:2"
    assert "malformed JSON" in bad.reason
    with pytest.raises(InputError, match=r"^m\.jsonl:2: malformed JSON"):
        raise bad.to_error()
    assert isinstance(records[2].record, ParseError) and "not an object" in records[2].record.reason
    assert records[3].record == ROWS[1]
    assert isinstance(records[4].record, ParseError) and records[4].record.location == "m.jsonl:7"
    assert "UTF-8" in records[4].record.reason
    assert records[5].record == {"text": "end"}


def test_byte_order_mark_is_ignored(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "hi"}\n')
    assert [r.record for r in iter_raw_records(path)] == [{"text": "hi"}]


def _cut_gzip(path, lines: int):
    """A gzip JSON Lines shard of ``lines`` records, cut off halfway through its compressed bytes."""
    data = gzip.compress(b"".join(f'{{"text": "line {i}"}}\n'.encode() for i in range(lines)))
    path.write_bytes(data[: len(data) // 2])
    return path


def test_truncated_gzip_yields_the_readable_records_then_the_first_line_lost(tmp_path):
    path = _cut_gzip(tmp_path / "cut.jsonl.gz", 2000)
    records = list(iter_raw_records(path))
    *good, lost = records
    assert len(good) > 100 and [r.record for r in good] == [{"text": f"line {i}"} for i in range(len(good))]
    assert isinstance(lost.record, ParseError) and lost.position == len(good)
    assert lost.record.location == f"cut.jsonl.gz:{len(good) + 1}"
    assert f"cannot read line {len(good) + 1} or any after it" in lost.record.reason
    assert "truncated or corrupt" in lost.record.reason
    with pytest.raises(InputError, match=rf"^cut\.jsonl\.gz:{len(good) + 1}: cannot read line"):
        raise lost.record.to_error()


def test_truncated_gzip_is_its_shards_error_and_the_other_shards_are_read(tmp_path, tokenizer, jsonl_writer):
    cut = _cut_gzip(tmp_path / "a-cut.jsonl.gz", 2000)
    good = jsonl_writer(tmp_path / "b-good.jsonl", ROWS)
    out = list(iter_examples([cut, good], RecordSpec(), tokenizer, on_error="skip"))
    rejected = [o for o in out if not isinstance(o, Example)]
    assert len(rejected) == 1 and rejected[0].shard == "a-cut.jsonl.gz"
    assert "or any after it" in rejected[0].reason
    kept = [o for o in out if isinstance(o, Example)]
    assert sum(e.shard == "a-cut.jsonl.gz" for e in kept) == rejected[0].position > 100
    assert [e.content["text"] for e in kept if e.shard == "b-good.jsonl"] == [r["text"] for r in ROWS]
    with pytest.raises(InputError, match=r"^a-cut\.jsonl\.gz:[0-9]+: cannot read line"):
        list(iter_examples([cut, good], RecordSpec(), tokenizer))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"text": "a"', "Expecting ',' delimiter at column 13"),  # cut short: the line's end
        ('{"text": "a", "n": tru}', "Expecting value at column 20"),
        ('{"text": "abc', "Unterminated string starting at column 10 (the line ends at column 14"),
        ('{"a": 1} x', "Extra data at column 10"),
        ('  {"text": 1,}', "Expecting property name enclosed in double quotes at column 14"),
    ],
)
def test_malformed_json_is_reported_at_its_column(tmp_path, line, expected):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"text": "ok"}\n' + line.encode() + b"\r\n")
    _, bad = iter_raw_records(path)
    assert bad.record.location == "m.jsonl:2"
    assert bad.record.reason.startswith(f"malformed JSON: {expected}"), bad.record.reason


def test_invalid_utf8_is_reported_at_its_column(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_bytes('{"text": "héllo \xff"}\n'.encode("utf-8").replace(b"\xc3\xbf", b"\xff"))
    (bad,) = iter_raw_records(path)
    assert "not valid UTF-8 at column 17 (byte 18)" in bad.record.reason


def test_corrupt_parquet_raises(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match=r"^bad\.parquet: cannot read Parquet file"):
        list(iter_raw_records(path))


def test_expand_shards_sorts_dedups_and_checks(tmp_path, jsonl_writer):
    (tmp_path / "sub").mkdir()
    for name in ["b.jsonl", "a.jsonl.gz", "sub/c.jsonl"]:
        jsonl_writer(tmp_path / name, ROWS[:1])
    found = expand_shards([str(tmp_path / "*.jsonl*"), tmp_path / "b.jsonl", str(tmp_path / "**" / "*.jsonl")])
    assert found == sorted([tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl", tmp_path / "sub" / "c.jsonl"], key=os.fspath)
    with pytest.raises(InputError, match=r"shard pattern '.*nothing\*\.jsonl' matches no file"):
        expand_shards([str(tmp_path / "*.jsonl"), str(tmp_path / "nothing*.jsonl")])
    with pytest.raises(InputError, match=r"shard '.*missing\.jsonl' does not exist"):
        expand_shards([tmp_path / "missing.jsonl"])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError, match=r"notes\.txt: unsupported shard format"):
        expand_shards([str(tmp_path / "*")])
    with pytest.raises(InputError, match=r"sub: is a dataset: name its split as '.*sub::train'"):
        expand_shards([tmp_path / "sub"])
    with pytest.raises(InputError, match="no shards given"):
        expand_shards([])


def test_shard_names_by_file_name_or_root(tmp_path, jsonl_writer):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    paths = [jsonl_writer(tmp_path / d / "part.jsonl", ROWS[:1]) for d in ("x", "y")]
    with pytest.raises(InputError, match="have the same name 'part.jsonl'.*pass a shard root"):
        shard_names(paths)
    assert shard_names(paths, root=tmp_path) == ["x/part.jsonl", "y/part.jsonl"]
    assert shard_names([paths[0]]) == ["part.jsonl"]
    with pytest.raises(InputError, match="is not under the shard root"):
        shard_names(paths, root=tmp_path / "x")
    examples = list(iter_examples(paths, RecordSpec(), _tokenizer_stub(), shard_root=tmp_path))
    assert [e.shard for e in examples] == ["x/part.jsonl", "y/part.jsonl"]
    assert examples[0].id != examples[1].id


def _tokenizer_stub():
    # Only pre-tokenized records need no tokenizer; these are text, so use a trivial stand-in.
    class Stub:
        def __call__(self, text, add_special_tokens=True, verbose=True):
            return {"input_ids": [ord(c) for c in text]}

        def __len__(self):
            return 0x110000

    return Stub()


def test_location_of():
    assert location_of("a.jsonl", 0) == "a.jsonl:1"
    assert location_of("a.jsonl.zst", 9) == "a.jsonl.zst:10"
    assert location_of("sub/a.json.gz", 0) == "sub/a.json.gz:1"
    assert location_of("a.parquet", 0) == "a.parquet:row 0"
    assert location_of("dd::train", 5) == "dd::train:row 5"


def test_same_examples_from_every_format(tmp_path, tokenizer, jsonl_writer, parquet_writer, hf_writer):
    spec = RecordSpec(metadata_fields=("source", "n"))
    shards = [
        jsonl_writer(tmp_path / "s.jsonl", ROWS),
        jsonl_writer(tmp_path / "s.jsonl.gz", ROWS),
        jsonl_writer(tmp_path / "s.jsonl.zst", ROWS),
        parquet_writer(tmp_path / "s.parquet", ROWS),
        hf_writer(tmp_path / "s_hf", ROWS),
    ]
    examples = list(iter_examples(shards, spec, tokenizer))
    assert all(isinstance(e, Example) for e in examples)
    by_shard: dict[str, list[Example]] = {}
    for example in examples:
        by_shard.setdefault(example.shard, []).append(example)
    assert sorted(by_shard) == ["s.jsonl", "s.jsonl.gz", "s.jsonl.zst", "s.parquet", "s_hf"]
    reference = by_shard["s.jsonl"]
    for shard, group in by_shard.items():
        assert [(e.input_ids, e.labels, e.metadata, e.position) for e in group] == [
            (e.input_ids, e.labels, e.metadata, e.position) for e in reference
        ], shard
    assert len({e.id for e in examples}) == len(examples)  # shard names go into the ids
    # Same content, shard and position -> same id in a second run.
    assert [e.id for e in iter_examples(shards, spec, tokenizer)] == [e.id for e in examples]
