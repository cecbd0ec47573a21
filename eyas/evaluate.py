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
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .aux_layers import check_drafter_aux_layers, config_aux_ids
from .config import check_settings
from .data import read_dataset, select_split
from .data.prepare import check_split_ratios, regen_dir, same_source, tokens_dir
from .data.reasoning import answered_turn, history_messages
from .decode import Decoder
from .eval_report import write_report
from .eval_stats import Tally, by_repetition, by_turn, repeat_bucket, round_sums, tau_interval, turn_bucket
from .formats import import_drafter
from .target import load_target
from .tree import TreeSpec, serving_flags
from .tree_decode import TreeDecoder
from .util import EyasError, log, progress

MAX_CONTEXT = 4096  # longest prompt + answer an eval turn may reach; longer turns are skipped


# ---------------------------------------------------------------------------------------------
# inputs

def load_eval_drafter(path: str | Path, target):
    """An eyas drafter folder, or an SGLang/EAGLE or vLLM-speculators folder (via eyas.formats)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise EyasError(f"drafter folder {path} not found or has no config.json (train one with `eyas train`, "
                        f"or pass --draft)")
    return import_drafter(path, target)  # an eyas folder through load_drafter; a damaged config.json is named


def recorded_aux_layers(path: str | Path) -> list[int] | None:
    """The aux layers (eyas ids) a drafter folder says it was trained on: an eyas folder's `aux_layers`, a vLLM
    folder's `eagle_aux_hidden_state_layer_ids`, an SGLang folder's nested `eagle_config` ids; None where the
    folder records none (the engines then use the target's default) or cannot be read (the loader says why)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict):
        return None
    if raw.get("eyas_format") == 1:
        return raw.get("aux_layers") or None  # checked where it is used (check_drafter_aux_layers)
    return config_aux_ids(raw)


def drafter_aux_layers(target, path: str | Path, explicit: bool = False) -> list[int]:
    """The layers the target is to capture for the drafter at `path`: the ones it was trained on. Unless the user
    named the target's aux layers (`explicit`: then a drafter trained on others is refused when it is loaded,
    saying which), the drafter's recorded ones, so `eyas eval --set eval.draft=DIR` needs no `target.aux_layers`.
    `target` is left as it is: the caller makes the target that captures them (dataclasses.replace)."""
    aux = recorded_aux_layers(path)
    if explicit or aux is None or list(aux) == list(target.aux_layers):
        return list(target.aux_layers)
    aux = check_drafter_aux_layers(aux, Path(path) / "config.json", target)
    log(f"eval: capturing aux layers {aux}, the ones the drafter in {path} was trained on")
    return aux


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if torch.is_tensor(ids):
        ids = ids.view(-1).tolist()
    return list(ids)


def load_prompt_set(cfg) -> tuple[str, list]:
    """(set name, conversations) for cfg.eval.prompts: held-out ShareGPT test split, humaneval, or a file."""
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
    check_settings(cfg, (("eval.limit", cfg.eval.limit >= 0, "0 (every conversation) or more"),))
    check_split_ratios(cfg.data)


def check_heldout_split(cfg, run_dir: str | Path) -> None:
    """Refuse a data.test_ratio other than the one the training data of `run_dir` (the drafter's run) were split
    at, when the eval reads the held-out test split of the same data set. The split is a hash of each record's id
    below data.test_ratio: at a larger ratio it takes in conversations outside the run's held-out ones, which the
    drafter may have trained on, at a smaller one only part of them. (data.val_ratio does not move the test split:
    a record is in it by its hash alone.) A run whose tokens record no settings, or another data set, is not
    checked."""
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

def _new_decoder(target, drafter, k, temperature, top_p, max_len, compile_, seed=0, fused=None, tree=None):
    if tree is not None:  # an EAGLE-2 dynamic tree (eyas.tree_decode); its depth plays K's part
        return TreeDecoder(target, drafter, tree, temperature=temperature, top_p=top_p, max_len=max_len,
                           compile=compile_, seed=seed)
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


@dataclass
class _Measured:
    """What the eval has measured so far."""
    t: Tally
    turns: dict[str, Tally] = field(default_factory=dict)  # by turn_bucket
    repeats: dict[str, Tally] = field(default_factory=dict)  # by repeat_bucket
    n_prompts: int = 0  # answers decoded
    skipped: int = 0  # user turns left out, too long for the context
    too_long: list[int] = field(default_factory=list)  # the prompt length of each conversation's first turn left out
    groups: list = field(default_factory=list)  # each conversation's (Σ (accepted + 1), rounds), for the interval
    first_answers: list = field(default_factory=list)  # each conversation's first answer's token ids (None: none)
    extra: int = 3  # cache slots a round may write past the committed length: a chain's K, a tree's verified tokens


def evaluate(target, drafter, convs: list, k: int = 3, temperature: float = 0.0, top_p: float = 1.0,
             max_new_tokens: int = 256, compile_: bool = False, seed: int = 0, baseline: bool = True,
             fused: bool | None = None, max_turns: int = 0, tree=None) -> dict:
    """Answer every user turn of every conversation in sequence (the history holds eyas' own
    answers), or its first `max_turns` ones, with speculative decoding and, when `baseline`, plain decoding on
    the same engine. tree: an eyas.tree.TreeSpec to draft dynamic trees (k must be its depth), or None for a chain."""
    tok = target.tokenizer
    max_len = min(MAX_CONTEXT, getattr(target.config, "max_position_embeddings", MAX_CONTEXT) or MAX_CONTEXT)
    dec = _new_decoder(target, drafter, k, temperature, top_p, max_len, compile_, seed, fused, tree)
    stop = target.eot_token_ids
    m = _Measured(Tally(k), extra=k if tree is None else max(tree.tokens, tree.depth + 1))
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
            m.groups.append(_answer_conversation(dec, conv, m, tok, stop, k, temperature, max_len, max_new_tokens,
                                                 max_turns, baseline))
            bar.update(1)
        bar.close()
    finally:
        dec.close()
    _check_answered(m, len(convs), max_len, max_new_tokens)
    res = _result(m, dec, target, convs, k, temperature, top_p, max_new_tokens, max_turns, max_len)
    # the dynamic tree drafted (topk, depth, tokens), or None for a chain of k; with a tree, k is its depth and
    # per_position_acceptance is per level
    return {**res, "tree": tree.as_dict() if tree is not None else None, "serving_flags": serving_flags(tree, k)}


def _answer_conversation(dec, conv, m: _Measured, tok, stop, k, temperature, max_len, max_new_tokens, max_turns,
                         baseline) -> tuple[int, int]:
    """Answer a conversation's user turns in sequence (each after eyas' own earlier answers), speculatively and,
    when `baseline`, plainly; returns its (Σ (accepted + 1), rounds)."""
    t = m.t
    history: list = []  # the turns before the next prompt (Turn), as a served target is given them
    answered = 0
    conv_sum = conv_rounds = 0
    first = None
    for i, turn in enumerate(conv.turns):
        if turn.role == "system":
            history.append(turn)
            continue
        if turn.role != "user":
            continue  # the data set's answers are replaced by the target's own
        if max_turns and answered >= max_turns:
            break
        ids = prompt_ids(tok, history_messages(history + [turn], tok))
        if len(ids) + max_new_tokens + m.extra + 2 > max_len:
            # this turn and the later ones, longer still (up to max_turns), are left out
            left = sum(x.role == "user" for x in conv.turns[i:])
            m.skipped += min(left, max_turns - answered) if max_turns else left
            m.too_long.append(len(ids))
            break
        g = dec.generate(ids, max_new_tokens, stop, speculative=True)
        t.add_rounds(g.accepted)
        answered += 1
        if answered == 1:
            first = [int(x) for x in g.tokens]
        a_sum, a_rounds = round_sums(g.accepted)
        conv_sum, conv_rounds = conv_sum + a_sum, conv_rounds + a_rounds
        content = [x for x in g.tokens if x not in stop]
        for tb in (m.turns.setdefault(turn_bucket(answered), Tally(k)),
                   m.repeats.setdefault(repeat_bucket(content), Tally(k))):
            tb.add_rounds(g.accepted)
            tb.tokens += len(g.tokens)
            tb.answers += 1
        t.spec_s += g.seconds
        t.spec_tokens += len(g.tokens)
        t.draft_s += g.draft_seconds
        t.verify_s += g.verify_seconds
        t.prefill_s += g.prefill_seconds
        if baseline:
            _plain(dec, ids, g, t, stop, max_new_tokens, temperature, conv.id)
        m.n_prompts += 1
        answer = tok.decode(content, skip_special_tokens=True)
        history += [turn, answered_turn(tok, answer)]
    m.first_answers.append(first)
    return conv_sum, conv_rounds


def _plain(dec, ids, g, t: Tally, stop, max_new_tokens, temperature, conv_id) -> None:
    """Plain decoding of the same prompt: its time, and at temperature 0 whether the speculative answer `g` is its
    own token for token."""
    b = dec.generate(ids, max_new_tokens, stop, speculative=False)
    t.plain_s += b.seconds
    t.plain_prefill_s += b.prefill_seconds
    t.plain_tokens += len(b.tokens)
    if temperature == 0:
        t.checked += 1
        if b.tokens == g.tokens:
            t.matched += 1
            return
        # plain decoding again, untimed, with its steps shaped as the verify (Decoder.generate_like_verify): equal
        # there, the answers part only where a kernel rounds by the call's shape, at a near-tie; not, a wrong token
        same = dec.generate_like_verify(ids, max_new_tokens, stop).tokens == g.tokens
        t.rounding += same
        if len(t.mismatches) < 10:
            first = next((i for i, (x, y) in enumerate(zip(b.tokens, g.tokens)) if x != y),
                         min(len(b.tokens), len(g.tokens)))
            t.mismatches.append(f"{conv_id}: first difference at new token {first}"
                                + (" (rounding: equal with the verify's shapes)" if same else " (a wrong token)"))


def _check_answered(m: _Measured, n_convs: int, max_len: int, max_new_tokens: int) -> None:
    """Say which turns were left out, too long for the context; refuse an eval that answered none."""
    too_long, k = m.too_long, m.extra
    if too_long:
        why = (f"a prompt of {min(too_long)}{'' if min(too_long) == max(too_long) else f' to {max(too_long)}'} "
               f"tokens + max_new_tokens {max_new_tokens} + {k + 2} (K + 2) is over the {max_len}-token context the "
               f"eval decodes in")
        log(f"eval: {m.skipped} user turns of {len(too_long)} conversations left out: {why} (a conversation's later "
            f"turns, longer still, are left out with its first one too long)")
    if not m.n_prompts:
        if not too_long:
            raise EyasError(f"no answer decoded: the {n_convs} conversations hold no user turn to answer")
        # the most new tokens that let every first turn in, or else the shortest one
        room_all, room_one = max_len - max(too_long) - k - 2, max_len - min(too_long) - k - 2
        room = room_all if room_all >= 1 else room_one
        fix = (f"lower eval.max_new_tokens (--max-new-tokens) to {room} or less" if room >= 1 else
               f"give prompts shorter than {max_len - k - 3} tokens (eval.prompts)")
        raise EyasError(f"no answer decoded: every conversation's first turn is too long ({why}); {fix}. Nothing "
                        f"was written")


def _result(m: _Measured, dec, target, convs, k, temperature, top_p, max_new_tokens, max_turns, max_len) -> dict:
    t = m.t
    tps = t.spec_tokens / t.spec_s if t.spec_s else 0.0
    base = t.plain_tokens / t.plain_s if t.plain_s else None
    return {
        "k": k, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
        "turns": max_turns, "prompts_answered": m.n_prompts, "conversations": len(convs),
        "turns_skipped_too_long": m.skipped, "context": max_len,
        "acceptance_length": t.acceptance_length(), "acceptance_length_ci95": tau_interval(m.groups),
        # each conversation's (Σ (accepted + 1), rounds), in order, and its id: two drafters' evals pair by them
        # (tau_difference)
        "rounds_by_conversation": [list(g) for g in m.groups], "conversation_ids": [str(c.id) for c in convs],
        # each conversation's first answer as token ids (None where its first turn was too long): `eyas parity`
        # compares them with the engine's answers to the same prompts
        "first_answer_ids": m.first_answers,
        "per_position_acceptance": t.per_position(),
        "accepted_length_histogram": t.hist, "verify_rounds": t.rounds, "new_tokens": t.spec_tokens,
        "by_turn": by_turn(m.turns), "by_repetition": by_repetition(m.repeats),
        "tokens_per_s": tps, "baseline_tokens_per_s": base,
        "speedup": (tps / base) if base else None,
        "lossless": (t.matched == t.checked) if (temperature == 0 and t.checked) else None,
        "lossless_checked": t.checked, "lossless_matched": t.matched, "lossless_mismatches": t.mismatches,
        # of the answers that part from plain decoding, those equal to it with its steps shaped as the verify (the
        # same kernels): rounding at near-ties. lossless_exact: every answer is plain decoding's on one of the two
        "lossless_rounding": t.rounding if temperature == 0 and t.checked else None,
        "lossless_exact": (t.matched + t.rounding == t.checked) if (temperature == 0 and t.checked) else None,
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


def lossless_words(report: dict) -> str:
    """The lossless check of a report whose answers did not all equal plain decoding's, in words."""
    n, same, rnd = report["lossless_checked"], report.get("lossless_matched"), report.get("lossless_rounding")
    miss = report.get("lossless_mismatches") or []
    if same is None or rnd is None:  # a report from before the rounding check
        return f"NO, of {n} answers checked, first difference {miss[0] if miss else '?'}"
    wrong = n - same - rnd
    return (f"{same} of {n} answers equal plain decoding's; "
            + (f"the other {rnd} equal it with its steps shaped as the verify (kernel rounding at near-ties, no "
               f"wrong token)" if not wrong else
               f"{wrong} part from it with the verify's shapes too: NOT lossless, first difference "
               f"{next((m for m in miss if 'wrong' in m), miss[0] if miss else '?')}"))


def check_eval_settings(cfg) -> None:
    """Refuse eval settings out of range, naming the key."""
    check_settings(cfg, (("eval.max_new_tokens", cfg.eval.max_new_tokens >= 1, "at least 1"),
                         ("eval.turns", cfg.eval.turns >= 0, "0 (every turn) or more")))
    check_prompt_settings(cfg)
    TreeSpec.parse(cfg.eval.tree, "eval.tree (--tree)")
    if cfg.eval.draft and not (Path(cfg.eval.draft).expanduser() / "config.json").exists():
        raise EyasError(f"eval.draft: {Path(cfg.eval.draft).expanduser()} is not a drafter folder (no config.json)")


def run_eval(cfg) -> dict:
    """The `eyas eval` stage."""
    e = cfg.eval
    check_eval_settings(cfg)
    check_out_dir(cfg.out)
    draft_path = Path(e.draft or os.path.join(cfg.out, "draft")).expanduser()
    check_heldout_split(cfg, draft_path.parent)  # the run the drafter was trained in
    tcfg = replace(cfg.target, dtype=e.dtype) if e.dtype else cfg.target
    target = load_target(tcfg)
    target = replace(target, aux_layers=drafter_aux_layers(target, draft_path, explicit=bool(cfg.target.aux_layers)))
    drafter = load_eval_drafter(draft_path, target)
    set_name, convs = load_prompt_set(cfg)
    tree = TreeSpec.parse(e.tree, "eval.tree (--tree)")
    k = tree.depth if tree is not None else e.k
    shape = f"tree {tree} (topk, depth, tokens)" if tree is not None else f"K={e.k}"
    log(f"eval: {len(convs)} conversations from {set_name}, {shape}, temperature={e.temperature}")
    res = evaluate(target, drafter, convs, k=k, temperature=e.temperature, top_p=e.top_p,
                   max_new_tokens=e.max_new_tokens, compile_=e.compile,
                   fused={"fused": True, "stepwise": False, "auto": None}[e.round], max_turns=e.turns, tree=tree)
    report = {"target": target.name, "target_identity": target.identity(), "dtype": str(target.dtype).replace("torch.", ""),
              "draft": str(draft_path), "k": k, "temperature": e.temperature,
              "prompts": {"set": set_name, "count": res["prompts_answered"], "conversations": len(convs)},
              **{k: v for k, v in res.items() if k not in ("k", "temperature")}}
    path = write_report(report, Path(cfg.out) / "eval")
    ci = report["acceptance_length_ci95"]
    ci = f" (95% interval {ci[0]:.3f}-{ci[1]:.3f})" if ci else " (one conversation: no interval)"
    loss = report["lossless"]
    speed = (f"{report['tokens_per_s']:,.1f} against {report['baseline_tokens_per_s']:,.1f} tok/s plain "
             f"({report['speedup']:.2f}x)" if report.get("speedup") else "speed not measured")
    unchecked = "not checked" + (" (sampled decoding)" if e.temperature > 0 else "")
    log(f"eval: τ {report['acceptance_length']:.3f}{ci} at {shape} over "
        f"{res['prompts_answered']} answers; {speed}; lossless: "
        + ("yes" if loss else unchecked if loss is None else lossless_words(report))
        + f"; {path.parent / 'report.md'}")
    keys = ("acceptance_length", "acceptance_length_ci95", "tokens_per_s", "baseline_tokens_per_s", "speedup",
            "lossless")
    return {"report": str(path), **{k: report[k] for k in keys}}
