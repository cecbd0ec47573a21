"""target.device_map: a target split over devices by transformers loads, captures and computes as the plain load
does (checked on the CPU, the one device here: every module on "cpu" by strategy and by name, and a map that sends
one decoder layer to disk, which accelerate dispatches with the same hooks that move states between GPUs); a split
target makes eyas' fast engine step aside for transformers' forward; bad settings stop with one line. The split
over several GPUs itself needs GPUs (docs/features.md says what was run where)."""
import json

import pytest
import torch

from eyas.config import TargetConfig
from eyas.device_map import devices_of, parse_device_map
from eyas.engine.fastlm import supported
from eyas.target import load_target
from eyas.util import EyasError


def _module_map(target) -> dict:
    """Every top-level piece of the tiny Llama placed by name, one entry per decoder layer."""
    m = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    m.update({f"model.layers.{i}": "cpu" for i in range(target.num_layers)})
    return m


@pytest.mark.parametrize("how", ["cpu", "modules", "disk"])
def test_device_mapped_target_equals_the_plain_load(tiny, how):
    m = _module_map(tiny)
    if how == "disk":
        m["model.layers.1"] = "disk"
    dm = "cpu" if how == "cpu" else json.dumps(m)
    split = load_target(TargetConfig(name="tiny", dtype="float32", device="cpu", device_map=dm))
    assert split.device == torch.device("cpu")
    assert devices_of(split.model) == ({"cpu", "disk"} if how == "disk" else set())  # dispatched with hooks, or not
    ids = tiny.tokenizer("The hawk circled twice over the valley before it dove.", return_tensors="pt").input_ids
    a1, f1 = tiny.capture(ids)
    a2, f2 = split.capture(ids)
    assert torch.equal(a1, a2) and torch.equal(f1, f2)
    assert torch.equal(tiny.model(input_ids=ids).logits, split.model(input_ids=ids).logits)
    assert supported(split.model)[0] == (how != "disk")  # on one device eyas' fast engine still runs it


def test_a_target_split_over_devices_leaves_the_fast_engine(tiny, monkeypatch):
    """What transformers records for a model spread over two GPUs (hf_device_map) makes FastLM decline, naming the
    devices, so the decoder and regen take transformers' forward."""
    monkeypatch.setattr(tiny.model, "hf_device_map", {"model.embed_tokens": 0, "model.layers.0": 0, "lm_head": 1},
                        raising=False)
    ok, why = supported(tiny.model)
    assert not ok and "split over 0, 1 (target.device_map)" in why


def test_bad_device_maps_are_refused(monkeypatch):
    assert parse_device_map(" auto ") == "auto"
    assert parse_device_map('{"model.layers.0": 1, "lm_head": "cuda:1"}') == {"model.layers.0": 1, "lm_head": "cuda:1"}
    with pytest.raises(EyasError, match=r"target.device_map 'gpus': give auto, balanced"):
        parse_device_map("gpus")
    with pytest.raises(EyasError, match=r"target.device_map '\{model': not a JSON object"):
        parse_device_map("{model")
    with pytest.raises(EyasError, match=r"expected module name -> device .*not one: 'lm_head'"):
        parse_device_map('{"lm_head": [0]}')
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(EyasError, match=r"target.device_map and target.tensor_parallel both split the target"):
        load_target(TargetConfig(name="tiny", device="cpu", device_map="cpu", tensor_parallel=True), allow_tp=True)


def test_a_split_target_decodes_losslessly_on_transformers_forward(tiny):
    """The eval's decoder on a target split by device_map (a layer on disk: accelerate's hooks, as between GPUs) takes
    transformers' forward and writes the plain load's greedy tokens, speculative or not."""
    from eyas.decode import Decoder
    from eyas.draft import build_drafter
    from eyas.evaluate import prompt_ids

    m = _module_map(tiny)
    m["model.layers.1"] = "disk"
    split = load_target(TargetConfig(name="tiny", dtype="float32", device="cpu", device_map=json.dumps(m)))
    torch.manual_seed(0)
    d = build_drafter(tiny, 512)
    ids = prompt_ids(tiny.tokenizer, [{"role": "user", "content": "Tell me about hawks."}])
    plain = Decoder(tiny, d, k=3, max_len=128).generate(ids, 16, (), speculative=False).tokens
    dec = Decoder(split, d, k=3, max_len=128)
    assert dec.engine == "hf"
    out = dec.generate(ids, 16, (), speculative=True)
    assert out.tokens == plain and len(out.accepted) > 0
