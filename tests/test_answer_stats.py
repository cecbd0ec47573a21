"""bench/answer_stats.py: answers by turn from regen shards, on hand-made shards whose figures are worked out below
(a character tokenizer stands in for the target's, so every count can be read off the strings)."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("answer_stats", ROOT / "bench" / "answer_stats.py")
ans = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ans)


def chars(text, add_special_tokens=False):
    return {"input_ids": [ord(c) for c in text]}


def _shards(d: Path):
    # conversation a: a first answer that does not repeat and stopped, a second that loops and hit the cap;
    # conversation b: one first answer, capped, half of whose bigrams repeat; then a torn line (a killed run)
    a = {"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abcdef"},
                                 {"role": "user", "content": "q2"}, {"role": "assistant", "content": "xyxyxyxyxy"}],
         "meta": {"turns": [{"finish_reason": "stop"}, {"finish_reason": "length"}]}}
    b = {"id": "b", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abab"}],
         "meta": {"turns": [{"finish_reason": "length"}]}}
    (d / "shard-00000.jsonl").write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n" + '{"id": "c", "mess')


def test_answers_by_turn(tmp_path):
    _shards(tmp_path)
    rows = list(ans.regen_answers(tmp_path))
    assert [(r[0], r[1], r[3]) for r in rows] == [("a", 0, False), ("a", 1, True), ("b", 0, True)]
    s = ans.stats(rows, chars, ngram=2, loop=0.5)
    # first answers: "abcdef" (5 bigrams, none repeated) and "abab" (3 bigrams, 2 distinct: 1/3 repeated)
    assert s["1"]["answers"] == 2 and s["1"]["mean_tokens"] == 5.0 and s["1"]["capped"] == 0.5
    assert s["1"]["mean_repeated_share"] == round((0 + 1 / 3) / 2, 3)
    assert s["1"]["tokens_in_looping_answers"] == 0.0  # 1/3 is under the loop threshold of 0.5
    # the second answer: 9 bigrams, 2 distinct -> 7/9 repeated, a loop; all its 10 tokens count
    assert s["2"] == {"answers": 1, "mean_tokens": 10.0, "capped": 1.0, "mean_repeated_share": round(7 / 9, 3),
                      "tokens_in_looping_answers": 1.0}
    assert "3" not in s and "4+" not in s
    assert len(list(ans.regen_answers(tmp_path, limit=1))) == 2  # one record, both its answers


def test_turns_past_the_third_share_a_bucket():
    assert [ans.bucket(i) for i in range(6)] == ["1", "2", "3", "4+", "4+", "4+"]
