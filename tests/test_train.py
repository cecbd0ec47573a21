"""`eyas train`: overfitting real SmolLM2 features, exact resume after kill -9, two gloo processes
equal one, --finetune-from, packing and schedules."""
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eyas.config import resolve
from eyas.data.conversation import Conversation, Turn
from eyas.data.prepare import TokenSet, load_tokens
from eyas.data.tokenize import tokenize_conversation
from eyas.draft import DraftConfig, Eagle3Drafter, build_drafter, save_drafter
from eyas.features import OnlineFeatures
from eyas.train import run_train
from eyas.train.batches import pack_indices
from eyas.train.drafter_init import initial_drafter
from eyas.train.steps import lr_factor
from eyas.train.ttt import pack_samples, target_labels, ttt_unroll
from eyas.util import EyasError
from eyas.vocab import choose_vocab, count_tokens, load_vocab, required_token_ids, run_vocab

ROOT = Path(__file__).resolve().parents[1]

ITERS = 16
QA = [
    ("What is the capital of France?", "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre "
     "museum and its cafes along the river Seine."),
    ("Write a Python function that adds two numbers.", "Here is a simple function:\n\n```python\ndef add(a, b):\n"
     "    return a + b\n```\n\nCall it as `add(2, 3)` to get 5."),
    ("Give me three tips for better sleep.", "1. Go to bed at the same time every night.\n2. Keep your bedroom dark "
     "and cool.\n3. Avoid screens for an hour before sleeping."),
    ("Explain photosynthesis in one paragraph.", "Photosynthesis is the process by which plants use sunlight, water "
     "and carbon dioxide to make glucose and oxygen. It happens in the chloroplasts of leaf cells."),
]


def test_pack_indices_is_a_partition_within_budget():
    lengths = [5, 17, 3, 30, 30, 1, 12, 8, 29, 2] * 7
    bins = pack_indices(lengths, 32, seed=3)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 32 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 32) + 3  # nearly tight
    assert bins == pack_indices(lengths, 32, seed=3) and bins != pack_indices(lengths, 32, seed=4)


def test_lr_schedules():
    assert [round(lr_factor(s, 10, "constant", 0.2), 3) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    lin = [lr_factor(s, 10, "linear", 0.0) for s in range(10)]
    cos = [lr_factor(s, 10, "cosine", 0.0) for s in range(10)]
    assert lin[0] == 1.0 and lin == sorted(lin, reverse=True) and lin[-1] == pytest.approx(0.1)
    assert cos[0] == 1.0 and cos == sorted(cos, reverse=True) and cos[5] == pytest.approx(0.5)


def test_overfits_real_smollm2_features(smol):
    """A drafter trained on a handful of real SmolLM2 feature batches: the TTT loss falls and the
    accuracy of every step rises."""
    torch.manual_seed(0)
    toks = [tokenize_conversation(smol.tokenizer, Conversation(f"qa{i}", [Turn("user", q), Turn("assistant", a)]),
                                  512, "keep", smol.eot_token_ids) for i, (q, a) in enumerate(QA)]
    ts = TokenSet.from_tokenized(toks)
    counts = count_tokens(ts, smol.vocab_size)
    draft_ids = choose_vocab(counts, 1024, required_token_ids(smol, counts))
    feats = OnlineFeatures(smol, ts).get(list(range(len(ts))))
    lm_head = smol.model.get_output_embeddings()
    batches = [pack_samples(feats[:2]), pack_samples(feats[2:])]
    labels = [target_labels(b.final, lm_head, draft_ids) for b in batches]
    drafter = build_drafter(smol, draft_ids.numel(), draft_ids)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=2e-3, betas=(0.9, 0.95))
    hist = []
    for it in range(ITERS):
        b = it % 2
        st = ttt_unroll(drafter, batches[b], labels[b], 3)
        loss = sum(st.loss_sum[j] / st.count[j] for j in range(3))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        hist.append((float(loss.detach()), [float(st.correct[j] / st.count[j]) for j in range(3)]))
    first = (hist[0][0] + hist[1][0]) / 2
    last = (hist[-1][0] + hist[-2][0]) / 2
    assert last < 0.5 * first, [h[0] for h in hist]
    for j in range(3):
        acc0 = (hist[0][1][j] + hist[1][1][j]) / 2
        acc1 = (hist[-1][1][j] + hist[-2][1][j]) / 2
        assert acc1 > acc0 + 0.2, (j, acc0, acc1, hist)


def test_scaled_fc_init_puts_every_aux_layer_at_one_scale(smol):
    """SmolLM2's aux layers differ several-fold in scale: with PyTorch's init the deepest dominates
    fc's output. scale_fc_init divides each layer's block of columns by that layer's RMS (first
    token of each sequence, an attention sink, left out), so each block contributes alike."""
    from eyas.train.drafter_init import scale_fc_init

    toks = [tokenize_conversation(smol.tokenizer, Conversation(f"qa{i}", [Turn("user", q), Turn("assistant", a)]),
                                  512, "keep", smol.eot_token_ids) for i, (q, a) in enumerate(QA)]
    feats = OnlineFeatures(smol, TokenSet.from_tokenized(toks)).get(list(range(len(toks))))
    batch = pack_samples(feats)
    H, n = smol.hidden_size, len(smol.aux_layers)
    aux = batch.aux[batch.pos > 0].view(-1, n, H)
    want = aux.pow(2).mean((0, 2)).sqrt()
    drafter = build_drafter(smol, 1024)
    W0 = drafter.fc.weight.detach().clone().view(H, n, H)

    def block_rms(W):  # RMS over tokens of each layer's contribution to fc's output
        return torch.stack([(aux[:, i] @ W[:, i].T).pow(2).mean().sqrt() for i in range(n)])

    before = block_rms(W0)
    got = scale_fc_init(drafter, [batch])
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), want.double(), rtol=1e-3)
    assert torch.allclose(drafter.fc.weight.view(H, n, H), W0 / want[None, :, None])
    after = block_rms(drafter.fc.weight.detach().view(H, n, H))
    assert before.max() / before.min() > 3  # the problem is real for this target
    assert after.max() / after.min() < 1.5


# ------------------------------------------------------------------ run-directory tests (CLI)

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny):
    """A tiny-preset run directory with tokens and a vocabulary, made once."""
    from eyas.data.prepare import run_tokenize

    run = tmp_path_factory.mktemp("train") / "base"
    data = run.parent / "chats.jsonl"
    with open(data, "w") as f:
        for i in range(48):
            q, a = QA[i % len(QA)]
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"{q} (variant {i})"},
                {"role": "assistant", "content": " ".join([a] * (1 + i % 3))}]}) + "\n")
    cfg = resolve(preset_name="tiny", overrides={"out": str(run), "data.source": str(data), "data.limit": 0,
                                                 "data.test_ratio": 0.0, "train.val_ratio": 0.1})
    run_tokenize(cfg, tiny)
    run_vocab(cfg, tiny)
    return run


