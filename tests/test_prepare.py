"""Which conversations the tokenize stage trains on."""
import json

import pytest

from eyas import config as C
from eyas.data.prepare import training_conversations


def test_regenerated_plus_extra_original(tmp_path):
    cfg = C.resolve(None, "smollm2", {"out": str(tmp_path), "data.extra_original": 3})
    convs, source = training_conversations(cfg)  # no regen output yet: the data set's train split
    assert source == "sharegpt" and len(convs) > 1000
    regen = tmp_path / "data" / "regen"
    regen.mkdir(parents=True)
    first = convs[0]
    rec = {"id": first.id, "messages": [{"role": "user", "content": first.turns[0].content},
                                        {"role": "assistant", "content": "regenerated answer"}]}
    (regen / "shard-00000.jsonl").write_text(json.dumps(rec) + "\n")
    got, source = training_conversations(cfg)
    assert got[0].turns[-1].content == "regenerated answer"
    assert [c.id for c in got[1:]] == [c.id for c in convs[1:4]]  # originals, without the regenerated id
    assert "3 original" in source
    cfg.data.extra_original = 0
    got, _ = training_conversations(cfg)
    assert [c.id for c in got] == [first.id]


def test_regenerated_first_turn_continued_with_original_turns(tmp_path):
    cfg = C.resolve(None, "smollm2", {"out": str(tmp_path), "data.original_rest": True})
    convs, _ = training_conversations(cfg)
    multi = next(c for c in convs if c.n_assistant() >= 3 and c.turns[0].role == "user")
    single = next(c for c in convs if c.n_assistant() == 1 and c.turns[0].role == "user")
    regen = tmp_path / "data" / "regen"
    regen.mkdir(parents=True)
    recs = [{"id": c.id, "messages": [{"role": "user", "content": c.turns[0].content},
                                      {"role": "assistant", "content": f"regenerated {c.id}"}]} for c in (multi, single)]
    (regen / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got, source = training_conversations(cfg)
    by_id = {c.id: c for c in got}
    m = by_id[multi.id]
    # the target's first answer, then the data set's own later turns, ending with an answer
    assert [t.content for t in m.turns[:2]] == [multi.turns[0].content, f"regenerated {multi.id}"]
    rest = multi.turns[2:]
    while rest[-1].role != "assistant":
        rest = rest[:-1]
    assert [(t.role, t.content) for t in m.turns[2:]] == [(t.role, t.content) for t in rest]
    assert m.meta["original_rest_turns"] == len(rest) and m.n_assistant() == multi.n_assistant()
    s = by_id[single.id]  # nothing after its only answer: unchanged
    assert [t.content for t in s.turns] == [single.turns[0].content, f"regenerated {single.id}"]
    assert "original_rest_turns" not in s.meta and "1 continued" in source
    cfg.data.original_rest = False
    got, _ = training_conversations(cfg)
    assert [len(c.turns) for c in got] == [2, 2]


def test_original_rest_edge_cases():
    from eyas.data.conversation import Conversation, Turn
    from eyas.data.prepare import with_original_rest

    orig = Conversation("a", [Turn("system", "s"), Turn("user", "u1"), Turn("assistant", "a1"), Turn("user", "u2"),
                              Turn("assistant", "a2"), Turn("user", "u3")])
    two = Conversation("a", [Turn("system", "s"), Turn("user", "u1"), Turn("assistant", "r1"), Turn("user", "u2"),
                             Turn("assistant", "r2")])
    assert with_original_rest(two, orig) is two  # every original answer was regenerated
    one = Conversation("a", two.turns[:3])
    got = with_original_rest(one, orig)
    assert [t.content for t in got.turns] == ["s", "u1", "r1", "u2", "a2"]  # the unanswered u3 is dropped
    assert with_original_rest(one, None) is one
    assert with_original_rest(Conversation("a", [Turn("user", "u1")]), orig).n_assistant() == 0


def test_nothing_to_train_on_says_why(tmp_path, tiny):
    """Tokenize with no answer left to train on names the cause: prompts alone with regeneration off, or every
    conversation cut at data.max_seq_len before its first answer."""
    import pytest

    from eyas.data.prepare import run_tokenize
    from eyas.util import EyasError

    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"Question number {i}?\n" for i in range(20)))
    cfg = C.resolve(None, "tiny", {"out": str(tmp_path / "a"), "data.source": str(prompts), "regen.enabled": False})
    with pytest.raises(EyasError, match=r"none of the \d+ conversations of .*p.txt has an assistant answer.*"
                                        r"regen.enabled=false"):
        run_tokenize(cfg, target=tiny)
    chats = tmp_path / "c.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": "a long question " * 40}, {"role": "assistant", "content": "an answer"}]}) + "\n"
        for i in range(20)))
    cfg = C.resolve(None, "tiny", {"out": str(tmp_path / "b"), "data.source": str(chats), "regen.enabled": False,
                                   "data.max_seq_len": 32})
    with pytest.raises(EyasError, match=r"lost its assistant tokens: \d+ of \d+ were cut at data.max_seq_len 32"):
        run_tokenize(cfg, target=tiny)


