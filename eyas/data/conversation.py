"""The one record type every data stage passes around."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # the markers of reasoning written inline


@dataclass
class Turn:
    role: str
    content: str
    reasoning: str | None = None  # assistant reasoning (the text a template puts inside <think>)

    def to_dict(self) -> dict:
        d = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            d["reasoning"] = self.reasoning
        return d


@dataclass
class Conversation:
    id: str
    turns: list[Turn]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {"id": self.id, "messages": [t.to_dict() for t in self.turns]}
        if self.meta:
            d["meta"] = self.meta
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Conversation":
        """Inverse of to_dict (no validation; readers validate)."""
        return cls(id=str(d["id"]), turns=[Turn(m["role"], m["content"], m.get("reasoning")) for m in d["messages"]],
                   meta=d.get("meta", {}))

    @property
    def prompt_turns(self) -> list[Turn]:
        """System and user turns (what regeneration keeps)."""
        return [t for t in self.turns if t.role != "assistant"]

    def n_assistant(self) -> int:
        return sum(t.role == "assistant" for t in self.turns)


def split_reasoning(text: str, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE) -> tuple[str, str | None]:
    """(answer, reasoning) from text that may carry inline reasoning between think markers. The opening
    marker may be missing (templates that put it in the generation prompt); an unclosed one means the
    turn was cut short while thinking."""
    if close_tag in text:
        head, tail = text.split(close_tag, 1)
        head = head.strip()
        if head.startswith(open_tag):
            head = head[len(open_tag):]
        return tail.strip(), head.strip()
    stripped = text.lstrip()
    if stripped.startswith(open_tag):
        return "", stripped[len(open_tag):].strip()
    return text.strip(), None
