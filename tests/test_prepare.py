"""Which conversations the tokenize stage trains on."""
import json

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
