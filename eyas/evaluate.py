"""`eyas eval`: what a decoder accepts. Acceptance length, per-position acceptance, speedup over plain
decoding on the same engine, and a token-for-token lossless check against plain greedy decoding.

Writes <run>/eval/report.json (docs/design.md lists its keys), report.md and PNG plots.
`measure_acceptance` gives eyas' own acceptance on a list of prompts (the parity tool compares it
with a serving engine's counters).
"""
from __future__ import annotations

import json
import os
import platform
import resource
from dataclasses import replace
from pathlib import Path

import torch

from .util import EyasError, atomic_path, atomic_write_json, atomic_write_text, log, progress, repeated_share

MAX_CONTEXT = 4096  # longest prompt + answer an eval turn may reach; longer turns are skipped


# ---------------------------------------------------------------------------------------------
# inputs

def load_eval_drafter(path: str | Path, target):
    """An eyas drafter folder, or an SGLang/EAGLE or vLLM-speculators folder (via eyas.export)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise EyasError(f"drafter folder {path} not found or has no config.json (train one with `eyas train`, "
                        f"or pass --draft)")
    from .export import import_drafter

    return import_drafter(path, target)  # an eyas folder through load_drafter; a damaged config.json is named


def recorded_aux_layers(path: str | Path) -> list[int] | None:
    """The aux layers (eyas ids) a drafter folder says it was trained on: an eyas folder's `aux_layers`, a vLLM
    folder's `eagle_aux_hidden_state_layer_ids`, an SGLang folder's nested `eagle_config` ids; None where the
    folder records none (the engines then use the target's default) or cannot be read (the loader says why)."""
    import json

    from .export import config_aux_ids

    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict):
        return None
    if raw.get("eyas_format") == 1:
        return raw.get("aux_layers") or None  # checked where it is used (check_drafter_aux_layers)
    return config_aux_ids(raw)


def adopt_drafter_aux_layers(target, path: str | Path, explicit: bool = False) -> None:
    """Capture the layers the drafter at `path` was trained on. Unless the user named the target's aux layers
    (`explicit`: then a drafter trained on others is refused when it is loaded, saying which), the target takes
    the drafter's recorded ones, so `eyas eval --set eval.draft=DIR` needs no `target.aux_layers`."""
    from .draft import check_drafter_aux_layers

    aux = recorded_aux_layers(path)
    if explicit or aux is None or list(aux) == list(target.aux_layers):
        return
    target.aux_layers = check_drafter_aux_layers(aux, Path(path) / "config.json", target)
    log(f"eval: capturing aux layers {target.aux_layers}, the ones the drafter in {path} was trained on")


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if torch.is_tensor(ids):
        ids = ids.view(-1).tolist()
    return list(ids)


def load_prompt_set(cfg) -> tuple[str, list]:
    """(set name, conversations) for cfg.eval.prompts: held-out ShareGPT test split, humaneval, or a file."""
    from .data import read_dataset, select_split

    check_prompt_settings(cfg)
    src = cfg.eval.prompts
    limit = cfg.eval.limit
    if src == "sharegpt":
        source = heldout_source(cfg)
        every, _ = read_dataset(source, strict=False)
        convs = select_split(every, "test", cfg.data.val_ratio, cfg.data.test_ratio)
        if not convs:
            raise EyasError(f"the held-out test split of {source}, the eval's prompts, is empty: none of its "
                            f"{len(every)} conversations falls in it at data.test_ratio {cfg.data.test_ratio} (a "
                            f"hash of each record's id decides). Raise --set data.test_ratio, or give the eval "
                            f"prompts of its own with --set eval.prompts=FILE (or humaneval)")
        name = "sharegpt-test" if source == "sharegpt" else f"{source}:test"
    elif src == "humaneval":
        convs, _ = read_dataset("humaneval")
        name = "humaneval"
    else:
        p = Path(src).expanduser()
        if not p.exists():
            raise EyasError(f"eval.prompts: file not found: {p}")
        convs, rep = read_dataset(str(p))
        if not convs:
            raise EyasError(f"eval.prompts: {p} holds no usable prompts ({rep.summary()})")
        name = p.name
    return name, (convs[:limit] if limit else convs)


def heldout_source(cfg) -> str:
    """The data set whose held-out test split eval.prompts=sharegpt reads."""
    return cfg.data.source if cfg.data.source not in ("humaneval",) else "sharegpt"


