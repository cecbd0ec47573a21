"""`eyas parity`: does a serving engine accept what eyas says the drafter should get?

The failure this catches: a drafter loads fine in vLLM or SGLang, but the engine feeds it other
aux layers, another norm order or a wrong vocabulary map, and accepts a fraction of what eyas
measured. We send the evaluation prompts with the evaluation settings, read the engine's own
acceptance counters and compare its acceptance length (tokens per target forward) with
`<run>/eval/report.json`'s.

* vLLM: Prometheus counters on `/metrics` (`vllm:spec_decode_num_drafts`,
  `..._num_draft_tokens`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos{position}`),
  read before and after; tau = 1 + accepted / drafts.
* SGLang: the per-request `meta_info` of its native `/generate` (`completion_tokens`,
  `spec_verify_ct`); tau = sum(completion_tokens) / sum(spec_verify_ct). Its
  `spec_correct_drafts_histogram` (rounds by drafts accepted) gives the per-position acceptance.

Each prompt's rounds are kept too, (Σ (accepted + 1), rounds) as eyas' report keeps each
conversation's, so the engine's τ and eyas' pair prompt by prompt: a paired bootstrap interval of
their difference says whether a gap is more than how the prompts' rounds vary.

Standard-library HTTP only.
"""
from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from .data.tokenize import render
from .eval_stats import occurrences, tau_difference
from .evaluate import check_heldout_split, check_out_dir, load_prompt_set
from .target import load_tokenizer
from .util import EyasError, atomic_write_json, progress

GAP_LIMIT = 0.15
CONTACT_TIMEOUT = 15.0  # seconds for the first request, which a live server answers at once
REQUEST_TIMEOUT = 600.0  # seconds for a generation (and the metrics around them), which may queue behind other traffic
ENGINES = ("vllm", "sglang")
VLLM_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


# ----------------------------------------------------------------------------- HTTP

class _Status(EyasError):
    """The server answered with an HTTP error."""


class _NoAnswer(EyasError):
    """The server took the request but did not answer within the timeout."""


