"""The decoder's target runners: the target over one sequence with a cache a speculative decoder can roll back, on
eyas' own forward (FastTargetRunner) or on transformers with a StaticCache (TargetRunner, for the architectures
FastLM does not run). Both take ids at consecutive positions and return the logits and the aux states."""
from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from ..target import decoder_layers
from .fastlm import FastLM


class FastTargetRunner:
    """The target on eyas' static-cache forward (one row): no cache pointer to move, a query at
    position p sees slots 0..p, so rollback is free."""

    def __init__(self, target, max_len: int):
        self.lm = FastLM(target.model, 1, max_len, target.aux_layers)

    def close(self) -> None:
        pass

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, last_only: bool = False, upto: int | None = None,
                one_off: bool = False):
        """ids [1, T] at positions pos [T] (consecutive) -> (logits [1, T or 1, V], aux [1, T, 3H]);
        attends to the first `upto` cache slots (None: all); one_off: a prompt prefill (see FastLM)."""
        return self.lm.forward(ids, pos[:1], last_only=last_only, want_aux=True, upto=upto, one_off=one_off)


class TargetRunner:
    """The target with a preallocated transformers StaticCache and pre-hooks that grab the aux
    states (the residual streams entering the aux layers) of every forward pass (for
    architectures eyas.engine.fastlm does not run)."""

    def __init__(self, target, max_len: int):
        self.target = target
        self.model = target.model
        self.max_len = max_len
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        # sliding-window layers (Gemma 3, gpt-oss) get full-length caches too: a window's cache is a ring that the
        # rejected drafts overwrite, so a rollback would lose keys still in the window; the attention mask, built
        # from positions, keeps each such layer within its window all the same
        self.cache.layers = [StaticLayer(max_cache_len=max_len) for _ in self.cache.layers]
        self._grab: dict[int, torch.Tensor] = {}
        self._handles = []
        layers = decoder_layers(self.model)
        n = len(layers)
        grab = self._grab

        def pre_hook(idx):
            def fn(module, args, kwargs):
                grab[idx] = args[0] if args else kwargs["hidden_states"]
            return fn

        for a in sorted(set(target.aux_layers)):
            mod = layers[a] if a < n else self.model.get_decoder().norm
            self._handles.append(mod.register_forward_pre_hook(pre_hook(a), with_kwargs=True))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __del__(self):
        self.close()

    def set_length(self, n) -> None:
        """Move the cache's write pointer to `n` tokens (an int or a 0-d tensor; a rollback when n is
        smaller). Entries past it are stale and masked by position until they are overwritten."""
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(n)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, last_only: bool = False, upto: int | None = None,
                one_off: bool = False):
        """ids [1, T] at positions pos [T] (consecutive) -> (logits [1, T or 1, V], aux [1, T, 3H]).
        (`upto` and `one_off` are ignored: transformers' cache attends to all of its slots.)"""
        self.set_length(pos[0])
        out = self.model(input_ids=ids, position_ids=pos[None], past_key_values=self.cache, use_cache=True,
                         logits_to_keep=1 if last_only else 0)
        aux = torch.cat([self._grab[a] for a in self.target.aux_layers], dim=-1)
        return out.logits, aux