def clone_run(base: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for sub in ("data", "vocab"):
        shutil.copytree(base / sub, dst / sub)
    return dst


def cli(run: Path, *args, torchrun: int = 0, compiled: bool = False) -> list[str]:
    """`eyas train` on the tiny preset, under torchrun with `torchrun` processes; `compiled`: with the drafter's
    TTT steps compiled (`--compile-drafter on`, the GPU default)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"] \
        if torchrun else [sys.executable]
    return launcher + ["-m", "eyas", "train", "--preset", "tiny", "--out", str(run), "--batch-tokens", "512",
                       "--max-seq-len", "256", *(["--compile-drafter", "on"] if compiled else []), *args]


def env():
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    e.pop("EYAS_PROGRESS", None)
    return e


def losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def wait_for_checkpoint(p: subprocess.Popen, latest: Path, step: int) -> None:
    """Until the running training `p` has written a checkpoint of at least `step` (it must still run then)."""
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if latest.exists() and json.loads(latest.read_text())["step"] >= step:
            break
        time.sleep(0.02)
    assert p.poll() is None, "the run finished before it could be killed"


def killed_and_resumed(cut: Path, args: list[str], first_env: dict) -> Path:
    """`eyas train ARGS` on run `cut` (24 steps, a checkpoint every 4) killed with SIGKILL once a checkpoint of
    step 8 or later is written (`first_env`: the killed run's environment), then run again to the end; checks that
    the second run resumed from that checkpoint."""
    p = subprocess.Popen(cli(cut, *args), env=first_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = cut / "ckpt" / "latest.json"
    wait_for_checkpoint(p, latest, 8)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert 8 <= killed_at < 24
    r = subprocess.run(cli(cut, *args), env=env(), check=True, capture_output=True, text=True, timeout=600)
    assert f"resuming from step {killed_at}" in r.stderr
    return cut


def test_kill_and_resume_repeats_the_same_losses(tiny_run, tmp_path):
    args = ["--epochs", "3", "--max-steps", "24", "--save-every", "4", "--eval-every", "8", "--noise-std", "0.05"]
    full = clone_run(tiny_run, tmp_path / "full")
    subprocess.run(cli(full, *args), env=env(), check=True, capture_output=True, timeout=300)
    ref = losses(full)
    assert [s for s, _ in ref] == list(range(1, 25))

    cut = killed_and_resumed(clone_run(tiny_run, tmp_path / "cut"), args, env())
    assert losses(cut) == ref  # exactly: same data order, noise, weights and optimizer state
    assert (cut / "draft" / "model.safetensors").exists() and (cut / "train" / "curves.png").exists()
    best = json.loads((cut / "ckpt" / "best.json").read_text())
    assert best == json.loads((full / "ckpt" / "best.json").read_text())
    assert len(best["val_acc"]) == 3 and len(best["val_accept"]) == 3
    assert best["val_tau"] == pytest.approx(1 + best["val_accept"][0] * (1 + best["val_accept"][1] * (
        1 + best["val_accept"][2])))  # the forecast from the greedy chain's per-position acceptance


def test_stored_features_read_ahead_give_the_same_losses(tiny_run, tiny, tmp_path):
    """train.num_workers threads read the stored features of the next steps while one trains: the same batches, so
    the same losses as reading them in the loop, and the reads do come from the threads."""
    from eyas.features import run_extract
    from eyas.train import batches as T

    runs = {}
    for workers in (0, 2):
        run = clone_run(tiny_run, tmp_path / f"w{workers}")
        cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.online": False, "train.epochs": 2,
                                                     "train.batch_tokens": 256, "train.max_seq_len": 256,
                                                     "train.greedy_val": 0, "train.num_workers": workers})
        run_extract(cfg, tiny)
        read = []
        real_get = T.ReadAhead.ahead

        def ahead(self, batches, read=read):
            read.extend(batches)
            return real_get(self, batches)

        T.ReadAhead.ahead = ahead
        try:
            run_train(cfg, tiny)
        finally:
            T.ReadAhead.ahead = real_get
        runs[workers] = (losses(run), read)
    (plain, none), (ahead, asked) = runs[0], runs[2]
    assert none == [] and len(plain) > 4 and len(asked) >= len(plain)
    assert ahead == plain


def test_sigterm_saves_the_step_under_way_and_resumes_the_same(tiny_run, tmp_path):
    """SIGTERM (or Ctrl-C) while training: the step under way finishes and is saved as a checkpoint, though none
    was due (--save-every 100), the command exits as interrupted, and the same command then goes on from that
    step with the losses of a run never stopped."""
    args = ["--epochs", "3", "--max-steps", "24", "--save-every", "100", "--eval-every", "8", "--noise-std", "0.05"]
    full = clone_run(tiny_run, tmp_path / "full")
    subprocess.run(cli(full, *args), env=env(), check=True, capture_output=True, timeout=300)
    ref = losses(full)
    cut = clone_run(tiny_run, tmp_path / "cut")
    p = subprocess.Popen(cli(cut, *args), env=dict(env(), EYAS_DEBUG_STEP_SLEEP="0.2"), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    metrics = cut / "train" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None and not (metrics.exists() and len(losses(cut)) >= 5):
        time.sleep(0.05)
    assert p.poll() is None, "the run finished before it could be stopped"
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 143 and "interrupted by SIGTERM" in err, err[-2000:]  # as every other command gives it
    stopped = json.loads((cut / "ckpt" / "latest.json").read_text())["step"]
    assert 5 <= stopped < 24 and f"stopped by SIGTERM at step {stopped} of 24" in err and "Traceback" not in err
    r = subprocess.run(cli(cut, *args), env=env(), check=True, capture_output=True, text=True, timeout=600)
    assert f"resuming from step {stopped}" in r.stderr
    assert losses(cut) == ref


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "graph",
                                      pytest.param("ddp-compiled", marks=pytest.mark.compiler)])
def test_two_gloo_processes_equal_one(tiny_run, tiny, tmp_path, parallel):
    """2 processes x 1 micro-batch and 1 process x 2 micro-batches see the same global batches, so
    after 3 AdamW steps the weights agree to float32 rounding (atol 1e-6, while they move ~1e-3), with the
    drafter whole in each process (DDP) or sharded across them (FSDP2: the checkpoint and the saved drafter
    are gathered from the shards); under DDP with the drafter's steps compiled, as a GPU runs them by
    default (both runs compiled); and with train.cuda_graph's steps as a GPU runs them by default, eagerly
    here (EYAS_DEBUG_GRAPH_ON_CPU): no DDP, AccumGraph's one all-reduce of the flat gradients."""
    from safetensors.torch import load_file

    compiled = parallel.endswith("-compiled")
    parallel = parallel.removesuffix("-compiled")
    graph = parallel == "graph"
    args = ["--max-steps", "3", "--save-every", "3", "--eval-every", "3", "--lr", "1e-3", "--warmup-ratio", "0",
            *(["--cuda-graph"] if graph else [])]
    run_env = dict(env(), **({"EYAS_DEBUG_GRAPH_ON_CPU": "1"} if graph else {}))
    one = clone_run(tiny_run, tmp_path / "one")
    two = clone_run(tiny_run, tmp_path / "two")
    r = subprocess.run(cli(one, *args, "--grad-accum", "2", compiled=compiled), env=run_env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(cli(two, *args, "--grad-accum", "1", "--parallel", "ddp" if graph else parallel, torchrun=2,
                           compiled=compiled), env=run_env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [json.loads((run / "train" / "summary.json").read_text()) for run in (one, two)]
    assert summaries[1]["processes"] == 2
    assert ([s["step_graph"] for s in summaries] == ["eager (no capture)"] * 2) == graph
    assert [s["drafter_step"] for s in summaries] == ["compiled" if compiled else "eager"] * 2
    a = load_file(str(one / "ckpt" / "step-0000003" / "model.safetensors"))
    b = load_file(str(two / "ckpt" / "step-0000003" / "model.safetensors"))
    (steps_one, loss_one), (steps_two, loss_two) = zip(*losses(one)), zip(*losses(two))
    assert steps_one == steps_two
    assert list(loss_one) == pytest.approx(list(loss_two), rel=1e-5)
    torch.manual_seed(0)
    init = build_drafter(tiny, load_vocab(tiny_run).numel(), load_vocab(tiny_run)).trainable_state_dict()
    moved = max(float((a[k] - init[k]).abs().max()) for k in ("fc.weight", "lm_head.weight"))
    assert moved > 1e-3
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert sorted(a) == sorted(b)
    oa = load_file(str(one / "ckpt" / "step-0000003" / "optim.safetensors"))
    ob = load_file(str(two / "ckpt" / "step-0000003" / "optim.safetensors"))
    assert sorted(k for k in oa if not k.startswith("rng.")) == sorted(k for k in ob if not k.startswith("rng."))
    for k in [k for k in oa if k.endswith("::exp_avg")]:
        torch.testing.assert_close(oa[k], ob[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    da = load_file(str(one / "draft" / "model.safetensors"))
    db = load_file(str(two / "draft" / "model.safetensors"))
    assert sorted(da) == sorted(db)
    for k in da:
        torch.testing.assert_close(da[k], db[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"draft {k}: {m}")


def _pids_running(text: str) -> list[int]:
    """Processes whose command line contains `text` (from /proc), zombies left out."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") \
                        and ") Z " not in (d / "stat").read_text():
                    out.append(int(d.name))
    return out


def test_fsdp_kill_and_resume_repeats_the_same_losses(tiny_run, tmp_path):
    """Two gloo processes with the drafter sharded (FSDP2), killed (both, kill -9) after a checkpoint, then run
    again: the checkpoint gathered from the shards loads back into them and the losses repeat exactly."""
    args = ["--epochs", "3", "--max-steps", "12", "--save-every", "3", "--eval-every", "6", "--noise-std", "0.05",
            "--parallel", "fsdp"]
    full = clone_run(tiny_run, tmp_path / "full")
    r = subprocess.run(cli(full, *args, torchrun=2), env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = losses(full)
    assert [s for s, _ in ref] == list(range(1, 13))

    cut = clone_run(tiny_run, tmp_path / "cut")
    p = subprocess.Popen(cli(cut, *args, torchrun=2), env=dict(env(), EYAS_DEBUG_STEP_SLEEP="0.3"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = cut / "ckpt" / "latest.json"
    wait_for_checkpoint(p, latest, 3)
    for pid in [p.pid, *_pids_running(str(cut))]:  # torchrun and both of its processes (their own sessions)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    p.wait()
    deadline = time.time() + 30
    while _pids_running(str(cut)) and time.time() < deadline:
        time.sleep(0.05)
    assert not _pids_running(str(cut))
    killed_at = json.loads(latest.read_text())["step"]
    assert 3 <= killed_at < 12
    r = subprocess.run(cli(cut, *args, torchrun=2), env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from step {killed_at}" in r.stderr
    got = losses(cut)
    assert [s for s, _ in got] == [s for s, _ in ref]
    assert [x for _, x in got] == pytest.approx([x for _, x in ref], rel=1e-6, abs=1e-7)


def test_slot_bins_keep_each_sequence_with_one_slot(tiny_run):
    """Slot j of `slots` packs exactly the sequences i % slots == j every epoch, each once; one slot is
    the plain epoch packing."""
    from eyas.train.batches import Data

    data = Data(load_tokens(tiny_run, "train"), None, 256, 512)
    n = len(data.lengths)
    assert data.slot_bins(5, 1)[0] == pack_indices(data.lengths, 512, 5)
    for seed in (0, 1):
        slots = data.slot_bins(seed, 3)
        for j, bins in enumerate(slots):
            seen = [i for b in bins for i in b]
            assert sorted(seen) == list(range(j, n, 3))
            assert all(sum(data.lengths[i] for i in b) <= 512 for b in bins)
    assert data.slot_bins(0, 3) != data.slot_bins(1, 3)  # packed anew each epoch


def test_two_gloo_processes_compute_each_feature_once(tiny_run, tmp_path):
    """Under DDP a process keeps its own sequences every epoch, so with the feature cache on it runs the
    target over each of them once (ahead of training) and reads them from the cache in every epoch."""
    run = clone_run(tiny_run, tmp_path / "two")
    r = subprocess.run(cli(run, "--epochs", "3", "--set", "train.feature_cache_gb=1", torchrun=2), env=env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    c = json.loads((run / "train" / "summary.json").read_text())["feature_cache"]
    n = len(load_tokens(tiny_run, "train"))
    assert c["misses"] == c["sequences"] == (n + 1) // 2  # rank 0: only its own slot, each computed once
    assert c["hits"] > 2 * c["sequences"]  # every epoch read them (less a bin a slot may drop an epoch)


def test_finetune_from_saved_drafter_and_refuse_misfit(tiny_run, tiny, tmp_path):
    ids = load_vocab(tiny_run)
    torch.manual_seed(5)
    src = build_drafter(tiny, ids.numel(), ids)
    save_drafter(src, tmp_path / "mine")
    cfg = resolve(preset_name="tiny", overrides={"out": str(tiny_run), "train.finetune_from": str(tmp_path / "mine")})
    got = initial_drafter(cfg, tiny, ids)
    for k, v in src.trainable_state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k

    # fine-tuning runs end to end from it
    run = clone_run(tiny_run, tmp_path / "ft")
    cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.finetune_from": str(tmp_path / "mine"),
                                                 "train.max_steps": 2, "train.batch_tokens": 512,
                                                 "train.max_seq_len": 256})
    res = run_train(cfg, tiny)
    assert res["steps"] == 2 and (run / "draft" / "config.json").exists()
    split = res["step_time_split"]  # where the steps' time went, by section
    assert set(split) == {"features", "forward", "backward", "optimizer"}
    assert all(v["s"] >= 0 for v in split.values()) and split["forward"]["s"] > 0 and split["backward"]["s"] > 0
    assert abs(sum(v["share"] for v in split.values()) - 1) < 0.01

    # a drafter made for a target of another width is refused, saying why
    c = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    target_hidden_size=32, target_vocab_size=tiny.vocab_size, draft_vocab_size=ids.numel(),
                    aux_layers=[1, 2, 3])
    save_drafter(Eagle3Drafter(c), tmp_path / "wrong")
    cfg = resolve(preset_name="tiny", overrides={"out": str(tiny_run), "train.finetune_from": str(tmp_path / "wrong")})
    with pytest.raises(EyasError, match="hidden size 32 != target's 64"):
        initial_drafter(cfg, tiny, ids)
    # the CLI says so in one line, exit status 2
    r = subprocess.run(cli(clone_run(tiny_run, tmp_path / "bad"), "--finetune-from", str(tmp_path / "wrong")),
                       env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "does not fit target" in r.stderr and "Traceback" not in r.stderr


def test_bad_train_settings_are_refused_before_any_work(tiny, tmp_path):
    """Settings out of range stop `eyas train` with the key named, before anything is tokenized."""
    for key, value, want in (("train.lr", -1.0, "above 0"), ("train.noise_std", -0.5, "0 or above"),
                             ("train.warmup_ratio", 2.0, "between 0 and 1"), ("train.val_ratio", 1.5, "below 1"),
                             ("train.epochs", 0, "at least 1")):
        cfg = resolve(preset_name="tiny", overrides={"out": str(tmp_path / "r"), key: value})
        with pytest.raises(EyasError, match=f"{key} must be .*{want}"):
            run_train(cfg, tiny)
        assert not (tmp_path / "r" / "data").exists()
    with pytest.raises(EyasError, match=r"data.max_seq_len must be 0 \(no limit\) or more, got -1"):
        run_train(resolve(preset_name="tiny", overrides={"out": str(tmp_path / "r"), "data.max_seq_len": -1}), tiny)
    assert not (tmp_path / "r" / "data" / "tokens").exists()


def test_standalone_train_checks_the_tokens_and_vocabulary_it_finds(tiny_run, tiny, tmp_path):
    """`eyas train` reuses the run's tokens and vocabulary as they are, but refuses tokens split or cut with other
    values of settings it was given, or made before the regenerated answers changed; it chooses the vocabulary
    again for another explicit size, or at its own size when the tokens were made again; and a checkpoint of
    other training data or another vocabulary is not resumed."""
    from eyas.data.prepare import ensure_tokens, run_tokenize

    run = clone_run(tiny_run, tmp_path / "r")
    base = {"out": str(run), "train.max_steps": 1, "train.batch_tokens": 512, "train.max_seq_len": 256}
    meta = run / "data" / "tokens" / "meta.json"
    made = meta.read_text()
    run_train(resolve(preset_name="tiny", overrides=base), tiny)  # the preset's data settings differ: not given
    assert meta.read_text() == made and load_vocab(run).numel() == 2048
    for key, value, said in (("train.val_ratio", 0.3, "train.val_ratio was 0.1, this command gives 0.3"),
                             ("data.max_seq_len", 128, "data.max_seq_len was 256, this command gives 128")):
        with pytest.raises(EyasError, match=f"cannot use: {said}.*eyas tokenize --out"):
            run_train(resolve(preset_name="tiny", overrides={**base, key: value}), tiny)
        assert meta.read_text() == made
    # answers regenerated after the tokens were made
    (run / "data" / "regen").mkdir()
    (run / "data" / "regen" / "shard-00000.jsonl").write_text("")
    with pytest.raises(EyasError, match="regenerated answers in .* changed since"):
        ensure_tokens(resolve(preset_name="tiny", overrides=base), tiny)
    (run / "data" / "regen" / "shard-00000.jsonl").unlink()
    # tokens of another model (the same one under another name would pass)
    m = json.loads(made)
    m["inputs"]["tokenizer"].update(name="other", sha256="0123456789abcdef")
    meta.write_text(json.dumps(m))
    with pytest.raises(EyasError, match=r"for target other \(0123456789ab\), not tiny"):
        ensure_tokens(resolve(preset_name="tiny", overrides=base), tiny)
    m["inputs"]["tokenizer"].update(name="renamed", sha256=json.loads(made)["inputs"]["tokenizer"]["sha256"])
    meta.write_text(json.dumps(m))
    assert ensure_tokens(resolve(preset_name="tiny", overrides=base), tiny) is False
    meta.write_text(made)
    # another size, given: the checkpoint of the old one is refused before the vocabulary is chosen again (which
    # left the run's vocabulary unlike its drafter)
    size = load_vocab(run).numel()
    with pytest.raises(EyasError, match=r"different training run \(the draft vocabulary's size changed\)"):
        run_train(resolve(preset_name="tiny", overrides={**base, "vocab.draft_vocab_size": 1024}), tiny)
    assert load_vocab(run).numel() == size != 1024
    # tokens made again with another split: the vocabulary follows at its own size; the checkpoint is refused
    data = {"data.source": str(tiny_run.parent / "chats.jsonl"), "data.limit": 0, "data.test_ratio": 0.0}
    run_tokenize(resolve(preset_name="tiny", overrides={**base, **data, "train.val_ratio": 0.3}), tiny)
    with pytest.raises(EyasError, match=r"the training data \(.*tokens\) changed"):
        run_train(resolve(preset_name="tiny", overrides=base), tiny)
    assert load_vocab(run).numel() == size
    # with the checkpoint gone it trains on the new split
    shutil.rmtree(run / "ckpt")
    res = run_train(resolve(preset_name="tiny", overrides=base), tiny)
    assert res["steps"] == 1 and len(load_tokens(run, "val")) > len(load_tokens(tiny_run, "val"))


def test_bf16_precision_on_cpu_trains_under_autocast(tiny_run, tiny, tmp_path):
    """train.precision=bf16 runs the drafter under bf16 autocast on the CPU: the losses move off the
    fp32 ones (so the setting is applied) but stay close and finite."""
    losses = {}
    for prec in ("fp32", "bf16"):
        run = clone_run(tiny_run, tmp_path / prec)
        cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.max_steps": 3, "train.batch_tokens": 512,
                                                     "train.max_seq_len": 256, "train.precision": prec})
        run_train(cfg, tiny)
        rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
        losses[prec] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses["fp32"]) == len(losses["bf16"]) == 3
    assert losses["fp32"] != losses["bf16"]
    assert all(math.isfinite(x) for x in losses["bf16"])
    assert abs(losses["fp32"][0] - losses["bf16"][0]) < 0.05 * abs(losses["fp32"][0])


def test_label_temperature_trains_on_sharper_labels(tiny_run, tiny, tmp_path):
    """train.label_temperature reaches the training loss (it moves off the default's from the first step), and a
    checkpoint made at one temperature is not resumed at another, either way, with the setting named."""
    losses = {}
    for t in (1.0, 0.5):
        run = clone_run(tiny_run, tmp_path / str(t))
        cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.max_steps": 2, "train.batch_tokens": 512,
                                                     "train.max_seq_len": 256, "train.label_temperature": t})
        run_train(cfg, tiny)
        rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
        losses[t] = [r["loss"] for r in rows if "loss" in r]
        other = resolve(preset_name="tiny", overrides={"out": str(run), "train.max_steps": 2, "train.batch_tokens": 512,
                                                       "train.max_seq_len": 256, "train.label_temperature": 1.5 - t})
        with pytest.raises(EyasError, match=r"\(train.label_temperature changed\)"):
            run_train(other, tiny)
    assert len(losses[1.0]) == len(losses[0.5]) == 2 and losses[1.0][0] != losses[0.5][0]


def test_loss_positions_all_trains_on_every_token(tiny_run, tiny, tmp_path):
    """train.loss_positions=all counts every position of a sequence that has a label at each TTT step (the answers
    are a strict part of them), moves the loss off the answers-only one from the first step, and keys the
    checkpoint like any training setting."""
    from eyas.train.batches import Data

    tokens = load_tokens(tiny_run, "train")
    answers, every = Data(tokens, None, 256, 512), Data(tokens, None, 256, 512, all_positions=True)
    bins = every.bins(0)
    want = [sum(max(0, every.lengths[i] - j - 2) for b in bins for i in b) for j in range(3)]
    assert every.counts(bins, 3) == want
    assert all(a < w for a, w in zip(answers.counts(bins, 3), want))
    losses = {}
    for pos in ("answers", "all"):
        run = clone_run(tiny_run, tmp_path / pos)
        over = {"out": str(run), "train.max_steps": 2, "train.batch_tokens": 512, "train.max_seq_len": 256}
        run_train(resolve(preset_name="tiny", overrides={**over, "train.loss_positions": pos}), tiny)
        rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
        losses[pos] = [r["loss"] for r in rows if "loss" in r]
        other = "all" if pos == "answers" else "answers"
        with pytest.raises(EyasError, match=r"\(train.loss_positions changed\)"):
            run_train(resolve(preset_name="tiny", overrides={**over, "train.loss_positions": other}), tiny)
    assert len(losses["answers"]) == len(losses["all"]) == 2 and losses["answers"][0] != losses["all"][0]


def test_loss_path_reaches_the_training_and_its_checkpoint(tiny_run, tiny, tmp_path):
    """train.loss_path goes into the unroll (other losses than the default on the same batches) and into the
    checkpoint's fingerprint while it is not the default, so a resume with another path is refused."""
    over = {"train.max_steps": 2, "train.batch_tokens": 512, "train.max_seq_len": 256, "train.greedy_val": 0}
    losses = {}
    for path in ("all", "greedy"):
        run = clone_run(tiny_run, tmp_path / path)
        run_train(resolve(preset_name="tiny", overrides={**over, "out": str(run), "train.loss_path": path}), tiny)
        losses[path] = [json.loads(x)["loss"] for x in (run / "train" / "metrics.jsonl").read_text().splitlines()
                        if '"loss"' in x]
    assert len(losses["all"]) == len(losses["greedy"]) == 2 and losses["all"][0] > losses["greedy"][0]
    with pytest.raises(EyasError, match=r"\(train.loss_path changed\)"):
        run_train(resolve(preset_name="tiny", overrides={**over, "out": str(tmp_path / "greedy"),
                                                         "train.loss_path": "chain"}), tiny)


def test_draft_layers_trains_a_deeper_drafter(tiny_run, tiny, tmp_path):
    """train.draft_layers=2 trains a drafter of two decoder layers (the saved drafter loads with both; that every
    layer gets a gradient is test_ttt's slow-reference test), and the setting is in the checkpoint's fingerprint:
    a resume with another depth is refused."""
    from eyas.draft import load_drafter

    over = {"train.max_steps": 3, "train.batch_tokens": 512, "train.max_seq_len": 256, "train.greedy_val": 0,
            "train.draft_layers": 2}
    run = clone_run(tiny_run, tmp_path / "deep")
    run_train(resolve(preset_name="tiny", overrides={**over, "out": str(run)}), tiny)
    d = load_drafter(run / "draft", tiny)
    assert d.config.num_hidden_layers == 2 and len(d.decoder_layers()) == 2
    assert tuple(d.state_dict()["layers.1.self_attn.q_proj.weight"].shape) == (
        d.config.num_attention_heads * d.config.head_dim, d.config.hidden_size)
    summary = json.loads((run / "train" / "summary.json").read_text())
    assert summary["steps"] == 3
    with pytest.raises(EyasError, match=r"\(train.draft_layers changed\)"):
        run_train(resolve(preset_name="tiny", overrides={**over, "out": str(run), "train.draft_layers": 1}), tiny)


def test_best_by_picks_the_checkpoint_by_the_chosen_measure(tiny_run, tiny, tmp_path):
    """train.best_by: the drafter kept in draft/ is the evaluation with the highest value of the chosen measure (the
    first such on a tie); auto is greedy_tau while the greedy answers are there; greedy_tau without them is refused."""
    over = {"train.max_steps": 40, "train.eval_every": 5, "train.save_every": 20, "train.batch_tokens": 512,
            "train.max_seq_len": 256, "train.greedy_val": 3, "train.seed": 1, "train.lr": 1e-2, "train.epochs": 4}
    picks = {}
    for by in ("auto", "val_tau", "val_al"):
        run = clone_run(tiny_run, tmp_path / by)
        summary = run_train(resolve(preset_name="tiny", overrides={**over, "out": str(run), "train.best_by": by}), tiny)
        evals = [r for r in (json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines())
                 if "val_tau" in r]
        key = "greedy_tau" if by == "auto" else by
        top = max(r[key] for r in evals)
        want = next(r["step"] for r in evals if r[key] == top)
        assert len(evals) == 8 and summary["best"]["step"] == want and summary["best"]["by"] == key
        assert json.loads((run / "draft" / "config.json").read_text())["trained"]["step"] == want
        assert json.loads((run / "ckpt" / "best.json").read_text())["step"] == want
        picks[by] = want
    assert len(set(picks.values())) > 1, picks  # the measures disagree on this run, so the choice is what is tested
    with pytest.raises(EyasError, match="train.greedy_val=0"):
        run_train(resolve(preset_name="tiny", overrides={**over, "out": str(clone_run(tiny_run, tmp_path / "off")),
                                                         "train.greedy_val": 0, "train.best_by": "greedy_tau"}), tiny)


def test_greedy_val_scores_the_targets_greedy_answers(tiny_run, tiny, tmp_path, monkeypatch):
    """train.greedy_val: the target answers the validation split's first prompts greedily once (kept with the run),
    each evaluation reports greedy_tau (over the decoder's rounds on them) beside val_tau, the best checkpoint
    carries it, and the same run reads the answers back instead of generating them again; a failure to make them is
    reported and the training goes on; 0 turns it off."""
    import eyas.train.greedyval as gv
    from eyas.data.prepare import TokenSet

    run = clone_run(tiny_run, tmp_path / "g")
    over = {"out": str(run), "train.max_steps": 2, "train.batch_tokens": 512, "train.max_seq_len": 256,
            "train.greedy_val": 3, "train.seed": 1}  # not regen.seed (0), which the greedy answers' engine seeds
    summary = run_train(resolve(preset_name="tiny", overrides=over), tiny)
    rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_tau" in r]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert evals and all(1.0 <= r["greedy_tau"] <= 4.0 and len(r["greedy_accept"]) == 3 and r["greedy_rounds"] > 0
                         and 1.0 <= r["greedy_tau_all"] <= 4.0 for r in evals)
    assert summary["best"]["greedy_tau"] == evals[-1]["greedy_tau"]
    assert summary["best"]["greedy_rounds"] == evals[-1]["greedy_rounds"]
    meta = json.loads((run / "train" / "greedy_val.json").read_text())
    g = TokenSet.load(run / "train" / "greedy_val.safetensors", meta["ids"])
    assert len(g) == meta["answers"] == 3
    for i in range(len(g)):  # prompt, then the target's greedy answer (transformers' generate, one prompt alone)
        ids, mask = g[i]
        a = int(mask.nonzero()[0])
        assert not mask[:a].any() and mask[a:].all()
        ref = tiny.model.generate(ids[None, :a], attention_mask=torch.ones(1, a, dtype=torch.long), do_sample=False,
                                  max_new_tokens=16, eos_token_id=tiny.eot_token_ids, pad_token_id=0)[0, a:].tolist()
        stop = next((j for j, t in enumerate(ref) if t in tiny.eot_token_ids), None)
        assert ids[a:].tolist() == (ref[:stop + 1] if stop is not None else ref)
    pairs = gv.read_greedy_val(run)  # what bench/bench_decode.py --prompts greedy:RUN decodes
    assert [p + x for p, x in pairs] == [g[i][0].tolist() for i in range(len(g))]
    assert [len(p) for p, _ in pairs] == [int(g[i][1].nonzero()[0]) for i in range(len(g))]
    with pytest.raises(EyasError, match="no greedy validation answers"):
        gv.read_greedy_val(tmp_path / "nothing")

    def no_generation(*a, **k):
        raise AssertionError("generated again")

    monkeypatch.setattr(gv, "greedy_answers", no_generation)
    shutil.rmtree(run / "ckpt", ignore_errors=True)  # a fresh training on the same run: the answers read back
    run_train(resolve(preset_name="tiny", overrides={**over, "train.max_steps": 1}), tiny)
    monkeypatch.undo()

    def broken(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(gv, "greedy_answers", broken)  # a failed measurement: said, and the training goes on
    bad = clone_run(tiny_run, tmp_path / "bad")
    s_bad = run_train(resolve(preset_name="tiny", overrides={**over, "out": str(bad)}), tiny)
    assert s_bad["steps"] == 2 and "greedy_tau" not in s_bad["best"]
    assert "out of memory" in json.loads((bad / "train" / "greedy_val_error.json").read_text())["error"]
    monkeypatch.undo()
    off = clone_run(tiny_run, tmp_path / "off")
    run_train(resolve(preset_name="tiny", overrides={**over, "out": str(off), "train.greedy_val": 0}), tiny)
    rows = [json.loads(x) for x in (off / "train" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_tau" in r for r in rows) and not any("greedy_tau" in r for r in rows)
    assert [r["loss"] for r in rows if "loss" in r] == losses  # generating the answers leaves the training as it was
    assert not (off / "train" / "greedy_val.json").exists()


def test_ttt_decay_weighs_each_step(tiny_run, tiny, tmp_path):
    """The first step's loss at decay d is L0 + d*L1 + d**2*L2 (the TTT steps' losses on the same batch and the
    same initial weights): the per-step losses solved from d = 0, 0.5 and 1 predict the loss at d = 2. A decay
    below 0 is refused, naming the setting."""
    first = {}
    for d in (0.0, 0.5, 1.0, 2.0):
        run = clone_run(tiny_run, tmp_path / str(d))
        cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.max_steps": 1, "train.batch_tokens": 512,
                                                     "train.max_seq_len": 256, "train.ttt_steps": 3,
                                                     "train.ttt_decay": d})
        run_train(cfg, tiny)
        rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
        first[d] = [r["loss"] for r in rows if "loss" in r][0]
    l0 = first[0.0]
    # L1 + L2 = a and L1/2 + L2/4 = b
    a, b = first[1.0] - l0, first[0.5] - l0
    l2 = (a - 2 * b) * 2
    l1 = a - l2
    assert l1 > 0 and l2 > 0
    assert first[2.0] == pytest.approx(l0 + 2 * l1 + 4 * l2, rel=1e-4)
    bad = resolve(preset_name="tiny", overrides={"out": str(tmp_path / "bad"), "train.ttt_decay": -0.5})
    with pytest.raises(EyasError, match=r"train.ttt_decay must be 0 or above, got -0.5"):
        run_train(bad, tiny)


def test_feature_cache_trains_like_recomputing(tiny_run, tiny, tmp_path):
    """Online features kept after their first computation (train.feature_cache_gb) give the losses of
    recomputing them every epoch (to float rounding: a sequence's forward can fall in another padded
    group), and later epochs read them from the cache."""
    out = {}
    for gb in (0, 1):
        run = clone_run(tiny_run, tmp_path / f"cache{gb}")
        cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.epochs": 3, "train.batch_tokens": 512,
                                                     "train.max_seq_len": 256, "train.online": True,
                                                     "train.feature_cache_gb": gb})
        summary = run_train(cfg, tiny)
        rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
        out[gb] = ([r["loss"] for r in rows if "loss" in r], summary)
    (plain, s0), (cached, s1) = out[0], out[1]
    assert len(plain) == len(cached) == s1["steps"] and s1["steps"] >= 3
    assert plain == pytest.approx(cached, rel=1e-4)
    c, c0 = s1["feature_cache"], s0["feature_cache"]
    n = len(load_tokens(tiny_run, "train"))
    assert s1["feature_warm"]["sequences"] == c["sequences"] == c["misses"] == n  # computed once, ahead of training
    assert c0["sequences"] == c0["hits"] == 0 and s0["feature_warm"] is None
    assert c["hits"] == c0["misses"]  # every batch the recomputing run computed came from the cache
    assert "2" in s1["epoch_tok_s"]  # the throughput of each epoch, where the cache shows


def test_statistics_read_a_step_late_log_what_reading_at_once_logs(tiny_run, tiny, tmp_path, monkeypatch):
    """LAG_STATS (each step's loss, accuracies, grad norm and tokens read one step later, so the host does not wait
    for the device between steps) logs the same rows in the same order as reading them at once, through the
    validations and checkpoints that read them at once, and trains the same drafter."""
    import eyas.train.trainer as train_mod
    from safetensors.torch import load_file

    out = {}
    for lag in (False, True):
        monkeypatch.setattr(train_mod, "LAG_STATS", lag)
        run = clone_run(tiny_run, tmp_path / f"lag{int(lag)}")
        cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.epochs": 2, "train.batch_tokens": 512,
                                                     "train.max_seq_len": 256, "train.eval_every": 3,
                                                     "train.save_every": 5})
        summary = run_train(cfg, tiny)
        rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
        out[lag] = ([{k: v for k, v in r.items() if k != "tok_s"} for r in rows], summary,
                    load_file(str(run / "draft" / "model.safetensors")))
    (rows0, s0, w0), (rows1, s1, w1) = out[False], out[True]
    steps = [r["step"] for r in rows1 if "loss" in r]
    assert steps == list(range(1, s1["steps"] + 1)) and s1["steps"] >= 7
    assert rows1 == rows0  # every step's row and every validation's, in the same order
    assert s1["tokens_trained"] == s0["tokens_trained"] and s1["best"] == s0["best"]
    assert s1["tok_s_steady"] and set(s1["step_time_split"]) == {"features", "forward", "backward", "optimizer"}
    assert w1.keys() == w0.keys() and all(torch.equal(w1[k], w0[k]) for k in w0)


def test_host_feature_tier_trains_like_recomputing(tiny_run, tiny, tmp_path):
    """Sequences whose features do not fit in the device cache go to the host tier
    (train.feature_cache_host_gb) and train as if recomputed; every sequence is kept in one tier or the other,
    and later epochs read the host tier."""
    out = {}
    for name, over in (("plain", {"train.feature_cache_gb": 0, "train.feature_cache_host_gb": 0}),
                       ("tiers", {"train.feature_cache_gb": 0.0002, "train.feature_cache_host_gb": 1})):
        run = clone_run(tiny_run, tmp_path / name)
        cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.epochs": 3, "train.batch_tokens": 512,
                                                     "train.max_seq_len": 256, "train.online": True, **over})
        summary = run_train(cfg, tiny)
        rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
        out[name] = ([r["loss"] for r in rows if "loss" in r], summary)
    (plain, _), (tiers, s) = out["plain"], out["tiers"]
    assert plain == pytest.approx(tiers, rel=1e-4)
    c = s["feature_cache"]
    n = len(load_tokens(tiny_run, "train"))
    assert 0 < c["sequences"] < n and c["host_sequences"] == n - c["sequences"]  # both tiers used, nothing dropped
    assert s["feature_warm"]["sequences"] == n and s["feature_warm"]["host_sequences"] == c["host_sequences"]
    assert c["host_hits"] >= 2 * c["host_sequences"]  # epochs 2 and 3 at least read them back
    assert c["misses"] == n  # computed once
    # nothing holds the host tier once the training returns, so `eyas run` can give its (pinned) memory back
    import gc

    from eyas.features import HostSlab

    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, HostSlab) and o.chunks]


