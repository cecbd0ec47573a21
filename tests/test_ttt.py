"""Training-time test: the packed, masked unroll equals a slow reference that drafts each sequence
on its own with an explicit loop over steps and positions (attention by hand)."""
import math

import pytest
import torch

from eyas.train import attention, ttt
from eyas.draft import build_drafter
from eyas.features import OnlineFeatures, Sample
from eyas.train.attention import TTTAttend, ttt_dense_mask
from eyas.train.ttt import acceptance_length, count_positions, pack_samples, target_labels, ttt_unroll

LENGTHS = [9, 4, 13, 2, 7]


def allowed_by_rule(lengths, pad, step):
    """The TTT rule, spelled out: query (step j, position t) sees step-0 keys of its own sequence
    at positions <= t, and the keys of steps 1..j at position t."""
    spans, off = [], 0
    for L in lengths + ([pad] if pad else []):
        spans.append((off, off + L))
        off += L
    n = off
    m = torch.zeros(n, (step + 1) * n, dtype=torch.bool)
    for a, b in spans:
        for q in range(a, b):
            for kv in range(a, q + 1):
                m[q, kv] = True
            for i in range(1, step + 1):
                m[q, i * n + q] = True
    return m


def test_mask_equals_rule():
    samples = [Sample(torch.zeros(L, dtype=torch.long), torch.ones(L, dtype=torch.bool), torch.zeros(L, 3),
                      torch.zeros(L, 1)) for L in LENGTHS]
    b = pack_samples(samples, pad_to=40)
    assert b.n_real == sum(LENGTHS) and b.input_ids.shape[0] == 40
    for step in range(4):
        assert torch.equal(ttt_dense_mask(b.doc, step), allowed_by_rule(LENGTHS, 40 - sum(LENGTHS), step))


