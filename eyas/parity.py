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
  `spec_verify_ct`); tau = sum(completion_tokens) / sum(spec_verify_ct).

Standard-library HTTP only.
"""
from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from pathlib import Path

from .util import EyasError, atomic_write_json, progress

GAP_LIMIT = 0.15
VLLM_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


# ----------------------------------------------------------------------------- HTTP

def _http(url: str, payload: dict | None = None, timeout: float = 600.0) -> bytes:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        body = e.read()[:300].decode("utf-8", "replace")
        raise EyasError(f"{url}: HTTP {e.code}: {body}") from None
    except (urllib.error.URLError, OSError) as e:
        raise EyasError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None


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


def _vllm_run(endpoint: str, prompts: list[list[dict]], cfg, model: str) -> dict:
    before = vllm_counters(_http(endpoint + "/metrics").decode("utf-8", "replace"))
    if before["num_drafts"] is None:
        raise EyasError(f"{endpoint}/metrics has no {VLLM_COUNTERS['num_drafts']} counter: is the server running "
                        f"with a speculative config (--speculative-config) and metrics enabled?")
    completion_tokens = 0
    for msgs in progress(prompts, desc="parity (vllm)", unit="prompt"):
        r = _json(endpoint + "/v1/chat/completions",
                  {"model": model, "messages": msgs, "max_tokens": cfg.eval.max_new_tokens,
                   "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p})
        completion_tokens += int((r.get("usage") or {}).get("completion_tokens") or 0)
    after = vllm_counters(_http(endpoint + "/metrics").decode("utf-8", "replace"))
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
    }


def _vllm_model(endpoint: str) -> str:
    data = _json(endpoint + "/v1/models").get("data") or []
    if not data:
        raise EyasError(f"{endpoint}/v1/models lists no model")
    return data[0]["id"]


# ----------------------------------------------------------------------------- SGLang

def sglang_acceptance(meta_infos: list[dict]) -> dict:
    """SGLang's acceptance length from per-request meta_info: sum(completion_tokens) / sum(spec_verify_ct)."""
    toks = verify = 0
    for i, m in enumerate(meta_infos):
        if "spec_verify_ct" not in m:
            raise EyasError(f"SGLang response {i} has no meta_info.spec_verify_ct: is the server running with "
                            f"--speculative-algorithm EAGLE3?")
        toks += int(m.get("completion_tokens", 0))
        verify += int(m["spec_verify_ct"])
    if verify <= 0:
        raise EyasError("SGLang reported no verify steps (spec_verify_ct = 0 on every prompt); the server is not drafting")
    return {"acceptance_length": toks / verify, "counters": {"completion_tokens": toks, "spec_verify_ct": verify}}


