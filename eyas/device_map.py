"""`target.device_map`: a target larger than one GPU split over the node's devices by transformers (accelerate's
`device_map`), whole layers per device, run in one process. transformers' hooks move each layer's input to its
device, so eyas' stages see one model: inputs go to the embedding's device, and captures gather their states there.
eyas' own fast engine runs a model on one device, so decoding and regeneration of a split target take transformers'
forward (eyas.engine.fastlm.supported says why)."""
from __future__ import annotations

import json

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