def test_host_slab_keeps_copies_within_its_limit():
    from eyas.features import HostSlab

    slab = HostSlab(3000)
    slab.CHUNK = 1024  # several chunks
    a = torch.randn(7, 5).to(torch.bfloat16)
    b = torch.arange(11, dtype=torch.int32)
    c = torch.randn(3, 2, 4)
    kept = slab.put((a, b, c))
    assert kept is not None and all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(kept, (a, b, c)))
    a[0, 0] = 99  # copies, not views of the caller's tensors
    assert kept[0][0, 0] != 99
    more = [slab.put((torch.full((100,), float(i)),)) for i in range(8)]  # 448 bytes each with the alignment
    assert [m is not None for m in more] == [True] * 5 + [False] * 3  # 3000 bytes: the rest refused
    assert all(torch.equal(m[0], torch.full((100,), float(i))) for i, m in enumerate(more[:5]))  # nothing overwritten
    assert slab.used <= slab.limit and len(slab.chunks) > 1
    assert HostSlab(0).put((b,)) is None


def test_a_host_slab_whose_memory_runs_out_refuses_instead_of_failing(monkeypatch, capsys):
    """A host that has less memory than the budget said (an allocation fails) ends the slab where it is: what it
    holds stays, later puts are refused (the sequences are computed again), and the log says so once."""
    from eyas.features import HostSlab

    slab = HostSlab(4096)
    slab.CHUNK = 1024
    first = slab.put((torch.full((100,), 1.0),))
    real = torch.empty

    def no_memory(*a, **k):
        raise RuntimeError("CUDA error: out of memory\nmore")

    monkeypatch.setattr(torch, "empty", no_memory)
    assert [slab.put((torch.full((200,), 2.0),)) for _ in range(3)] == [None] * 3
    monkeypatch.setattr(torch, "empty", real)
    err = capsys.readouterr().err
    assert err.count("host memory for features stopped at") == 1 and "(RuntimeError: CUDA error: out of memory)" in err
    assert slab.limit == slab.used and torch.equal(first[0], torch.full((100,), 1.0))


