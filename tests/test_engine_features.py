"""Features read from vLLM's hidden-state extraction (eyas.engine_features): files written here in the exact format
of vLLM's ExampleHiddenStatesConnector (and hs_connectors' FP8 one) from a tiny random target's own transformers
forward become the same shards `eyas extract` writes for the same conversations, and training runs from them; the
same through a server speaking vLLM's /v1/completions protocol; bad files are refused naming the file and what is
wrong."""
import json
import shutil
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eyas.config import TargetConfig
from eyas.engine_features import run_engine_extract
from eyas.features import OfflineFeatures, run_extract
from eyas.target import load_target
from eyas.util import EyasError, read_json
from test_families import make_target, tokenizer_dir  # noqa: F401  (a fixture)
from test_features import shard_hashes, tiny_cfg, write_tokens


@torch.no_grad()
def engine_states(model, ids: torch.Tensor, aux_layers: list[int]) -> torch.Tensor:
    """What vLLM stacks for layer ids aux + [N], in layer order, each id once: transformers' hidden_states[k] for id
    k < N (the stream entering layer k) and the last layer's output before the final norm for N, [T, 4 (or 3), H]."""
    n = model.config.num_hidden_layers
    grab = {}
    norm = model.get_decoder().norm
    h = norm.register_forward_pre_hook(lambda m, a: grab.__setitem__("x", a[0]))
    try:
        out = model(input_ids=ids[None], output_hidden_states=True)
    finally:
        h.remove()
    return torch.stack([out.hidden_states[k][0] if k < n else grab["x"][0] for k in sorted(set(aux_layers) | {n})],
                       dim=1)