def test_count_positions():
    m = torch.tensor([0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    # sequence [0,1,1,1] then [0,1,1]: step j trains on tokens j+2.. of each sequence
    assert count_positions(m, [4, 3], 3) == [2 + 1, 1 + 0, 0]


def test_acceptance_length():
    assert acceptance_length([0.8, 0.5, 0.5]) == pytest.approx(0.8 + 0.4 + 0.2)
    assert acceptance_length([]) == 0.0


def reference_unroll(drafter, sample, lm_head, draft_ids, steps, path="all"):
    """One sequence, no packing: step j, position t drafts x_{t+j+2} from (x_{t+j+1}, h^{(j-1)}_t)
    with attention written as loops; soft CE against softmax(target logits at t+j+1) over the
    draft vocab on loss-masked x_{t+j+2} whose full-vocab target argmax is in the draft vocab.
    path (loss_path): at step j > 0 only positions whose fed tokens x_{t+2}..x_{t+j+1} each are the target's top
    token in the draft vocabulary ("greedy"), and also each step before j's argmax ("chain")."""
    ids, mask, aux, final = sample.input_ids, sample.loss_mask, sample.aux, sample.final
    L = len(ids)
    full = final @ lm_head.weight.T
    top = full.argmax(-1)
    to_draft = {int(t): i for i, t in enumerate(draft_ids)}
    tl = full[:, draft_ids]

    def loop_attend():  # one per decoder layer, each with the keys of its own layer
        cache_k, cache_v = [], []

        def attend(q, k, v):  # q [1,h,L,d], k/v [1,kv,L,d]
            cache_k.append(k)
            cache_v.append(v)
            j = len(cache_k) - 1
            rep = q.shape[1] // k.shape[1]
            out = torch.zeros_like(q)
            for t in range(L):  # keys this position may see: its sequence up to t, then its own later steps
                keys = torch.cat([cache_k[0][0, :, : t + 1]] + [cache_k[i][0, :, t:t + 1] for i in range(1, j + 1)], 1)
                vals = torch.cat([cache_v[0][0, :, : t + 1]] + [cache_v[i][0, :, t:t + 1] for i in range(1, j + 1)], 1)
                keys, vals = keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0)  # [h, m, d]
                w = torch.softmax((keys @ q[0, :, t, :, None]).squeeze(-1) / math.sqrt(q.shape[-1]), -1)
                out[0, :, t] = (w[..., None] * vals).sum(1)
            return out
        return attend

    layers = drafter.config.num_hidden_layers
    attend = loop_attend() if layers == 1 else [loop_attend() for _ in range(layers)]
    hidden = aux[None]
    pos = torch.arange(L)[None]
    res, drafted = [], []
    for j in range(steps):
        inp = torch.tensor([int(ids[min(t + j + 1, L - 1)]) for t in range(L)])[None]
        hidden, logits = drafter(inp, hidden, pos + j, attend)  # step j drafts at position t+j
        drafted.append(logits[0].argmax(-1))
        loss, count, correct = torch.zeros(()), 0, 0
        for t in range(L):
            if t + j + 2 >= L or not mask[t + j + 2]:
                continue
            if path != "all" and not all(
                    to_draft.get(int(top[t + i]), -1) >= 0 and int(ids[t + i + 1]) == int(top[t + i])
                    and (path == "greedy" or int(drafted[i - 1][t]) == to_draft[int(top[t + i])])
                    for i in range(1, j + 1)):
                continue
            count += 1
            label = t + j + 1
            d = to_draft.get(int(top[label]), -1)
            if d < 0:
                continue
            p = torch.softmax(tl[label], -1)
            loss = loss - (p * torch.log_softmax(logits[0, t], -1)).sum()
            correct += int(int(logits[0, t].argmax()) == d)
        res.append((loss, count, correct))
    return res


@pytest.fixture(scope="module")
def setup(tiny):
    torch.manual_seed(3)
    V = tiny.vocab_size
    g = torch.Generator().manual_seed(1)
    seqs = []
    for L in LENGTHS:
        ids = torch.randint(0, V, (L,), generator=g)
        mask = torch.rand(L, generator=g) < 0.7
        seqs.append((ids, mask))

    class Toks:
        def __getitem__(self, i):
            return seqs[i]

    samples = OnlineFeatures(tiny, Toks()).get(list(range(len(seqs))))
    # a draft vocab that holds about half of the target's top tokens, so both cases occur
    full_top = torch.cat([(s.final @ tiny.model.get_output_embeddings().weight.T).argmax(-1) for s in samples])
    keep = full_top.unique()[::2]
    rest = torch.tensor(sorted(set(range(V)) - set(full_top.tolist())))
    draft_ids = torch.cat([keep, rest[torch.randperm(rest.numel(), generator=g)[:8]]]).sort().values
    drafter = build_drafter(tiny, draft_ids.numel(), draft_ids)
    with torch.no_grad():  # make the later steps matter: a random but non-trivial midlayer
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.mul_(4.0)
    return drafter, samples, draft_ids


def _deeper(tiny, setup, layers: int):
    """setup's drafter with `layers` decoder layers: its own weights where they exist, the later layers random and
    scaled up as setup's are."""
    drafter, _, draft_ids = setup
    if layers == 1:
        return drafter
    torch.manual_seed(5)
    deep = build_drafter(tiny, draft_ids.numel(), draft_ids, num_layers=layers)
    deep.load_state_dict(drafter.state_dict(), strict=False)
    with torch.no_grad():
        for n, p in deep.named_parameters():
            if n.startswith("layers.") and p.dim() == 2:
                p.mul_(4.0)
    return deep


@pytest.mark.parametrize("layers", [1, 2])
def test_unroll_equals_slow_reference(tiny, setup, layers):
    """The packed unroll (one TTTAttend per decoder layer) equals the loop reference: losses, counts, right
    guesses and every gradient, for EAGLE-3's one-layer drafter and a two-layer one."""
    _, samples, draft_ids = setup
    drafter = _deeper(tiny, setup, layers)
    assert len(drafter.decoder_layers()) == layers
    steps = 3
    lm_head = tiny.model.get_output_embeddings()
    batch = pack_samples(samples, pad_to=48)
    labels = target_labels(batch.final, lm_head, draft_ids, chunk=7)
    # the top ids the features carry give the same labels as recomputing them from the final states
    stored = target_labels(batch.final, lm_head, draft_ids, top=batch.top)
    n = batch.n_real
    assert torch.equal(stored.draft_idx[:n], labels.draft_idx[:n]) and torch.equal(stored.logits, labels.logits)
    drafter.zero_grad()
    st = ttt_unroll(drafter, batch, labels, steps)
    sum(st.loss_sum).backward()
    fast_grad = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}

    drafter.zero_grad()
    ref_loss = [torch.zeros(()) for _ in range(steps)]
    ref_cnt, ref_cor = [0] * steps, [0] * steps
    for s in samples:
        for j, (loss, c, k) in enumerate(reference_unroll(drafter, s, lm_head, draft_ids, steps)):
            ref_loss[j] = ref_loss[j] + loss
            ref_cnt[j] += c
            ref_cor[j] += k
    sum(ref_loss).backward()
    assert all(c > 0 for c in ref_cnt) and 0 < sum(ref_cor)
    for j in range(steps):
        assert st.loss_sum[j].item() == pytest.approx(ref_loss[j].item(), rel=1e-5)
        assert int(st.count[j]) == ref_cnt[j]
        assert int(st.correct[j]) == ref_cor[j]
    for n, p in drafter.named_parameters():
        if p.requires_grad:
            scale = float(p.grad.abs().max())
            assert scale > 0, n
            torch.testing.assert_close(fast_grad[n], p.grad, rtol=1e-4, atol=1e-5 * scale,
                                       msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("path", ["greedy", "chain"])
def test_loss_path_keeps_the_positions_a_decoder_reaches(tiny, path):
    """train.loss_path: steps after the first train only where the data's fed tokens are the target's top tokens
    (greedy), and also the drafter's earlier drafts (chain); losses, counts and right guesses equal the slow
    reference with the same filter. The text follows the tiny target's greedy path at 3 tokens in 4, so every step
    keeps some positions and drops others."""
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(2)
    V = tiny.vocab_size
    seqs = []
    for L in (23, 17, 30):
        ids = [int(torch.randint(0, V, (1,), generator=g))]
        with torch.no_grad():
            for _ in range(L - 1):
                top = int(tiny.model(torch.tensor([ids])).logits[0, -1].argmax())
                follow = float(torch.rand(1, generator=g)) < 0.75
                ids.append(top if follow else int(torch.randint(0, V, (1,), generator=g)))
        seqs.append((torch.tensor(ids), torch.rand(L, generator=g) < 0.9))

    class Toks:
        def __getitem__(self, i):
            return seqs[i]

    samples = OnlineFeatures(tiny, Toks()).get(list(range(len(seqs))))
    lm_head = tiny.model.get_output_embeddings()
    tops = torch.cat([(s.final @ lm_head.weight.T).argmax(-1) for s in samples]).unique()
    draft_ids = torch.cat([tops, torch.tensor(sorted(set(range(V)) - set(tops.tolist()))[:6])]).sort().values
    drafter = build_drafter(tiny, draft_ids.numel(), draft_ids)
    if path == "chain":  # a drafter that drafts the target's top token often: its head is the target's
        with torch.no_grad():
            drafter.lm_head.weight.copy_(lm_head.weight[draft_ids])
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, -tiny.model.config.hidden_size:] = torch.eye(tiny.model.config.hidden_size) * 4
    batch = pack_samples(samples, pad_to=80)
    labels = target_labels(batch.final, lm_head, draft_ids)
    with torch.no_grad():
        full = ttt_unroll(drafter, batch, labels, 3)
        st = ttt_unroll(drafter, batch, labels, 3, loss_path=path)
        ref = [[0.0, 0, 0] for _ in range(3)]
        for s in samples:
            for j, (loss, c, k) in enumerate(reference_unroll(drafter, s, lm_head, draft_ids, 3, path)):
                ref[j] = [ref[j][0] + float(loss), ref[j][1] + c, ref[j][2] + k]
    for j in range(3):
        assert float(st.loss_sum[j]) == pytest.approx(ref[j][0], rel=1e-5)
        assert int(st.count[j]) == ref[j][1] and int(st.correct[j]) == ref[j][2]
    assert int(st.count[0]) == int(full.count[0]) and float(st.loss_sum[0]) == pytest.approx(float(full.loss_sum[0]))
    assert all(0 < int(st.count[j]) < int(full.count[j]) for j in (1, 2)), (st.count, full.count)
    with pytest.raises(ValueError, match="loss_path"):
        ttt_unroll(drafter, batch, labels, 3, loss_path="greedy_only")