def test_host_cache_budget():
    from eyas.features import host_cache_budget

    assert host_cache_budget(2, "cpu") == 2e9  # as given
    assert host_cache_budget(-1, "cpu") == 0  # auto: none on a CPU
    assert host_cache_budget(-1, "cuda", available=100e9) == 80e9  # auto: 80% of what is available
    assert host_cache_budget(-1, "cuda", available=100e9, local_processes=2) == 40e9
    assert host_cache_budget(-1, "cuda", available=40e9) == 24e9  # at least 16 GB left to the rest
    assert host_cache_budget(-1, "cuda", available=10e9) == 0


def test_available_memory_is_bounded_by_the_memory_cgroup(tmp_path):
    """Inside a container with a memory limit, psutil and /proc/meminfo count the whole machine: the memory the host
    tier may take is bounded by what the cgroup's limit leaves (its dropped-at-will file pages counted as room), in
    cgroup v2 and v1, in the process's own group or at the mount's root; no limit or no cgroup leaves the host's."""
    from eyas.util import cgroup_room, mem_available

    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/job/a\n0::/job/b\n")
    v2 = tmp_path / "v2"
    (v2 / "job" / "b").mkdir(parents=True)
    (v2 / "job" / "b" / "memory.max").write_text("40000000000\n")
    (v2 / "job" / "b" / "memory.current").write_text("30000000000\n")
    (v2 / "job" / "b" / "memory.stat").write_text("anon 1\ninactive_file 5000000000\nactive_file 7\n")
    assert cgroup_room(v2, proc) == 15_000_000_000
    assert 0 < mem_available(v2, proc) <= 15_000_000_000
    (v2 / "job" / "b" / "memory.max").write_text("max\n")  # no limit of its own
    assert cgroup_room(v2, proc) is None and mem_available(v2, proc) == mem_available(tmp_path / "none", proc)
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)  # the mount's root, as inside a container
    (v1 / "memory" / "memory.limit_in_bytes").write_text("24000000000\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("26000000000\n")
    (v1 / "memory" / "memory.stat").write_text("cache 9\ninactive_file 1\ntotal_inactive_file 3000000000\n")
    assert cgroup_room(v1, proc) == 1_000_000_000
    (v1 / "memory" / "memory.stat").unlink()
    assert cgroup_room(v1, proc) == 0  # over its limit: no room, never below 0
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_room(v1, proc) is None
    assert cgroup_room(tmp_path / "none", tmp_path / "no_proc") is None


def _graph_runs(tiny_run, target, tmp_path, **over) -> dict:
    """Two short runs of the tiny preset, train.cuda_graph off and on, with validations and checkpoints between
    steps: {on: (loss rows, summary, drafter weights)}."""
    from safetensors.torch import load_file

    out = {}
    for on in (False, True):
        run = clone_run(tiny_run, tmp_path / f"graph{int(on)}")
        cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.epochs": 2, "train.batch_tokens": 512,
                                                     "train.max_seq_len": 256, "train.eval_every": 3,
                                                     "train.save_every": 5, "train.cuda_graph": on, **over})
        summary = run_train(cfg, target)
        out[on] = (losses(run), summary, load_file(str(run / "draft" / "model.safetensors")))
    return out