def write_vllm_file(path: Path, model, ids: torch.Tensor, aux_layers: list[int], dtype=torch.float32,
                    fp8: bool = False) -> None:
    """One file as vLLM's connector saves it (safetensors save_file, no metadata; a .lock beside it), or with fp8 as
    hs_connectors' FP8HiddenStatesConnector does (one float32 scale per token over all layers)."""
    hs = engine_states(model, ids, aux_layers).to(dtype)
    tensors = {"hidden_states": hs.contiguous(), "token_ids": ids.to(torch.int64)}
    if fp8:
        amax = hs.float().abs().amax(dim=(1, 2), keepdim=True)
        scale = (amax / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
        tensors.update(hidden_states=(hs.float() / scale).to(torch.float8_e4m3fn), hidden_states_scales=scale)
    save_file(tensors, str(path))
    Path(str(path) + ".lock").touch()


def all_sequences(run: Path, split: str):
    from eyas.data.prepare import load_tokens

    return load_tokens(run, split)


def engine_folder(run: Path, target, folder: Path, names: str = "vllm", skip: torch.Tensor | None = None,
                  **kw) -> None:
    """Files for every train and val sequence of `run` (but the one of tokens `skip`), named as vLLM names them
    (request ids) or as speculators' generate-offline-data renames them (hs_<i>)."""
    folder.mkdir(parents=True, exist_ok=True)
    k = 0
    for split in ("val", "train"):  # any order: files are matched by their tokens
        toks = all_sequences(run, split)
        for i in range(len(toks)):
            if skip is not None and torch.equal(toks[i][0].long(), skip):
                continue
            name = f"cmpl-{uuid.uuid4().hex}-0.safetensors" if names == "vllm" else f"hs_{k}.safetensors"
            write_vllm_file(folder / name, target.model, toks[i][0].long(), target.aux_layers, **kw)
            k += 1


def same_features(a: Path, b: Path, atol: float) -> None:
    for split in ("train", "val"):
        fa, fb = OfflineFeatures(a, split, verify=True), OfflineFeatures(b, split, verify=True)
        assert len(fa) == len(fb)
        idx = list(range(len(fa)))
        for x, y in zip(fa.get(idx), fb.get(idx)):
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
            torch.testing.assert_close(y.aux, x.aux, rtol=0, atol=atol)
            torch.testing.assert_close(y.final, x.final, rtol=0, atol=atol)
            assert torch.equal(x.top, y.top)
        ia, ib = read_json(fa.dir / "index.json"), read_json(fb.dir / "index.json")
        # the same plan: the same shards holding the same sequences and tokens
        assert [(e["file"], e["sequences"], e["tokens"]) for e in ia["shards"]] == \
               [(e["file"], e["sequences"], e["tokens"]) for e in ib["shards"]]


def engine_run(ref: Path, run: Path) -> None:
    """A run directory with the same tokens as `ref` (what tokenize wrote) and no features."""
    shutil.copytree(ref / "data", run / "data")


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """The tiny target and a run it extracted in-process (fp32), the reference the engine's shards must equal."""
    tiny = load_target(TargetConfig(name="tiny", dtype="float32", device="cpu"))
    ref = tmp_path_factory.mktemp("ref")
    write_tokens(ref, tiny, 6, 64)
    run_extract(tiny_cfg(ref, dtype="fp32", shard_tokens=128), tiny)
    return tiny, ref


def test_vllm_files_become_the_shards_eyas_extract_writes_and_train(extracted, tmp_path):
    from eyas.train import run_train
    from eyas.vocab import run_vocab

    tiny, ref = extracted
    engine_folder(ref, tiny, tmp_path / "hs")
    run = tmp_path / "run"
    engine_run(ref, run)
    res = run_engine_extract(tiny_cfg(run, dtype="fp32", shard_tokens=128, from_vllm=str(tmp_path / "hs")))
    assert res["engine"]["files"] == 8 and [s["reused_shards"] for s in res["splits"]] == [0, 0]
    same_features(ref, run, atol=1e-5)
    man = read_json(run / "features" / "train" / "manifest.json")
    assert man["source"] == {"engine": "vllm"} and man["engine"]["layer_ids"] == [*tiny.aux_layers, tiny.num_layers]
    # run again: every shard is reused, nothing is read; a shard lost is read again, the same bytes
    before = shard_hashes(run)
    again = run_engine_extract(tiny_cfg(run, dtype="fp32", shard_tokens=128, from_vllm=str(tmp_path / "hs")))
    assert [s["extracted_tokens"] for s in again["splits"]] == [0, 0]
    lost = run / "features" / "train" / "shard-000-00001.safetensors"
    n_lost = read_json(run / "features" / "train" / "index.json")["shards"][1]["tokens"]
    lost.unlink()
    again = run_engine_extract(tiny_cfg(run, dtype="fp32", shard_tokens=128, from_vllm=str(tmp_path / "hs")))
    assert [s["extracted_tokens"] for s in again["splits"]] == [n_lost, 0] and shard_hashes(run) == before
    # an in-process extraction into the same folder does not mix its shards with the engine's
    with pytest.raises(EyasError, match=r"manifest.json: features were extracted with other settings \(source"):
        run_extract(tiny_cfg(run, dtype="fp32", shard_tokens=128), tiny)
    # and training reads them as its own (the trainer holds only the target's head)
    cfg = tiny_cfg(run, dtype="fp32", shard_tokens=128)
    cfg.vocab.draft_vocab_size = 256
    run_vocab(cfg, tiny)
    cfg.train.online, cfg.train.greedy_val, cfg.train.max_steps, cfg.train.batch_tokens = False, 0, 2, 256
    cfg.train.max_seq_len = 256
    out = run_train(cfg)
    assert out["steps"] == 2 and out["target_held"] == "head" and (run / "draft").is_dir()


def test_fp8_files_named_as_speculators_names_them(extracted, tmp_path):
    """hs_connectors' FP8 connector (fp8 states, one scale per token) and speculators' hs_<i> names; stored in bf16."""
    tiny, ref = extracted
    engine_folder(ref, tiny, tmp_path / "hs", names="speculators", fp8=True)
    run = tmp_path / "run"
    engine_run(ref, run)
    run_engine_extract(tiny_cfg(run, dtype="bf16", shard_tokens=128, from_vllm=str(tmp_path / "hs")))
    a, b = OfflineFeatures(ref, "train"), OfflineFeatures(run, "train", dtype=torch.float32)
    for x, y in zip(a.get(range(len(a))), b.get(range(len(b)))):
        # fp8 e4m3 (3 mantissa bits) with one scale per token over all four layers, then bf16
        err = (y.aux - x.aux).abs().amax(-1) / x.aux.abs().amax(-1)
        assert float(err.max()) < 0.08
        assert torch.equal(x.input_ids, y.input_ids)


def test_other_family_final_norm_is_its_own(tmp_path, tokenizer_dir):  # noqa: F811
    """Gemma 3's RMSNorm scales by (1 + weight): the engine's last-layer states are normed by the target's own class."""
    folder = make_target("gemma3_text", tmp_path / "g3", tokenizer_dir)
    g3 = load_target(TargetConfig(name=str(folder), dtype="float32", device="cpu"))
    ref = tmp_path / "ref"
    write_tokens(ref, g3, 3, 48, n_val=1)
    cfg = tiny_cfg(ref, dtype="fp32")
    cfg.target.name = str(folder)
    run_extract(cfg, g3)
    engine_folder(ref, g3, tmp_path / "hs")
    run = tmp_path / "run"
    engine_run(ref, run)
    cfg = tiny_cfg(run, dtype="fp32", from_vllm=str(tmp_path / "hs"))
    cfg.target.name = str(folder)
    run_engine_extract(cfg)
    same_features(ref, run, atol=1e-5)


class _FakeVllm(BaseHTTPRequestHandler):
    """Answers as a vLLM server started with extract_hidden_states and ExampleHiddenStatesConnector does: the
    states are computed by the target's transformers forward and saved to the connector's storage."""
    target = storage = None
    requests: list = []
    busy = 0  # answer 503 to this many completion requests first
    lock = threading.Lock()  # one forward at a time: the capture hook sits on the shared model

    def log_message(self, *a):
        pass

    def _send(self, obj, code=200):
        raw = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            if type(self).busy > 0:
                type(self).busy -= 1
                return self._send({"error": "engine busy"}, 503)
        type(self).requests.append(body)
        ids = torch.tensor(body["prompt"], dtype=torch.long)
        rid = f"cmpl-{uuid.uuid4().hex}-0"
        path = self.storage / f"{rid}.safetensors"
        with self.lock:
            write_vllm_file(path, self.target.model, ids, self.target.aux_layers)
        self._send({"id": rid, "object": "text_completion", "model": body["model"],
                    "choices": [{"index": 0, "text": "!", "finish_reason": "length",
                                 "prompt_token_ids": body["prompt"], "token_ids": [0]}],
                    "kv_transfer_params": {"hidden_states_path": str(path)}})


def test_server_url_sends_eyas_tokens_and_reads_what_it_wrote(extracted, tmp_path):
    tiny, ref = extracted
    storage = tmp_path / "storage"
    storage.mkdir()
    handler = type("H", (_FakeVllm,), {"target": tiny, "storage": storage, "requests": [], "busy": 1})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        run = tmp_path / "run"
        engine_run(ref, run)
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        res = run_engine_extract(tiny_cfg(run, dtype="fp32", shard_tokens=128, from_vllm=url))
    finally:
        srv.shutdown()
    assert res["engine"]["model"] == "tiny"
    reqs = handler.requests
    assert len(reqs) == 8 and all(r["max_tokens"] == 1 and r["return_token_ids"] for r in reqs)
    assert handler.busy == 0  # the one busy answer was tried again
    same_features(ref, run, atol=1e-5)
    assert not list(storage.iterdir())  # read, then deleted with their locks


def test_bad_engine_files_are_named(extracted, tmp_path):
    tiny, ref = extracted
    toks = all_sequences(ref, "train")
    ids = toks[0][0].long()
    H, aux = tiny.hidden_size, tiny.aux_layers

    good_rest = tmp_path / "rest"  # good files for every sequence but the first train one
    engine_folder(ref, tiny, good_rest, skip=ids)

    def refused(tensors: dict, match: str, alone: bool = False):
        d = tmp_path / uuid.uuid4().hex
        if alone:
            d.mkdir()
        else:
            shutil.copytree(good_rest, d)
        save_file(tensors, str(d / "x.safetensors"))
        run = tmp_path / uuid.uuid4().hex
        engine_run(ref, run)
        with pytest.raises(EyasError, match=match):
            run_engine_extract(tiny_cfg(run, dtype="fp32", from_vllm=str(d)))

    good = engine_states(tiny.model, ids, aux)
    # launched without the last layer (speculators' --no-include-last-layer): three layers, no final state
    refused({"hidden_states": good[:, :3].contiguous(), "token_ids": ids},
            rf"x.safetensors: hidden_states is \[{len(ids)}, 3, {H}\], expected \[tokens, 4, {H}\] .*the last layer "
            rf"\({tiny.num_layers}\) is missing.*eagle_aux_hidden_state_layer_ids")
    refused({"hidden_states": good[:, :, :8].contiguous(), "token_ids": ids}, r"expected \[tokens, 4, ")
    refused({"hidden_states": good[:-1].contiguous(), "token_ids": ids},
            r"token_ids is \[\d+\] torch.int64, expected \[\d+\] integers")
    bad = good.clone()
    bad[0, 0, 0] = float("nan")
    refused({"hidden_states": bad, "token_ids": ids}, r"x.safetensors: hidden_states holds non-finite values")
    # a file for the first train sequence alone: the others are named as missing
    refused({"hidden_states": good, "token_ids": ids}, r"5 of 6 train sequences have no file with their token ids",
            alone=True)
    d = tmp_path / "notst"
    d.mkdir()
    (d / "a.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    run = tmp_path / "r2"
    engine_run(ref, run)
    with pytest.raises(EyasError, match=r"a.safetensors: not a readable safetensors file"):
        run_engine_extract(tiny_cfg(run, dtype="fp32", from_vllm=str(d)))
    with pytest.raises(EyasError, match=r"no such folder"):
        run_engine_extract(tiny_cfg(run, dtype="fp32", from_vllm=str(tmp_path / "nowhere")))


def test_online_training_streams_features_from_the_server(extracted, tmp_path):
    """train.online with features.from_vllm: the trainer holds the head, asks the engine for each batch's sequences
    and gets what the target's own forward gives (OnlineFeatures in-process)."""
    from eyas.data.prepare import load_tokens
    from eyas.engine_features import engine_online_features
    from eyas.features import OnlineFeatures
    from eyas.target_head import load_target_head
    from eyas.train import run_train
    from eyas.vocab import run_vocab

    tiny, ref = extracted
    storage = tmp_path / "storage"
    storage.mkdir()
    handler = type("H", (_FakeVllm,), {"target": tiny, "storage": storage, "requests": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        run = tmp_path / "run"
        engine_run(ref, run)
        cfg = tiny_cfg(run, from_vllm=f"http://127.0.0.1:{srv.server_address[1]}")
        toks = load_tokens(run, "train")
        mine = engine_online_features(cfg, load_target_head(cfg.target), toks)
        idx = [3, 0, 5]
        for x, y in zip(OnlineFeatures(tiny, toks).get(idx), mine.get(idx)):
            torch.testing.assert_close(y.aux, x.aux, rtol=0, atol=1e-5)
            torch.testing.assert_close(y.final, x.final, rtol=0, atol=1e-5)
            assert torch.equal(x.top, y.top) and torch.equal(x.input_ids, y.input_ids)
        assert len(handler.requests) == 3
        cfg.vocab.draft_vocab_size = 256
        run_vocab(cfg, tiny)
        cfg.train.online, cfg.train.greedy_val, cfg.train.max_steps, cfg.train.batch_tokens = True, 0, 2, 256
        cfg.train.max_seq_len = 256
        out = run_train(cfg)
    finally:
        srv.shutdown()
    assert out["steps"] == 2 and out["target_held"] == "head"
    assert len(handler.requests) > 3 and not list(storage.iterdir())


def test_the_pipeline_loads_no_target_to_read_an_engine(tmp_path):
    from eyas.pipeline import stage_runs_target

    cfg = tiny_cfg(tmp_path)
    assert stage_runs_target("extract", cfg)
    cfg.features.from_vllm = "http://127.0.0.1:8000"
    assert not stage_runs_target("extract", cfg)
    cfg.train.online, cfg.train.greedy_val = True, 0  # online from the engine: the trainer holds the head
    assert not stage_runs_target("train", cfg)


def test_the_extract_stage_reads_the_engine_where_from_vllm_is_given(extracted, tmp_path, capsys):
    """`eyas extract --from-vllm` and `eyas run`'s extract stage run eyas.engine_features' extraction; without it,
    the in-process one. run_extract itself refuses the setting rather than run the target in its place."""
    from eyas.cli import main
    from eyas.pipeline import STAGES, stage_spec

    spec = dict((n, s) for n, s, *_ in STAGES)["extract"]
    cfg = tiny_cfg(tmp_path)
    assert stage_spec("extract", cfg, spec) == "eyas.features:run_extract"
    cfg.features.from_vllm = str(tmp_path / "nowhere")
    assert stage_spec("extract", cfg, spec) == "eyas.engine_features:run_engine_extract"
    assert stage_spec("train", cfg, "eyas.train:run_train") == "eyas.train:run_train"
    with pytest.raises(EyasError, match=r"features.from_vllm: the features are read from vLLM by eyas.engine_features"):
        run_extract(cfg)
    _, ref = extracted
    run = tmp_path / "run"
    engine_run(ref, run)
    assert main(["extract", "--preset", "tiny", "--out", str(run), "--device", "cpu",
                 "--from-vllm", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "features.from_vllm" in err and "no such folder" in err, err


def test_a_server_whose_files_are_not_visible_here_is_named(extracted, tmp_path, monkeypatch):
    """The connector's storage is on the server's machine only: the file the answer names never appears here."""
    import eyas.engine_features as ef

    class Elsewhere(_FakeVllm):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send({"choices": [{"prompt_token_ids": body["prompt"]}],
                        "kv_transfer_params": {"hidden_states_path": "/elsewhere/hs/cmpl-1-0.safetensors"}})

    monkeypatch.setattr(ef, "APPEAR_TIMEOUT_S", 0.2)
    tiny, ref = extracted
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        run = tmp_path / "run"
        engine_run(ref, run)
        with pytest.raises(EyasError, match=r"/elsewhere/hs/cmpl-1-0.safetensors: the server wrote its hidden states "
                                            r"here, but this machine cannot see the file"):
            run_engine_extract(tiny_cfg(run, from_vllm=f"http://127.0.0.1:{srv.server_address[1]}"))
    finally:
        srv.shutdown()


def test_an_aux_layer_that_is_the_last_is_asked_for_once(tmp_path):
    """A target whose aux layers include N (the last layer's output, as a 2-3-layer target's defaults do; given here
    out of order, as a user may): vLLM is asked for each layer once, in the layer order it stacks them in, and the
    features equal an in-process extraction's."""
    tiny = load_target(TargetConfig(name="tiny", dtype="float32", device="cpu", aux_layers=[8, 1, 4]))
    n = tiny.num_layers
    assert n == 8 and tiny.aux_layers == [1, 4, 8]
    ref = tmp_path / "ref"
    write_tokens(ref, tiny, 4, 48)
    run_extract(tiny_cfg(ref, dtype="fp32", shard_tokens=128), tiny)
    engine_folder(ref, tiny, tmp_path / "hs")
    f = next((tmp_path / "hs").glob("*.safetensors"))
    from safetensors import safe_open

    with safe_open(str(f), "pt") as g:
        assert g.get_slice("hidden_states").get_shape()[1] == 3  # layers 1, 4 and 8: N once
    run = tmp_path / "run"
    engine_run(ref, run)
    cfg = tiny_cfg(run, dtype="fp32", shard_tokens=128, from_vllm=str(tmp_path / "hs"))
    cfg.target.aux_layers = [8, 1, 4]
    run_engine_extract(cfg)
    assert read_json(run / "features" / "train" / "manifest.json")["engine"]["layer_ids"] == [1, 4, 8]
    same_features(ref, run, atol=1e-5)
