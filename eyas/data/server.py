"""The server backend of `eyas regen`: any OpenAI-compatible chat-completions endpoint (vLLM, SGLang,
llama.cpp, a hosted API), stdlib only.

Requests go out from `concurrency` worker threads, spread round-robin over the endpoints (a retry
moves on to the next one). 429, 5xx, connection errors, timeouts and unreadable answers are retried
with exponential backoff (429's Retry-After is honoured). A request that still fails on a
transport-level error marks the endpoints as down: the driver stops, keeping finished shards. Other
4xx answers (a prompt too long for the server, say) and answers that stay unreadable fail only that
conversation. The API key comes from an environment variable and is never logged.
"""
from __future__ import annotations

import json
import os
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.client import HTTPException

from ..config import RegenConfig, TargetConfig
from ..engine.turn import TurnResult
from ..util import EyasError, log
from .conversation import split_reasoning


def chat_url(endpoint: str) -> str:
    """A base URL (http://host:8000, .../v1) or a full chat-completions URL -> the chat-completions URL."""
    e = endpoint.strip().rstrip("/")
    if not e.startswith(("http://", "https://")):
        raise EyasError(f"regen.endpoint {endpoint!r}: expected an http:// or https:// URL")
    if e.endswith("/chat/completions"):
        return e
    if e.endswith("/v1"):
        return e + "/chat/completions"
    return e + "/v1/chat/completions"


class _Retry(Exception):
    def __init__(self, kind: str, msg: str, wait: float | None = None):
        super().__init__(msg)
        self.kind, self.wait = kind, wait


class _Fail(Exception):
    def __init__(self, kind: str, msg: str):
        super().__init__(msg)
        self.kind = kind