def test_steps_depend_on_own_hidden_states(tiny, setup):
    """Later TTT steps must read the drafter's fed-back states: changing fc changes step 1's loss
    only through them (fc is applied at step 0 alone)."""
    drafter, samples, draft_ids = setup
    lm_head = tiny.model.get_output_embeddings()
    batch = pack_samples(samples)
    labels = target_labels(batch.final, lm_head, draft_ids)
    with torch.no_grad():
        a = [float(x) for x in ttt_unroll(drafter, batch, labels, 2).loss_sum]
        w = drafter.fc.weight.clone()
        drafter.fc.weight.mul_(0.5)
        b = [float(x) for x in ttt_unroll(drafter, batch, labels, 2).loss_sum]
        drafter.fc.weight.copy_(w)
    assert a[1] != pytest.approx(b[1], rel=1e-4)


def test_packing_keeps_sequences_apart(tiny, setup):
    """A sequence's losses do not depend on what it is packed with."""
    drafter, samples, draft_ids = setup
    lm_head = tiny.model.get_output_embeddings()
    with torch.no_grad():
        alone = pack_samples(samples[2:3])
        la = ttt_unroll(drafter, alone, target_labels(alone.final, lm_head, draft_ids), 3)
        mixed = pack_samples([samples[0], samples[2], samples[1]], pad_to=64)
        lm = ttt_unroll(drafter, mixed, target_labels(mixed.final, lm_head, draft_ids), 3)
        other = pack_samples([samples[0], samples[1]], pad_to=64)
        lo = ttt_unroll(drafter, other, target_labels(other.final, lm_head, draft_ids), 3)
    for j in range(3):
        assert float(lm.loss_sum[j]) == pytest.approx(float(la.loss_sum[j]) + float(lo.loss_sum[j]), rel=1e-5)


