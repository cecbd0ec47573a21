"""Chat-template tokenization with an assistant-only loss mask.

The mask is found in text space, then mapped to tokens through the fast tokenizer's offsets:
for assistant turn i, the template rendered over turns[:i] with the generation prompt is a
prefix P of the full rendering, and turns[:i+1] rendered without it is a prefix F. The
assistant's span runs from len(P) to the end of the end-of-turn token inside F, so the
template's role header and the newline after the end-of-turn token are not trained on, while
the assistant text (with its reasoning, rendered the template's way) and the end-of-turn token
are. Templates that are not prefix-consistent fall back to locating the content text itself.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..util import EyasError
from .conversation import THINK_CLOSE, THINK_OPEN, Conversation


@dataclass
class Tokenized:
    id: str
    input_ids: Sequence[int]  # a list, or an array("i") from the tokenize stage (eyas.data.prepare.tokenize_all)
    loss_mask: Sequence[int]
    truncated: bool = False

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(self.input_ids), torch.tensor(self.loss_mask, dtype=torch.bool)


def template_handles_reasoning(tokenizer) -> bool:
    t = getattr(tokenizer, "chat_template", None) or ""
    return "reasoning_content" in t


def to_messages(conv: Conversation, tokenizer, reasoning: str = "keep") -> list[dict]:
    """Conversation -> template messages. Reasoning goes into `reasoning_content` for templates
    that render it; for others it is written inline as <think>...</think> before the answer."""
    native = template_handles_reasoning(tokenizer)
    msgs = []
    for t in conv.turns:
        m = {"role": t.role, "content": t.content}
        if t.role == "assistant" and t.reasoning and reasoning == "keep":
            if native:
                m["reasoning_content"] = t.reasoning
            else:
                m["content"] = f"{THINK_OPEN}\n{t.reasoning}\n{THINK_CLOSE}\n\n{t.content}"
        msgs.append(m)
    return msgs


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise EyasError("the target's tokenizer has no chat template; eyas needs one to build training data")
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict], full: str, eot: str | None) -> list[tuple[int, int]]:
    """Character spans of the trained-on text of every assistant turn in `full`."""
    spans = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if full.startswith(prefix) and full.startswith(upto) and len(upto) > len(prefix):
            start, stop = len(prefix), len(upto)
            if eot:
                k = upto.rfind(eot, start)
                if k >= 0:
                    stop = k + len(eot)
        else:  # not prefix-consistent: find the content itself
            k = full.find(m["content"], cursor)
            if k < 0:
                raise EyasError("chat template does not render assistant text verbatim; cannot build a loss mask")
            start, stop = k, k + len(m["content"])
            if eot and full.startswith(eot, stop):
                stop += len(eot)
        spans.append((start, stop))
        cursor = stop
    return spans


def eot_text(tokenizer, eot_ids: list[int] | None) -> str | None:
    if eot_ids:
        return tokenizer.convert_ids_to_tokens(eot_ids[0])
    return tokenizer.eos_token


def tokenize_conversation(tokenizer, conv: Conversation, max_seq_len: int = 0, reasoning: str = "keep",
                          eot_ids: list[int] | None = None) -> Tokenized:
    msgs = to_messages(conv, tokenizer, reasoning)
    full = render(tokenizer, msgs)
    spans = assistant_spans(tokenizer, msgs, full, eot_text(tokenizer, eot_ids))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    j = 0
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        if j < len(spans) and b > a and a >= spans[j][0] and b <= spans[j][1]:
            mask[t] = 1
    truncated = bool(max_seq_len) and len(ids) > max_seq_len
    if truncated:
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    return Tokenized(conv.id, ids, mask, truncated)


def check_mask(tok: Tokenized) -> None:
    """A mask of all ones or all zeros means the template or data is wrong: fail loudly."""
    s = sum(tok.loss_mask)
    if s == 0:
        raise EyasError(f"conversation {tok.id}: the loss mask is all zeros (no assistant tokens survive "
                        f"tokenization/truncation); check the chat template and max_seq_len")
    if s == len(tok.loss_mask):
        raise EyasError(f"conversation {tok.id}: the loss mask is all ones (the template's own tokens would be "
                        f"trained on); the chat template does not mark assistant turns")


def masked_text(tokenizer, tok: Tokenized) -> list[str]:
    """Decode each contiguous masked run (for tests and `eyas data --show`)."""
    runs, cur = [], []
    for i, m in zip(tok.input_ids, tok.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r) for r in runs]