@pytest.mark.parametrize("accum", [1, 2])
def test_graph_step_on_cpu_trains_like_the_plain_step(tiny_run, tiny, tmp_path, monkeypatch, accum):
    """train.cuda_graph's step, run eagerly on the CPU (GRAPH_ON_CPU): each batch padded to the budget and copied
    into one set of buffers, the loss denominators and real tokens read from tensors. One micro-batch a step
    (StepGraph): one body for the loss, the backward, clipping and AdamW, gradients set to None before each. Two
    (grad_accum 2, AccumGraph): a body per micro-batch adding its gradients into one flat buffer zeroed once a
    step, then one for clipping and AdamW. Their losses, validations and drafter are the plain loop's, to the
    rounding the padding brings; a step that read a stale batch, denominator or token count, or lost or doubled a
    micro-batch's gradients, would not be."""
    import eyas.train.trainer as train_mod

    monkeypatch.setattr(train_mod, "GRAPH_ON_CPU", True)
    out = _graph_runs(tiny_run, tiny, tmp_path, **({"train.grad_accum": accum} if accum > 1 else {}))
    (plain, s0, w0), (graphed, s1, w1) = out[False], out[True]
    assert s0["step_graph"] == "off" and s1["step_graph"] == "eager (no capture)"
    assert [s for s, _ in graphed] == [s for s, _ in plain] == list(range(1, s1["steps"] + 1))
    assert s1["steps"] >= 7 // accum
    assert [v for _, v in graphed] == pytest.approx([v for _, v in plain], rel=1e-4)
    assert len({round(v, 3) for _, v in plain}) > 3  # the batches differ, so a stale one would show
    assert s1["tokens_trained"] == s0["tokens_trained"]
    assert s1["best"]["step"] == s0["best"]["step"]
    assert s1["best"]["val_acc"] == pytest.approx(s0["best"]["val_acc"], abs=1e-3)
    assert all(torch.allclose(w1[k], w0[k], rtol=1e-3, atol=1e-5) for k in w0)
    assert set(s1["step_time_split"]) == {"features", "step"}


