"""The MoE's combine inside the next mHC site (``kernels.moe.MoEPending``, ``mhc._hc_fused`` COMBINE,
``model.deepseek_v4.DEFER_MOE_COMBINE``): the decode MoE hands over its w2 rows (or their split partials),
the sort's inverse permutation and the shared expert's output, and the fused ``hc_post_pre`` sums them as
``_moe_combine`` does. Bit-equal to the combine's own launch followed by the site, in both forms of the w2
output, with and without a shared expert, at 1-3 rows; through the model, the tiny checkpoint's logits are
the same bits with the deferral on and off.

On a CPU machine the kernels run under the Triton interpreter; on a GPU a plain ``pytest`` runs them compiled."""
import pytest
from kernel_helpers import kernel_device
import torch

pytest.importorskip("triton")

from dsv4.kernels import moe as Mo  # noqa: E402
from dsv4.kernels.mhc import hc_post_pre  # noqa: E402

DEV = kernel_device()


def _site_inputs(T, D, gen):
    x = (torch.randn(T, 4, D, generator=gen) * 2).bfloat16()
    fn = torch.randn(24, 4 * D, generator=gen) * (4 * D) ** -0.5 * 2
    base = torch.randn(24, generator=gen) * 0.5
    scale = torch.rand(3, generator=gen) + 0.5
    post = torch.rand(T, 4, generator=gen) * 2
    comb = torch.softmax(torch.randn(T, 4, 4, generator=gen), dim=-1)
    w = torch.randn(D, generator=gen) * 0.2 + 1
    return [t.to(DEV) for t in (x, fn, base, scale, post, comb, w)]


def _pending(T, D, k, S, shared, gen):
    """A MoEPending as the decode MoE leaves it: T tokens' k pairs sorted by expert (one pair of the last token
    dropped, as a repeated hash id is), w2 rows bf16 [P, D] (S = 0) or fp32 split partials [S, P, D]."""
    E = 5
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    keep = torch.ones(T, k, dtype=torch.bool)
    keep[-1, -1] = False
    eflat = torch.where(keep, idx, torch.full_like(idx, E)).to(torch.int32).reshape(-1).to(DEV)
    perm, offs, tcum, inv = Mo.sort_pairs(eflat, E, 1)
    P = T * k
    out = (torch.randn(S, P, D, generator=gen) if S else torch.randn(P, D, generator=gen).bfloat16()).to(DEV)
    sh = torch.randn(T, D, generator=gen).bfloat16().to(DEV) if shared else None
    return Mo.MoEPending(out, inv, offs, sh, k)


@pytest.mark.parametrize("T,S,shared", [(1, 3, True), (2, 0, True), (3, 5, False), (1, 0, False)])
def test_the_site_s_combine_gives_the_combine_launch_s_bits(T, S, shared):
    gen = torch.Generator().manual_seed(40 + T + S)
    D, k = 64, 3
    pend = _pending(T, D, k, S, shared, gen)
    x, fn, base, scale, post, comb, w = _site_inputs(T, D, gen)
    y = pend.dense()
    assert y.shape == pend.shape == (T, D) and y.dtype == torch.bfloat16
    # the combine's own launch against its definition: each token's kept rows in expert order, split
    # partials summed in split order and rounded, plus the shared row, one rounding
    inv = pend.inv.cpu().long().view(T, k)
    nvalid = int(pend.offs[-1])
    for t in range(T):
        acc = torch.zeros(D)
        for p in sorted(int(v) for v in inv[t] if v < nvalid):
            row = pend.out[:, p].cpu().sum(0) if S else pend.out[p].cpu().float()
            if S:
                row = torch.zeros(D)
                for s in range(S):
                    row = row + pend.out[s, p].cpu()
                row = row.bfloat16().float()
            acc = acc + row
        if shared:
            acc = acc + pend.sh[t].cpu().float()
        assert torch.equal(acc.bfloat16(), y[t].cpu())
    cfg = {"impl": "fused", "splits": 3}
    want = hc_post_pre(y, x, post, comb, fn, base, scale, w, config=cfg)
    got = hc_post_pre(pend, x, post, comb, fn, base, scale, w, config=cfg)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # above the fused path's rows (the three kernels) the pending form is combined first: the same call works
    tiled = hc_post_pre(pend, x, post, comb, fn, base, scale, w, config={"impl": "tiled"})
    assert torch.equal(tiled[0], hc_post_pre(y, x, post, comb, fn, base, scale, w, config={"impl": "tiled"})[0])