def _sglang_run(endpoint: str, prompts: list[list[dict]], cfg, tokenizer) -> dict:
    from .data.tokenize import render

    metas = []
    for msgs in progress(prompts, desc="parity (sglang)", unit="prompt"):
        text = render(tokenizer, msgs, add_generation_prompt=True)
        r = _json(endpoint + "/generate",
                  {"text": text, "sampling_params": {"max_new_tokens": cfg.eval.max_new_tokens,
                                                     "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p}})
        metas.append(r.get("meta_info") or {})
    res = sglang_acceptance(metas)
    res.update(per_position_acceptance=None, k=None, completion_tokens=res["counters"]["completion_tokens"])
    return res


# ----------------------------------------------------------------------------- prompts and report

def eval_prompts(cfg) -> tuple[list[list[dict]], str]:
    """The evaluation prompts as chat messages (system/user turns before the first answer), from the
    same prompt set `eyas eval` uses (cfg.eval.prompts and cfg.eval.limit)."""
    from .evaluate import load_prompt_set

    name, convs = load_prompt_set(cfg)
    prompts = []
    for c in convs:
        msgs = []
        for t in c.turns:
            if t.role == "assistant":
                break
            msgs.append({"role": t.role, "content": t.content})
        if any(m["role"] == "user" for m in msgs):
            prompts.append(msgs)
    if not prompts:
        raise EyasError(f"eval.prompts {cfg.eval.prompts!r} gave no prompts")
    return prompts, name


def compare(engine_tau: float, eyas_tau: float | None, limit: float = GAP_LIMIT) -> dict:
    """gap = (eyas - engine) / eyas; |gap| > limit is flagged."""
    if eyas_tau is None or not eyas_tau or (isinstance(eyas_tau, float) and math.isnan(eyas_tau)):
        return {"gap": None, "flagged": None}
    gap = (eyas_tau - engine_tau) / eyas_tau
    return {"gap": gap, "flagged": abs(gap) > limit}


def run_parity(cfg, endpoint: str | None = None, engine: str | None = None, prompts=None, tokenizer=None) -> dict:
    """Send the eval prompts to `endpoint`, read `engine`'s acceptance counters, compare with
    <run>/eval/report.json and write <run>/eval/parity.json."""
    if not endpoint:
        raise EyasError("--endpoint is required (the base URL of the running server, e.g. http://127.0.0.1:8000)")
    if engine not in ("vllm", "sglang"):
        raise EyasError(f"--engine must be vllm or sglang, got {engine!r}")
    endpoint = endpoint.rstrip("/")
    if endpoint.endswith("/v1"):
        endpoint = endpoint[:-3]
    if prompts is None:
        prompts, source = eval_prompts(cfg)
    else:
        source = "given"
    if engine == "vllm":
        model = getattr(getattr(cfg, "regen", None), "model", "") or _vllm_model(endpoint)
        res = _vllm_run(endpoint, prompts, cfg, model)
    else:
        from .target import load_tokenizer

        res = _sglang_run(endpoint, prompts, cfg, tokenizer or load_tokenizer(cfg.target))

    run = Path(cfg.out)
    report_path = run / "eval" / "report.json"
    notes = []
    eyas_tau = None
    report = None
    if report_path.exists():
        try:
            report = json.loads(report_path.read_text())
        except json.JSONDecodeError as e:
            notes.append(f"{report_path}: line {e.lineno}: invalid JSON, eyas' own acceptance length unknown")
    else:
        notes.append(f"no eyas evaluation at {report_path}: run `eyas eval` with the same prompts and settings "
                     f"first; only the engine's acceptance length is reported")
    if report is not None:
        eyas_tau = report.get("acceptance_length")
        if eyas_tau is None:
            notes.append(f"{report_path} has no acceptance_length")
        if report.get("temperature") is not None and float(report["temperature"]) != float(cfg.eval.temperature):
            notes.append(f"eyas' report used temperature {report['temperature']}, parity used {cfg.eval.temperature}")
        k_engine = res.get("k")
        if report.get("k") is not None and k_engine and int(report["k"]) != int(k_engine):
            notes.append(f"eyas' report used k={report['k']}, the server drafts {k_engine} tokens")
        rp = report.get("prompts")
        if isinstance(rp, dict) and rp.get("count") is not None and int(rp["count"]) != len(prompts):
            notes.append(f"eyas' report covered {rp['count']} prompts, parity sent {len(prompts)}")
    cmp = compare(res["acceptance_length"], eyas_tau)
    if cmp["flagged"]:
        direction = "below" if cmp["gap"] > 0 else "above"
        verdict = (f"FLAGGED: {engine}'s acceptance length {res['acceptance_length']:.3f} is "
                   f"{abs(cmp['gap']) * 100:.1f}% {direction} eyas' {eyas_tau:.3f} (limit {GAP_LIMIT * 100:.0f}%): "
                   f"likely an integration fault (aux-layer ids, norm flags, vocabulary map, chat template)")
    elif cmp["flagged"] is False:
        verdict = (f"ok: {engine}'s acceptance length {res['acceptance_length']:.3f} is within "
                   f"{GAP_LIMIT * 100:.0f}% of eyas' {eyas_tau:.3f}")
    else:
        verdict = f"incomplete: {engine}'s acceptance length is {res['acceptance_length']:.3f}; eyas' own is unknown"
    out = {
        "engine": engine, "endpoint": endpoint, "prompts": {"set": source, "count": len(prompts)},
        "max_new_tokens": cfg.eval.max_new_tokens, "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p,
        "engine_acceptance_length": res["acceptance_length"],
        "engine_per_position_acceptance": res.get("per_position_acceptance"),
        "engine_k": res.get("k"), "engine_counters": res["counters"],
        "completion_tokens": res.get("completion_tokens"),
        "eyas_acceptance_length": eyas_tau,
        "eyas_per_position_acceptance": (report or {}).get("per_position_acceptance"),
        "gap": cmp["gap"], "gap_limit": GAP_LIMIT, "flagged": cmp["flagged"], "verdict": verdict, "notes": notes,
    }
    atomic_write_json(run / "eval" / "parity.json", out)
    return out