class ServerBackend:
    """submit(rid, messages, seed) / poll(timeout) -> [TurnResult] / close(), like the embedded engines."""

    def __init__(self, rc: RegenConfig, target: TargetConfig | None = None):
        if not rc.endpoint:
            raise EyasError("regen.backend is 'server' but no endpoint is set (--endpoint http://host:port/v1)")
        self.urls = [chat_url(e) for e in rc.endpoint]
        self.rc = rc
        self.key = os.environ.get(rc.api_key_env, "") if rc.api_key_env else ""
        self.template_kwargs = template_kwargs(rc)  # before anything is asked of the server
        self.model = rc.model or self._first_model()
        self.target, self._tok = target, None  # the target's tokenizer, loaded for the first answer to cap
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self._next = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(max(1, rc.concurrency))]
        for t in self.threads:
            t.start()

    @property
    def window(self) -> int:
        return 2 * max(1, self.rc.concurrency)

    def describe(self) -> dict:
        return {"backend": "server", "model": self.model, "endpoints": len(self.urls)}

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.key:
            h["Authorization"] = f"Bearer {self.key}"
        return h

    def _first_model(self) -> str:
        url = self.urls[0].rsplit("/chat/completions", 1)[0] + "/models"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=self._headers()),
                                        timeout=self.rc.timeout) as r:
                data = json.loads(r.read())
            return str(data["data"][0]["id"])
        except urllib.error.URLError as e:
            if not isinstance(e, urllib.error.HTTPError):  # nothing answered there at all
                raise EyasError(f"cannot reach the server at {url} ({e.reason}): is it running, and is "
                                f"--endpoint its address?") from None
            raise EyasError(f"regen.model is not set and {url} answered HTTP {e.code}; pass --model NAME") from None
        except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
            raise EyasError(f"regen.model is not set and {url} did not name a model ({type(e).__name__}: {e}); "
                            f"pass --model NAME") from None

    def submit(self, rid: str, messages: list[dict], seed: int) -> None:
        self.inbox.put((rid, messages, seed))

    def poll(self, timeout: float) -> list[TurnResult]:
        out = []
        try:
            out.append(self.outbox.get(timeout=timeout))
            while True:
                out.append(self.outbox.get_nowait())
        except queue.Empty:
            pass
        for r in out:
            self._cap(r)
        return out

    def _cap(self, r: TurnResult) -> None:
        """Cut an answer longer than regen.max_new_tokens (a server that ignores max_tokens) to that many tokens of
        the target's tokenizer, reasoning first, and count it as cut at the length limit. A byte-level tokenizer
        makes at most one token of a byte, so only an answer of more UTF-8 bytes than the limit is tokenized (in the
        driver's thread)."""
        limit = self.rc.max_new_tokens
        size = len(r.content.encode("utf-8", "replace")) + len((r.reasoning or "").encode("utf-8", "replace"))
        if r.error or (r.completion_tokens <= limit and size <= limit):
            return
        if self._tok is None:
            self._tok = _tokenizer_or_none(self.target)
        budget, cut = limit, False
        if r.reasoning:
            r.reasoning, n, c = cap_text(r.reasoning, budget, self._tok)
            budget, cut = budget - n, c
        r.content, n, c = cap_text(r.content, budget, self._tok)
        if cut or c:
            r.finish_reason = "length"
            r.completion_tokens = limit - budget + n
        elif r.completion_tokens > limit:  # the server's count of its own tokens, not the target's
            r.completion_tokens = limit - budget + n

    def close(self) -> None:
        for _ in self.threads:
            self.inbox.put(None)

    def _worker(self) -> None:
        while True:
            item = self.inbox.get()
            if item is None:
                return
            rid, messages, seed = item
            try:
                res = self._complete(rid, messages, seed)
            except Exception as e:  # noqa: BLE001 - a bug here must not hang the driver
                res = TurnResult(rid, error="internal", message=f"{type(e).__name__}: {e}", fatal=True)
            self.outbox.put(res)

    def _complete(self, rid: str, messages: list[dict], seed: int) -> TurnResult:
        rc = self.rc
        body = {"model": self.model, "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                "max_tokens": rc.max_new_tokens, "temperature": rc.temperature, "top_p": rc.top_p,
                "seed": seed, "n": 1, "stream": False}
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs
        data = json.dumps(body).encode("utf-8")
        retries: Counter = Counter()
        with self._lock:
            start = self._next
            self._next += 1
        last = ("", "")
        for attempt in range(rc.retries + 1):
            url = self.urls[(start + attempt) % len(self.urls)]
            try:
                res = self._post(url, data)
                res.rid, res.retries = rid, retries
                return res
            except _Fail as f:
                return TurnResult(rid, error=f.kind, message=f"{url}: {f}", retries=retries)
            except _Retry as r:
                last = (r.kind, f"{url}: {r}")
                if attempt == rc.retries:
                    break
                retries[r.kind] += 1
                delay = r.wait if r.wait is not None else min(60.0, rc.backoff * 2 ** attempt)
                time.sleep(delay * (0.75 + 0.5 * random.random()) if r.wait is None else delay)
        kind, msg = last
        # an answer that stays unreadable fails this conversation; a server that stays unreachable or
        # overloaded stops the run
        return TurnResult(rid, error=kind, message=f"{msg} (after {rc.retries} retries)", retries=retries,
                          fatal=kind != "bad_response")

    def _post(self, url: str, data: bytes) -> TurnResult:
        req = urllib.request.Request(url, data=data, headers=self._headers(), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.rc.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode("utf-8", "replace") if e.fp else ""
            if e.code == 429 or e.code >= 500:
                wait = None
                ra = e.headers.get("Retry-After") if e.headers else None
                if ra:
                    try:
                        wait = min(60.0, max(0.0, float(ra)))
                    except ValueError:
                        wait = None
                raise _Retry(f"http_{e.code}", f"HTTP {e.code} {detail}".strip(), wait) from None
            raise _Fail(f"http_{e.code}", f"HTTP {e.code} {detail}".strip()) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise _Retry("timeout", f"no answer within {self.rc.timeout:g}s") from None
            raise _Retry("connection", f"cannot connect ({e.reason})") from None
        except TimeoutError:
            raise _Retry("timeout", f"no answer within {self.rc.timeout:g}s") from None
        except (ConnectionError, HTTPException, OSError) as e:
            raise _Retry("connection", f"connection failed ({type(e).__name__}: {e})") from None
        return parse_chat_response(raw)


def template_kwargs(rc: RegenConfig) -> dict:
    """regen.chat_template_kwargs as a dict ({} when unset); a clear error when it is not a JSON object."""
    text = rc.chat_template_kwargs.strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise EyasError(f"regen.chat_template_kwargs {text!r} is not valid JSON ({e}); give an object such as "
                        f"'{{\"enable_thinking\": true}}'") from None
    if not isinstance(value, dict):
        raise EyasError(f"regen.chat_template_kwargs must be a JSON object (names to values), got {text!r}")
    return value


def _tokenizer_or_none(target: TargetConfig | None):
    """The target's tokenizer, or None (answers are then cut at 4 characters a token) where it cannot be loaded."""
    if target is None:
        return None
    from ..target import load_tokenizer

    try:
        return load_tokenizer(target)
    except Exception as e:  # noqa: BLE001 - cutting by characters still bounds what the server sent
        log(f"regen: the server sent an answer longer than regen.max_new_tokens and the target's tokenizer could not "
            f"be loaded to cut it ({type(e).__name__}: {e}); cutting answers at 4 characters a token")
        return None


def cap_text(text: str, limit: int, tok) -> tuple[str, int, bool]:
    """`text` cut to at most `limit` tokens of `tok` (None: 4 characters a token) -> (text, its tokens, whether it
    was cut). Only the first 16 characters a token are read, so a huge answer costs no more than a short one."""
    if limit <= 0:
        return "", 0, bool(text)
    if tok is None:
        return text[: 4 * limit], min(limit, -(-len(text) // 4)), len(text) > 4 * limit
    head = text[: 16 * limit]
    ids = tok(head, add_special_tokens=False).input_ids
    if len(ids) <= limit:
        return head, len(ids), len(head) < len(text)
    return tok.decode(ids[:limit]), limit, True


def parse_chat_response(raw: bytes) -> TurnResult:
    """An OpenAI chat-completions answer -> TurnResult; reasoning from `reasoning_content`, `reasoning`
    or inline think markers. Unreadable answers raise _Retry('bad_response')."""
    try:
        d = json.loads(raw)
        choice = d["choices"][0]
        msg = choice["message"]
        content = msg.get("content")
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if content is None and not reasoning:  # a refusal or tool call, not an answer
            raise TypeError("the message's content is null")
        content = content or ""
        if not isinstance(content, str):
            raise TypeError("content is not a string")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise _Retry("bad_response", f"unreadable answer ({type(e).__name__}: {str(e)[:100]}; "
                     f"the answer began {raw[:80].decode('utf-8', 'replace')!r})") from None
    if not isinstance(reasoning, str) or not reasoning.strip():
        reasoning = None
    answer, inline = split_reasoning(content)
    if reasoning is None:
        reasoning = inline
    usage = d.get("usage") if isinstance(d.get("usage"), dict) else {}
    finish = choice.get("finish_reason") or "stop"
    return TurnResult("", content=answer, reasoning=reasoning.strip() if reasoning else None, finish_reason=finish,
                      prompt_tokens=int(usage.get("prompt_tokens") or 0),
                      completion_tokens=int(usage.get("completion_tokens") or 0))