def _http(url: str, payload: dict | None = None, timeout: float = REQUEST_TIMEOUT) -> bytes:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        body = e.read()[:300].decode("utf-8", "replace")
        raise _Status(f"{url}: HTTP {e.code}: {body}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(e, TimeoutError) or isinstance(reason, TimeoutError):
            raise _NoAnswer(f"{url}: no answer within {timeout:g} s") from None
        raise EyasError(f"cannot reach {url}: {reason}") from None


def check_endpoint(endpoint: str | None) -> str:
    """The server's base URL, refused (naming --endpoint) unless it is an http(s) URL with a host; a trailing
    slash or /v1 is dropped (the engines' paths are added to the base)."""
    if not endpoint:
        raise EyasError("--endpoint is required (the base URL of the running server, e.g. http://127.0.0.1:8000)")
    try:
        parts = urllib.parse.urlsplit(endpoint)
        parts.port  # a port that is not a number raises here
    except ValueError as e:
        raise EyasError(f"--endpoint {endpoint!r} is not a valid URL ({e}); give the server's base URL, e.g. "
                        f"http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        hint = f": give http://{endpoint}" if "://" not in endpoint else ""
        raise EyasError(f"--endpoint {endpoint!r} is not an http:// or https:// URL with a host{hint} (the server's "
                        f"base URL, e.g. http://127.0.0.1:8000)")
    endpoint = endpoint.rstrip("/")
    return endpoint[:-3] if endpoint.endswith("/v1") else endpoint


def first_contact(endpoint: str) -> dict | None:
    """GET /v1/models (both engines serve it) with a short timeout, before any long request: a server that accepts
    the connection but never answers (a port held by something else, a server still loading or stuck) is told
    apart from a slow generation. The model list, or None where the server answers that path with an HTTP error
    (it answers, which is all this asks)."""
    url = endpoint + "/v1/models"
    try:
        raw = _http(url, timeout=CONTACT_TIMEOUT)
    except _Status:
        return None
    except _NoAnswer:
        raise EyasError(f"{endpoint}: the server accepted the connection but did not answer GET /v1/models within "
                        f"{CONTACT_TIMEOUT:g} s: is the engine still loading, or is another program listening on "
                        f"that port?") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def _json(url: str, payload: dict | None = None) -> dict:
    raw = _http(url, payload)
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise EyasError(f"{url}: the server did not answer JSON: {raw[:200]!r}") from None


# ----------------------------------------------------------------------------- vLLM

def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """Samples of a Prometheus text exposition: (name, labels, value)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, value))
    return out


def vllm_counters(text: str) -> dict:
    """Spec-decode counters summed over engines/models: num_drafts, num_draft_tokens,
    num_accepted_tokens and per_position (accepted tokens at each draft position)."""
    samples = parse_prometheus(text)
    out: dict = {k: None for k in VLLM_COUNTERS}
    per_pos: dict[int, float] = {}
    for name, labels, value in samples:
        base = name[:-len("_total")] if name.endswith("_total") else name
        for key, metric in VLLM_COUNTERS.items():
            if base == metric:
                out[key] = (out[key] or 0.0) + value
        if base == VLLM_PER_POS and "position" in labels:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    out["per_position"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def _token_ids(x) -> list[int] | None:
    """An answer's token ids as the engine returned them, or None where it returned none (or something else)."""
    if isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        return list(x)
    return None


def _vllm_run(endpoint: str, prompts: list[list[dict]], cfg, model: str) -> dict:
    before = vllm_counters(_http(endpoint + "/metrics").decode("utf-8", "replace"))
    if before["num_drafts"] is None:
        raise EyasError(f"{endpoint}/metrics has no {VLLM_COUNTERS['num_drafts']} counter: is the server running "
                        f"with a speculative config (--speculative-config) and metrics enabled?")
    completion_tokens, by_prompt, prev, answers = 0, [], before, []
    for msgs in progress(prompts, desc="parity (vllm)", unit="prompt"):
        # return_token_ids: the answer's token ids beside its text (vLLM 0.10.2 and later; earlier ones ignore it)
        r = _json(endpoint + "/v1/chat/completions",
                  {"model": model, "messages": msgs, "max_tokens": cfg.eval.max_new_tokens,
                   "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p, "return_token_ids": True})
        completion_tokens += int((r.get("usage") or {}).get("completion_tokens") or 0)
        answers.append(_token_ids(((r.get("choices") or [{}])[0] or {}).get("token_ids")))
        # the counters after each answer: its own drafts and accepted tokens, the prompts being sent one at a time
        now = vllm_counters(_http(endpoint + "/metrics").decode("utf-8", "replace"))
        drafts = round((now["num_drafts"] or 0.0) - (prev["num_drafts"] or 0.0))
        accepted = round((now["num_accepted_tokens"] or 0.0) - (prev["num_accepted_tokens"] or 0.0))
        by_prompt.append((drafts + accepted, drafts))
        prev = now
    after = prev
    d = {k: (after[k] or 0.0) - (before[k] or 0.0) for k in VLLM_COUNTERS}
    pos_before = before["per_position"] + [0.0] * (len(after["per_position"]) - len(before["per_position"]))
    per_pos = [a - b for a, b in zip(after["per_position"], pos_before)]
    if d["num_drafts"] <= 0:
        raise EyasError(f"{endpoint}: the spec-decode counters did not move while {len(prompts)} prompts were "
                        f"answered; the server is not drafting")
    return {
        "acceptance_length": 1.0 + d["num_accepted_tokens"] / d["num_drafts"],
        "per_position_acceptance": [p / d["num_drafts"] for p in per_pos],
        "k": len(per_pos) or None,
        "counters": {**d, "per_position": per_pos},
        "completion_tokens": completion_tokens,
        "by_prompt": by_prompt,
        "answers": answers,
    }


def _vllm_model(endpoint: str) -> str:
    data = _json(endpoint + "/v1/models").get("data") or []
    if not data:
        raise EyasError(f"{endpoint}/v1/models lists no model")
    return data[0]["id"]


# ----------------------------------------------------------------------------- SGLang

def sglang_histogram(meta: dict) -> list[int] | None:
    """A request's verify rounds by the number of drafts they accepted (index i: rounds that accepted i), as SGLang's
    meta_info gives them (`spec_correct_drafts_histogram`; `spec_accept_histogram` in earlier releases)."""
    h = meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))
    if isinstance(h, list) and h and all(isinstance(x, (int, float)) and x >= 0 for x in h):
        return [int(x) for x in h]
    return None


def sglang_acceptance(meta_infos: list[dict]) -> dict:
    """SGLang's acceptance length from per-request meta_info: sum(completion_tokens) / sum(spec_verify_ct).
    SGLang leaves spec_verify_ct out of a request that had no verify step (answered at its prefill), so a missing
    key counts 0 steps; missing on every request means the server is not drafting. Where the requests carry their
    acceptance histograms, the per-position acceptance ("reached": the share of rounds that accepted at least i+1
    drafts) and each request's (Σ (accepted + 1), rounds) come from them; else each request's rounds are
    (completion_tokens, spec_verify_ct), which counts the token of its prefill too."""
    toks = verify = 0
    if meta_infos and not any("spec_verify_ct" in m for m in meta_infos):
        raise EyasError(f"no SGLang response of {len(meta_infos)} has meta_info.spec_verify_ct: is the server running "
                        f"with --speculative-algorithm EAGLE3?")
    hists = [sglang_histogram(m) for m in meta_infos]
    total: list[int] = []
    by_prompt = []
    for m, h in zip(meta_infos, hists):
        toks += int(m.get("completion_tokens", 0))
        verify += int(m.get("spec_verify_ct", 0))
        if h is not None:
            total += [0] * (len(h) - len(total))
            for i, n in enumerate(h):
                total[i] += n
            by_prompt.append((sum((i + 1) * n for i, n in enumerate(h)), sum(h)))
        else:
            by_prompt.append((int(m.get("completion_tokens", 0)), int(m.get("spec_verify_ct", 0))))
    if verify <= 0:
        raise EyasError("SGLang reported no verify steps (spec_verify_ct = 0 on every prompt); the server is not drafting")
    out = {"acceptance_length": toks / verify, "counters": {"completion_tokens": toks, "spec_verify_ct": verify},
           "per_position_acceptance": None, "k": None, "by_prompt": by_prompt}
    if total and sum(total) and all(h is not None for h in hists):
        rounds = sum(total)
        out["per_position_acceptance"] = [sum(total[i:]) / rounds for i in range(1, len(total))]
        out["counters"]["accepted_histogram"] = total
    return out


def _sglang_run(endpoint: str, prompts: list[list[dict]], cfg, tokenizer) -> dict:
    metas, answers = [], []
    for msgs in progress(prompts, desc="parity (sglang)", unit="prompt"):
        text = render(tokenizer, msgs, add_generation_prompt=True)
        r = _json(endpoint + "/generate",
                  {"text": text, "sampling_params": {"max_new_tokens": cfg.eval.max_new_tokens,
                                                     "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p}})
        metas.append(r.get("meta_info") or {})
        answers.append(_token_ids(r.get("output_ids")))
    res = sglang_acceptance(metas)
    res["answers"] = answers
    res["completion_tokens"] = res["counters"]["completion_tokens"]
    return res


# ----------------------------------------------------------------------------- prompts and report

def first_turns(convs, ids: list | None = None) -> list[list[dict]]:
    """Each conversation's first user turn, with the system turns before it, as chat messages; `ids`, where given,
    gets the id of each prompt's conversation."""
    prompts = []
    for c in convs:
        msgs = []
        for t in c.turns:
            if t.role == "system":
                msgs.append({"role": t.role, "content": t.content})
            elif t.role == "user":
                prompts.append(msgs + [{"role": t.role, "content": t.content}])
                if ids is not None:
                    ids.append(str(c.id))
                break
    return prompts


def eval_prompts(cfg, ids: list | None = None) -> tuple[list[list[dict]], str]:
    """The evaluation prompts as chat messages, from the same prompt set `eyas eval` uses (cfg.eval.prompts and
    cfg.eval.limit): each conversation's first user turn with the system turns before it, the prompt of its first
    answer in `eyas eval`, whose τ over those answers (report.json's by_turn["1"]) is what the engine's is compared
    with."""
    check_heldout_split(cfg, cfg.out)
    name, convs = load_prompt_set(cfg)
    prompts = first_turns(convs, ids)
    if not prompts:
        raise EyasError(f"eval.prompts {cfg.eval.prompts!r} gave no prompts")
    return prompts, name


def eyas_first_answers(report: dict) -> dict:
    """eyas' acceptance over the answers parity asks the engine for, each conversation's first: report.json's
    by_turn["1"]. A report without by_turn gives its τ over every answer, which is the same only where each
    conversation was answered once; `compared` says which figure it is, `note` what to mind."""
    first = (report.get("by_turn") or {}).get("1") if isinstance(report.get("by_turn"), dict) else None
    if isinstance(first, dict) and first.get("acceptance_length") is not None:
        return {"tau": first["acceptance_length"], "per_position": first.get("per_position_acceptance"),
                "answers": first.get("answers"),
                "compared": f"by_turn[\"1\"]: eyas' τ over the first answers of its conversations "
                            f"({first.get('answers')} answers), the prompts parity sends", "note": None}
    rp = report.get("prompts") if isinstance(report.get("prompts"), dict) else {}
    once = rp.get("count") is not None and rp.get("count") == rp.get("conversations")
    return {"tau": report.get("acceptance_length"), "per_position": report.get("per_position_acceptance"),
            "answers": rp.get("count"),
            "compared": "acceptance_length: eyas' τ over every answer of its eval" + (
                " (one answer per conversation, the prompts parity sends)" if once else ""),
            "note": None if once else "eyas' report has no by_turn, so its τ over every answer it decoded (later "
                                      "turns included) is compared with the engine's over first turns alone; rerun "
                                      "`eyas eval` for a report with by_turn"}


def tree_settings_note(report: dict, engine: str) -> str | None:
    """For a report of an EAGLE-2 dynamic tree (eyas eval --tree): the engine flags that serve the same tree, which
    the server must have been started with for the two acceptance lengths to compare (None for a chain's report)."""
    tree = report.get("tree")
    if not isinstance(tree, dict):
        return None
    from .tree import TreeSpec, serving_flags

    try:
        spec = TreeSpec(int(tree["topk"]), int(tree["depth"]), int(tree["tokens"]))
    except (KeyError, TypeError, ValueError):
        return f"eyas' report has a tree setting it cannot read ({tree!r}); run `eyas eval --tree` again"
    flags = serving_flags(spec, spec.depth)
    if engine == "sglang":
        return (f"eyas' τ is of the dynamic tree {spec} (topk, depth, tokens): compare with SGLang serving it, "
                f"started with {flags['sglang']}")
    return (f"eyas' τ is of the dynamic tree {spec} (topk, depth, tokens); vLLM has {flags['vllm']}: compare "
            f"with SGLang (--engine sglang, {flags['sglang']}) or evaluate a chain in eyas (eval.k)")


def reached(conditional: list[float] | None) -> list[float] | None:
    """Per-position acceptance given the drafts before it were accepted (eyas' report) -> the share of drafts whose
    first i+1 tokens were all accepted (vLLM's per-position counters over its drafts), the same measure both ways."""
    if not conditional:
        return None
    out, p = [], 1.0
    for a in conditional:
        p *= a
        out.append(p)
    return out


def conditional(reached_: list[float] | None) -> list[float] | None:
    """The inverse of `reached`: the share of drafts whose position i was accepted, over those whose i-1 was."""
    if not reached_:
        return None
    return [r / prev if prev else 0.0 for r, prev in zip(reached_, [1.0] + list(reached_[:-1]))]


def compare(engine_tau: float, eyas_tau: float | None, limit: float = GAP_LIMIT) -> dict:
    """gap = (eyas - engine) / eyas; |gap| > limit is flagged."""
    if eyas_tau is None or not eyas_tau or (isinstance(eyas_tau, float) and math.isnan(eyas_tau)):
        return {"gap": None, "flagged": None}
    gap = (eyas_tau - engine_tau) / eyas_tau
    return {"gap": gap, "flagged": abs(gap) > limit}


def same_answer(a: list[int], b: list[int]) -> bool:
    """Two greedy answers to one prompt are the same text where their token ids are equal, or where one holds one
    token more at its end (an engine that counts the end-of-turn token it stopped at, the other not)."""
    n = min(len(a), len(b))
    return a[:n] == b[:n] and abs(len(a) - len(b)) <= 1


def compare_answers(engine_answers: list | None, ids: list[str] | None, report: dict | None) -> dict:
    """The engine's answer to each prompt against eyas' first answer of the same conversation (report.json's
    first_answer_ids), token for token. Each engine is lossless against its own target kernels, so greedy answers
    can part where two logits nearly tie; from there the two engines draft and verify different text, and their
    acceptance differs with it. `same` holds the conversation keys whose answers are the same (`same_answer`), for
    the paired τ over those alone; `first_difference`, per prompt sent, the new-token index where the answers part
    (None: the same, or not compared). `why` says what is missing where nothing compares."""
    if not engine_answers or ids is None or len(ids) != len(engine_answers) \
            or all(a is None for a in engine_answers):
        return {"why": "the engine returned no token ids with its answers"}
    if not isinstance(report, dict) or not isinstance(report.get("first_answer_ids"), list) \
            or not isinstance(report.get("conversation_ids"), list) \
            or len(report["first_answer_ids"]) != len(report["conversation_ids"]):
        return {"why": "eyas' report has no first answers' token ids (rerun `eyas eval`)"}
    mine = dict(zip(occurrences(report["conversation_ids"]), report["first_answer_ids"]))
    same, firsts, compared = set(), [], 0
    for key, a in zip(occurrences(ids), engine_answers):
        b = mine.get(key)
        if a is None or not isinstance(b, list):
            firsts.append(None)
            continue
        compared += 1
        if same_answer(a, b):
            same.add(key)
            firsts.append(None)
        else:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    if not compared:
        return {"why": "no prompt's answer was found on both sides"}
    return {"compared": compared, "same": same, "first_difference": firsts}


def pair_prompts(by_prompt: list | None, ids: list[str] | None, report: dict | None, keep: set | None = None) -> dict:
    """The engine's rounds per prompt against eyas' per conversation (report.json's rounds_by_conversation and
    conversation_ids), matched by conversation id: τ over the pairs on each side and a paired bootstrap interval of
    the difference (eval_stats.tau_difference). Only a report whose conversations were answered once (eval.turns 1)
    pairs: its rounds are then those of the first answers parity asks for. `keep`, where given, limits the pairs to
    those conversation keys. `why` says what is missing otherwise."""
    if not by_prompt or ids is None or len(ids) != len(by_prompt):
        return {"why": "the engine's rounds per prompt are unknown"}
    if not isinstance(report, dict) or not isinstance(report.get("rounds_by_conversation"), list) \
            or not isinstance(report.get("conversation_ids"), list):
        return {"why": "eyas' report has no rounds per conversation (rerun `eyas eval`)"}
    if report.get("turns") != 1:
        return {"why": "eyas' report answered later turns too (eval.turns is not 1), so its rounds per conversation "
                       "are not those of the first answers"}
    mine = dict(zip(occurrences(report["conversation_ids"]), report["rounds_by_conversation"]))
    a, b = [], []
    for key, g in zip(occurrences(ids), by_prompt):
        if key in mine and (keep is None or key in keep):
            a.append(tuple(g))
            b.append(tuple(mine[key]))
    d = tau_difference(a, b)
    if d is None:
        return {"why": f"fewer than two prompts pair ({len(a)} of {len(ids)} found in eyas' report)"}
    return {"pairs": d["pairs"], "tau_engine": d["tau_a"], "tau_eyas": d["tau_b"], "difference": d["difference"],
            "level": d["level"], "interval": d["interval"]}


def run_parity(cfg, endpoint: str | None = None, engine: str | None = None, prompts=None, tokenizer=None) -> dict:
    """Send the eval prompts (each conversation's first turn) to `endpoint`, read `engine`'s acceptance counters,
    compare with eyas' τ over the same answers in <run>/eval/report.json and write <run>/eval/parity.json."""
    if engine is None:
        raise EyasError(f"--engine is required: which engine serves the drafter ({' or '.join(ENGINES)})")
    if engine not in ENGINES:
        raise EyasError(f"--engine must be {' or '.join(ENGINES)}, got {engine!r}")
    endpoint = check_endpoint(endpoint)
    check_out_dir(cfg.out)
    ids: list[str] | None = None  # each prompt's conversation, where the prompts are the eval's
    if prompts is None:
        ids = []
        prompts, source = eval_prompts(cfg, ids)
    else:
        source = "given"
    models = first_contact(endpoint)
    if engine == "vllm":
        model = getattr(getattr(cfg, "regen", None), "model", "")
        if not model:  # the served model's name, from the first contact's list (asked again to say what is wrong)
            listed = (models or {}).get("data") or [None]
            model = (listed[0].get("id") if isinstance(listed[0], dict) else None) or _vllm_model(endpoint)
        res = _vllm_run(endpoint, prompts, cfg, model)
    else:
        res = _sglang_run(endpoint, prompts, cfg, tokenizer or load_tokenizer(cfg.target))

    run = Path(cfg.out)
    report_path = run / "eval" / "report.json"
    notes = []
    eyas_tau = None
    report = None
    mine = {"tau": None, "per_position": None, "compared": None}
    if report_path.exists():
        try:
            report = json.loads(report_path.read_text())
        except json.JSONDecodeError as e:
            notes.append(f"{report_path}: line {e.lineno}: invalid JSON, eyas' own acceptance length unknown")
        else:
            if not isinstance(report, dict):
                notes.append(f"{report_path} is not an eval report, eyas' own acceptance length unknown")
                report = None
    else:
        notes.append(f"no eyas evaluation at {report_path}: run `eyas eval` with the same prompts and settings "
                     f"first; only the engine's acceptance length is reported")
    if report is not None:
        mine = eyas_first_answers(report)
        eyas_tau = mine["tau"]
        if eyas_tau is None:
            notes.append(f"{report_path} has no acceptance_length")
        if mine["note"]:
            notes.append(mine["note"])
        for key, what in (("temperature", "temperature"), ("top_p", "top-p"), ("max_new_tokens", "max_new_tokens")):
            if report.get(key) is not None and float(report[key]) != float(getattr(cfg.eval, key)):
                notes.append(f"eyas' report used {what} {report[key]}, parity used {getattr(cfg.eval, key)}")
        k_engine = res.get("k")
        tree_note = tree_settings_note(report, engine)
        if tree_note:
            notes.append(tree_note)
        elif report.get("k") is not None and k_engine and int(report["k"]) != int(k_engine):
            notes.append(f"eyas' report used k={report['k']}, the server drafts {k_engine} tokens")
        if mine["answers"] is not None and int(mine["answers"]) != len(prompts):
            notes.append(f"eyas' figure covers {mine['answers']} first answers, parity sent {len(prompts)} prompts "
                         f"(another prompt set or limit, or first turns too long for the eval's context)")
    paired = pair_prompts(res.get("by_prompt"), ids, report)
    answers = compare_answers(res.get("answers"), ids, report)
    if "same" in answers:
        answers["paired_same"] = pair_prompts(res.get("by_prompt"), ids, report, keep=answers["same"])
    cmp = compare(res["acceptance_length"], eyas_tau)
    ours = f"eyas' {eyas_tau:.3f} ({mine['compared']})" if eyas_tau is not None else ""
    if cmp["flagged"]:
        direction = "below" if cmp["gap"] > 0 else "above"
        verdict = (f"FLAGGED: {engine}'s acceptance length {res['acceptance_length']:.3f} is "
                   f"{abs(cmp['gap']) * 100:.1f}% {direction} {ours} (limit {GAP_LIMIT * 100:.0f}%): "
                   f"likely an integration fault (aux-layer ids, norm flags, vocabulary map, chat template)")
    elif cmp["flagged"] is False:
        verdict = (f"ok: {engine}'s acceptance length {res['acceptance_length']:.3f} is within "
                   f"{GAP_LIMIT * 100:.0f}% of {ours}")
    else:
        verdict = f"incomplete: {engine}'s acceptance length is {res['acceptance_length']:.3f}; eyas' own is unknown"
    if paired.get("difference") is not None:
        lo, hi = paired["interval"]
        verdict += (f". Prompt by prompt ({paired['pairs']} pairs, each side's tokens per round): {engine} minus eyas "
                    f"{paired['difference']:+.3f}, {paired['level'] * 100:.0f}% interval {lo:+.3f} to {hi:+.3f}"
                    + (" (no difference beyond how the prompts vary)" if lo <= 0 <= hi else ""))
    if "same" in answers:
        verdict += f". Answers the same token for token: {len(answers['same'])} of {answers['compared']}"
        same_pairs = answers["paired_same"]
        if same_pairs.get("difference") is not None:
            lo, hi = same_pairs["interval"]
            verdict += (f"; over those, {engine} minus eyas {same_pairs['difference']:+.3f}, "
                        f"{same_pairs['level'] * 100:.0f}% interval {lo:+.3f} to {hi:+.3f}")
    out = {
        "engine": engine, "endpoint": endpoint, "prompts": {"set": source, "count": len(prompts)},
        "max_new_tokens": cfg.eval.max_new_tokens, "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p,
        "engine_acceptance_length": res["acceptance_length"],
        # per position, two ways each: "reached", the share of drafts whose first i+1 tokens were all accepted (what
        # vLLM counts), and "acceptance", given the drafts before it were accepted (what eyas' report holds)
        "engine_per_position_reached": res.get("per_position_acceptance"),
        "engine_per_position_acceptance": conditional(res.get("per_position_acceptance")),
        "engine_k": res.get("k"), "engine_counters": res["counters"],
        "completion_tokens": res.get("completion_tokens"),
        "eyas_acceptance_length": eyas_tau,
        "eyas_compared": mine["compared"],  # which of the report's figures: the answers to the prompts sent
        "eyas_per_position_acceptance": mine["per_position"],
        "eyas_per_position_reached": reached(mine["per_position"]),
        "gap": cmp["gap"], "gap_limit": GAP_LIMIT, "flagged": cmp["flagged"], "verdict": verdict, "notes": notes,
        # prompt by prompt: the engine's (Σ (accepted + 1), rounds) in the order sent, and the paired difference with
        # eyas' rounds of the same conversations
        "engine_by_prompt": [list(g) for g in res.get("by_prompt") or []] or None,
        "paired": paired,
        # each prompt's answer from both engines: how many are the same token for token, where each other parts,
        # and the paired τ over the same answers alone (a gap that stays there is not the text's)
        "answers": ({"compared": answers["compared"], "same": len(answers["same"]),
                     "first_difference": answers["first_difference"], "paired_same": answers["paired_same"]}
                    if "same" in answers else {"why": answers["why"]}),
        # the engine flags that serve what eyas evaluated (a dynamic tree or a chain of k)
        "serving_flags": (report or {}).get("serving_flags") if isinstance(report, dict) else None,
    }
    atomic_write_json(run / "eval" / "parity.json", out)
    return out
