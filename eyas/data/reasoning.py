"""Reasoning targets whose chat template drops the reasoning of earlier turns (DeepSeek-R1, Qwen3).

Such a template renders an assistant turn's `<think>...</think>` only for the turn being answered: served, the
target sees every earlier answer without its reasoning, and writes the reasoning of the turn it answers. Rendering
a whole conversation once would lose the reasoning of every answer (R1 strips it from all of them), or show the
drafter earlier turns with reasoning the target never sees. So, for such a template, a conversation whose answers
carry reasoning becomes one training sequence per answer: the template's rendering of the turns before it with the
generation prompt (what a server feeds the target at that turn: earlier answers as a client sends them back, their
content only), then that answer with its reasoning as the model writes it, and its end-of-turn token; only the
answer is trained on. Templates that keep reasoning stay on the one-sequence path of eyas.data.tokenize.
"""
from __future__ import annotations

from .conversation import THINK_CLOSE, THINK_OPEN, Conversation, Turn, split_reasoning
from .tokenize import Tokenized, eot_text, render, to_messages, tokenize_conversation

_PROBE_REASONING = ("Zq7 first reasoning", "Zq8 second reasoning")
_drops: dict[tuple[str, bool], bool] = {}  # (chat template, renders reasoning_content) -> drops_reasoning


def drops_reasoning(tokenizer) -> bool:
    """Whether the chat template leaves out the reasoning of an assistant turn when it renders a conversation of
    two answers with reasoning (either answer's: R1 drops both, Qwen3 the first). A template that cannot render the
    probe counts as keeping it (the one-sequence path, which reports its own errors)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return False
    key = (template, "reasoning_content" in template)
    if key not in _drops:
        probe = Conversation("probe", [
            Turn("user", "Zq1 question"), Turn("assistant", "Zq2 answer", _PROBE_REASONING[0]),
            Turn("user", "Zq3 question"), Turn("assistant", "Zq4 answer", _PROBE_REASONING[1])])
        try:
            text = render(tokenizer, to_messages(probe, tokenizer, "keep"))
        except Exception:  # noqa: BLE001 - any failure of a template's own code means: not this path
            _drops[key] = False
        else:
            _drops[key] = not all(r in text for r in _PROBE_REASONING)
    return _drops[key]


def history_messages(turns: list[Turn], tokenizer, reasoning: str = "keep") -> list[dict]:
    """Template messages of the turns before an answer, as a served target is given them: for a template that drops
    earlier reasoning, assistant turns carry their answer only (OpenAI-style clients send `content` back, not the
    reasoning); for others, as to_messages writes them."""
    conv = Conversation("", list(turns))
    return to_messages(conv, tokenizer, "drop" if drops_reasoning(tokenizer) else reasoning)


def per_turn(conv: Conversation, tokenizer, reasoning: str) -> bool:
    """Whether `conv` is tokenized one sequence per answer (see the module's docstring)."""
    return (reasoning == "keep" and any(t.role == "assistant" and t.reasoning for t in conv.turns)
            and drops_reasoning(tokenizer))


def written_answer(tokenizer, history: list[dict], turn: Turn, prompt: str, reasoning: str, eot: str | None) -> str:
    """The text the target writes after `prompt` for `turn`: the template's own rendering of it where that keeps its
    reasoning (Qwen3 renders the last turn's), else the reasoning inline between think markers before the answer (R1
    strips it, but writes it so), less the part of the opening marker the generation prompt already holds; then the
    end-of-turn token."""
    msg = to_messages(Conversation("", [turn]), tokenizer, reasoning)
    upto = render(tokenizer, history + msg)
    rendered = upto.startswith(prompt) and len(upto) > len(prompt)
    if rendered and (not turn.reasoning or turn.reasoning in upto[len(prompt):]):
        text = upto[len(prompt):]
        k = upto.rfind(eot, len(prompt)) if eot else -1
        return text[: k - len(prompt) + len(eot)] if k >= 0 else text
    text = f"{THINK_OPEN}\n{turn.reasoning}\n{THINK_CLOSE}\n\n{turn.content}" if turn.reasoning else turn.content
    for n in range(min(len(prompt), len(THINK_OPEN) + 1), 0, -1):  # `<think>\n` ending the generation prompt
        if text.startswith(prompt[-n:]) and THINK_OPEN in prompt[-n:]:
            text = text[n:]
            break
    return text + (eot or "")


def tokenize_per_turn(tokenizer, conv: Conversation, max_seq_len: int = 0, reasoning: str = "keep",
                      eot_ids: list[int] | None = None) -> list[Tokenized]:
    """One sequence per assistant turn: prompt (not trained on) then the answer as written (trained on). Every
    sequence keeps the conversation's id, so all of them fall on the conversation's side of every split."""
    eot = eot_text(tokenizer, eot_ids)
    out = []
    for i, turn in enumerate(conv.turns):
        if turn.role != "assistant":
            continue
        history = history_messages(conv.turns[:i], tokenizer, reasoning)
        prompt = render(tokenizer, history, add_generation_prompt=True)
        answer = written_answer(tokenizer, history, turn, prompt, reasoning, eot)
        p = list(tokenizer(prompt, add_special_tokens=False).input_ids) if prompt else []
        a = list(tokenizer(answer, add_special_tokens=False).input_ids)
        ids, mask = p + a, [0] * len(p) + [1] * len(a)
        truncated = bool(max_seq_len) and len(ids) > max_seq_len
        if truncated:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        out.append(Tokenized(conv.id, ids, mask, truncated))
    return out


def tokenize_sequences(tokenizer, conv: Conversation, max_seq_len: int = 0, reasoning: str = "keep",
                       eot_ids: list[int] | None = None) -> list[Tokenized]:
    """The training sequences of `conv`: one per answer for a template that drops earlier reasoning (when its
    answers carry reasoning), else the whole conversation as one."""
    if per_turn(conv, tokenizer, reasoning):
        return tokenize_per_turn(tokenizer, conv, max_seq_len, reasoning, eot_ids)
    return [tokenize_conversation(tokenizer, conv, max_seq_len, reasoning, eot_ids)]


def answered_turn(tokenizer, text: str) -> Turn:
    """The target's decoded answer as the history of a later turn holds it: split into answer and reasoning for a
    template that drops earlier reasoning (a client sends the answer back), the text as written for others."""
    if drops_reasoning(tokenizer):
        answer, thought = split_reasoning(text)
        return Turn("assistant", answer, thought)
    return Turn("assistant", text)


# --------------------------------------------------------------------------- reasoning capture per turn


def capture_by_turn(flags: list[list[bool]]) -> list[dict]:
    """From each record's answers' has-reasoning flags (in turn order): per answer index (1 = first answer), how many
    answers there are and the share with reasoning."""
    out: list[dict] = []
    for answers in flags:
        for j, has in enumerate(answers):
            if j == len(out):
                out.append({"turn": j + 1, "answers": 0, "with_reasoning": 0})
            out[j]["answers"] += 1
            out[j]["with_reasoning"] += bool(has)
    for d in out:
        d["rate"] = round(d["with_reasoning"] / d["answers"], 4)
    return out


def capture_words(by_turn: list[dict] | None, most: int = 8) -> str:
    """`capture_by_turn` for people: 'turn 1 92% of 100, turn 2 40% of 55, ...' (the first `most` turns)."""
    if not by_turn:
        return "none"
    shown = [f"turn {d['turn']} {d['rate']:.0%} of {d['answers']}" for d in by_turn[:most]]
    return ", ".join(shown) + (f", ... ({len(by_turn)} turns)" if len(by_turn) > most else "")