def test_graph_step_refused_where_it_cannot_run():
    """The reasons train.cuda_graph falls back to eager steps, one line each."""
    from eyas.train.stepgraph import graph_unfit

    cuda = torch.device("cuda")
    assert "GPU" in graph_unfit(torch.device("cpu"), 1, 1, 0.0, True, False)
    assert "FSDP2" in graph_unfit(cuda, 2, 1, 0.0, True, True)
    assert graph_unfit(cuda, 2, 1, 0.0, True, False) == graph_unfit(cuda, 1, 4, 0.0, True, False) == ""  # AccumGraph
    assert "noise_std" in graph_unfit(cuda, 1, 1, 0.05, True, False)
    assert "compiled" in graph_unfit(cuda, 1, 1, 0.0, False, False)
    assert graph_unfit(cuda, 1, 1, 0.0, True, False) == ""


@pytest.mark.gpu
def test_graph_step_on_gpu_trains_like_the_eager_step(tiny_run, tmp_path):
    """On a GPU the step is captured after its warm-up and replayed; its losses follow the eager steps' to the
    rounding of AdamW's learning rate read as a float32 tensor and of autocast without its weight cache."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    target = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    out = _graph_runs(tiny_run, target, tmp_path)
    (plain, s0, w0), (graphed, s1, w1) = out[False], out[True]
    assert s0["step_graph"] == "off" and s1["step_graph"] == "graph", s1["step_graph"]
    assert [s for s, _ in graphed] == [s for s, _ in plain] and s1["steps"] >= 7
    assert [v for _, v in graphed] == pytest.approx([v for _, v in plain], rel=2e-3)
    assert s1["best"]["val_acc"] == pytest.approx(s0["best"]["val_acc"], abs=0.02)
    assert all(torch.allclose(w1[k], w0[k], rtol=1e-2, atol=1e-4) for k in w0)


@pytest.mark.gpu
def test_accum_graph_on_gpu_trains_like_the_eager_step(tiny_run, tmp_path):
    """grad_accum 2 on a GPU: AccumGraph captures the micro-batch's forward and backward and the update as two
    graphs after their warm-up, the replays adding into the flat gradients; the losses and drafter follow the
    eager steps' as the one-graph step's do."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    target = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    out = _graph_runs(tiny_run, target, tmp_path, **{"train.grad_accum": 2})
    (plain, s0, w0), (graphed, s1, w1) = out[False], out[True]
    assert s0["step_graph"] == "off" and s1["step_graph"] == "graph", s1["step_graph"]
    assert [s for s, _ in graphed] == [s for s, _ in plain] and s1["steps"] >= 4
    assert [v for _, v in graphed] == pytest.approx([v for _, v in plain], rel=2e-3)
    assert all(torch.allclose(w1[k], w0[k], rtol=1e-2, atol=1e-4) for k in w0)