def _regen_run(run, plan: dict | None = None):
    """A run directory holding regenerated answers (one shard of 8 conversations), and their plan if given."""
    regen = run / "data" / "regen"
    regen.mkdir(parents=True)
    recs = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                         {"role": "assistant", "content": f"answer number {i} " * 4}]} for i in range(8)]
    (regen / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if plan is not None:
        (regen / "plan.json").write_text(json.dumps({"version": 1, "split": "train", "ids": [r["id"] for r in recs],
                                                     **plan}))
    return run


def test_tokens_are_the_same_however_the_run_is_named(tmp_path, tiny):
    """The tokens' meta.json names the regenerated answers relative to the run: tokenizing the run under an
    absolute --out, a relative one or after copying it gives the same tokens key (the vocabulary's and the
    checkpoint's), and meta.json holds no path of the run."""
    import shutil

    from eyas.data.prepare import run_tokenize, tokens_dir, tokens_key

    run = _regen_run(tmp_path / "run")  # the test runs in tmp_path: "run" is the same folder
    run_tokenize(C.resolve(None, "tiny", {"out": str(run)}), target=tiny)
    key = tokens_key(run)
    meta = (tokens_dir(run) / "meta.json").read_text()
    assert json.loads(meta)["source"] == "regenerated (data/regen)" and str(tmp_path) not in meta
    run_tokenize(C.resolve(None, "tiny", {"out": "run"}), target=tiny)
    assert tokens_key("run") == key
    shutil.copytree(run, tmp_path / "moved")
    run_tokenize(C.resolve(None, "tiny", {"out": str(tmp_path / "moved")}), target=tiny)
    assert tokens_key(tmp_path / "moved") == key


def test_a_data_setting_the_regenerated_answers_ignore_is_refused(tmp_path):
    """With regenerated answers in the run, a data.source, data.limit or data.test_ratio given explicitly that they
    were not made with is refused, naming both and what to do, instead of being recorded as the tokens' inputs while
    the answers are tokenized; the settings they were made with, a path spelled another way, or none, pass."""
    from eyas.util import EyasError

    run = _regen_run(tmp_path / "run", {"source": "sharegpt", "data": {"limit": 64, "val_ratio": 0.02,
                                                                         "test_ratio": 0.02}})
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                                  "content": "a"}]}) + "\n")

    def read(**given):
        return training_conversations(C.resolve(None, "tiny", {"out": str(run), **given}))[0]

    with pytest.raises(EyasError, match=rf"{run}/data/regen holds answers regenerated from sharegpt: training on them "
                                        rf"would ignore data.source {other} that this command was given.*use another "
                                        rf"--out, or delete .* `eyas regen --out {run} --source {other}`"):
        read(**{"data.source": str(other)})
    with pytest.raises(EyasError, match=r"chosen at data.limit=64: training on them would ignore data.limit=10 .*"
                                        r"leave data.limit out.*`eyas regen --out .* --set data.limit=10`"):
        read(**{"data.limit": 10})
    with pytest.raises(EyasError, match=r"chosen at data.test_ratio=0.02: training on them would ignore "
                                        r"data.test_ratio=0.1 "):
        read(**{"data.test_ratio": 0.1})
    assert len(read()) == len(read(**{"data.source": "sharegpt", "data.limit": 64})) == 8
    plan = json.loads((run / "data" / "regen" / "plan.json").read_text())
    plan["source"] = "other.jsonl"  # as the regen was given it, from tmp_path (the working directory)
    del plan["data"]  # a regen before the record: the settings it chose with are not known, so not checked
    (run / "data" / "regen" / "plan.json").write_text(json.dumps(plan))
    assert len(read(**{"data.source": str(other), "data.limit": 10})) == 8


