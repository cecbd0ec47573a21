"""Loss masks: decoding the masked spans gives exactly the assistant texts plus the end-of-turn token."""
import copy

import pytest

from eyas.data import Conversation, Turn
from eyas.data.tokenize import check_mask, masked_text, tokenize_conversation
from eyas.util import EyasError

# A Qwen3-style template: reasoning_content is rendered inside <think>...</think> before the answer.
THINK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if m.get('reasoning_content') %}{{ '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ONE = Conversation("one", [Turn("user", "What is the capital of France?"),
                           Turn("assistant", "The capital of France is Paris.")])
MULTI = Conversation("multi", [
    Turn("system", "You are terse."),
    Turn("user", "Name a prime number."),
    Turn("assistant", "7"),
    Turn("user", "And an even one?\nJust one."),
    Turn("assistant", "2 is the only even prime.\n\n```python\nprint(2)\n```"),
])
REASON = Conversation("reason", [
    Turn("user", "Is 91 prime?"),
    Turn("assistant", "No, 91 = 7 × 13.", reasoning="Try small divisors: 91 / 7 = 13."),
    Turn("user", "And 97?"),
    Turn("assistant", "Yes, 97 is prime.", reasoning="No divisor up to 9 works."),
])


def answers(conv, with_reasoning):
    out = []
    for t in conv.turns:
        if t.role == "assistant":
            text = t.content
            if with_reasoning and t.reasoning:
                text = f"<think>\n{t.reasoning}\n</think>\n\n{t.content}"
            out.append(text + "<|im_end|>")
    return out


@pytest.mark.parametrize("conv", [ONE, MULTI], ids=["single", "multi"])
def test_smollm2_template_masks_exactly_the_answers(smol, conv):
    t = tokenize_conversation(smol.tokenizer, conv, eot_ids=smol.eot_token_ids)
    assert masked_text(smol.tokenizer, t) == answers(conv, False)
    check_mask(t)
    # the whole sequence is the template's rendering
    assert smol.tokenizer.decode(t.input_ids) == smol.tokenizer.apply_chat_template(
        [{"role": x.role, "content": x.content} for x in conv.turns], tokenize=False)


@pytest.fixture(scope="module")
def think_tok(smol):
    tok = copy.deepcopy(smol.tokenizer)
    tok.chat_template = THINK_TEMPLATE
    return tok


@pytest.mark.parametrize("conv", [ONE, REASON], ids=["single", "multi-reasoning"])
def test_think_template_renders_reasoning_its_way(think_tok, smol, conv):
    t = tokenize_conversation(think_tok, conv, eot_ids=smol.eot_token_ids)
    assert masked_text(think_tok, t) == answers(conv, True)
    dropped = tokenize_conversation(think_tok, conv, reasoning="drop", eot_ids=smol.eot_token_ids)
    assert masked_text(think_tok, dropped) == answers(conv, False)


def test_reasoning_inline_for_templates_without_it(smol):
    t = tokenize_conversation(smol.tokenizer, REASON, eot_ids=smol.eot_token_ids)
    assert masked_text(smol.tokenizer, t) == answers(REASON, True)


def test_truncation_and_bad_masks(smol):
    t = tokenize_conversation(smol.tokenizer, MULTI, max_seq_len=20, eot_ids=smol.eot_token_ids)
    assert t.truncated and len(t.input_ids) == len(t.loss_mask) == 20
    with pytest.raises(EyasError, match="all zeros"):
        check_mask(t)  # the answers start after token 20
    tok = copy.deepcopy(smol.tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no role markup at all
    only_assistant = Conversation("x", [Turn("user", "q"), Turn("assistant", "a")])
    t2 = tokenize_conversation(tok, Conversation("y", [Turn("assistant", "only answer")]), eot_ids=[])
    with pytest.raises(EyasError, match="all ones"):
        check_mask(t2)
    tok.chat_template = None
    with pytest.raises(EyasError, match="no chat template"):
        tokenize_conversation(tok, only_assistant)


def test_worker_processes_give_the_same_tokens(smol):
    """The stage's tokenizing in spawned worker processes (data.tokenize_workers) gives the one-process result:
    the same sequences in the same order, tokens, masks and counts, on real ShareGPT conversations (multi-turn,
    some cut at max_seq_len, some left without an answer token)."""
    from eyas import config as C
    from eyas.data.prepare import POOL_FROM, tokenize_all, tokenize_workers
    from eyas.data.readers import read_dataset

    convs, _ = read_dataset("sharegpt", limit=120)
    convs = convs + [Conversation("late", [Turn("user", "x " * 600), Turn("assistant", "never reached")])]
    cfg = C.resolve(None, "smollm2", {"data.max_seq_len": 512})
    one, s1 = tokenize_all(convs, smol.tokenizer, cfg, smol.eot_token_ids, workers=1)
    two, s2 = tokenize_all(convs, smol.tokenizer, cfg, smol.eot_token_ids, workers=2)
    assert s1 == s2 and s1["truncated"] > 0 and s1["empty_mask"] >= 1
    assert [t.id for t in two] == [t.id for t in one] and len(one) == len(convs) - s1["empty_mask"]
    for a, b in zip(one, two):
        assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask and a.truncated == b.truncated
    # auto: this process for small sets, one per core (at most 16) from POOL_FROM conversations on
    assert tokenize_workers(0, POOL_FROM - 1) == 1 and 1 <= tokenize_workers(0, POOL_FROM) <= 16
    assert tokenize_workers(3, 10) == 3
    with pytest.raises(EyasError, match="data.tokenize_workers"):
        tokenize_workers(-2, 10)
