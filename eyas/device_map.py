"""`target.device_map`: a target larger than one GPU split over the node's devices by transformers (accelerate's
`device_map`), whole layers per device, run in one process. transformers' hooks move each layer's input to its
device, so eyas' stages see one model: inputs go to the embedding's device, and captures gather their states there.
eyas' own fast engine runs a model on one device, so decoding and regeneration of a split target take transformers'
forward (eyas.engine.fastlm.supported says why)."""
from __future__ import annotations

import json
import re

import torch

from .util import EyasError

NAMED = ("auto", "balanced", "balanced_low_0", "sequential", "cpu")


def parse_device_map(value: str):
    """The setting -> what from_pretrained's device_map takes: a strategy name (auto, balanced, balanced_low_0,
    sequential), "cpu", or a JSON object of module name -> device ("cuda:0", 0, "cpu", "disk")."""
    v = value.strip()
    if v in NAMED:
        return v
    if v.startswith("{"):
        try:
            m = json.loads(v)
        except ValueError as e:
            raise EyasError(f"target.device_map {value!r}: not a JSON object ({e})") from None
        bad = [k for k, d in m.items() if not isinstance(k, str) or not isinstance(d, (str, int))]
        if not m or bad:
            raise EyasError(f"target.device_map {value!r}: expected module name -> device (\"cuda:0\", 0, \"cpu\")"
                            + (f"; not one: {bad[0]!r}" if bad else ""))
        return m
    raise EyasError(f"target.device_map {value!r}: give {', '.join(NAMED)} or a JSON object of module name -> device")


def devices_of(model) -> set[str]:
    """The devices a model loaded with a device_map is spread over (empty for a model placed whole)."""
    m = getattr(model, "hf_device_map", None) or {}
    return {str(d) for d in m.values()}


def is_split(model) -> bool:
    return len(devices_of(model)) > 1


def layer_shares(model) -> dict[torch.device, float]:
    """Each device a split model runs on (not "disk") and the share of its decoder layers there, whose KV cache that
    device keeps: 0 for one holding only the embedding or the head. A map that names no single layer (whole stacks
    per device) gives every device 1, the most it could hold. Empty for a model placed whole."""
    m = getattr(model, "hf_device_map", None) or {}
    devs = {str(d): torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
            for d in m.values() if str(d) != "disk"}
    layers = [str(d) for name, d in m.items() if re.search(r"(^|\.)layers\.\d+$", name)]
    if len(devs) < 2:
        return {}
    return {dev: (layers.count(key) / len(layers) if layers else 1.0) for key, dev in devs.items()}