def check_prompt_settings(cfg) -> None:
    """Refuse the settings that choose the eval's prompts out of range, naming the key (`eyas parity` reads them
    too, without the rest of the eval's checks)."""
    from .config import check_settings

    check_settings(cfg, (("eval.limit", cfg.eval.limit >= 0, "0 (every conversation) or more"),))
    from .data.prepare import check_split_ratios

    check_split_ratios(cfg.data)


def check_heldout_split(cfg, run_dir: str | Path) -> None:
    """Refuse a data.test_ratio other than the one the training data of `run_dir` (the drafter's run) were split
    at, when the eval reads the held-out test split of the same data set. The split is a hash of each record's id
    below data.test_ratio: at a larger ratio it takes in conversations outside the run's held-out ones, which the
    drafter may have trained on, at a smaller one only part of them. (data.val_ratio does not move the test split:
    a record is in it by its hash alone.) A run whose tokens record no settings, or another data set, is not
    checked."""
    from .data.prepare import regen_dir, same_source, tokens_dir

    if cfg.eval.prompts != "sharegpt":
        return
    plan = regen_dir(Path(run_dir)) / "plan.json"
    try:
        recorded = json.loads(plan.read_text())
        made_split, made_from = recorded["split"], recorded["source"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        made_split = made_from = None
    if made_split is not None and same_source(str(made_from), heldout_source(cfg)):
        check_regen_split(made_split, f"the drafter of {run_dir} was trained on answers to its regen.split={made_split} "
                                      f"({plan})")
    meta = tokens_dir(Path(run_dir)) / "meta.json"
    try:
        made = json.loads(meta.read_text())["inputs"]["data"]
        made_ratio, made_source = float(made["test_ratio"]), str(made["source"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return
    if not same_source(made_source, heldout_source(cfg)) or made_ratio == float(cfg.data.test_ratio):
        return
    raise EyasError(f"data.test_ratio is {cfg.data.test_ratio}, but the training data of {run_dir} were split at "
                    f"{made_ratio} ({meta}): the eval's prompts, the held-out test split of {made_source}, would not "
                    f"be the conversations the run held out (a larger ratio takes in ones the drafter may have "
                    f"trained on, a smaller one only part of them). Leave data.test_ratio at {made_ratio} (drop "
                    f"--test-ratio), or give the eval prompts of its own with --set eval.prompts=FILE")


def check_regen_split(split: str, what: str) -> None:
    """Refuse training answers regenerated from the held-out test split (regen.split test or all) while the eval's
    prompts are that split (eval.prompts=sharegpt): τ would be measured on conversations the drafter trained on."""
    if split in ("test", "all"):
        raise EyasError(f"{what}, which holds the held-out test split that the eval decodes (eval.prompts=sharegpt): "
                        f"its τ would be measured on conversations the drafter trained on. Give the eval prompts of "
                        f"its own (--set eval.prompts=FILE, or humaneval), or regenerate regen.split=train")


def check_out_dir(out: str | Path) -> None:
    """Refuse a run directory that cannot hold <run>/eval/ (it, or a folder above it, is a file), before anything
    is decoded: the report would fail to be written only at the end."""
    p = Path(out) / "eval"
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                raise EyasError(f"--out {out}: {q} is a file, not a folder; give a run directory (a new one is "
                                f"made where none is)")
            return


# ---------------------------------------------------------------------------------------------
# measuring

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
    from .draft import json_kind

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


def _occurrences(ids: list) -> list[tuple[str, int]]:
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
        where = {key: j for j, key in enumerate(_occurrences(rb["ids"]))}
        idx = [(i, where[key]) for i, key in enumerate(_occurrences(ra["ids"])) if key in where]
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


def _new_decoder(target, drafter, k, temperature, top_p, max_len, compile_, seed=0, fused=None):
    from .decode import Decoder

    return Decoder(target, drafter, k=k, temperature=temperature, top_p=top_p, max_len=max_len,
                   compile=compile_, seed=seed, fused=fused)


def measure_acceptance(target, drafter, prompts: list, k: int = 3, temperature: float = 0.0, top_p: float = 1.0,
                       max_new_tokens: int = 256, seed: int = 0) -> dict:
    """eyas' own acceptance on `prompts` (each a user message string, a list of chat messages, or a
    list of token ids), one answer per prompt. Returns acceptance_length (tokens per target
    forward), per_position_acceptance, accepted_length_histogram, rounds, new_tokens, and the
    generated token ids per prompt."""
    lens = []
    ids_list = []
    for p in prompts:
        if isinstance(p, str):
            ids = prompt_ids(target.tokenizer, [{"role": "user", "content": p}])
        elif p and isinstance(p[0], dict):
            ids = prompt_ids(target.tokenizer, p)
        else:
            ids = [int(t) for t in p]
        ids_list.append(ids)
        lens.append(len(ids))
    dec = _new_decoder(target, drafter, k, temperature, top_p, max(lens, default=1) + max_new_tokens + k + 2, False,
                       seed)
    tally = Tally(k)
    outputs = []
    groups = []  # each prompt's (Σ (accepted + 1), rounds), for the interval
    try:
        for ids in progress(ids_list, desc="acceptance", unit="prompt"):
            g = dec.generate(ids, max_new_tokens, target.eot_token_ids, speculative=True)
            tally.add_rounds(g.accepted)
            groups.append(round_sums(g.accepted))
            tally.tokens += len(g.tokens)
            outputs.append(g.tokens)
    finally:
        dec.close()
    return {"k": k, "temperature": temperature, "prompts": len(ids_list),
            "acceptance_length": tally.acceptance_length(), "acceptance_length_ci95": tau_interval(groups),
            # each prompt's (Σ (accepted + 1), rounds), in order: two drafters' runs pair by it (tau_difference)
            "rounds_by_prompt": [list(g) for g in groups],
            "per_position_acceptance": tally.per_position(),
            "accepted_length_histogram": tally.hist, "rounds": tally.rounds, "new_tokens": tally.tokens,
            "outputs": outputs}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # max RSS, Linux kB


def evaluate(target, drafter, convs: list, k: int = 3, temperature: float = 0.0, top_p: float = 1.0,
             max_new_tokens: int = 256, compile_: bool = False, seed: int = 0, baseline: bool = True,
             fused: bool | None = None, max_turns: int = 0) -> dict:
    """Answer every user turn of every conversation in sequence (the history holds eyas' own
    answers), or its first `max_turns` ones, with speculative decoding and, when `baseline`, plain decoding on
    the same engine."""
    from .data.reasoning import answered_turn, history_messages

    tok = target.tokenizer
    max_len = min(MAX_CONTEXT, getattr(target.config, "max_position_embeddings", MAX_CONTEXT) or MAX_CONTEXT)
    dec = _new_decoder(target, drafter, k, temperature, top_p, max_len, compile_, seed, fused)
    stop = target.eot_token_ids
    t = Tally(k)
    turns: dict[str, Tally] = {}  # by turn_bucket
    repeats: dict[str, Tally] = {}  # by repeat_bucket
    n_prompts = skipped = 0  # answers decoded; user turns left out, too long for the context
    too_long: list[int] = []  # the prompt length of each conversation's first turn left out
    groups = []  # each conversation's (Σ (accepted + 1), rounds), for the interval
    if target.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target.device)
    try:
        # warm-up, not timed: every fixed-shape step on a GPU (graphs and per-shape kernels for every span of the
        # cache, which later turns reach), then a short generation (allocator, prefill kernels)
        if target.device.type == "cuda":
            dec.warm_up(plain=baseline, speculative=True)
        warm = prompt_ids(tok, [{"role": "user", "content": "Hello! Say something short."}])
        dec.generate(warm, min(16, max_new_tokens), stop, speculative=True)
        if baseline:
            dec.generate(warm, min(16, max_new_tokens), stop, speculative=False)
        bar = progress(total=len(convs), desc="eval", unit="conv")
        for conv in convs:
            history: list = []  # the turns before the next prompt (Turn), as a served target is given them
            answered = 0
            conv_sum = conv_rounds = 0
            for i, turn in enumerate(conv.turns):
                if turn.role == "system":
                    history.append(turn)
                    continue
                if turn.role != "user":
                    continue  # the data set's answers are replaced by the target's own
                if max_turns and answered >= max_turns:
                    break
                ids = prompt_ids(tok, history_messages(history + [turn], tok))
                if len(ids) + max_new_tokens + k + 2 > max_len:
                    # this turn and the later ones, longer still (up to max_turns), are left out
                    left = sum(x.role == "user" for x in conv.turns[i:])
                    skipped += min(left, max_turns - answered) if max_turns else left
                    too_long.append(len(ids))
                    break
                g = dec.generate(ids, max_new_tokens, stop, speculative=True)
                t.add_rounds(g.accepted)
                answered += 1
                a_sum, a_rounds = round_sums(g.accepted)
                conv_sum, conv_rounds = conv_sum + a_sum, conv_rounds + a_rounds
                content = [x for x in g.tokens if x not in stop]
                for tb in (turns.setdefault(turn_bucket(answered), Tally(k)),
                           repeats.setdefault(repeat_bucket(content), Tally(k))):
                    tb.add_rounds(g.accepted)
                    tb.tokens += len(g.tokens)
                    tb.answers += 1
                t.spec_s += g.seconds
                t.spec_tokens += len(g.tokens)
                t.draft_s += g.draft_seconds
                t.verify_s += g.verify_seconds
                t.prefill_s += g.prefill_seconds
                if baseline:
                    b = dec.generate(ids, max_new_tokens, stop, speculative=False)
                    t.plain_s += b.seconds
                    t.plain_prefill_s += b.prefill_seconds
                    t.plain_tokens += len(b.tokens)
                    if temperature == 0:
                        t.checked += 1
                        if b.tokens == g.tokens:
                            t.matched += 1
                        elif len(t.mismatches) < 10:
                            first = next((i for i, (x, y) in enumerate(zip(b.tokens, g.tokens)) if x != y),
                                         min(len(b.tokens), len(g.tokens)))
                            t.mismatches.append(f"{conv.id}: first difference at new token {first}")
                n_prompts += 1
                answer = tok.decode(content, skip_special_tokens=True)
                history += [turn, answered_turn(tok, answer)]
            groups.append((conv_sum, conv_rounds))
            bar.update(1)
        bar.close()
    finally:
        dec.close()
    if too_long:
        why = (f"a prompt of {min(too_long)}{'' if min(too_long) == max(too_long) else f' to {max(too_long)}'} "
               f"tokens + max_new_tokens {max_new_tokens} + {k + 2} (K + 2) is over the {max_len}-token context the "
               f"eval decodes in")
        log(f"eval: {skipped} user turns of {len(too_long)} conversations left out: {why} (a conversation's later "
            f"turns, longer still, are left out with its first one too long)")
    if not n_prompts:
        if not too_long:
            raise EyasError(f"no answer decoded: the {len(convs)} conversations hold no user turn to answer")
        # the most new tokens that let every first turn in, or else the shortest one
        room_all, room_one = max_len - max(too_long) - k - 2, max_len - min(too_long) - k - 2
        room = room_all if room_all >= 1 else room_one
        fix = (f"lower eval.max_new_tokens (--max-new-tokens) to {room} or less" if room >= 1 else
               f"give prompts shorter than {max_len - k - 3} tokens (eval.prompts)")
        raise EyasError(f"no answer decoded: every conversation's first turn is too long ({why}); {fix}. Nothing "
                        f"was written")
    tps = t.spec_tokens / t.spec_s if t.spec_s else 0.0
    base = t.plain_tokens / t.plain_s if t.plain_s else None
    return {
        "k": k, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
        "turns": max_turns, "prompts_answered": n_prompts, "conversations": len(convs),
        "turns_skipped_too_long": skipped, "context": max_len,
        "acceptance_length": t.acceptance_length(), "acceptance_length_ci95": tau_interval(groups),
        # each conversation's (Σ (accepted + 1), rounds), in order, and its id: two drafters' evals pair by them
        # (tau_difference)
        "rounds_by_conversation": [list(g) for g in groups], "conversation_ids": [str(c.id) for c in convs],
        "per_position_acceptance": t.per_position(),
        "accepted_length_histogram": t.hist, "verify_rounds": t.rounds, "new_tokens": t.spec_tokens,
        "by_turn": by_turn(turns), "by_repetition": by_repetition(repeats),
        "tokens_per_s": tps, "baseline_tokens_per_s": base,
        "speedup": (tps / base) if base else None,
        "lossless": (t.matched == t.checked) if (temperature == 0 and t.checked) else None,
        "lossless_checked": t.checked, "lossless_mismatches": t.mismatches,
        "time_split": {"draft_s": t.draft_s, "verify_s": t.verify_s, "prefill_s": t.prefill_s,
                       "speculative_total_s": t.spec_s,
                       "other_s": max(0.0, t.spec_s - t.draft_s - t.verify_s - t.prefill_s), "plain_total_s": t.plain_s,
                       "plain_prefill_s": t.plain_prefill_s},
        "peak_memory_bytes": _peak_memory(target.device), "device": _device_name(target.device),
        "engine": dec.engine,  # fast: eyas' own static-cache forward; hf: transformers' StaticCache
        "cuda_graphs": bool(dec.graphs.enabled and dec.graphs.replays),  # off also when a check failed
        "fused_round": dec.fused,  # drafts + verify + rebuild as one step; draft time counted in verify_s
        "overlap": dec.overlapped,  # steps queued before the last one is read: verify_s spans the whole loop
        "compiled_elementwise": dec.elementwise_compiled,  # the target's rope, add+norm, silu*mul compiled
        "compiled_drafter": dec.drafter_compiled,  # the drafter's steps as two compiled parts around the attention
        "padded_prefill": dec.prefill_padded,  # prompts prefilled padded to 128-token multiples (CUDA graphs)
    }


# ---------------------------------------------------------------------------------------------
# reports

def write_plots(report: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def bar_png(name, x, y, color, xlabel, ylabel, title, ylim=None):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar(x, y, color=color)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_title(title)
        fig.tight_layout()
        with atomic_path(out_dir / name) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
        return name

    k = report["k"]
    hist = report["accepted_length_histogram"]
    total = max(1, sum(hist))
    return [
        bar_png("per_position_acceptance.png", range(1, k + 1), report["per_position_acceptance"], "#3b6ea8",
                "draft position", "acceptance (given earlier accepted)",
                f"per-position acceptance, K={k}, T={report['temperature']}", (0, 1)),
        bar_png("accepted_length_histogram.png", range(len(hist)), [h / total for h in hist], "#a8583b",
                "drafts accepted per verify step", "share of verify steps",
                f"accepted lengths, tau = {report['acceptance_length']:.2f}"),
    ]


def ci_text(r: dict) -> str:
    """The τ interval as report pages print it after τ, or nothing where the report has none."""
    ci = r.get("acceptance_length_ci95")
    if not ci:
        return ""
    return f" (95% interval {ci[0]:.2f}-{ci[1]:.2f}, bootstrap over the {r.get('conversations')} conversations)"


def report_markdown(r: dict) -> str:
    def f(x, fmt="{:.2f}"):
        return "n/a" if x is None else fmt.format(x)

    ts = r["time_split"]
    lines = [
        f"# eyas eval: {r['target']}", "",
        f"Drafter `{r.get('draft', '')}`, K = {r['k']}, temperature = {r['temperature']}, top-p = {r['top_p']}, "
        f"{r['prompts']['count']} prompts from `{r['prompts']['set']}`, up to {r['max_new_tokens']} new tokens, "
        f"device {r['device']}.", "",
        "| metric | value |", "| --- | --- |",
        f"| acceptance length τ (tokens per target forward) | {f(r['acceptance_length'])}{ci_text(r)} |",
        f"| speculative tokens/s | {f(r['tokens_per_s'], '{:.1f}')} |",
        f"| plain decoding tokens/s (same engine) | {f(r['baseline_tokens_per_s'], '{:.1f}')} |",
        f"| speedup | {f(r['speedup'])}× |",
        f"| lossless (greedy output = plain greedy) | {r['lossless']} ({r['lossless_checked']} checked) |",
        *([f"| user turns left out, too long for the {r.get('context')}-token context | "
           f"{r['turns_skipped_too_long']} |"] if r.get("turns_skipped_too_long") else []),
        f"| draft / verify / prefill / other time (s) | {ts['draft_s']:.2f} / {ts['verify_s']:.2f} / {ts['prefill_s']:.2f} / {ts['other_s']:.2f} |",
        f"| peak memory | {r['peak_memory_bytes'] / 1e6:.0f} MB |", "",
        "Per-position acceptance (draft i accepted given drafts 1..i-1 were): " +
        ", ".join(f"{i + 1}: {a:.3f}" for i, a in enumerate(r["per_position_acceptance"])), "",
        "Accepted drafts per verify step: " +
        ", ".join(f"{i}: {c}" for i, c in enumerate(r["accepted_length_histogram"])), "",
        *(["τ by the answer's place in its conversation: " + ", ".join(
            f"answer {b}: {v['acceptance_length']:.2f} ({v['answers']} answers, {v['new_tokens']} tokens)"
            for b, v in r["by_turn"].items()), ""] if r.get("by_turn") else []),
        *([f"τ by how much the answer repeats itself (the share of its {REPEAT_NGRAM}-grams seen earlier in it): " +
           ", ".join(f"{b}: {v['acceptance_length']:.2f} ({v['answers']} answers, {v['new_tokens']} tokens)"
                     for b, v in r["by_repetition"].items()), ""] if r.get("by_repetition") else []),
        "![per-position acceptance](per_position_acceptance.png)",
        "![accepted lengths](accepted_length_histogram.png)", "",
    ]
    if r.get("lossless_mismatches"):
        lines += ["Mismatches:", *[f"- {m}" for m in r["lossless_mismatches"]], ""]
    return "\n".join(lines)


def write_report(report: dict, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(report, out_dir)
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "report.md", report_markdown(report))
    stale = out_dir / "parity.json"  # `eyas parity`'s comparison with the report just replaced
    if stale.exists():
        stale.unlink()
        log(f"eval: removed {stale}, an engine's parity check against the eval this one replaces (run `eyas "
            f"parity` again to check against this one)")
    return out_dir / "report.json"


def check_eval_settings(cfg) -> None:
    """Refuse eval settings out of range, naming the key."""
    from .config import check_settings

    check_settings(cfg, (("eval.max_new_tokens", cfg.eval.max_new_tokens >= 1, "at least 1"),
                         ("eval.turns", cfg.eval.turns >= 0, "0 (every turn) or more")))
    check_prompt_settings(cfg)
    if cfg.eval.draft and not (Path(cfg.eval.draft).expanduser() / "config.json").exists():
        raise EyasError(f"eval.draft: {Path(cfg.eval.draft).expanduser()} is not a drafter folder (no config.json)")


def run_eval(cfg) -> dict:
    """The `eyas eval` stage."""
    from .target import load_target

    e = cfg.eval
    check_eval_settings(cfg)
    check_out_dir(cfg.out)
    draft_path = Path(e.draft or os.path.join(cfg.out, "draft")).expanduser()
    check_heldout_split(cfg, draft_path.parent)  # the run the drafter was trained in
    tcfg = replace(cfg.target, dtype=e.dtype) if e.dtype else cfg.target
    target = load_target(tcfg)
    adopt_drafter_aux_layers(target, draft_path, explicit=bool(cfg.target.aux_layers))
    drafter = load_eval_drafter(draft_path, target)
    set_name, convs = load_prompt_set(cfg)
    log(f"eval: {len(convs)} conversations from {set_name}, K={e.k}, temperature={e.temperature}")
    res = evaluate(target, drafter, convs, k=e.k, temperature=e.temperature, top_p=e.top_p,
                   max_new_tokens=e.max_new_tokens, compile_=e.compile,
                   fused={"fused": True, "stepwise": False, "auto": None}[e.round], max_turns=e.turns)
    report = {"target": target.name, "target_identity": target.identity(), "dtype": str(target.dtype).replace("torch.", ""),
              "draft": str(draft_path), "k": e.k, "temperature": e.temperature,
              "prompts": {"set": set_name, "count": res["prompts_answered"], "conversations": len(convs)},
              **{k: v for k, v in res.items() if k not in ("k", "temperature")}}
    path = write_report(report, Path(cfg.out) / "eval")
    ci = report["acceptance_length_ci95"]
    ci = f" (95% interval {ci[0]:.3f}-{ci[1]:.3f})" if ci else " (one conversation: no interval)"
    loss, miss = report["lossless"], report.get("lossless_mismatches") or []
    speed = (f"{report['tokens_per_s']:,.1f} against {report['baseline_tokens_per_s']:,.1f} tok/s plain "
             f"({report['speedup']:.2f}x)" if report.get("speedup") else "speed not measured")
    unchecked = "not checked" + (" (sampled decoding)" if e.temperature > 0 else "")
    log(f"eval: τ {report['acceptance_length']:.3f}{ci} at K={e.k} over "
        f"{res['prompts_answered']} answers; {speed}; lossless: "
        + ("yes" if loss else unchecked if loss is None else
           f"NO, of {report['lossless_checked']} answers checked, first difference {miss[0] if miss else '?'}")
        + f"; {path.parent / 'report.md'}")
    keys = ("acceptance_length", "acceptance_length_ci95", "tokens_per_s", "baseline_tokens_per_s", "speedup",
            "lossless")
    return {"report": str(path), **{k: report[k] for k in keys}}