def _attend_outputs(backend, lens, n, heads, dim, dtype, device="cpu"):
    """Outputs and gradients of three TTT steps of `backend` attention over a packed row."""
    doc = torch.cat([torch.full((L,), i) for i, L in enumerate(lens + [n - sum(lens)])]).int().to(device)
    g = torch.Generator(device=device).manual_seed(0)

    def rand(h):
        return [torch.randn(1, h, n, dim, generator=g, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]

    qs, ks, vs = rand(heads), rand(2), rand(2)
    att = TTTAttend(doc, backend, steps=3)
    o = torch.cat([att(q, k, v) for q, k, v in zip(qs, ks, vs)])
    o.square().sum().backward()
    return o.detach(), [t.grad for t in qs + ks + vs]


def _assert_same(a, b, tol):
    torch.testing.assert_close(a[0], b[0], rtol=tol, atol=tol)
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


@pytest.mark.compiler
def test_layers_share_each_steps_flex_mask(tiny, setup, monkeypatch):
    """A two-layer drafter's unroll with the flex attention makes one block mask a batch (the last TTT step's; the
    earlier steps' are cut from it), which both layers use (not one a layer), and gives the dense pattern's losses
    (forward only: flex has no backward on a CPU)."""
    drafter = _deeper(tiny, setup, 2)
    samples, draft_ids = setup[1], setup[2]
    batch = pack_samples(samples, pad_to=attention.FLEX_BLOCK, multiple=attention.FLEX_BLOCK)  # as on CUDA
    labels = target_labels(batch.final, tiny.model.get_output_embeddings(), draft_ids)
    built = []
    real, made = attention._block_mask, attention._last_step_mask
    monkeypatch.setattr(attention, "_block_mask", lambda doc, total, j: built.append((total, j)) or real(doc, total, j))
    monkeypatch.setattr(attention, "_last_step_mask", lambda doc, total: built.append(("last", total)) or made(doc, total))
    with torch.no_grad():
        flex = ttt_unroll(drafter, batch, labels, 3, backend="flex")
        dense = ttt_unroll(drafter, batch, labels, 3, backend="dense")
    assert built == [("last", 3)]
    assert [float(x) for x in flex.loss_sum] == pytest.approx([float(x) for x in dense.loss_sum], rel=1e-4)
    assert [int(x) for x in flex.correct] == [int(x) for x in dense.correct] and sum(int(x) for x in flex.correct) > 0


@pytest.mark.parametrize("total", [1, 3, 5])
def test_step_masks_list_the_blocks_of_the_mask_they_stand_for(total):
    """The flex block masks the unroll uses (the last TTT step's made from the documents' bounds, the earlier ones
    cut from it) list, for every query block, the same key blocks, partial and full, and for every key block the
    same query blocks (the backward's side) as torch's create_block_mask evaluating the TTT pattern at every
    position: over packed sequences that start and end inside blocks, on block bounds, span several blocks, and a
    padding tail."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(7)
    packings = [[100, 420, 7, 61, 40, 12], [640], [128, 128, 256, 128], [1] * 5 + [379]]
    for _ in range(6):
        n = 128 * int(torch.randint(1, 9, (1,), generator=g))
        cuts = sorted(set(torch.randint(1, n, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g).tolist()))
        packings.append([b - a for a, b in zip([0] + cuts, cuts + [n])])
    fulls = cut_away = 0
    for lengths in packings:
        n = sum(lengths)
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).int()
        masks = {}
        for j in range(total):
            def pattern(b, h, q, kv, j=j):
                return attention.ttt_mask_mod(doc, n)(b, h, q, kv) & (kv // n <= j)

            ref = create_block_mask(pattern, None, None, n, total * n, device="cpu", _compile=False)
            got = attention._step_mask(doc, total, j, masks)
            assert got.seq_lengths == ref.seq_lengths and tuple(got.BLOCK_SIZE) == tuple(ref.BLOCK_SIZE)
            for num, idx in attention.BLOCK_FIELDS:
                assert torch.equal(getattr(got, num), getattr(ref, num)), (lengths, j, num)
                for f in (num, idx):  # as create_block_mask's; flex's CUDA kernels read index rows as if their stride were 1
                    assert getattr(got, f).is_contiguous() and getattr(ref, f).is_contiguous(), (lengths, j, f)
            assert attention.block_lists(got) == attention.block_lists(ref), (lengths, j)
            fulls += int(ref.full_kv_num_blocks.sum())
            cut_away += int(masks[(total, total - 1)].kv_num_blocks.sum() - ref.kv_num_blocks.sum())
        assert list(masks) == [(total, total - 1)]  # one made a batch (the unroll keeps the cut ones beside it)
    assert fulls > 0 and (cut_away > 0 or total == 1)  # both kinds of block occur, and the cuts dropped some


@pytest.mark.gpu
def test_flex_equals_dense_on_gpu():
    args = ([300, 17, 129, 5, 400], 1024, 8, 64, torch.float32, "cuda")
    _assert_same(_attend_outputs("flex", *args), _attend_outputs("dense", *args), 2e-3)


def test_per_document_equals_dense_mask():
    """The CPU backend (attention inside each packed sequence + diagonal scores) computes the same
    outputs and gradients as SDPA with the dense TTT mask."""
    args = ([30, 1, 17, 5, 40], 96, 6, 16, torch.float64)
    _assert_same(_attend_outputs("docs", *args), _attend_outputs("dense", *args), 1e-10)


def _loss_inputs(n, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    lg = (3 * torch.randn(n, V, generator=g)).to(device, dtype).requires_grad_()
    tl = (3 * torch.randn(n, V, generator=g)).to(device, dtype)
    nxt = (torch.arange(n) + 1).clamp(max=n - 1).to(device)
    didx = torch.randint(-1, V, (n,), generator=g).to(device)
    didx[::3] = -1  # targets outside the draft vocabulary
    right = torch.arange(0, n - 1, 7)  # some right guesses: row t's argmax as the label read at row t+1
    didx[right + 1] = lg.detach().float().argmax(-1)[right].cpu().to(device)
    valid = (torch.rand(n, generator=g) < 0.7).to(device)
    return lg, tl, nxt, didx, valid


def _loss_and_grad(fn, lg, *rest):
    loss, correct = fn(lg, *rest)
    grad, = torch.autograd.grad(loss, lg)
    return loss, correct, grad


def test_step_loss_equals_log_softmax_form():
    """logsumexp(q) - sum(p q) over all rows, masked, is the soft cross-entropy -(p log_softmax(q)) summed over
    the rows that train, with its gradient; right guesses count valid rows only."""
    lg, tl, nxt, didx, valid = _loss_inputs(50, 300, torch.float32, "cpu")
    loss, correct, grad = _loss_and_grad(ttt._step_loss, lg, tl, nxt, didx, valid)
    rows = (valid & (didx[nxt] >= 0)).nonzero().squeeze(1)  # the rows that train
    lg64 = lg.detach().double().requires_grad_()  # the reference in float64
    ref = -(torch.softmax(tl.double()[nxt[rows]], -1) * torch.log_softmax(lg64[rows], -1)).sum()
    ref_grad, = torch.autograd.grad(ref, lg64)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
    hits = (lg.detach().argmax(-1) == didx[nxt]) & valid
    assert int(hits.sum()) > 0 and correct.item() == int(hits.sum())


def test_label_temperature_sharpens_the_labels(tiny, setup):
    """train.label_temperature divides the target's draft-vocabulary logits and keeps which token is on top; far
    below 1 the soft cross-entropy becomes the hard one against the target's top token."""
    drafter, samples, draft_ids = setup
    b = pack_samples(samples)
    head = tiny.model.get_output_embeddings()
    one, half = (target_labels(b.final, head, draft_ids, temperature=t) for t in (1.0, 0.5))
    torch.testing.assert_close(half.logits, one.logits / 0.5)
    assert torch.equal(half.draft_idx, one.draft_idx) and int((one.draft_idx >= 0).sum()) > 0
    n = b.input_ids.shape[0]
    lg = torch.randn(n, draft_ids.numel(), generator=torch.Generator().manual_seed(5))
    nxt, valid = torch.arange(n), torch.ones(n, dtype=torch.bool)
    trains = one.draft_idx >= 0
    hard = torch.nn.functional.cross_entropy(lg[trains], one.draft_idx[trains], reduction="sum")
    cold = target_labels(b.final, head, draft_ids, temperature=1e-4)
    sharp, _ = ttt._step_loss(lg, cold.logits, nxt, cold.draft_idx, valid)
    soft, _ = ttt._step_loss(lg, one.logits, nxt, one.draft_idx, valid)
    assert sharp.item() == pytest.approx(hard.item(), rel=1e-4) and abs(soft.item() - hard.item()) > 1e-2 * hard.item()


@pytest.mark.compiler
def test_compiled_step_loss_equals_eager(monkeypatch):
    """The step loss as torch.compile builds it (what training runs on a GPU) gives the eager loss, count and
    gradient; here through inductor's CPU code, on a GPU below through its Triton code."""
    monkeypatch.setattr(ttt, "_compiled_loss", None)
    args = _loss_inputs(40, 257, torch.float32, "cpu", seed=1)
    eager = _loss_and_grad(ttt._step_loss, *args)
    compiled = _loss_and_grad(ttt.step_loss_fn(torch.device("cpu"), "on"), *args)
    assert ttt.loss_state(torch.device("cpu"), "on") == "compiled"
    assert compiled[0].item() == pytest.approx(eager[0].item(), rel=1e-5)
    assert compiled[1].item() == eager[1].item()
    torch.testing.assert_close(compiled[2], eager[2], rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_compiled_step_loss_equals_eager_on_gpu(monkeypatch):
    """On CUDA in bf16 at the training shape's scale, `step_loss_fn` is the compiled loss and agrees with eager."""
    monkeypatch.setattr(ttt, "_compiled_loss", None)
    fn = ttt.step_loss_fn(torch.device("cuda"))
    args = _loss_inputs(4096, 32000, torch.bfloat16, "cuda", seed=2)
    eager = _loss_and_grad(ttt._step_loss, *args)
    compiled = _loss_and_grad(fn, *args)
    assert ttt.loss_state(torch.device("cuda")) == "compiled"
    assert compiled[0].item() == pytest.approx(eager[0].item(), rel=1e-3)
    assert compiled[1].item() == eager[1].item()
    torch.testing.assert_close(compiled[2].float(), eager[2].float(), rtol=2e-2, atol=1e-3)


class BrokenBackward(torch.autograd.Function):
    """Forward fine, backward raising like a failed backward compile."""
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward compile failed\nsecond line")


def compile_fails(*a):
    raise RuntimeError("forward compile failed")


def test_compiled_loss_falls_back_to_eager(monkeypatch):
    """A compiler failure, in the forward or in the lazily built backward, leaves training on the eager loss with
    the reason in `state`, and the loss and gradient are eager's."""
    args = _loss_inputs(30, 101, torch.float32, "cpu", seed=3)
    eager = _loss_and_grad(ttt._step_loss, *args)

    for fake, why in [(compile_fails, "forward compile failed"),
                      (lambda lg, *rest: ttt._step_loss(BrokenBackward.apply(lg), *rest), "backward compile failed")]:
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: fake)
        monkeypatch.setattr(ttt, "_compiled_loss", None)
        fn = ttt.step_loss_fn(torch.device("cpu"), "on")
        got = _loss_and_grad(fn, *args)
        state = ttt.loss_state(torch.device("cpu"), "on")
        assert state.startswith("eager: torch.compile failed") and why in state and "second line" not in state
        assert got[0].item() == eager[0].item() and got[1].item() == eager[1].item()
        torch.testing.assert_close(got[2], eager[2])
        again = _loss_and_grad(fn, *args)  # later calls go straight to eager
        torch.testing.assert_close(again[2], eager[2])
    assert ttt.loss_state(torch.device("cpu"), "off") == "eager"
    assert ttt.loss_state(torch.device("cpu")) == "eager"  # auto: compiled on CUDA only
    with pytest.raises(ValueError, match="compile setting"):
        ttt.step_loss_fn(torch.device("cpu"), "yes")


def _unroll_grads(drafter, batch, labels, backend="auto", steps=3, compile_drafter="off"):
    drafter.zero_grad()
    st = ttt_unroll(drafter, batch, labels, steps, backend=backend, compile_drafter=compile_drafter)
    sum(st.loss_sum).backward()
    return ([float(x.detach()) for x in st.loss_sum], [int(x) for x in st.correct],
            {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad})


@pytest.mark.compiler
@pytest.mark.parametrize("backend,layers", [("docs", 1), ("dense", 1), ("docs", 2)])
def test_compiled_drafter_step_equals_eager(tiny, setup, monkeypatch, backend, layers):
    """The unroll with the drafter's stateless parts compiled around the attention (`compile_drafter`; with two
    layers, also the part between them) gives the eager unroll's losses, right guesses and gradients, on the first
    call (which also probes the compiled graphs on copies: they must leave the attention's keys and the gradients
    alone) and on later ones, and with no grad."""
    import copy

    drafter = copy.deepcopy(_deeper(tiny, setup, layers))
    samples, draft_ids = setup[1], setup[2]
    lm_head = tiny.model.get_output_embeddings()
    batch = pack_samples(samples, pad_to=48)
    labels = target_labels(batch.final, lm_head, draft_ids)
    eager = _unroll_grads(drafter, batch, labels, backend)
    assert sum(eager[1]) > 0
    for _ in range(2):
        got = _unroll_grads(drafter, batch, labels, backend, compile_drafter="on")
        assert ttt.drafter_state(drafter, torch.device("cpu"), "on") == "compiled"
        assert got[0] == pytest.approx(eager[0], rel=1e-5) and got[1] == eager[1]
        for n, g in eager[2].items():
            torch.testing.assert_close(got[2][n], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()),
                                       msg=lambda m, n=n: f"{n}: {m}")
    with torch.no_grad():
        st = ttt_unroll(drafter, batch, labels, 3, backend=backend, compile_drafter="on")
    assert [float(x) for x in st.loss_sum] == pytest.approx(eager[0], rel=1e-5)
    assert ttt.drafter_state(drafter, torch.device("cpu")) == "eager"  # auto, the default: eager on a CPU