def test_refused_tokens_name_the_tokenize_command_that_makes_them(tmp_path, tiny):
    """Tokens refused for a setting a command was given name the exact `eyas tokenize` that makes them with it
    (train.val_ratio as --set: tokenize's --val-ratio is data.val_ratio), and that command does; a setting the
    regenerated answers ignore is said as such first; a token file gone names the command that makes it again."""
    import re
    import shlex

    from eyas.cli import main
    from eyas.data.prepare import ensure_tokens, load_tokens, run_tokenize, tokens_dir
    from eyas.util import EyasError

    run = _regen_run(tmp_path / "run", {"source": "sharegpt"})
    cfg = C.resolve(None, "tiny", {"out": str(run)})
    C.save(cfg, run)
    run_tokenize(cfg, target=tiny)

    def given(**over):  # a stage command's settings on the run: its own, under what the command was given
        return C.resolve(None, None, over, run_config=run / "eyas.toml")

    train = given(**{"train.val_ratio": 0.0, "data.max_seq_len": 128})
    with pytest.raises(EyasError, match="train.val_ratio was 0.02, this command gives 0.0") as e:
        ensure_tokens(train, tiny)
    cmd = re.search(r"`(eyas tokenize [^`]*)` makes them again", str(e.value)).group(1)
    assert cmd == f"eyas tokenize --out {run} --set data.max_seq_len=128 --set train.val_ratio=0.0"
    assert main(shlex.split(cmd)[1:]) == 0
    assert ensure_tokens(train, tiny) is False  # they are the tokens the command means now
    with pytest.raises(EyasError, match="holds answers regenerated from sharegpt: training on them would ignore "
                                        "data.source other.jsonl"):
        ensure_tokens(given(**{"data.source": "other.jsonl"}), tiny)
    (tokens_dir(run) / "train.safetensors").unlink()
    with pytest.raises(EyasError, match=rf"train.safetensors: token file missing; `eyas tokenize --out {run}` makes "
                                        rf"the run's tokens again \(or delete {run}/data/tokens, and `eyas run --out "
                                        rf"{run}` makes them again\)"):
        load_tokens(run, "train")


@pytest.mark.parametrize("flags,said", [
    (["--val-ratio", "-1"], "data.val_ratio must be at least 0 and below 1, got -1.0"),
    (["--val-ratio", "1"], "data.val_ratio must be at least 0 and below 1, got 1.0"),
    (["--test-ratio", "1.5"], "data.test_ratio must be at least 0 and below 1, got 1.5"),
    (["--val-ratio", "0.5", "--test-ratio", "0.5"], "data.val_ratio and data.test_ratio must be 0 or above with a sum "
                                                    "below 1 (the rest is the train split), got 0.5 and 0.5"),
    (["--extra-original", "-1"], "data.extra_original must be 0 (none) or more, got -1"),
    (["--limit", "-1"], "data.limit must be 0 (all records) or more, got -1")])
def test_tokenize_refuses_data_settings_out_of_range(flags, said, capsys):
    from eyas.cli import main

    assert main(["tokenize", "--preset", "tiny", "--out", "run", *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
