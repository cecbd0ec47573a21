"""Reading offline feature shards: OfflineFeatures yields the samples `eyas extract` wrote, each shard's bytes checked
against the sha256 its index records.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..util import EyasError, read_json, sha256_file
from .online import Sample
from .shards import FORMAT, STORE_DTYPES, dequantize_fp8


def _is_feature_manifest(path: Path) -> bool:
    try:
        return read_json(path).get("format") == FORMAT
    except (OSError, EyasError):
        return False


# shards whose bytes this process has checked against their recorded sha256: (path, size, mtime, sha256)
_VERIFIED: set[tuple[str, int, int, str]] = set()
_VERIFIED_LOCK = threading.Lock()


class OfflineFeatures:
    """Features read from the shards `eyas extract` wrote. `path` is a run directory, its
    `features/` folder or one split's folder. With `target` (a Target or its identity dict) the
    manifest must name the same target. fp8 features come back dequantized to `dtype` (default
    bf16); bf16 and fp32 ones in their stored dtype unless `dtype` says otherwise. Sizes and headers
    are checked on opening; each shard's bytes are checked against the sha256 index.json records the
    first time this process reads from it (a shard is at most MAX_SHARD_BYTES: a fraction of a second),
    or of every shard on opening with `verify=True`."""

    def __init__(self, path: str | os.PathLike, split: str = "train", target=None,
                 dtype: torch.dtype | None = None, verify: bool = False):
        p = Path(path)
        for cand in (p / "features" / split, p / split, p):
            # the run's own manifest.json is not a feature manifest: only the canonical folder is taken on its name
            if (cand / "manifest.json").exists() and (cand == p / "features" / split
                                                      or _is_feature_manifest(cand / "manifest.json")):
                d = cand
                break
        else:
            raise EyasError(f"{p}: no extracted features for split '{split}' (run `eyas extract --out RUN` first)")
        self.dir = d
        man_path = d / "manifest.json"
        self.manifest = read_json(man_path)
        if self.manifest.get("format") != FORMAT:
            raise EyasError(f"{man_path}: not an eyas feature manifest (format {self.manifest.get('format')!r})")
        if not self.manifest.get("complete"):
            raise EyasError(f"{man_path}: extraction did not finish; run the same `eyas extract` again to resume it")
        if target is not None:
            want = target if isinstance(target, dict) else target.identity()
            have = self.manifest["target"]
            if any(have.get(k) != want.get(k) for k in ("sha256", "hidden_size", "aux_layers", "num_layers")):
                raise EyasError(f"{man_path}: features were extracted from target {have.get('name')} "
                                f"(sha256 {have.get('sha256')}, aux layers {have.get('aux_layers')}), not "
                                f"{want.get('name')} (sha256 {want.get('sha256')}, aux layers {want.get('aux_layers')})")
        self.dtype = self.manifest["dtype"]
        self.out_dtype = dtype or (torch.bfloat16 if self.dtype == "fp8" else STORE_DTYPES[self.dtype])
        index = read_json(d / "index.json")
        n = self.manifest["sequences"]
        self._files, self._offsets, self._keys = [], [], []
        self._shards = [(d / e["file"], e.get("sha256")) for e in index["shards"]]
        self._checked = [False] * len(self._shards)
        self._locks = [threading.Lock() for _ in self._shards]  # read-ahead threads: one hash of each shard
        self._loc = torch.full((n, 2), -1, dtype=torch.long)
        for s, e in enumerate(index["shards"]):
            f = d / e["file"]
            if not f.exists():
                raise EyasError(f"{f}: feature shard missing; run `eyas extract` again to rebuild it")
            size = f.stat().st_size
            if size != e["bytes"]:
                raise EyasError(f"{f}: shard is truncated or modified ({size:,} bytes, index.json says "
                                f"{e['bytes']:,}); delete it and run `eyas extract` again")
            if verify:
                self._verify(s)
            try:
                h = safe_open(str(f), "pt")
                seq_index = h.get_tensor("seq_index")
                offsets = h.get_tensor("offsets")
            except (SafetensorError, OSError) as err:
                raise EyasError(f"{f}: shard is corrupt ({err}); delete it and run `eyas extract` again") from None
            self._files.append(h)
            self._keys.append(set(h.keys()))
            self._offsets.append(offsets)
            self._loc[seq_index, 0] = s
            self._loc[seq_index, 1] = torch.arange(seq_index.numel())
        if (self._loc[:, 0] < 0).any():
            missing = int((self._loc[:, 0] < 0).sum())
            raise EyasError(f"{d / 'index.json'}: {missing} of {n} sequences are in no shard; run `eyas extract` again")

    def _verify(self, s: int) -> None:
        """Shard s's bytes against the sha256 index.json recorded when it was written, once per process: a byte
        flipped on the disk or in a copy would otherwise train unnoticed."""
        if self._checked[s]:
            return
        f, want = self._shards[s]
        with self._locks[s]:
            st = f.stat()
            key = (str(f.resolve()), st.st_size, st.st_mtime_ns, str(want))
            with _VERIFIED_LOCK:
                done = key in _VERIFIED
            if not done and want is not None:
                if sha256_file(f) != want:
                    raise EyasError(f"{f}: shard is corrupt (its sha256 is not the one {self.dir / 'index.json'} "
                                    f"records); delete it and run the same `eyas extract` again, which remakes the "
                                    f"missing shard and keeps the others")
                with _VERIFIED_LOCK:
                    _VERIFIED.add(key)
            self._checked[s] = True

    def __len__(self) -> int:
        return int(self._loc.shape[0])

    @property
    def carries_top(self) -> bool:
        """Whether every shard stores the target's top token (shards written before eyas stored it do not)."""
        return all("top" in k for k in self._keys)

    @property
    def lengths(self) -> torch.Tensor:
        out = torch.empty(len(self), dtype=torch.long)
        for s, off in enumerate(self._offsets):
            rows = (self._loc[:, 0] == s).nonzero().flatten()
            out[rows] = (off[1:] - off[:-1])[self._loc[rows, 1]]
        return out

    def get(self, indices: list[int]) -> list[Sample]:
        out = []
        for i in indices:
            s, r = (int(v) for v in self._loc[i])
            self._verify(s)
            f = self._files[s]
            a, b = int(self._offsets[s][r]), int(self._offsets[s][r + 1])
            aux, final = f.get_slice("aux")[a:b], f.get_slice("final")[a:b]
            if self.dtype == "fp8":
                aux = dequantize_fp8(aux, f.get_slice("aux_scale")[a:b], self.out_dtype)
                final = dequantize_fp8(final, f.get_slice("final_scale")[a:b], self.out_dtype)
            else:
                aux, final = aux.to(self.out_dtype), final.to(self.out_dtype)
            ids = f.get_slice("input_ids")[a:b].long()
            mask = f.get_slice("loss_mask")[a:b].bool()
            top = f.get_slice("top")[a:b] if "top" in self._keys[s] else None
            out.append(Sample(ids, mask, aux, final, top))
        return out
