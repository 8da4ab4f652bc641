"""Reading JSONL/Parquet and the bad-record policies (fail / skip / truncate)."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trex.data import BadRecordError, DataSection, build_loader, compact_tokenizer
from trex.data.documents import build_documents
from trex.data.records import BadRecordPolicy, SkipCounter, describe_skips, write_jsonl

TOK = compact_tokenizer()


def convo(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


GOOD = json.dumps(convo("1+1", "2"))
LONG = json.dumps(convo("1+1", "9" * 200))  # 200+ tokens with the compact tokenizer, loss in the first 64
# (line content, reason it is bad or None)
LINES = [
    (GOOD, None),
    (b'{"messages": [{"role": "user", "content": "\xff"}]}', "invalid_utf8"),
    ('{"messages": [', "malformed_json"),
    ("[1, 2]", "malformed_json"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "unknown_role"),
    (json.dumps({"messages": [{"content": "x"}]}), "missing_role"),
    (json.dumps({"messages": []}), "empty_conversation"),
    (json.dumps({"text": "no messages"}), "missing_messages"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "y"}]}',
     "invalid_utf8"),
    (LONG, "too_long"),
    (json.dumps(convo("2+2", "4")), None),
]


@pytest.fixture
def fixture_file(tmp_path):
    path = tmp_path / "mixed.jsonl"
    with open(path, "wb") as f:
        for line, _ in LINES:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
        f.write(b"\n")  # a trailing blank line is not a record
    return path


def cfg_for(path, policy, **kw):
    return DataSection(paths=[str(path)], tokenizer="compact", seq_len=64, bad_record_policy=policy, **kw)


@pytest.mark.parametrize("bad_line", [i for i, (_, reason) in enumerate(LINES) if reason])
def test_fail_names_file_line_and_reason(tmp_path, bad_line):
    path = tmp_path / "one_bad.jsonl"
    line, reason = LINES[bad_line]
    with open(path, "wb") as f:
        f.write(GOOD.encode() + b"\n" + (line if isinstance(line, bytes) else line.encode()) + b"\n")
    with pytest.raises(BadRecordError) as err:
        build_documents(cfg_for(path, "fail"), TOK, BadRecordPolicy("fail"))
    assert str(err.value).startswith(f"{path}:2: bad record ({reason})")
    assert (err.value.line, err.value.reason) == (2, reason)


def test_malformed_json_is_reported_at_the_files_line_not_the_parsers(tmp_path):
    path = tmp_path / "fifth_bad.jsonl"
    path.write_text("\n".join([GOOD] * 4 + ['{"messages": [], "x": 1,, "y": 2}', GOOD]) + "\n")
    with pytest.raises(BadRecordError) as err:
        build_documents(cfg_for(path, "fail"), TOK, BadRecordPolicy("fail"))
    message = str(err.value)
    assert message.startswith(f"{path}:5: bad record (malformed_json): ") and "column 25" in message, message
    assert "line 1" not in message, message  # the JSON parser's line within the record is not the file's


def test_skip_counts_every_reason(fixture_file):
    policy = BadRecordPolicy("skip")
    docs = build_documents(cfg_for(fixture_file, "skip"), TOK, policy)
    assert len(docs) == 2 and docs.records_read == len(LINES)
    want = {}
    for _, reason in LINES:
        if reason:
            want[reason] = want.get(reason, 0) + 1
    summary = policy.counter.as_dict()
    assert summary["skipped_by_reason"] == want
    assert summary["skipped"] == sum(want.values()) and summary["truncated"] == 0
    assert summary["first_seen"]["malformed_json"] == f"{fixture_file}:3"
    line = describe_skips(summary)
    assert line.startswith(f"skipped {sum(want.values())} bad records: ")
    assert f"{want['malformed_json']} malformed_json (first {fixture_file}:3)" in line
    assert describe_skips(BadRecordPolicy("skip").counter.as_dict()) is None  # nothing left out: no line


def test_truncate_cuts_long_documents_and_skips_the_rest(fixture_file):
    loader = build_loader(cfg_for(fixture_file, "truncate", shuffle=False), 0, 1, TOK)
    s = loader.summary()
    assert s["truncated"] == 1 and s["documents"] == 3
    assert "too_long" not in s["skipped_by_reason"] and s["skipped_by_reason"]["malformed_json"] == 2
    lengths = loader.rows.docs.lengths.tolist()
    assert lengths[1] == 64  # the long one, cut to seq_len, in file order (shuffle off)
    assert loader.rows.docs.tokens[loader.rows.docs.offsets[1]] == TOK.bos_id


def test_truncation_without_loss_tokens_is_skipped(tmp_path):
    path = tmp_path / "long_prompt.jsonl"
    write_jsonl(path, [convo("1+1", "2"), convo("9" * 200, "x")])
    s = build_loader(cfg_for(path, "truncate"), 0, 1, TOK).summary()
    assert s["skipped_by_reason"] == {"no_loss_tokens": 1} and s["truncated"] == 1


def test_no_trained_token_is_skipped(tmp_path):
    path = tmp_path / "ends_with_user.jsonl"
    two_turns = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
                              {"role": "user", "content": "and 2+2?"}]}
    write_jsonl(path, [convo("1+1", "2"), two_turns])
    s = build_loader(cfg_for(path, "skip", loss_on="last_assistant"), 0, 1, TOK).summary()
    assert s["skipped_by_reason"] == {"no_loss_tokens": 1} and s["documents"] == 1


def test_cpt_text_records(tmp_path):
    path = tmp_path / "text.jsonl"
    write_jsonl(path, [{"text": "12+3=15"}, {"text": ""}, {"body": "x"}])
    policy = BadRecordPolicy("skip")
    docs = build_documents(cfg_for(path, "skip", mode="cpt"), TOK, policy)
    assert TOK.decode(docs.tokens) == "<｜begin▁of▁sentence｜>12+3=15<｜end▁of▁sentence｜>"
    assert docs.loss_mask.all()
    assert policy.counter.as_dict()["skipped_by_reason"] == {"empty_text": 1, "missing_text": 1}


def test_parquet_matches_jsonl(tmp_path):
    records = [convo(f"{i}+{i}", str(2 * i)) for i in range(20)]
    records[3]["messages"].insert(0, {"role": "system", "content": "sys"})
    write_jsonl(tmp_path / "d.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    a = build_documents(cfg_for(tmp_path / "d.jsonl", "fail"), TOK, BadRecordPolicy("fail"))
    b = build_documents(cfg_for(tmp_path / "d.parquet", "fail"), TOK, BadRecordPolicy("fail"))
    assert a.tokens.tolist() == b.tokens.tolist() and a.offsets.tolist() == b.offsets.tolist()


def test_parquet_invalid_utf8_row(tmp_path):
    texts = pa.array([b"good", b"\xff\xfe", b"fine"], pa.binary()).view(pa.string())
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": texts}), path)
    with pytest.raises(BadRecordError, match=rf"{path}:2: bad record \(invalid_utf8\)"):
        build_documents(cfg_for(path, "fail", mode="cpt"), TOK, BadRecordPolicy("fail"))
    policy = BadRecordPolicy("skip")
    assert len(build_documents(cfg_for(path, "skip", mode="cpt"), TOK, policy)) == 2


def test_directory_and_missing_paths(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [convo("1+1", "2")])
    write_jsonl(tmp_path / "b.jsonl", [convo("2+2", "4")])
    docs = build_documents(cfg_for(tmp_path, "fail"), TOK, BadRecordPolicy("fail"))
    assert len(docs) == 2
    with pytest.raises(FileNotFoundError, match="matches no file"):
        build_documents(cfg_for(tmp_path / "nope*.jsonl", "fail"), TOK, BadRecordPolicy("fail"))


def _write_many(path: str) -> None:
    from trex.data.records import write_jsonl

    for i in range(300):
        write_jsonl(path, [{"i": i, "text": "x" * 2000}])


def test_processes_writing_the_same_file_at_once_all_succeed(tmp_path):
    """Every rank of a job generates the same data files: no writer may lose its temp file to another."""
    import multiprocessing

    path = str(tmp_path / "sft.jsonl")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(path,)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert json.loads(open(path).readline())["text"] == "x" * 2000
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_other_files_in_a_data_directory_are_counted_and_named(tmp_path, caplog):
    from trex.data.records import resolve_paths

    write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    (tmp_path / "notes.txt").write_text("not data")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "table.csv").write_text("a,b")
    (tmp_path / ".a.jsonl.123.tmp").write_text("")  # a writer's hidden temp file is not reported
    with caplog.at_level("WARNING", logger="trex"):
        files = resolve_paths([str(tmp_path)])
    assert [f.name for f, _ in files] == ["a.jsonl"]
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "2 file(s) skipped" in message and "notes.txt" in message and "sub/table.csv" in message
    counter = SkipCounter()
    resolve_paths([str(tmp_path)], counter=counter)
    summary = counter.as_dict()  # what summary.json's "data" section reports
    assert summary["files_skipped"] == 2 and sorted(os.path.basename(f) for f in summary["files_skipped_first"]) == [
        "notes.txt", "table.csv"]
