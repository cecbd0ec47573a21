"""The eval's statistics: acceptance over verify rounds (Tally), τ's bootstrap interval and the paired difference of
two drafters' τ, τ by an answer's place in its conversation and by how much it repeats itself, and the reports'
groups two runs compare by (`eyas compare`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .util import EyasError, json_kind, repeated_share


class Tally:
    """Acceptance statistics over verify rounds."""

    def __init__(self, k: int):
        self.k = k
        self.hist = [0] * (k + 1)
        self.tokens = 0
        self.spec_s = self.plain_s = self.draft_s = self.verify_s = self.prefill_s = self.plain_prefill_s = 0.0
        self.spec_tokens = self.plain_tokens = 0
        self.answers = 0
        self.checked = self.matched = 0
        self.rounding = 0  # answers that part from plain decoding but equal it with its steps shaped as the verify
        self.mismatches: list[str] = []

    def add_rounds(self, accepted: list[int]) -> None:
        for a in accepted:
            self.hist[a] += 1

    @property
    def rounds(self) -> int:
        return sum(self.hist)

    def acceptance_length(self) -> float:
        return sum((a + 1) * c for a, c in enumerate(self.hist)) / max(1, self.rounds)

    def per_position(self) -> list[float]:
        """P(draft i accepted | drafts 1..i-1 accepted), i = 1..K."""
        out = []
        for i in range(1, self.k + 1):
            reached = sum(self.hist[i - 1:])
            out.append(sum(self.hist[i:]) / reached if reached else 0.0)
        return out


def tau_interval(groups: list[tuple[int, int]], level: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> list[float] | None:
    """A bootstrap interval for τ over independent groups of verify rounds, each (Σ (accepted + 1), rounds): the
    groups drawn with replacement `resamples` times, τ of each draw its tokens over its rounds, and the central
    `level` of those. Groups are conversations in `evaluate` (an answer builds on the earlier ones, so its rounds
    are not independent of theirs) and prompts in `measure_acceptance`. Deterministic in `seed`; None with fewer
    than two groups."""
    groups = [g for g in groups if g[1] > 0]
    if len(groups) < 2:
        return None
    t = torch.tensor(groups, dtype=torch.float64)
    drawn = t[_draws(len(groups), resamples, seed)].sum(1)  # [resamples, 2]
    return _central(drawn[:, 0] / drawn[:, 1], level)


def tau_difference(a: list[tuple[int, int]], b: list[tuple[int, int]], level: float = 0.95, resamples: int = 2000,
                   seed: int = 0) -> dict | None:
    """τ over groups `a` minus τ over groups `b`, where a[i] and b[i] are the same prompt or conversation decoded
    with two drafters (greedy decoding gives both the target's text, so each pair differs only in its rounds), with
    a paired bootstrap interval: the same groups drawn for both sides in every draw, so what the prompts share
    (how easy their text is) cancels. None with fewer than two pairs of groups that both have rounds."""
    pairs = [(x, y) for x, y in zip(a, b) if x[1] > 0 and y[1] > 0]
    if len(pairs) < 2:
        return None
    ta = torch.tensor([x for x, _ in pairs], dtype=torch.float64)
    tb = torch.tensor([y for _, y in pairs], dtype=torch.float64)
    idx = _draws(len(pairs), resamples, seed)
    da, db = ta[idx].sum(1), tb[idx].sum(1)
    diff = da[:, 0] / da[:, 1] - db[:, 0] / db[:, 1]
    tau_a, tau_b = (ta[:, 0].sum() / ta[:, 1].sum()).item(), (tb[:, 0].sum() / tb[:, 1].sum()).item()
    return {"pairs": len(pairs), "tau_a": tau_a, "tau_b": tau_b, "difference": tau_a - tau_b, "level": level,
            "interval": _central(diff, level)}


def _draws(n: int, resamples: int, seed: int) -> torch.Tensor:
    """`resamples` draws of n group indices with replacement, deterministic in `seed`."""
    return torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(seed))


def _central(values: torch.Tensor, level: float) -> list[float]:
    """The central `level` of the bootstrap draws' values."""
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    return torch.quantile(values, q).tolist()


def round_sums(accepted: list[int]) -> tuple[int, int]:
    """One answer's (Σ (accepted + 1), rounds), the unit `tau_interval` adds up."""
    return sum(a + 1 for a in accepted), len(accepted)


def _whole(x) -> bool:
    """A count a report holds: a whole number, 0 or more (JSON has no integer type of its own)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 and x == int(x)


def report_groups(path: str | Path, method: str | None = None) -> dict:
    """What `eyas compare` pairs in a report: an `eyas eval` report (each conversation's rounds, with the
    conversations' ids where it keeps them; a run directory reads its eval/report.json) or a `bench/bench_decode.py`
    report (each prompt's accepted drafts of `method`, by default its first speculative method; its texts are the
    method's own or plain decoding's, which bench_decode checks the method against). Returns `groups` (Σ (accepted +
    1), rounds) in prompt order, `ids` (or None), `texts` (or None), `read` (what was read), `unit` (conversations
    or prompts) and `settings`: what decides the text of each group (prompts, target, K, ...), as far as the report
    records it."""
    p = Path(path)
    if p.is_dir():
        p = p / "eval" / "report.json"
    try:
        rep = json.loads(p.read_text())
    except FileNotFoundError:
        raise EyasError(f"{p}: no such report (give an eval report.json, a run directory or a bench_decode "
                        f"JSON)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise EyasError(f"{p}: cannot read a JSON report ({e})") from None
    if not isinstance(rep, dict):
        raise EyasError(f"{p}: holds {json_kind(rep)}, not a report (give an eval "
                        f"report.json, a run directory or a bench_decode JSON)")
    prompts = rep.get("prompts") if isinstance(rep.get("prompts"), dict) else {}
    ident = rep.get("target_identity") if isinstance(rep.get("target_identity"), dict) else {}
    settings = {"prompts": prompts.get("set"), "target": rep.get("target"), "target_sha256": ident.get("sha256"),
                "dtype": rep.get("dtype"), "max_new_tokens": rep.get("max_new_tokens")}
    if "rounds_by_conversation" in rep:
        if method is not None:
            raise EyasError(f"{p}: an eval report, which holds one decoder's rounds; --method picks a method of a "
                            f"bench_decode report: leave it out")
        rounds = rep["rounds_by_conversation"]
        if not isinstance(rounds, list):
            raise EyasError(f"{p}: rounds_by_conversation is {json_kind(rounds)}, not a "
                            f"list of (tokens, verify rounds) pairs")
        for i, g in enumerate(rounds):
            if not (isinstance(g, list) and len(g) == 2 and all(_whole(x) for x in g)):
                raise EyasError(f"{p}: rounds_by_conversation[{i}] is {json.dumps(g)}, not a pair of whole numbers "
                                f"(tokens, verify rounds)")
        ids = rep.get("conversation_ids")
        if ids is not None and not (isinstance(ids, list) and len(ids) == len(rounds)):
            raise EyasError(f"{p}: conversation_ids does not hold one id for each of the {len(rounds)} conversations "
                            f"of rounds_by_conversation")
        settings.update(k=rep.get("k"), temperature=rep.get("temperature"), turns=rep.get("turns"))
        if rep.get("temperature"):  # top-p shapes sampled text only
            settings["top_p"] = rep.get("top_p")
        return {"groups": [(g[0], g[1]) for g in rounds], "ids": ids, "texts": None, "read": "eval conversations",
                "unit": "conversations", "settings": {k: v for k, v in settings.items() if v is not None}}
    methods = rep.get("methods")
    if not isinstance(methods, dict):
        raise EyasError(f"{p}: neither an eval report with rounds_by_conversation (one from an older eyas lacks it: "
                        f"rerun `eyas eval`) nor a bench_decode report with methods")
    spec = [m for m, v in methods.items() if isinstance(v, dict) and "accepted_by_prompt" in v]
    if method is None:
        if not spec:
            raise EyasError(f"{p}: no speculative method with accepted_by_prompt")
        method = spec[0]
    if method not in spec:
        raise EyasError(f"{p}: no method {method!r} with accepted_by_prompt (there: {', '.join(spec) or 'none'})")
    m = methods[method]
    accepted = m["accepted_by_prompt"]
    if not isinstance(accepted, list):
        raise EyasError(f"{p}: methods.{method}.accepted_by_prompt is not a list (one list of accepted drafts per "
                        f"prompt)")
    for i, a in enumerate(accepted):
        if not (isinstance(a, list) and all(_whole(x) for x in a)):
            raise EyasError(f"{p}: methods.{method}.accepted_by_prompt[{i}] is {json.dumps(a)[:80]}, not a list of "
                            f"accepted-draft counts (whole numbers)")
    plain = methods.get("eyas_plain") if isinstance(methods.get("eyas_plain"), dict) else {}
    texts = m.get("outputs") or plain.get("outputs")
    what = method + (f" (same as plain: {m['same_as_plain']})" if "same_as_plain" in m else "")
    if isinstance(m.get("per_position_acceptance"), list):
        settings["k"] = len(m["per_position_acceptance"])
    return {"groups": [round_sums(a) for a in accepted], "ids": None,
            "texts": texts if isinstance(texts, list) else None, "read": what, "unit": "prompts",
            "settings": {k: v for k, v in settings.items() if v is not None}}


def occurrences(ids: list) -> list[tuple[str, int]]:
    """Each id with how many times it came before: a key that is unique even where a prompt file repeats an id."""
    seen: dict[str, int] = {}
    out = []
    for x in ids:
        x = str(x)
        out.append((x, seen.get(x, 0)))
        seen[x] = seen.get(x, 0) + 1
    return out


def compare_reports(a: str | Path, b: str | Path, method: str | None = None, level: float = 0.95) -> dict:
    """`eyas compare`: τ of report A minus τ of report B on the prompts or conversations both reached, with a paired
    bootstrap interval (`tau_difference`). Greedy decoding writes the target's own text whatever the drafter, so
    conversation i of A and of B differ only in their rounds, provided both were decoded alike: reports whose
    prompts, target, dtype, K, max_new_tokens, temperature or turns differ are refused, naming the setting. Eval
    reports that keep their conversations' ids pair by id, others by position; where both reports keep the texts,
    how many agree is given too (all of them at temperature 0 on one engine and dtype)."""
    if not 0 < level < 1:
        raise EyasError(f"--level must be between 0 and 1, got {level}")
    ra, rb = report_groups(a, method), report_groups(b, method)
    kinds = {"conversations": "an eval report (τ by conversation)", "prompts": "a bench_decode report (τ by prompt)"}
    if ra["unit"] != rb["unit"]:
        raise EyasError(f"{a} is {kinds[ra['unit']]}, {b} {kinds[rb['unit']]}: their groups do not pair; compare "
                        f"two reports of one kind")
    unit = ra["unit"]
    sa, sb = ra["settings"], rb["settings"]
    fields = [f for f in sa if f in sb and f != "target_sha256"]
    if "target_sha256" in sa and "target_sha256" in sb:  # one model under two names (a preset, its GGUF) is fine
        fields = [f if f != "target" else "target_sha256" for f in fields]
    differ = [f for f in fields if sa[f] != sb[f]]
    if differ:
        def shown(s, f):
            return f"{s['target']} ({s[f]})" if f == "target_sha256" else json.dumps(s[f])

        raise EyasError(f"{a} and {b} were not decoded alike, so their {unit} do not pair: "
                        + "; ".join(f"{'target' if f == 'target_sha256' else f}: A {shown(sa, f)}, B {shown(sb, f)}"
                                    for f in differ)
                        + ". Compare reports of the same prompts and settings")
    ga, gb = ra["groups"], rb["groups"]
    if ra["ids"] is not None and rb["ids"] is not None:
        where = {key: j for j, key in enumerate(occurrences(rb["ids"]))}
        idx = [(i, where[key]) for i, key in enumerate(occurrences(ra["ids"])) if key in where]
        paired_by = "conversation id"
    else:
        idx = [(i, i) for i in range(min(len(ga), len(gb)))]
        paired_by = "position"
    res = tau_difference([ga[i] for i, _ in idx], [gb[j] for _, j in idx], level=level)
    if res is None:
        raise EyasError(f"fewer than two {unit} with rounds in both reports ({len(ga)} and {len(gb)} {unit}"
                        + (f", {len(idx)} of them in both by id" if paired_by != "position" else "") + ")")
    out = {"a": str(a), "b": str(b), "read": [ra["read"], rb["read"]], "unit": unit, "paired_by": paired_by,
           f"{unit}_a": len(ga), f"{unit}_b": len(gb), **res}
    ta, tb = ra["texts"], rb["texts"]
    if ta is not None and tb is not None:  # over the compared prompts that have a text in both
        both = [(i, j) for i, j in idx if i < len(ta) and j < len(tb)]
        out["same_text"] = f"{sum(ta[i] == tb[j] for i, j in both)}/{len(both)}"
    return out


def turn_bucket(n: int) -> str:
    """Where a conversation's n-th answer (from 1) is counted in report.json's `by_turn`."""
    return str(n) if n < 3 else "3+"


def _buckets(tallies: dict[str, "Tally"], order: list[str]) -> dict:
    return {b: {"answers": t.answers, "new_tokens": t.tokens, "verify_rounds": t.rounds,
                "acceptance_length": t.acceptance_length(), "per_position_acceptance": t.per_position()}
            for b in order if (t := tallies.get(b))}


def by_turn(tallies: dict[str, "Tally"]) -> dict:
    """τ by the answer's place in its conversation: a first answer follows the user's prompt alone, later ones the
    target's own earlier answers (what regen.later_turns and data.original_rest train for)."""
    return _buckets(tallies, sorted(tallies))


# an answer's repetition: the share of its token 8-grams seen earlier in it
REPEAT_NGRAM = 8
REPEAT_BUCKETS = ["<0.1", "0.1-0.5", ">=0.5"]


def repeat_bucket(tokens: list[int]) -> str:
    """Where an answer is counted in report.json's `by_repetition`."""
    share = repeated_share(tokens, REPEAT_NGRAM)
    return REPEAT_BUCKETS[0] if share < 0.1 else REPEAT_BUCKETS[1] if share < 0.5 else REPEAT_BUCKETS[2]


def by_repetition(tallies: dict[str, "Tally"]) -> dict:
    """τ by how much the answer repeats itself: a small target's greedy answers loop, and a drafter predicts a loop
    far better than fresh text, so this says how much of τ the loops make."""
    return _buckets(tallies, REPEAT_BUCKETS)