def test_compiled_drafter_step_falls_back_to_eager(tiny, setup, monkeypatch):
    """A compiler failure in either part, forward or backward, leaves the unroll eager with the reason in
    `state`, and its losses and gradients are eager's."""
    import copy

    samples, draft_ids = setup[1], setup[2]
    lm_head = tiny.model.get_output_embeddings()
    batch = pack_samples(samples, pad_to=48)
    labels = target_labels(batch.final, lm_head, draft_ids)
    eager = _unroll_grads(setup[0], batch, labels)

    def backward_fails(fn):
        def run(*a):
            h, *rest = fn(*a)
            return (BrokenBackward.apply(h), *rest)
        return run

    for fake, why in [(lambda fn: compile_fails, "forward compile failed"), (backward_fails, "backward compile failed")]:
        drafter = copy.deepcopy(setup[0])
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: fake(fn))
        got = _unroll_grads(drafter, batch, labels, compile_drafter="on")
        state = ttt.drafter_state(drafter, torch.device("cpu"), "on")
        assert state.startswith("eager: torch.compile failed") and why in state and "second line" not in state
        assert got[0] == eager[0] and got[1] == eager[1]
        for n, g in eager[2].items():
            torch.testing.assert_close(got[2][n], g)


@pytest.mark.compiler
def test_compiled_drafter_step_goes_eager_at_the_recompile_limit(tiny, setup):
    """Batches of ever new lengths (a caller that does not pad): once torch's recompile limit is reached the step
    runs eagerly, with the reason in `state`, instead of failing the call (fullgraph=True makes the limit an
    exception); every unroll gives the eager results."""
    import copy

    drafter = copy.deepcopy(setup[0])
    samples, draft_ids = setup[1], setup[2]
    lm_head = tiny.model.get_output_embeddings()
    batches = [pack_samples(samples, pad_to=n) for n in (48, 56, 64)]
    labels = [target_labels(b.final, lm_head, draft_ids) for b in batches]
    eager = [_unroll_grads(drafter, b, lab) for b, lab in zip(batches, labels)]
    torch._dynamo.reset()
    # each part is compiled for the target's states and for the drafter's own: 2 graphs a length, so the limit is
    # reached at the second length (set through config.patch: monkeypatch's undo deletes a torch config entry for
    # the rest of the process)
    states = []
    try:
        with torch._dynamo.config.patch(recompile_limit=2):
            for b, lab, want in zip(batches, labels, eager):
                got = _unroll_grads(drafter, b, lab, compile_drafter="on")
                states.append(ttt.drafter_state(drafter, torch.device("cpu"), "on"))
                assert got[0] == pytest.approx(want[0], rel=1e-5) and got[1] == want[1]
                for n, g in want[2].items():
                    torch.testing.assert_close(got[2][n], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()))
    finally:
        torch._dynamo.reset()
    assert states[0] == "compiled" and states[1] == states[2] and states[2].startswith("eager: torch.compile failed")


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [1, 2])
def test_compiled_drafter_step_on_gpu(tiny, setup, monkeypatch, layers):
    """On CUDA with the flex attention, the compiled drafter step agrees with the eager one: in fp32 closely, and in
    bf16 autocast as closely to the fp32 step as eager bf16 is. (Compiled and eager bf16 gradients can lie several
    percent of their largest value apart, so bf16 against bf16 alone cannot tell rounding from a fault; each is
    measured against fp32 instead.) Compiled from a clean slate: the GPU tests before it compile the same drafter
    functions for other shapes and modes, and one process's recompile limit would turn this one eager."""
    import copy

    torch._dynamo.reset()

    drafter = copy.deepcopy(_deeper(tiny, setup, layers)).cuda()
    samples, draft_ids = setup[1], setup[2]
    lm_head = copy.deepcopy(tiny.model.get_output_embeddings()).cuda()
    batch = pack_samples(samples, pad_to=128, multiple=128).to("cuda")
    labels = target_labels(batch.final, lm_head, draft_ids.cuda())

    def run(compiled, bf16):
        mode = "auto" if compiled else "off"
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            got = _unroll_grads(drafter, batch, labels, compile_drafter=mode)
            if compiled:  # the first compiled call probes its graphs on copies; the second is the steady state
                got = _unroll_grads(drafter, batch, labels, compile_drafter=mode)
        assert ttt.drafter_state(drafter, torch.device("cuda"), mode) == ("compiled" if compiled else "eager")
        return got

    def rel(a, b):  # the relative Frobenius distance of two gradients
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))

    ref = run(False, False)
    fp32 = run(True, False)
    assert fp32[0] == pytest.approx(ref[0], rel=1e-4)
    for n, g in ref[2].items():
        torch.testing.assert_close(fp32[2][n], g, rtol=1e-3, atol=1e-4 * float(g.abs().max()),
                                   msg=lambda m, n=n: f"{n}: {m}")
    eager = run(False, True)
    got = run(True, True)
    assert got[0] == pytest.approx(ref[0], rel=2e-2) and eager[0] == pytest.approx(ref[0], rel=2e-2)
    for n, g in ref[2].items():
        e, c = rel(eager[2][n], g), rel(got[2][n], g)
        assert c <= 2 * e + 1e-3, f"{n}: compiled bf16 is {c:.4f} from fp32, eager bf16 {e:.4f}"


