"""What every generation backend returns for one request: the embedded engines (engine.generate) and regen's
server backend (data.server). Stdlib only, as the server backend is."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TurnResult:
    """One generated assistant turn (or why there is none)."""
    rid: str
    content: str = ""
    reasoning: str | None = None
    finish_reason: str = "stop"        # stop | length | context (prompt already fills the context)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None           # error kind when the request failed for good
    message: str = ""                  # error detail
    fatal: bool = False                # the backend cannot go on (endpoints down)
    retries: Counter = field(default_factory=Counter)
