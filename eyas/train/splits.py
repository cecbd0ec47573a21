"""The data a training reads: the train and validation splits with their features, the target's greedy answers to
validation prompts (`greedy_tau`, eyas.train.greedyval), the online feature caches' budgets, and the warm-up that fills
them before the first step."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import Config
from ..data.prepare import TokenSet, load_tokens, tokens_dir
from ..features import OnlineFeatures, feature_cache_budget, host_cache_budget, train_step_bytes
from ..util import EyasError, atomic_write_json, human_bytes, log
from .batches import Data, make_features
from .dist import Dist
from .greedyval import greedy_val_set


@dataclass
class Splits:
    train: Data
    val: Data | None  # None: the run has no validation split
    greedy: Data | None  # the target's greedy answers to validation prompts, when train.greedy_val asks for them
    cached: bool  # the training split's online features are kept after their first computation

    def all(self) -> list[Data]:
        return [s for s in (self.train, self.val, self.greedy) if s is not None]


def load_splits(cfg: Config, d: Dist, target, draft_ids, max_len: int) -> Splits:
    """The run's splits as the trainer reads them; an empty training split, or train.best_by=greedy_tau without the
    greedy answers it needs, is refused."""
    tc = cfg.train
    run = Path(cfg.out)
    fp32 = tc.precision == "fp32"
    train_tokens, val_tokens = load_tokens(run, "train"), load_tokens(run, "val")
    cache, host = cache_budgets(cfg, target, int(draft_ids.numel()), train_tokens, val_tokens)
    train = Data(train_tokens, make_features(cfg, target, train_tokens, "train", cache["train"], host["train"]),
                 max_len, tc.batch_tokens, fp32, all_positions=tc.loss_positions == "all")
    val = Data(val_tokens, make_features(cfg, target, val_tokens, "val", cache["val"], host["val"]), max_len,
               tc.batch_tokens, fp32) if len(val_tokens) else None
    if len(train.tokens) == 0:
        raise EyasError(f"{tokens_dir(run)}: the training split is empty")
    if tc.best_by == "greedy_tau" and tc.greedy_val <= 0:
        raise EyasError("train.best_by=greedy_tau picks the best checkpoint by the forecast on the target's greedy "
                        "answers, which train.greedy_val=0 turns off: set train.greedy_val above 0 or choose "
                        "train.best_by=val_tau or val_al")
    greedy = greedy_split(cfg, d, target, val_tokens, max_len) if tc.greedy_val > 0 and len(val_tokens) else None
    return Splits(train, val, greedy, bool(cache["train"] or host["train"]))


def cache_budgets(cfg: Config, target, draft_vocab: int, train_tokens: TokenSet,
                  val_tokens: TokenSet) -> tuple[dict, dict]:
    """Bytes of device memory and of host memory each split's online features may be kept in ({split: bytes} twice):
    the budgets split between the splits by their tokens; none with stored features."""
    tc = cfg.train
    cache = {"train": 0, "val": 0}
    host = dict(cache)
    if not tc.online:
        return cache, host
    budget = feature_cache_budget(tc.feature_cache_gb, target.device,
                                  train_step_bytes(tc.batch_tokens, tc.ttt_steps, draft_vocab))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    host_budget = host_cache_budget(tc.feature_cache_host_gb, target.device, local_processes=local)
    n_tok = {k: max(1, int(t.lengths().sum())) for k, t in (("train", train_tokens), ("val", val_tokens))}
    cache = {k: budget * n / sum(n_tok.values()) for k, n in n_tok.items()}
    host = {k: host_budget * n / sum(n_tok.values()) for k, n in n_tok.items()}
    if budget or host_budget:
        log(f"train: online features kept after their first computation, in {target.device} memory up to "
            f"{human_bytes(budget)}" + (f", then in host memory up to {human_bytes(host_budget)}"
                                        if host_budget else ""))
    return cache, host


def greedy_split(cfg: Config, d: Dist, target, val_tokens: TokenSet, max_len: int) -> Data | None:
    """The target's greedy answers to the first validation prompts as a split (their features computed as they are
    needed, with stored features too); None when they could not be made, which is reported beside the training
    (train/greedy_val_error.json) while it goes on."""
    tc = cfg.train
    run = Path(cfg.out)
    n_new = cfg.eval.max_new_tokens
    gen_tokens = 65536 if target.device.type == "cuda" else 4096
    g_tokens, err = None, run / "train" / "greedy_val_error.json"
    if d.main:  # a measurement beside the training: its failure is reported, the training goes on
        err.unlink(missing_ok=True)
        try:
            g_tokens = greedy_val_set(run, target, val_tokens, tc.greedy_val, n_new, max_len, gen_tokens)
        except Exception as e:  # noqa: BLE001
            failed = f"{type(e).__name__}: {e}"
            log(f"train: WARNING: the greedy validation answers could not be made ({failed}); training goes on "
                f"without greedy_tau")
            err.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(err, {"error": failed})
    d.barrier()
    if not d.main and not err.exists():  # the main process's answers, read back
        g_tokens = greedy_val_set(run, target, val_tokens, tc.greedy_val, n_new, max_len, gen_tokens)
    if g_tokens is None or not len(g_tokens):
        return None
    feats = OnlineFeatures(target, g_tokens, max_batch_tokens=max(cfg.features.batch_tokens, tc.batch_tokens),
                           norm=cfg.features.norm)
    return Data(g_tokens, feats, max_len, tc.batch_tokens, tc.precision == "fp32")


def warm_features(cfg: Config, d: Dist, train: Data, group: int) -> dict:
    """This process's training sequences through the target ahead of the first step, extraction-sized, into the
    feature caches; what it computed and kept, for the summary."""
    tc = cfg.train
    mine_seqs = [i for i in range(len(train.tokens)) if i % group // tc.grad_accum == d.rank]
    t_w = time.perf_counter()
    n_kept = train.features.warm(mine_seqs, cfg.features.batch_tokens, keep=tc.feature_cache_keep)
    dt = time.perf_counter() - t_w
    n_tok = train.features.warm_tokens  # those computed: the warm-up stops once the budgets are full
    on_host = len(train.features.host_cache)
    log(f"train: target features of {n_kept} of {len(mine_seqs)} sequences computed ahead and kept"
        + (f" ({on_host} of them in host memory)" if on_host else "") + ", "
        f"{dt:.1f} s ({n_tok / dt:,.0f} tok/s)")
    return {"sequences": n_kept, "of": len(mine_seqs), "seconds": round(dt, 2), "tok_s": round(n_tok / dt, 1),
            "host_sequences": on_host, "keep": tc.feature_cache_keep}
