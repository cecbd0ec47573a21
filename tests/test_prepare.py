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