def test_the_decode_moe_defers_only_where_asked():
    from test_moe import _ref_moe
    gen = torch.Generator().manual_seed(44)
    ref = _ref_moe(8, 256, 128, 2, gen, False)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = (torch.randn(1, 256, generator=gen) * 1.5).bfloat16().to(DEV)
    ids = torch.zeros(1, dtype=torch.long, device=DEV)
    plain = Mo.moe_forward(x, ids, w, path="gemv")
    pend = Mo.moe_forward(x, ids, w, path="gemv", defer=True)
    assert isinstance(pend, Mo.MoEPending) and torch.equal(pend.dense(), plain)
    assert Mo.dense(plain) is plain
    # the expert-parallel partial sums return tensors
    y32, _ = Mo.moe_forward(x, ids, w, path="gemv", defer=True, partial=True)
    assert isinstance(y32, torch.Tensor) and y32.dtype == torch.float32


def _steps(m, prompts, steps=2):
    """Prefill the prompts together, then ``steps`` decode steps of all of them (one row each, teacher-forced
    tokens) -> the logits of every call."""
    from dsv4.engine.kv_cache import CacheConfig, KVCache, PagedSequenceState
    cache = KVCache(m.cfg, CacheConfig(max_num_seqs=len(prompts) + 1, num_blocks=4 * len(prompts) + 1, device=DEV))
    m.attach_cache(cache, 1024)
    sts = [PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(2)) for _ in prompts]
    out = [m(m.prefill_context(list(zip(prompts, sts))))]
    for st, ids in zip(sts, prompts):
        st.advance_to(ids.numel())
    on = lambda v: torch.as_tensor(v).to(DEV)      # noqa: E731
    for j in range(steps):
        bt = torch.full((len(sts), m.max_blocks), -1, dtype=torch.long)
        for i, st in enumerate(sts):
            bt[i, :len(st.block_table)] = torch.tensor(st.block_table)
        toks = [5 + 2 * j + i for i in range(len(sts))]
        out.append(m(m.decode_context(on(toks), on([st.pos for st in sts]), on([st.slot for st in sts]), on(bt))))
        for st in sts:
            st.advance_to(st.pos + 1)
    return [o.cpu() for o in out]


def test_the_tiny_model_s_logits_are_the_same_bits_with_the_combine_in_the_site(tmp_path, monkeypatch):
    """A three-block model: prompts of 2 and 1 tokens prefilled together (3 rows), then a decode step of both (2 rows), with the
    deferral on against off, on the mHC sites' kernel: at every call (the fused sites take up to 3 rows) each
    block but the last hands its MoE's pending form to the next block's site, and the logits are the same bits.
    The MoE here is its twin handed over as a one-pair pending form (each token's row its own pair, whose
    combine is the row itself): the real decode MoE's pending form is held above, and the interpreter's MoE
    kernels would take minutes at this depth."""
    from dsv4.checkpoint.tiny import make_tiny
    from dsv4.model import deepseek_v4 as M
    from dsv4.ops import Ops
    from dsv4.twins.layer_ops import moe as moe_twin
    from dsv4.config import preset
    # three blocks (two hash-routed, one score-routed CSA): two hand over, the last does not
    cfg = preset("tiny")
    tiny = make_tiny(str(tmp_path / "tiny"), cfg=cfg.replace(num_hidden_layers=3, compress_ratios=(0, 0, 4, 0)))
    ops = Ops(DEV, kernels={"moe", "hc_post_pre"})
    calls = []

    def moe(layer, x, ids, defer=False):
        y = moe_twin(layer, x, ids)
        if not defer:
            return y
        calls.append(1)
        T = y.shape[0]
        return Mo.MoEPending(y, torch.arange(T, dtype=torch.int32, device=y.device),
                             torch.tensor([0, T], device=y.device), None, 1)

    ops.moe = moe
    m = M.DeepseekV4.from_checkpoint(tiny, DEV, ops=ops)
    for mod in m.modules():          # one Sinkhorn iteration: the interpreter's time is mostly that loop
        if hasattr(mod, "iters"):
            mod.iters = 1
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 128000, (n,), generator=g) for n in (2, 1)]
    monkeypatch.setattr(M, "DEFER_MOE_COMBINE", False)
    off = _steps(m, prompts, steps=1)
    assert not calls
    monkeypatch.setattr(M, "DEFER_MOE_COMBINE", True)
    on = _steps(m, prompts, steps=1)
    # the prefill and the decode step x (3 blocks - the last) sites took a pending combine
    assert len(calls) == 2 * (m.cfg.num_hidden_layers - 1) == 4
    for a, b in zip(on, off):
        assert torch.equal(a, b)
    # a fault injected into the MoE's kernel (which corrupts its outputs as tensors) or the MoE on its twin turns
    # the deferral off
    assert m._defer_combine()
    ops.faults = {"moe": "nan"}
    assert not m._defer_combine()
    ops.faults = {}
    ops.use("moe", "twin")
    assert not m._defer_combine()