@pytest.mark.gpu
def test_two_gpu_processes_with_graphs_equal_one(tiny_run, tmp_path):
    """Two processes on two GPUs (NCCL), each step's micro-batch through AccumGraph's captured graphs and the flat
    gradients all-reduced between them, against one process with grad_accum 2 on one GPU: the same losses and
    weights, to the rounding of the GPU's kernels. Skipped with fewer than two GPUs."""
    from safetensors.torch import load_file

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    args = ["--max-steps", "8", "--save-every", "8", "--eval-every", "8", "--device", "cuda", "--cuda-graph"]
    one = clone_run(tiny_run, tmp_path / "one")
    two = clone_run(tiny_run, tmp_path / "two")
    r = subprocess.run(cli(one, *args, "--grad-accum", "2"), env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(cli(two, *args, "--grad-accum", "1", torchrun=2), env=env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [json.loads((run / "train" / "summary.json").read_text()) for run in (one, two)]
    assert [s["processes"] for s in summaries] == [1, 2]
    assert [s["step_graph"] for s in summaries] == ["graph", "graph"], [s["step_graph"] for s in summaries]
    assert [v for _, v in losses(two)] == pytest.approx([v for _, v in losses(one)], rel=2e-3)
    a = load_file(str(one / "ckpt" / "step-0000008" / "model.safetensors"))
    b = load_file(str(two / "ckpt" / "step-0000008" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], rtol=1e-2, atol=1e-4) for k in a)


@pytest.mark.gpu
def test_graph_step_kill_and_resume_on_gpu(tiny_run, tmp_path):
    """kill -9 during a run whose steps replay a CUDA graph, then the same command: it resumes from the last
    checkpoint, warms up and captures again, and logs the losses of the uninterrupted run (to the rounding of
    any atomic adds in the GPU's backward)."""
    args = ["--epochs", "3", "--max-steps", "24", "--save-every", "4", "--eval-every", "8", "--device", "cuda",
            "--cuda-graph"]
    slow = dict(env(), EYAS_DEBUG_STEP_SLEEP="0.2")  # steps of a few ms would end the run before the kill
    full = clone_run(tiny_run, tmp_path / "full")
    subprocess.run(cli(full, *args), env=env(), check=True, capture_output=True, timeout=600)
    ref = losses(full)
    assert [s for s, _ in ref] == list(range(1, 25))
    assert json.loads((full / "train" / "summary.json").read_text())["step_graph"] == "graph"

    cut = killed_and_resumed(clone_run(tiny_run, tmp_path / "cut"), args, slow)
    got = losses(cut)
    assert [s for s, _ in got] == [s for s, _ in ref]
    assert [v for _, v in got] == pytest.approx([v for _, v in ref], rel=1e-5)
    assert json.loads((cut / "train" / "summary.json").read_text())["step_graph"] == "graph"


# ------------------------------------------------------------------ non-finite numbers, damaged checkpoints

def test_non_finite_settings_are_refused_naming_the_setting(tmp_path):
    """inf and nan parse as floats (TOML, flags, --set) but are no setting: every float setting refuses them, naming
    itself; on the command line in one line, before any work (`--lr inf` trained a drafter full of Inf)."""
    import dataclasses
    import typing

    from eyas.config import SECTIONS, Config

    floats = [f"{sec}.{f.name}" for sec in SECTIONS for f in dataclasses.fields(getattr(Config(), sec))
              if typing.get_type_hints(type(getattr(Config(), sec)))[f.name] is float]
    assert {"train.lr", "regen.temperature", "eval.temperature", "train.grad_clip"} <= set(floats)
    for key in floats:
        for bad in ("inf", "-inf", "nan", float("inf")):
            with pytest.raises(EyasError, match=rf"config key '{key}': expected a finite number"):
                resolve(preset_name="tiny", overrides={"out": str(tmp_path / "r"), key: bad})
    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nlr = nan\n")
    with pytest.raises(EyasError, match=r"c.toml: config key 'train.lr': expected a finite number, got nan"):
        resolve(str(toml))
    for cmd, flag in (("train", "--lr"), ("regen", "--temperature"), ("eval", "--temperature")):
        r = subprocess.run([sys.executable, "-m", "eyas", cmd, "--preset", "tiny", "--out", str(tmp_path / cmd), flag,
                            "inf"], env=env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "expected a finite number, got 'inf'" in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / cmd).exists()


@pytest.mark.parametrize("step", ["plain", "graph"])
def test_diverged_training_stops_naming_the_step_and_writes_nothing_of_it(tiny_run, tiny, tmp_path, monkeypatch,
                                                                         step):
    """A learning rate of 1e30 (finite, accepted) sends the weights to Inf within a step or two: training stops with
    one line naming the step, where it finished with val_loss NaN and a drafter of Inf before. Its statistics are
    read where they were anyway (a step late, LAG_STATS): no checkpoint or drafter is written after they went bad,
    in the plain loop and in the CUDA-graph step (run eagerly on the CPU)."""
    import eyas.train.trainer as train_mod

    monkeypatch.setattr(train_mod, "GRAPH_ON_CPU", step == "graph")
    run = clone_run(tiny_run, tmp_path / "r")
    cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.lr": 1e30, "train.batch_tokens": 256,
                                                 "train.max_seq_len": 256, "train.max_steps": 6,
                                                 "train.cuda_graph": step == "graph", "train.greedy_val": 0})
    with pytest.raises(EyasError, match=r"train: the (training loss|gradient norm) is (nan|inf) at step [1-5] .*"
                                        r"diverged.*lower train.lr"):
        run_train(cfg, tiny)
    assert not (run / "ckpt").exists() and not (run / "draft").exists()


