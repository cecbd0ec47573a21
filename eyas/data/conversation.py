"""The one record type every data stage passes around."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


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
