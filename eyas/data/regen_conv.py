"""One conversation of `eyas regen`: its copies for later samples and the later turns, and the walk through its
turns that asks for each answer in order (ConvState)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.turn import TurnResult
from .conversation import Conversation, Turn
from .readers import LATER_SUFFIX, SAMPLE_SUFFIX


def sample_copy(conv: Conversation, sample: int) -> Conversation:
    """The conversation to regenerate as its sample `sample` (> 1): its id suffixed, so its seeds, shards and
    records are its own; `split_of` strips the suffix, so every sample of a conversation lands on the same side of
    a split."""
    return Conversation(f"{conv.id}{SAMPLE_SUFFIX}{sample}", list(conv.turns),
                        {**conv.meta, "sample_of": conv.id, "sample": sample})


def later_copy(conv: Conversation) -> Conversation:
    """The conversation whose later answers regen.later_turns asks for, with an id of its own (as sample_copy)."""
    return Conversation(f"{conv.id}{LATER_SUFFIX}", list(conv.turns), {**conv.meta, "later_of": conv.id})


def answer_slots(conv: Conversation) -> int:
    """How many answers regeneration asks for in `conv` (every one, regen.turns=0)."""
    return len(ConvState(0, conv).source_answers)


@dataclass
class ConvState:
    """Walks one conversation: keeps system/user turns, asks for an assistant turn wherever the source
    had one (and after a final unanswered user turn), stops after `max_turns` answers.
    `history="original"` asks each answer with the source's own earlier answers as its context instead of the
    target's (the record still holds the target's answers); `keep` answers at the start are kept as the source has
    them, not asked for (regen.later_turns: keep=1, the first answer being the samples')."""
    index: int
    conv: Conversation
    max_turns: int = 0
    history: str = "generated"
    keep: int = 0
    out: list[Turn] = field(default_factory=list)
    turn_meta: list[dict] = field(default_factory=list)
    pos: int = 0
    error: tuple[str, str] | None = None
    stopped: str | None = None

    def __post_init__(self):
        script: list = []
        answers: list = []  # the source's answer in each slot (None after a final unanswered user turn)
        seen_user = False
        for t in self.conv.turns:
            if t.role == "assistant":
                if seen_user and (not script or script[-1] is not None):
                    script.append(None)  # None = generate here
                    answers.append(t)
            else:
                seen_user |= t.role == "user"
                script.append(t)
        if script and script[-1] is not None and seen_user:
            script.append(None)
            answers.append(None)
        if self.max_turns:
            n = 0
            for i, s in enumerate(script):
                n += s is None
                if n == self.keep + self.max_turns:
                    script = script[: i + 1]
                    break
        self.script = script
        self.source_answers = answers
        self.ctx: list[Turn] = []  # what the next answer is asked with: `out`, or with the source's answers in it
        self.slot = 0  # answer slots passed

    def next_messages(self) -> list[dict] | None:
        """Messages to answer next, or None when the conversation is done."""
        if self.error or self.stopped:
            return None
        while self.pos < len(self.script):
            t = self.script[self.pos]
            if t is None:
                if self.slot >= self.keep:
                    break
                t = self.source_answers[self.slot]  # kept as the source has it
                self.slot += 1
            self.out.append(t)
            self.ctx.append(t)
            self.pos += 1
        if self.pos >= len(self.script):
            return None
        return [{"role": t.role, "content": t.content, **({"reasoning": t.reasoning} if t.reasoning else {})}
                for t in self.ctx]

    def accept(self, r: TurnResult) -> None:
        if r.error:
            self.error = (r.error, r.message)
            self.failed_retries = dict(r.retries)
            return
        meta = {"finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens}
        if r.retries:
            meta["retries"] = dict(r.retries)
        if r.finish_reason == "context":
            self.stopped = "context"
        elif not r.content.strip() and not r.reasoning:
            self.stopped = "empty_answer"
        else:
            answer = Turn("assistant", r.content, r.reasoning)
            self.out.append(answer)
            source = self.source_answers[self.slot]
            self.ctx.append(source if self.history == "original" and source is not None else answer)
            self.turn_meta.append(meta)
            self.pos += 1
            self.slot += 1
            return
        self.dropped = meta

    @property
    def n_answers(self) -> int:
        return len(self.turn_meta)

    def record(self, settings: dict, backend: dict) -> dict:
        turns = list(self.out)
        while turns and turns[-1].role != "assistant":  # a conversation ends with an answer
            turns.pop()
        meta = {"source_id": self.conv.id, **backend, "sampling": settings, "turns": self.turn_meta}
        if self.keep:
            meta["source_answers_kept"] = self.keep
        if self.stopped:
            meta["stopped"] = self.stopped
            meta["dropped_turn"] = getattr(self, "dropped", {})
        if self.conv.meta:
            meta["source_meta"] = self.conv.meta
        return Conversation(self.conv.id, turns, meta).to_dict()