def test_a_checkpoint_with_non_finite_weights_is_neither_resumed_nor_fine_tuned_from(tiny_run, tiny, tmp_path):
    """A checkpoint holding NaN (weights or optimizer state) was resumed and trained on: now resuming, and
    fine-tuning from it, stop naming the file and the tensor."""
    from safetensors.torch import load_file, save_file

    run = clone_run(tiny_run, tmp_path / "r")
    over = {"out": str(run), "train.batch_tokens": 512, "train.max_seq_len": 256, "train.save_every": 1,
            "train.greedy_val": 0, "train.max_steps": 2}
    run_train(resolve(preset_name="tiny", overrides=over), tiny)
    ck = run / "ckpt" / "step-0000002"
    for f, name in (("optim.safetensors", "fc.weight::exp_avg_sq"), ("model.safetensors", "fc.weight")):
        sd = load_file(str(ck / f))
        sd[name] = sd[name].clone()
        sd[name].view(-1)[0] = float("nan")
        save_file(sd, str(ck / f))
        with pytest.raises(EyasError, match=rf"{ck / f}: tensor '{name}' holds 1 non-finite values .*delete "
                                            rf"{run / 'ckpt'} to start over"):
            run_train(resolve(preset_name="tiny", overrides=over), tiny)  # (a finished run resumes too)
    cfg = resolve(preset_name="tiny", overrides={"out": str(tmp_path / "ft"), "train.finetune_from": str(ck)})
    with pytest.raises(EyasError, match=rf"{ck / 'model.safetensors'}: tensor 'fc.weight' holds 1 non-finite"):
        initial_drafter(cfg, tiny, load_vocab(tiny_run))


def test_ctrl_c_stops_training_as_the_other_commands_stop(tiny_run, tiny, tmp_path):
    """Ctrl-C stops the training as KeyboardInterrupt (the CLI exits 130), after saving the step under way; SIGTERM
    as Terminated (143: test_sigterm_saves_the_step_under_way_and_resumes_the_same), as regen and the other
    commands do."""
    from eyas.util import Terminated

    run = clone_run(tiny_run, tmp_path / "r")
    cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.batch_tokens": 512, "train.max_seq_len": 256,
                                                 "train.max_steps": 6, "train.greedy_val": 0})
    with pytest.raises(KeyboardInterrupt) as e:
        run_train(cfg, tiny, on_step=lambda s: s == 2 and os.kill(os.getpid(), signal.SIGINT))
    assert not isinstance(e.value, Terminated)
    assert json.loads((run / "ckpt" / "latest.json").read_text())["step"] == 3


def test_disk_full_while_saving_a_checkpoint_stops_in_one_line_leaving_nothing_half_written(tiny_run, tiny, tmp_path,
                                                                                          monkeypatch):
    """safetensors' writer raised its own error, a traceback, when the disk filled under a checkpoint, and left the
    unfinished checkpoint folder: now one line naming the checkpoint, the space it takes and what is free."""
    import safetensors.torch as st
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # what a writer leaves when the disk fills under it
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(st, "save_file", full)
    run = clone_run(tiny_run, tmp_path / "r")
    cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.batch_tokens": 512, "train.max_seq_len": 256,
                                                 "train.max_steps": 2, "train.save_every": 1, "train.greedy_val": 0})
    with pytest.raises(EyasError, match=rf"^{run / 'ckpt' / 'step-0000001'}: not written, the disk is full \(about "
                                        r"[\d.]+ [KM]B needed, [\d.]+ [KMGT]?B free on .*run the same command again$"):
        run_train(cfg, tiny)
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == []  # no unfinished folder, no latest.json