def test_chain_step_cuts_where_the_data_leave_the_greedy_path():
    """A position stays in the simulated chain only while every draft was accepted and the data's next token
    is the drafted one; where the data differ the chain is cut (not counted), where the draft is wrong it is
    rejected (counted, not accepted), and a target token outside the draft vocabulary is never accepted."""
    from eyas.train.ttt import chain_acceptance, chain_step

    draft_ids = torch.tensor([10, 11, 12, 13])  # draft index -> target id
    ids = torch.tensor([5, 9, 11, 12, 13, 9])  # the data's tokens by row
    didx = torch.tensor([0, 1, 3, 2, -1, 0])  # the target's top token after each row, as a draft index
    valid = torch.tensor([True, True, True, True, False, False])  # positions 0-3 count
    nxt0, nxt1 = torch.tensor([1, 2, 3, 4, 5, 5]), torch.tensor([2, 3, 4, 5, 5, 5])  # rows t+1, t+2
    one_hot = lambda x: torch.nn.functional.one_hot(torch.tensor(x), 4).float()  # noqa: E731
    alive0, hit0, drafted0 = chain_step(one_hot([1, 3, 0, 2, 0, 0]), didx, nxt0, valid, ids, draft_ids, None)
    assert alive0.tolist() == valid.tolist()
    # 0, 1: the target's top; 2: another token, rejected; 3: the top (after row 4) is outside the vocabulary
    assert hit0.tolist() == [True, True, False, False, False, False]
    alive1, hit1, _ = chain_step(one_hot([3, 3, 3, 3, 3, 3]), didx, nxt1, valid, ids, draft_ids, (hit0, drafted0))
    # 0: drafted 11 and the data go on with 11 (row 2): in the chain; 1: drafted 13, the data go on with 12: cut
    assert alive1.tolist() == [True, False, False, False, False, False]
    assert hit1.tolist() == [True, False, False, False, False, False]  # 3 is the top after row 2
    assert chain_acceptance([4.0, 1.0, 0.0], [2.0, 1.0, 0.0]) == [0.5, 1.0, 0.0]


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [1, 2])
def test_unroll_never_waits_for_the_device_on_gpu(tiny, setup, layers):
    """A warmed-up TTT unroll with the flex attention, forward and backward, has no operation that makes the host
    wait for the device (torch.cuda.set_sync_debug_mode("error") raises at the first). Until the thirty-second
    session each flex block mask copied its step number from the host: a stream sync every mask, 3 a one-layer
    training step, in a step whose kernels kept the H200 busy about a third of the time."""
    import copy

    drafter = copy.deepcopy(_deeper(tiny, setup, layers)).cuda()
    samples, draft_ids = setup[1], setup[2]
    lm_head = copy.deepcopy(tiny.model.get_output_embeddings()).cuda()
    batch = pack_samples(samples, pad_to=128, multiple=128).to("cuda")
    labels = target_labels(batch.final, lm_head, draft_ids.cuda())
    for _ in range(2):  # compile and probe first: compiling may wait, the steady state must not
        _unroll_grads(drafter, batch, labels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drafter.zero_grad()
        st = ttt_unroll(drafter, batch, labels, 3)
        sum(st.loss_sum).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad)
