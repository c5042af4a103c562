"""MXFP4 expert GEMM on FP8 tensor cores (dsv4/kernels/gemm/fp4_fp8.py) against the twin, the exact
product sum and the f16 prefill kernel (``fp4_prefill``).

CPU: the kernel runs under the Triton interpreter with the portable decode at small shapes (the
interpreter's fp8 dot is exact in fp32, so the tight ``check_gemm`` bound applies). GPU: the same
tests compiled, plus ``gpu``-marked ones at V4-Flash dims that compare the PTX decode with the
portable one bit for bit and both with the twin. On the GPU the wgmma's own accumulation over one
128-K block is not exact fp32 (the reason for the per-128 promotion), so the bound on the sum of
|products| is ``GPU_ACC`` there.

Fold edge cases (module doc of fp4_fp8): group scales up to 2^11 below their row's 128-block maximum
are exact; 2^12 and more are flushed to zero: exact for all-zero groups, otherwise the result equals
the twin on the weight with those groups zeroed.
"""
import collections
from pathlib import Path

import pytest
import torch
from kernel_helpers import check_gemm, gemm_exact, kernel_device, need_gpu

triton = pytest.importorskip("triton")

from dsv4.formats.fp4 import dequant_mxfp4, quant_mxfp4  # noqa: E402
from dsv4.formats.fp8 import act_quant_fp8 as act_quant_ref  # noqa: E402
from dsv4.kernels.gemm import common as GC, fp4_fp8 as F, fp4_prefill as FP  # noqa: E402
from dsv4.kernels.lib import u8  # noqa: E402
from dsv4.twins import gemm as GT  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEV = kernel_device()
ACC = 2.0 ** -16 if DEV == "cpu" else 2.0 ** -12
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def _weight(N, K, gen, drop=None):
    """MXFP4 weight [N, K]; ``drop``: (group index inside each 128-block, scale offset): that group's
    scale set ``offset`` below the block's others (its codes kept)."""
    W = torch.randn(N, K, generator=gen) * 0.05
    wp, s = quant_mxfp4(W)
    s = u8(s).clone()
    if drop is not None:
        g, off = drop
        sv = s.view(N, K // 128, 4)
        others = sv[:, :, [j for j in range(4) if j != g]].int().amax(-1)
        sv[:, :, g] = (others.clamp(min=off) - off).to(torch.uint8)
    return u8(wp), s


def _run(xq, xs, wp, s, cfg=None, use_asm=None):
    M, K = xq.shape
    N = wp.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
    F.fp4_fp8_launch(u8(xq).to(DEV), xs.float().to(DEV), wp[None].contiguous().to(DEV),
                     s[None].contiguous().to(DEV), None, out, None, M, N, K, 0, fmt="mxfp4", config=cfg,
                     use_asm=use_asm)
    return out


def test_decode_all_codes_and_shifts():
    """Every code at every group shift k = s_g - s_max + 12 in -2..12 (the portable decode; on the GPU
    also the PTX one, bit for bit): e4m3(e2m1 * 2^(k - 6)) for k >= 1, zero below."""
    import triton.language as tl

    @triton.jit
    def kern(B, KS, O, USE_ASM: tl.constexpr):
        r = tl.arange(0, 16)
        b = tl.load(B + r[:, None] * 64 + tl.arange(0, 64)[None, :])
        k = tl.load(KS + r[:, None] * 4 + tl.arange(0, 4)[None, :])
        w = F._fp8_weight_tile(b, k, USE_ASM, 16)
        tl.store(O + r[:, None] * 128 + tl.arange(0, 128)[None, :], w.to(tl.uint8, bitcast=True))

    gen = torch.Generator().manual_seed(1)
    b = torch.randint(0, 256, (16, 64), dtype=torch.uint8, generator=gen)
    b[0, :16] = torch.arange(16, dtype=torch.uint8) * 17          # every code in both nibbles
    b[0, 16:32] = (torch.arange(16, dtype=torch.uint8) * 16) | torch.arange(16, dtype=torch.uint8).flip(0)
    ks = torch.arange(-2, 13).repeat(5)[:64].view(16, 4).int()
    lo, hi = (b & 15).long(), (b >> 4).long()
    nat = torch.stack([E2M1[lo], E2M1[hi]], -1).view(16, 128)      # natural element order
    kk = ks.repeat_interleave(32, 1).double()
    ref = (nat.double() * torch.exp2(kk - 6)).float().to(torch.float8_e4m3fn)
    ref = torch.where(kk >= 1, ref.float(), 0.0).to(torch.float8_e4m3fn).view(torch.uint8)
    ref = torch.where(ref == 0x80, 0, ref)                           # -0 comes out as +0
    for asm in ((False, True) if DEV == "cuda" else (False,)):
        o = torch.empty(16, 128, dtype=torch.uint8, device=DEV)
        kern[(1,)](b.to(DEV), ks.to(DEV), o, USE_ASM=asm)
        got = o.cpu()
        assert torch.equal(got, ref), (asm, (got != ref).nonzero()[:8])
    # the fold is exact where it claims to be: no rounding for k >= 1
    assert torch.equal(torch.where(kk >= 1, ref.view(torch.float8_e4m3fn).double(), 0.0),
                       torch.where(kk >= 1, nat.double() * torch.exp2(kk - 6), 0.0))


@pytest.mark.parametrize("swap", [True, False])
def test_plain_against_twin_and_f16_kernel(swap):
    """70 rows (a partial m-tile), 96 columns (a partial column block), K 384, scales spread up to 2^11
    inside 128-blocks (the exact limit)."""
    gen = torch.Generator().manual_seed(3)
    M, N, K = 70, 96, 384
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    wp, s = _weight(N, K, gen, drop=(2, 11))
    sb = s.int().view(N, K // 128, 4)
    assert (sb.amax(-1) - sb.amin(-1)).max() == 11
    xq, xs = act_quant_ref(x)
    y = _run(xq, xs, wp, s, dict(BM=64 if DEV == "cuda" else 32, BN=64, SWAP=swap))
    assert y.shape == (M, N)
    Wd = dequant_mxfp4(wp, s)
    check_gemm(y, xq, xs, Wd, GT.fp4_gemm(xq, xs, wp, s), acc=ACC)
    old = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
    FP.fp4_prefill_launch(GC.f16_operand(xq.to(DEV)), xs.float().to(DEV), wp[None].contiguous().to(DEV),
                          s[None].contiguous().to(DEV), None, old, None, M, N, K, 0, fmt="mxfp4",
                          config=dict(BM=64, BN=64, KSPLIT=False))
    check_gemm(y, xq, xs, Wd, old, acc=ACC)


@pytest.mark.parametrize("spread", [12, 40])
def test_wide_spread_groups_flush(spread):
    """A group 2^12 / 2^40 below its block's maximum: flushed. All-zero codes there: the exact product;
    nonzero codes: the twin on the weight with those groups zeroed (and not the unflushed one)."""
    gen = torch.Generator().manual_seed(spread)
    M, N, K = 8, 32, 256
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    xq, xs = act_quant_ref(x)
    wp, s = _weight(N, K, gen, drop=(1, spread))
    assert F.wide_spread(s) and not F.wide_spread(_weight(N, K, gen)[1])
    y = _run(xq, xs, wp, s, dict(BM=16, BN=32))
    keep = torch.ones(N, K // 32, dtype=torch.bool)
    keep.view(N, K // 128, 4)[:, :, 1] = False
    Wd = dequant_mxfp4(wp, s)
    Wf = Wd * keep.repeat_interleave(32, 1)
    check_gemm(y, xq, xs, Wf, acc=ACC)
    if spread == 12 and DEV == "cpu":   # exact fp32 sums: the flushed 2^-12 is visible beside the full sum
        ex, mag = gemm_exact(xq, xs, Wd)
        assert ((y.cpu().double() - ex).abs() > 2.0 ** -8 * ex.abs() + ACC * mag).any()
    # the same scales with those groups' codes zeroed: exact
    wz = wp.clone()
    wz.view(N, K // 128, 4, 16)[:, :, 1] = 0
    yz = _run(xq, xs, wz, s, dict(BM=16, BN=32))
    check_gemm(yz, xq, xs, dequant_mxfp4(wz, s), GT.fp4_gemm(xq, xs, wz, s), acc=ACC)


def _grouped(E, counts, d, I, top_k, gen):
    Pn = sum(counts)
    T = -(-Pn // top_k)
    x = (torch.randn(T, d, generator=gen) * 1.5).bfloat16()
    xq, xs = act_quant_ref(x)
    perm = torch.randperm(T * top_k, generator=gen)[:Pn]
    offs = torch.tensor([0] + list(counts)).cumsum(0)
    pw = torch.rand(T * top_k, generator=gen) + 0.25
    w13 = [_weight(2 * I, d, gen) for _ in range(E)]
    w2 = [_weight(d, I, gen) for _ in range(E)]
    st = lambda v, j: torch.stack([t[j] for t in v])
    return dict(xq=xq, xs=xs, perm=perm, offs=offs, pw=pw, w13=st(w13, 0), s13=st(w13, 1), w2=st(w2, 0),
                s2=st(w2, 1), P=Pn, T=T)


def _tcum(offs, bm):
    cnt = offs[1:] - offs[:-1]
    return torch.cat([torch.zeros(1, dtype=torch.long), ((cnt + bm - 1) // bm).cumsum(0)])


def _gemms(c, E, d, I, top_k, limit, fn, operand, cfg, use_asm=None):
    """GEMM 1 (+ SwiGLU) and GEMM 2 through ``fn`` (either kernel's launcher): (h bytes, hs, out)."""
    bm = cfg["BM"]
    Pn = c["P"]
    g = dict(offs=c["offs"].to(DEV), tcum=_tcum(c["offs"], bm).to(DEV), n_groups=E,
             n_tiles=min(Pn, -(-Pn // bm) + min(E, Pn)), fmt="mxfp4")
    extra = {} if use_asm is None else dict(use_asm=use_asm)
    h = torch.empty(Pn, I, dtype=torch.uint8, device=DEV)
    hs = torch.empty(Pn, I // 128, dtype=torch.float32, device=DEV)
    fn(operand(c["xq"]).to(DEV), c["xs"].float().to(DEV), c["w13"].to(DEV), c["s13"].to(DEV), None, h, hs, Pn, I, d,
       I, swiglu=True, limit=limit, perm=c["perm"].to(DEV), pw=c["pw"].to(DEV), top_k=top_k, config=dict(cfg),
       **g, **extra)
    out = torch.empty(Pn, d, dtype=torch.bfloat16, device=DEV)
    h2 = operand(h.view(torch.float8_e4m3fn))
    fn(h2, hs, c["w2"].to(DEV), c["s2"].to(DEV), None, out, None, Pn, d, I, 0, config=dict(cfg), **g, **extra)
    return h, hs, out


def _compare(c, E, I, top_k, h_new, hs_new, out_new, h_old, hs_old, out_old):
    """h: e4m3 bytes within one FP8 step of the f16 kernel's (>= 98% equal; on the GPU 99.8% within one
    step, all within 2^-8 of their 128-block's largest); w2: each kernel against the exact sum of its own h operand, and against each other."""
    hn = h_new.cpu()
    ho = h_old.cpu()
    assert (hn == ho).float().mean() > 0.98
    deq = lambda h, s: h.view(torch.float8_e4m3fn).float() * s.cpu().repeat_interleave(128, 1)
    dn, do = deq(hn, hs_new), deq(ho, hs_old)
    step = 2.0 ** -3 * do.abs() + hs_old.cpu().repeat_interleave(128, 1) * 2.0 ** -9
    steps = (dn - do).abs() / step
    if DEV == "cpu":
        assert (steps <= 1.01).all()
    else:   # the wgmma's inexact 128-K accumulation errs relative to the block's magnitudes, not to |h|
        # (H200, V4-Flash dims: 0.08% of h beyond one step, up to ~22 steps, all on small entries)
        blk = do.abs().view(do.shape[0], -1, 128).amax(-1).repeat_interleave(128, 1)
        assert (steps <= 1.01).float().mean() > 0.998
        assert ((dn - do).abs() <= torch.maximum(1.01 * step, 2.0 ** -8 * blk)).all()
    for e in range(E):
        r = slice(int(c["offs"][e]), int(c["offs"][e + 1]))
        if r.stop > r.start:
            W2 = dequant_mxfp4(c["w2"][e], c["s2"][e])
            check_gemm(out_new.cpu()[r], hn[r].view(torch.float8_e4m3fn), hs_new.cpu()[r], W2, acc=ACC)
            check_gemm(out_old.cpu()[r], ho[r].view(torch.float8_e4m3fn), hs_old.cpu()[r], W2)


def test_grouped_swiglu_and_w2():
    """Grouped + gather + SwiGLU and grouped w2, 5 experts with
    0 / 1 / 33 / 40 / 5 rows at 32-row tiles, against the f16 prefill kernel on the same inputs."""
    gen = torch.Generator().manual_seed(11)
    E, d, I, top_k, limit = 5, 256, 128, 2, 6.0
    c = _grouped(E, [0, 1, 33, 40, 5], d, I, top_k, gen)
    bm = 32 if DEV == "cpu" else 64
    h, hs, out = _gemms(c, E, d, I, top_k, limit, F.fp4_fp8_launch, u8, dict(BM=bm, BN=128))
    ho, hso, outo = _gemms(c, E, d, I, top_k, limit, FP.fp4_prefill_launch, GC.f16_operand,
                           dict(BM=bm, BN=128, KSPLIT=False))
    _compare(c, E, I, top_k, h, hs, out, ho, hso, outo)


@pytest.mark.parametrize("spread,ku", [(11, 1), (12, 1), (12, 2), (11, 4)])
def test_predecode_is_the_kernels_own_fold(spread, ku):
    """``predecode``'s e4m3 bytes times its per-(row, 128-block) factors are the MXFP4 weight exactly,
    the groups 2^12 or more below their block's maximum flushed to zero (the kernel's fold); with KU
    128-blocks per step (KU 4 does not divide K's 3 blocks: the launcher falls back to 1)."""
    gen = torch.Generator().manual_seed(20 + spread)
    N, K = 48, 384 if ku != 2 else 512
    wp, s = _weight(N, K, gen, drop=(3, spread))
    w8, sb = F.predecode(torch.stack([wp, wp.flip(0)]).to(DEV), torch.stack([s, s.flip(0)]).to(DEV),
                         config={"KU": ku})
    assert w8.shape == (2, N, K) and w8.dtype == torch.uint8 and sb.shape == (2, N, K // 128)
    keep = torch.ones(N, K // 32)
    if spread >= F.FLUSH_SPREAD:
        keep.view(N, K // 128, 4)[:, :, 3] = 0
    for e, (q, sc) in enumerate(((wp, s), (wp.flip(0), s.flip(0)))):
        want = dequant_mxfp4(q, sc) * keep.flip(0).repeat_interleave(32, 1) if e else \
            dequant_mxfp4(q, sc) * keep.repeat_interleave(32, 1)
        got = w8[e].cpu().view(torch.float8_e4m3fn).float() * sb[e].cpu().repeat_interleave(128, 1)
        assert torch.equal(got, want.float())


def _same_bits_predecoded(c, E, d, I, top_k, limit, cfg, wtma, tile=False, prefetch=False, memo=None):
    """GEMM 1 + SwiGLU and GEMM 2 on ``predecode``'s tiles (``WTMA``: through TMA; ``tile``: one factor per
    128 x 128 weight tile) = on the FP4 bytes. ``memo`` (a dict kept across the variants of one case): the
    decoding kernel's outputs per configuration and ``predecode``'s tiles, computed once (the variants
    differ in how the GEMMs load those tiles; each is a deterministic function of its inputs). ``predecode``
    runs its GPU tile (32 rows x 4 128-blocks a step; the interpreter's 16 x 1 runs ~8x the programs): its own
    tiles are the fold tests' above and below."""
    memo = {} if memo is None else memo

    def predec(a, sa, w, ws, *args, config, **kw):
        key = ("predecode", tuple(w.shape), tile)
        if key not in memo:
            memo[key] = F.predecode(w, ws, tile=tile, config={"BN": 32, "KU": 4})
        w8, sb = memo[key]
        return F.fp4_fp8_launch(a, sa, w8, sb, *args, predecoded=True,
                                config=dict(config, WTMA=wtma, PREFETCH=prefetch), **kw)
    key = ("decoding", str(sorted(cfg.items())))
    if key not in memo:
        memo[key] = _gemms(c, E, d, I, top_k, limit, F.fp4_fp8_launch, u8, cfg)
    ref = memo[key]
    got = _gemms(c, E, d, I, top_k, limit, predec, u8, cfg)
    for r, g in zip(ref, got):
        assert torch.equal(r.cpu(), g.cpu())


@pytest.fixture(scope="module")
def predecoded_memo():
    """{case: the memo of ``_same_bits_predecoded``}, shared by the variants of each test below."""
    return collections.defaultdict(dict)


@pytest.mark.parametrize("swap,wtma,prefetch", [(True, False, False), (False, False, False), (False, True, False),
                                                (True, True, False), (True, True, True)])
def test_predecoded_weights_give_the_same_bits(swap, wtma, prefetch, predecoded_memo):
    """Grouped + gather + SwiGLU and grouped w2 on ``predecode``'s bytes (the FP8 tiles loaded, not
    decoded; by pointer loads or by TMA through one descriptor over all experts' rows, the scale operands
    loaded a K block ahead or not): h, its scales and w2's output equal the decoding kernel's bit for bit."""
    gen = torch.Generator().manual_seed(12)
    E, d, I, top_k, limit = 4, 256, 128, 2, 6.0
    c = _grouped(E, [3, 0, 37, 20], d, I, top_k, gen)
    c["s13"].view(E, 2 * I, -1, 4)[..., 2] -= 7          # spread inside blocks
    bm = 32 if DEV == "cpu" else 64
    cfg = dict(BM=bm, BN=128, SWAP=swap)
    _same_bits_predecoded(c, E, d, I, top_k, limit, cfg, wtma, prefetch=prefetch, memo=predecoded_memo["rows"])


def test_predecode_tile_fold():
    """``predecode(tile=True)``: bytes folded against each 128 x 128 tile's largest scale, one factor per
    tile; bytes times factors are the MXFP4 weight exactly while every group lies less than 2^12 below its
    tile's maximum (rows' maxima shifted by up to 2^4), and ``wide_spread(tile=True)`` says when a
    group does not (that group flushed, as the row fold flushes below its row's maximum)."""
    gen = torch.Generator().manual_seed(31)
    N, K = 256, 384
    wp, s = _weight(N, K, gen)
    s = s.clone()
    s -= torch.randint(0, 5, (N, 1), generator=gen).to(torch.uint8)     # rows' maxima spread by up to 2^4
    s.view(N, K // 128, 4)[:, :, 1] -= 3                                 # and groups inside blocks
    assert not F.wide_spread(s[None], tile=True) and F.wide_spread(s[None, :100], tile=True)  # whole tiles only
    cols = torch.stack([s, s], 1)[:, 0]                                  # a strided view: the same maxima
    assert not cols.is_contiguous() and torch.equal(F.tile_max(cols[None]), F.tile_max(s[None]))
    w8, sb = F.predecode(wp[None].to(DEV), s[None].to(DEV), tile=True)
    assert sb.shape == (1, N // 128, K // 128) and sb.dtype == torch.float32
    got = w8[0].cpu().view(torch.float8_e4m3fn).float() * \
        sb[0].cpu().repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(got, dequant_mxfp4(wp, s).float())
    w8r, _ = F.predecode(wp[None].to(DEV), s[None].to(DEV))
    assert not torch.equal(w8r, w8)                                      # the folds differ where rows do
    far = s.clone()
    v = far.view(N, K // 128, 4)
    r = int(v[:128, 1].amax(-1).argmin())                # the row of the tile with the lowest maximum
    v[r, 1, 0] = v[:128, 1].max() - F.FLUSH_SPREAD        # 2^12 below its tile's maximum, not its row's
    assert F.wide_spread(far[None], tile=True) and not F.wide_spread(far[None])
    w8f, sbf = F.predecode(wp[None].to(DEV), far[None].to(DEV), tile=True)
    keep = torch.ones(N, K // 32)
    keep[r, 4] = 0
    got = w8f[0].cpu().view(torch.float8_e4m3fn).float() * \
        sbf[0].cpu().repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(got, (dequant_mxfp4(wp, far) * keep.repeat_interleave(32, 1)).float())
    with pytest.raises(ValueError, match="whole 128-row tiles"):
        F.predecode(wp[None, :64].to(DEV), s[None, :64].to(DEV), tile=True)


@pytest.mark.parametrize("prefetch", [False, True])
def test_tile_factors_give_the_same_bits(prefetch, predecoded_memo):
    """Grouped + gather + SwiGLU and grouped w2 on ``predecode(tile=True)``'s tiles through TMA, promoted
    with one scalar factor per 128 x 128 tile, the factors loaded a K block ahead (``PREFETCH``) or not: the
    bits of the decoding kernel (each row's products are the row fold's times one power of two)."""
    gen = torch.Generator().manual_seed(13)
    E, d, I, top_k, limit = 4, 256, 128, 2, 6.0
    c = _grouped(E, [3, 0, 37, 20], d, I, top_k, gen)
    c["s13"].view(E, 2 * I, -1, 4)[..., 2] -= 3
    c["s13"] -= torch.randint(0, 4, (E, 2 * I, 1), generator=gen).to(torch.uint8)
    c["s2"] -= torch.randint(0, 5, (E, d, 1), generator=gen).to(torch.uint8)
    assert not F.wide_spread(c["s13"], tile=True) and not F.wide_spread(c["s2"], tile=True)
    bm = 32 if DEV == "cpu" else 64
    _same_bits_predecoded(c, E, d, I, top_k, limit, dict(BM=bm, BN=128, SWAP=False), True, tile=True,
                          prefetch=prefetch, memo=predecoded_memo["tile"])


def test_rejects_bad_inputs():
    a = torch.zeros(2, 256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="mxfp4"):
        F.fp4_fp8_launch(a, None, None, None, None, None, None, 2, 64, 256, 0, fmt="nvfp4")
    with pytest.raises(ValueError, match="multiple of 128"):
        F.fp4_fp8_launch(a[:, :200], None, None, None, None, None, None, 2, 64, 200, 0, fmt="mxfp4")
    with pytest.raises(ValueError, match="e4m3 bytes"):
        F.fp4_fp8_launch(a.half(), None, None, None, None, None, None, 2, 64, 256, 0, fmt="mxfp4")
    with pytest.raises(ValueError, match="ATMA"):                 # TMA activation rows cannot be gathered
        F.fp4_fp8_launch(a, None, None, None, None, None, None, 2, 64, 256, 0, fmt="mxfp4", perm=torch.zeros(2),
                         config={"ATMA": True})
    w = torch.zeros(1, 64, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="predecoded weights"):    # packed FP4 given as predecoded
        F.fp4_fp8_launch(a, None, w, torch.zeros(1, 64, 8, dtype=torch.uint8), None, None, None, 2, 64, 256, 0,
                         fmt="mxfp4", predecoded=True)
    with pytest.raises(ValueError, match="predecode: expected"):
        F.predecode(w, torch.zeros(1, 64, 4, dtype=torch.uint8))
    w8 = torch.zeros(1, 128, 256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="per 128 x 128 tile"):     # factors of neither layout
        F.fp4_fp8_launch(a, None, w8, torch.zeros(1, 2, 2), None, None, None, 2, 128, 256, 0, fmt="mxfp4",
                         predecoded=True)
    with pytest.raises(ValueError, match="WTMA"):                  # tile factors need the TMA weight tiles
        F.fp4_fp8_launch(a, None, w8, torch.zeros(1, 1, 2), None, None, None, 2, 128, 256, 0, fmt="mxfp4",
                         predecoded=True, config={"BM": 16, "BN": 128, "WTMA": False})


# ------------------------------------------------------------------------------------------------
# GPU: V4-Flash prefill dims

@pytest.mark.gpu
@pytest.mark.parametrize("swap,bm,warps", [(True, 64, 8), (True, 128, 8), (False, 64, 8)])
def test_gpu_flash_dims(swap, bm, warps):
    """Grouped w1|w3 + SwiGLU and w2 at V4-Flash dims (d 4096, inter 2048, top-6), 8 experts with 0 to
    150 rows, scales spread up to 2^11 inside blocks: PTX decode = portable decode bit for bit; h and
    w2 against the f16 prefill kernel and the exact sums."""
    need_gpu()
    gen = torch.Generator().manual_seed(5)
    E, d, I, top_k, limit = 8, 4096, 2048, 6, 10.0
    c = _grouped(E, [96, 150, 0, 90, 1, 96, 64, 17], d, I, top_k, gen)
    c["s13"].view(E, 2 * I, -1, 4)[..., 1] -= 5
    c["s13"].view(E, 2 * I, -1, 4)[..., 2] -= 11
    cfg = dict(BM=bm, BN=128, SWAP=swap, num_warps=warps, num_stages=3)
    h, hs, out = _gemms(c, E, d, I, top_k, limit, F.fp4_fp8_launch, u8, cfg)
    h2, hs2, out2 = _gemms(c, E, d, I, top_k, limit, F.fp4_fp8_launch, u8, cfg, use_asm=False)
    assert torch.equal(h, h2) and torch.equal(hs, hs2) and torch.equal(out, out2)
    ho, hso, outo = _gemms(c, E, d, I, top_k, limit, FP.fp4_prefill_launch, GC.f16_operand,
                           dict(BM=64, BN=128, KSPLIT=False, num_warps=8, num_stages=3))
    _compare(c, E, I, top_k, h, hs, out, ho, hso, outo)


@pytest.mark.gpu
@pytest.mark.parametrize("bm,warps,stages,wtma,prefetch", [(64, 8, 3, True, False), (64, 8, 3, False, False),
                                                         (128, 8, 3, True, False), (64, 4, 4, True, False),
                                                         (64, 8, 3, True, True)])
def test_gpu_predecoded_flash_dims(bm, warps, stages, wtma, prefetch):
    """The pre-decoded path at V4-Flash dims (8 experts, 0 to 150 rows, scales spread up to 2^11 and a
    flushed group): ``predecode``'s tiles through the same wgmma tile as the decoding kernel's
    (SWAP=False: both operands from shared memory) give its bits."""
    need_gpu()
    gen = torch.Generator().manual_seed(6)
    E, d, I, top_k, limit = 8, 4096, 2048, 6, 10.0
    c = _grouped(E, [96, 150, 0, 90, 1, 96, 64, 17], d, I, top_k, gen)
    c["s13"].view(E, 2 * I, -1, 4)[..., 1] -= 11
    c["s2"].view(E, d, -1, 4)[..., 3] -= 13
    cfg = dict(BM=bm, BN=128, SWAP=False, num_warps=warps, num_stages=stages)
    _same_bits_predecoded(c, E, d, I, top_k, limit, cfg, wtma, prefetch=prefetch)
