"""FP8 / FP4 GEMM and MoE kernels (dsv4/kernels/gemm.py, moe.py) against their torch twins.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA and the ``gpu``-marked tests add V4-Flash shapes. The AOT test compiles every
kernel for sm_90 and sm_100 without a GPU.

Tolerances (documented in the modules): ``act_quant`` and routing are bit-exact; GEMMs are held to
the fp64-accumulated sum of the same (exact) products: |y - exact| <= 2^-8 |exact| (one bf16 ulp)
+ 2^-16 sum|products| (fp32 summation order; 2^-12 for FP8 MMAs on CUDA, whose 128-K partials keep
~14 bits), and to the twin within twice that; the
MoE layer to the reference within FP8-step tolerance (a one-ulp bf16 difference in a w1/w3 output
can move h by one FP8 step).
"""
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from kernel_helpers import check_gemm, kernel_device, need_gpu, run_aot_script  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from dsv4.formats.fp4 import dequant_mxfp4, dequant_nvfp4, quant_mxfp4, quant_nvfp4  # noqa: E402
from dsv4.formats.fp8 import act_quant_fp8 as act_quant_ref  # noqa: E402
from dsv4.formats.fp8 import dequant_fp8_weight, quant_fp8_weight  # noqa: E402
from dsv4.kernels import gemm as G  # noqa: E402
from dsv4.kernels import moe as Mo  # noqa: E402
from dsv4.reference.linear import Linear  # noqa: E402
from dsv4.reference.moe import Expert, MoE  # noqa: E402
from dsv4.reference.numerics import OFFICIAL  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

DEV = kernel_device()

# Hopper's FP8 tensor-core MMA keeps ~14 bits while it sums a 128-K block partial (the DeepSeek-V3
# report; the official kernel promotes to fp32 per 128-K block for that reason, as fp8_gemm does):
# on CUDA the FP8 GEMM's summation term is 2^-12 sum|products| instead of fp32's 2^-16.
FP8_ACC = 2.0 ** -12 if DEV == "cuda" else 2.0 ** -16


# ------------------------------------------------------------------------------------------------
# act quant

def _act_inputs(M, K, gen):
    x = (torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 4).bfloat16()
    x[0, :128] = 0                                      # all-zero block: amax floor 1e-4
    if M > 1:
        x[1, :] = 0                                     # all-zero row
    if M > 2:
        x[2, 128:256] = torch.linspace(-1, 1, 128).bfloat16() * 448 * 2.0 ** -5   # block max 448*2^k
        x[2, 0] = 2.0 ** -20                            # tiny values under the floor
    if M > 3:
        x[3, 5] = -3.0e38                               # huge: scale 2^119
        x[3, 130] = 7.0625                              # rounding near a binade
    return x


@pytest.mark.parametrize("M,K", [(5, 256), (1, 384)])
def test_act_quant_bit_exact(M, K):
    gen = torch.Generator().manual_seed(M + K)
    x = _act_inputs(M, K, gen)
    q, s, a16 = G.act_quant_fp8(x.to(DEV), with_f16=True)
    qr, sr = act_quant_ref(x)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s.cpu(), sr)
    assert a16.dtype == torch.float16 and torch.equal(a16.cpu().float(), qr.float())
    # leading dims are kept
    q3, s3 = G.act_quant_fp8(x.view(1, M, K).to(DEV))
    assert q3.shape == (1, M, K) and s3.shape == (1, M, K // 128)
    assert torch.equal(q3.cpu().view(torch.uint8).view(M, K), qr.view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# FP8 GEMM

@pytest.mark.parametrize("M,N,K", [(5, 160, 256), (1, 96, 128), (33, 128, 384)])
def test_fp8_gemm(M, N, K):
    gen = torch.Generator().manual_seed(M * N + K)
    x = (torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 3).bfloat16()
    W = torch.randn(N, K, generator=gen) * 0.05
    W[:, :128] *= 8                                   # blocks with different scales
    wq, ws = quant_fp8_weight(W)
    Wd = dequant_fp8_weight(wq, ws)
    xq, xs = act_quant_ref(x)
    y = G.fp8_gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV))
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    twin = G.fp8_gemm_torch(xq, xs, wq, ws)
    ref = Linear(Wd, "fp8", OFFICIAL)(x)              # the reference Linear (official numerics)
    check_gemm(y, xq, xs, Wd, twin, acc=FP8_ACC)
    check_gemm(ref, xq, xs, Wd)
    # fp32 scales and e8m0 scales give the same bits; fused quant == two-step quant
    y32 = G.fp8_gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.float().to(DEV))
    assert torch.equal(y32.cpu().view(torch.int16), y.cpu().view(torch.int16))
    for fuse in (True, False):
        yl = G.fp8_linear(x.to(DEV), wq.to(DEV), ws.to(DEV), fuse_quant=fuse)
        assert torch.equal(yl.cpu().view(torch.int16), y.cpu().view(torch.int16))


@pytest.mark.parametrize("M,N,K,S", [(9, 256, 1024, None), (5, 128, 512, 1), (33, 256, 768, 3)])
def test_fp8_gemm_partials_sum_to_fp8_gemm(M, N, K, S):
    """fp8_gemm_partials (the shared expert's w1|w3 at 1-64 tokens): the split-K kernel's fp32
    partials, unsummed; summed in split order and rounded once they are fp8_gemm's output bit for bit
    at the same split (fp8_gemm's in-kernel split sum)."""
    gen = torch.Generator().manual_seed(M * N + K)
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    wq, ws = quant_fp8_weight(torch.randn(N, K, generator=gen) * 0.05)
    xq, xs = act_quant_ref(x)
    cfg = None if S is None else {"SPLIT_K": S}
    part = G.fp8_gemm_partials(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), config=cfg)
    n_split = part.shape[0]
    assert part.dtype == torch.float32 and part.shape[1:] == (M, N)
    assert n_split == S if S else n_split > 1          # the default splits at this size
    acc = torch.zeros(M, N, device=part.device)
    for p in part:
        acc = acc + p
    # fp8_gemm sums the same partials in its tiles' last arriving programs; twice: the counters reset
    for _ in range(2):
        y = G.fp8_gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), config={"SPLIT_K": n_split})
        assert torch.equal(acc.bfloat16().cpu().view(torch.int16), y.cpu().view(torch.int16))
    check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws), G.fp8_gemm_torch(xq, xs, wq, ws), acc=FP8_ACC)


@pytest.mark.parametrize("M,N,K,S", [(1, 96, 1024, None), (3, 64, 768, 3), (9, 160, 512, 4)])
def test_fp8_gemm_split_k(M, N, K, S):
    """Decode-sized GEMMs split K over programs (fp32 partials summed in split order): within the
    GEMM tolerance of the twin and of the unsplit kernel; the fused-quant path splits the same way."""
    gen = torch.Generator().manual_seed(M + N + K)
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    W = torch.randn(N, K, generator=gen) * 0.05
    W[:, 256:384] *= 16
    wq, ws = quant_fp8_weight(W)
    xq, xs = act_quant_ref(x)
    if S is None:
        assert G._split_k(M, N, K, 16, 64, torch.device(DEV), False) > 1    # the default splits here
    cfg = None if S is None else {"SPLIT_K": S}
    y = G.fp8_gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), config=cfg)
    y1 = G.fp8_gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), config={"SPLIT_K": 1})
    check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws), G.fp8_gemm_torch(xq, xs, wq, ws), acc=FP8_ACC)
    check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws), y1.cpu(), acc=FP8_ACC)
    yl = G.fp8_linear(x.to(DEV), wq.to(DEV), ws.to(DEV), fuse_quant=True, config=cfg)
    assert torch.equal(yl.cpu().view(torch.int16), y.cpu().view(torch.int16))


def test_fp8_gemm_matches_official_order_twin_closely():
    """Same per-128-block fp32 partials as the official order: at most 1 bf16 ulp apart."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 256, generator=gen).bfloat16()
    wq, ws = quant_fp8_weight(torch.randn(64, 256, generator=gen) * 0.1)
    xq, xs = act_quant_ref(x)
    y = G.fp8_gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV)).cpu()
    t = G.fp8_gemm_torch(xq, xs, wq, ws)
    b = lambda v: v.view(torch.int16).int()
    if DEV == "cpu":
        assert ((b(y) - b(t)).abs() <= 1).all()
    else:    # FP8 MMA partials (see FP8_ACC): a few ulps on near-cancelling sums
        check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws), t, acc=FP8_ACC)


# ------------------------------------------------------------------------------------------------
# FP4 GEMM

def _fp4_weight(fmt, N, K, gen, spread=False):
    W = torch.randn(N, K, generator=gen) * 0.05
    if spread:     # per-32 scales 2^16 apart inside a 128-block (the folded path's exact limit)
        W[:, 32:64] *= 2.0 ** -12
        W[:, 64:96] *= 2.0 ** -16
    if fmt == "mxfp4":
        wp, s = quant_mxfp4(W)
        return wp, s, None, dequant_mxfp4(wp, s)
    wp, s, s2 = quant_nvfp4(W)
    return wp, s, s2, dequant_nvfp4(wp, s, s2)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("M,N,K", [(5, 96, 256), (17, 64, 128)])
def test_fp4_gemm(fmt, M, N, K):
    gen = torch.Generator().manual_seed(M + N + K + len(fmt))
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    wp, s, s2, Wd = _fp4_weight(fmt, N, K, gen)
    xq, xs = act_quant_ref(x)
    y = G.fp4_gemm(xq.to(DEV), xs.to(DEV), wp.to(DEV), s.to(DEV), fmt, None if s2 is None else s2.to(DEV))
    twin = G.fp4_gemm_torch(xq, xs, wp, s, fmt, s2)
    ref = Linear(Wd, "fp4", OFFICIAL)(x)
    check_gemm(y, xq, xs, Wd, twin)
    check_gemm(ref, xq, xs, Wd)


@pytest.mark.parametrize("bm", [16, 64])
def test_fp4_gemm_mxfp4_scale_spread(bm):
    """Per-32 promotion (BM < 64) and the folded relative scales (BM >= 64) stay exact."""
    gen = torch.Generator().manual_seed(bm)
    x = (torch.randn(6, 256, generator=gen) * 2).bfloat16()
    wp, s, _, Wd = _fp4_weight("mxfp4", 64, 256, gen, spread=True)
    xq, xs = act_quant_ref(x)
    y = G.fp4_gemm(xq.to(DEV), xs.to(DEV), wp.to(DEV), s.to(DEV), "mxfp4", config={"BM": bm})
    check_gemm(y, xq, xs, Wd, G.fp4_gemm_torch(xq, xs, wp, s))


def test_fp4_gemm_pure_triton_decode_path():
    """The portable (no inline PTX) e2m1 decode gives the same bits as the default path."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 128, generator=gen).bfloat16()
    wp, s, _, _ = _fp4_weight("mxfp4", 32, 128, gen)
    xq, xs = act_quant_ref(x)
    outs = []
    for use_asm in ((False, True) if DEV == "cuda" else (False,)):
        a16 = G.f16_operand(xq.to(DEV))
        out = torch.empty(4, 32, dtype=torch.bfloat16, device=DEV)
        G.fp4_launch(a16, xs.to(DEV), G._u8(wp).to(DEV)[None], s.view(torch.uint8).to(DEV)[None], None,
                     out, None, 4, 32, 128, 0, fmt="mxfp4", path="dequant", use_asm=use_asm)
        outs.append(out.cpu())
    assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs)


# ------------------------------------------------------------------------------------------------
# decode GEMV (CUDA cores): same products, another fp32 summation order

@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
@pytest.mark.parametrize("M,split", [(1, None), (3, 2), (5, 1)])
def test_gemv_against_exact(fmt, M, split):
    """Plain (non-grouped) GEMV: 1-, 2- and 4-row tiles (M=3 pads a 4-row tile, M=5 takes two),
    split-K partials summed in split order; FP8 with the activation quantised in the prologue is
    bit-identical to the pre-quantised input."""
    from dsv4.kernels import gemv as V
    gen = torch.Generator().manual_seed(M * 7 + len(fmt))
    K, N = 512, 80
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    xq, xs = act_quant_ref(x)
    cfg = {"SPLIT_K": split} if split else None
    if fmt == "fp8":
        W = torch.randn(N, K, generator=gen) * 0.05
        q, s = quant_fp8_weight(W)
        Wd = dequant_fp8_weight(q, s)
        y = V.fp8_gemv(x.to(DEV), q.to(DEV), s.to(DEV), config=cfg)
        y2 = V.fp8_gemv(xq.to(DEV), q.to(DEV), s.to(DEV), xs=xs.to(DEV), config=cfg)
        assert torch.equal(y.cpu().view(torch.int16), y2.cpu().view(torch.int16))
        if split is None:     # fp8_linear(gemv=True) is this kernel
            yl = G.fp8_linear(x.to(DEV), q.to(DEV), s.to(DEV), gemv=True)
            assert torch.equal(yl.cpu().view(torch.int16), y.cpu().view(torch.int16))
        twin = G.fp8_gemm_torch(xq, xs, q, s)
        check_gemm(y, xq, xs, Wd, twin, acc=2.0 ** -16)
    else:
        wp, s, s2, Wd = _fp4_weight(fmt, N, K, gen)
        y = V.fp4_gemv(xq.to(DEV), xs.to(DEV), wp.to(DEV), s.to(DEV), fmt, None if s2 is None else s2.to(DEV),
                       config=cfg)
        check_gemm(y, xq, xs, Wd, G.fp4_gemm_torch(xq, xs, wp, s, fmt, s2))


def test_gemv_rejects_bad_tile_rows():
    from dsv4.kernels import gemv as V
    q, s = quant_fp8_weight(torch.randn(128, 128))
    a = torch.zeros(3, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bm must be 1, 2 or 4"):
        V.gemv_launch(a, torch.ones(3, 1), q, s, None, 3, 128, 128, wfmt="fp8", bm=3)


# ------------------------------------------------------------------------------------------------
# MoE

def _mx(w):
    q, s = quant_mxfp4(w)
    return dequant_mxfp4(q, s)


def _f8(w):
    q, s = quant_fp8_weight(w)
    return dequant_fp8_weight(q, s)


def _ref_moe(E, d, I, k, gen, hash_layer, vocab=64, shared=True, dup_row=None):
    lin = lambda o, i, f, fmt: Linear(f(torch.randn(o, i, generator=gen) * 0.06), fmt, OFFICIAL)
    experts = [Expert(lin(I, d, _mx, "fp4"), lin(d, I, _mx, "fp4"), lin(I, d, _mx, "fp4"), 10.0, OFFICIAL)
               for _ in range(E)]
    sh = Expert(lin(I, d, _f8, "fp8"), lin(d, I, _f8, "fp8"), lin(I, d, _f8, "fp8"), 10.0, OFFICIAL) if shared else None
    gate = torch.randn(E, d, generator=gen) * 0.1
    bias = None if hash_layer else torch.randn(E, generator=gen) * 0.05
    tid = None
    if hash_layer:
        tid = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(vocab)])
        if dup_row is not None:
            tid[dup_row, 1] = tid[dup_row, 0]          # a repeated expert id in one row
    return MoE(gate, bias, tid, experts, sh, k, 1.5, OFFICIAL)


def _check_moe(y, yr):
    y, yr = y.cpu().float(), yr.float()
    assert torch.isfinite(y).all()
    rel = ((y - yr).norm() / yr.norm()).item()
    assert rel < 2e-2, rel
    assert ((y - yr).abs() <= 0.05 * yr.abs().amax(-1, keepdim=True) + 1e-6).all()


@pytest.mark.parametrize("hash_layer", [False, True])
def test_route_exact(hash_layer):
    gen = torch.Generator().manual_seed(3 + hash_layer)
    ref = _ref_moe(8, 256, 128, 3, gen, hash_layer, dup_row=5, shared=False)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = (torch.randn(13, 256, generator=gen)).bfloat16()
    ids = torch.randint(0, 64, (13,), generator=gen)
    ids[2] = 5
    i0, w0 = ref.route(x, ids)
    i1, w1 = Mo.route(x.to(DEV), ids.to(DEV), w)
    i1, w1 = i1.cpu(), w1.cpu()
    if DEV == "cpu":   # same logits: the same ids in the same slot order, weights within ulps
        assert torch.equal(i1, i0)
        torch.testing.assert_close(w1, w0, rtol=4e-7, atol=0)
    else:              # scores from another device's GEMM: compare as sets, weights to ~ulps
        assert torch.equal(i1.sort(-1).values, i0.sort(-1).values)
        o1, o0 = i1.argsort(-1), i0.argsort(-1)
        torch.testing.assert_close(w1.gather(1, o1), w0.gather(1, o0), rtol=1e-5, atol=1e-6)
    # the router's quantised x (the expert GEMMs' operand from the same launch): act_quant_fp8's bytes
    x = x * torch.logspace(-3, 1, 256).bfloat16()          # blocks of very different scales
    i2, w2, e2, xq, xs = Mo._route(x.to(DEV), ids.to(DEV), w, quant=True)
    i3, w3, e3, nq, ns = Mo._route(x.to(DEV), ids.to(DEV), w)
    q0, s0 = G.act_quant_fp8(x.to(DEV))
    assert nq is None and ns is None
    assert torch.equal(xq, q0.view(torch.uint8)) and torch.equal(xs, s0)
    assert torch.equal(i2, i3) and torch.equal(w2, w3) and torch.equal(e2, e3)


@triton.jit
def _sqrt_softplus_probe(Z, Y, N, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(Y + i, Mo._sqrt_softplus(tl.load(Z + i, mask=i < N)), mask=i < N)


def test_sqrt_softplus_matches_torch():
    """The routing kernel's sqrt(softplus(z)) against torch's over the fp32 range that matters (tails,
    the 20 threshold, zero)."""
    z = torch.cat([torch.linspace(-90, 40, 4001), torch.tensor([0.0, -0.0, 20.0, 20.000002, 19.999998, -1e-8,
                                                                 1e-8, -20.0, -88.0])]).float()
    y = torch.empty_like(z).to(DEV)
    _sqrt_softplus_probe[(triton.cdiv(z.numel(), 1024),)](z.to(DEV), y, z.numel(), B=1024)
    ref = torch.sqrt(torch.nn.functional.softplus(z))
    # a few ulps (the GPU's exp / log are the approximate ex2 / lg2 forms); below z = -87.3 exp() is
    # subnormal and keeps fewer bits (19 at z = -90: the H200 measured 3.4e-6 there)
    normal = z >= -87.3
    torch.testing.assert_close(y.cpu()[normal], ref[normal], rtol=2e-6, atol=0)
    torch.testing.assert_close(y.cpu()[~normal], ref[~normal], rtol=2e-5, atol=0)


@pytest.mark.parametrize("P,E", [(1, 8), (6, 256), (100, 8), (384, 256), (1000, 64), (1500, 8)])
def test_sort_pairs_stable(P, E):
    """sort_pairs (the one-launch counting sort up to SORT_COUNTING_MAX pairs, torch.sort above) =
    a stable sort by expert id with the sentinel E last; offs / tcum / inv consistent."""
    gen = torch.Generator().manual_seed(P)
    ef = torch.randint(0, E + 1, (P,), generator=gen, dtype=torch.int32)
    ef[: P // 3] = ef[0]                          # long runs of one expert
    perm, offs, tcum, inv = Mo.sort_pairs(ef.to(DEV), E, 8)
    ref = torch.sort(ef.long(), stable=True).indices
    assert torch.equal(perm.cpu(), ref)
    assert torch.equal(inv.cpu().long()[ref], torch.arange(P))
    cnt = torch.bincount(ef.long(), minlength=E + 1)
    assert torch.equal(offs.cpu(), torch.cat([torch.zeros(1, dtype=torch.long), cnt.cumsum(0)[:E]]))
    assert torch.equal(tcum.cpu(), torch.cat([torch.zeros(1, dtype=torch.long), ((cnt[:E] + 7) // 8).cumsum(0)]))


@pytest.mark.parametrize("S", [2, 5])
def test_combine_sums_split_partials(S):
    """The MoE combine on the w2 GEMM's unsummed fp32 split partials (the decode path's one launch
    fewer) equals the combine on their ``sum_splits`` bf16 rows bit for bit, masked pairs included."""
    from dsv4.kernels.gemv import sum_splits
    gen = torch.Generator().manual_seed(S)
    T, k, E, d = 5, 3, 8, 96
    eflat = torch.randint(0, E, (T * k,), generator=gen)
    eflat[4] = E                                   # a masked slot (sentinel expert: no row)
    perm, offs, tcum, inv = Mo.sort_pairs(eflat.int().to(DEV), E, 1)
    part = (torch.randn(S, T * k, d, generator=gen) * 3).to(DEV)
    sh = torch.randn(T, d, generator=gen).bfloat16().to(DEV)
    y_split = torch.empty(T, d, dtype=torch.bfloat16, device=DEV)
    y_summed = torch.empty_like(y_split)
    Mo._combine(part, inv, offs, sh, y_split, k)
    Mo._combine(sum_splits(part), inv, offs, sh, y_summed, k)
    assert torch.equal(y_split.view(torch.int16), y_summed.view(torch.int16))
    # ... and differs from a combine that skipped a split (the partials are really read)
    Mo._combine(part[:-1].contiguous(), inv, offs, sh, y_split, k)
    assert not torch.equal(y_split, y_summed)


@pytest.mark.parametrize("hash_layer,T,path,bm", [(False, 9, "dequant", None), (True, 7, "dequant", None),
                                                  (False, 9, "gemv", 2), (True, 7, "gemv", 4), (False, 1, "gemv", 1),
                                                  (True, 2, None, None), (False, 12, None, None),
                                                  (False, 30, "prefill", None), (True, 9, "prefill", None)])
def test_moe_forward(hash_layer, T, path, bm):
    """Every expert-GEMM path: the MMA kernels, the prefill kernel (fp4_prefill.py: one K=128 dot per
    block, split-K-order operands) and the decode GEMV (1/2/4-row tiles); the shared expert on the
    split-K MMA partials (<= 64 tokens); the default picks the GEMV at <= 2 rows per expert."""
    gen = torch.Generator().manual_seed(20 + T)
    ref = _ref_moe(8, 256, 128, 2, gen, hash_layer, dup_row=4)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = (torch.randn(T, 256, generator=gen) * 1.5).bfloat16()
    ids = torch.randint(0, 64, (T,), generator=gen)
    ids[0] = 4
    y, parts = Mo.moe_forward(x.to(DEV), ids.to(DEV), w, path=path, config=None if bm is None else {"BM": bm},
                              return_parts=True)
    yr = ref(x, ids)
    _check_moe(y, yr)
    # the default takes the decode kernels up to GEMV_ROWS_PER_EXPERT rows per active expert (T x 2
    # pairs, 8 experts), MMA_GEMV_ROWS_PER_EXPERT where the tensor-core one runs (sm_89+)
    P = T * 2
    from dsv4.kernels import fp4_mma
    gemv_max = Mo.MMA_GEMV_ROWS_PER_EXPERT if fp4_mma.available(torch.device(DEV)) else Mo.GEMV_ROWS_PER_EXPERT
    assert parts["path"] == (path or ("gemv" if P / min(8, P) <= gemv_max else G.fp4_path("mxfp4", DEV)))
    # pairs sorted by expert: offsets are the cumulative counts (duplicates dropped)
    idx = parts["idx"].cpu()
    first = torch.ones_like(idx, dtype=torch.bool)
    first[:, 1] = idx[:, 1] != idx[:, 0]
    counts = torch.bincount(idx[first], minlength=8)
    assert torch.equal(parts["offs"].cpu(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))


def _nv_expert(I, d, gen):
    """A ModelOpt-style expert: w1/w3 share one global scale, w2 has its own (exact dequantised values)."""
    a, b, c = (torch.randn(I, d, generator=gen) * 0.06, torch.randn(I, d, generator=gen) * 0.05,
               torch.randn(d, I, generator=gen) * 0.06)
    g = torch.maximum(a.abs().amax(), b.abs().amax()) / (6 * 448)
    deq = [dequant_nvfp4(*quant_nvfp4(a, g)), dequant_nvfp4(*quant_nvfp4(b, g)), dequant_nvfp4(*quant_nvfp4(c))]
    return Expert(Linear(deq[0], "fp4", OFFICIAL), Linear(deq[2], "fp4", OFFICIAL), Linear(deq[1], "fp4", OFFICIAL),
                  10.0, OFFICIAL)


def test_moe_weights_pick_the_checkpoint_fp4_format():
    """The fused path packs experts in the FP4 format that holds them exactly: MXFP4 for official
    checkpoints, NVFP4 for ModelOpt ones (w1/w3 sharing a global scale); neither is a named error."""
    gen = torch.Generator().manual_seed(11)
    ref = _ref_moe(4, 256, 128, 2, gen, False)
    assert Mo.MoEWeights.from_reference_exact(ref).fmt == "mxfp4"
    ref.experts = [_nv_expert(128, 256, gen) for _ in range(4)]
    w = Mo.MoEWeights.from_reference_exact(ref, layer=3)
    assert w.fmt == "nvfp4"
    back = w.to_reference()
    for e0, e1 in zip(ref.experts, back.experts):
        for n in ("w1", "w2", "w3"):
            assert torch.equal(getattr(e0, n).weight, getattr(e1, n).weight)
    x = (torch.randn(5, 256, generator=gen) * 1.5).bfloat16()
    _check_moe(Mo.moe_forward(x.to(DEV), None, w.to(DEV)), ref(x, None))
    ref.experts[1].w2.weight = ref.experts[1].w2.weight * 1.001          # no longer on either grid
    with pytest.raises(ValueError, match="layer 3: routed experts fit neither FP4 kernel format"):
        Mo.MoEWeights.from_reference_exact(ref, layer=3)


def test_moe_empty_experts_and_unrouted_tokens():
    gen = torch.Generator().manual_seed(5)
    ref = _ref_moe(8, 256, 128, 2, gen, False)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    # one token: six of the eight experts get none
    x = torch.randn(1, 256, generator=gen).bfloat16()
    _check_moe(Mo.moe_forward(x.to(DEV), None, w), ref(x, None))
    # explicit routing with masked slots (-1): token 1 goes to no routed expert (shared only)
    x = torch.randn(3, 256, generator=gen).bfloat16()
    idx = torch.tensor([[1, 6], [-1, -1], [3, -1]])
    rw = torch.tensor([[0.7, 0.8], [0.0, 0.0], [1.5, 0.0]])
    y = Mo.moe_forward(x.to(DEV), None, w, routing=(idx.to(DEV), rw.to(DEV))).cpu()
    yr = ref.shared(x).float()
    for t in range(3):
        for j in range(2):
            e = int(idx[t, j])
            if e >= 0:
                yr[t] += ref.experts[e](x[t:t + 1], rw[t, j:j + 1])[0].float()
    _check_moe(y, yr.bfloat16())
    # no tokens
    assert Mo.moe_forward(x[:0].to(DEV), None, w).shape == (0, 256)


def test_moe_nvfp4_packed():
    gen = torch.Generator().manual_seed(9)
    E, d, I, k = 4, 256, 128, 2
    pk = {n: [] for n in ("w1", "s1", "g1", "w3", "s3", "g3", "w2", "s2", "g2")}
    for _ in range(E):
        for a, (o, i) in (("1", (I, d)), ("3", (I, d)), ("2", (d, I))):
            q, s, g = quant_nvfp4(torch.randn(o, i, generator=gen) * 0.06)
            pk["w" + a].append(q)
            pk["s" + a].append(s)
            pk["g" + a].append(g)
    st = {n: torch.stack(v) for n, v in pk.items()}
    sh = tuple(quant_fp8_weight(torch.randn(o, i, generator=gen) * 0.06) for o, i in ((I, d), (I, d), (d, I)))
    w = Mo.MoEWeights.from_packed(torch.randn(E, d, generator=gen) * 0.1, torch.zeros(E), None, k, 1.5, 10.0,
                                  "nvfp4", st["w1"], st["s1"], st["w3"], st["s3"], st["w2"], st["s2"],
                                  w1_s2=st["g1"], w3_s2=st["g3"], w2_s2=st["g2"], shared=sh)
    ref = w.to_reference()
    x = torch.randn(6, d, generator=gen).bfloat16()
    _check_moe(Mo.moe_forward(x.to(DEV), None, w.to(DEV)), ref(x, None))


# ------------------------------------------------------------------------------------------------
# ahead-of-time compilation for Hopper and Blackwell (no GPU needed)

_AOT_SCRIPT = textwrap.dedent("""
    import os, re, sys
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    from kernel_helpers import aot_compile
    from dsv4.kernels import gemm as G, gemv as V, moe as Mo

    DIV = ("K", "N_out", "n_half", "stride_am", "stride_sam", "stride_we", "stride_wn", "stride_wse",
           "stride_wsn", "stride_w2e", "stride_cm", "stride_csm", "stride_bn", "stride_sbn", "stride_x",
           "stride_q", "stride_s", "stride_a", "d", "stride_o", "stride_y", "N", "k_per_split", "N2", "n_half")
    P = lambda t: "*" + t

    def comp(fn, types, const, cap, warps, stages=3):
        return aot_compile(fn, types, const, cap, warps, stages, div=DIV)[0]

    fp8t = dict(A=P("u8"), SA=P("fp32"), B=P("u8"), SB=P("fp32"), C=P("bf16"), CS=P("fp32"), limit="fp32")
    fp4t = dict(A16=P("fp16"), SA=P("fp32"), W=P("u8"), WS=P("u8"), WS2=P("fp32"), C=P("bf16"), CS=P("fp32"),
                PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"), PW=P("fp32"), limit="fp32")
    sct = dict(A=P("u8"), SA=P("fp32"), W=P("u8"), WS=P("u8"), C=P("bf16"), CS=P("fp32"), PERM=P("i64"),
               OFFS=P("i64"), TCUM=P("i64"), PW=P("fp32"), limit="fp32")
    for cap in (90, 100):
        comp(G._act_quant_kernel, dict(X=P("bf16"), Q=P("u8"), S=P("fp32")), dict(BLOCKS=8, INTERP=False), cap, 4)
        ptx = comp(G._fp8_gemm_kernel, fp8t, dict(SB_SHIFT=7, A_BF16=False, SB_E8M0=False, SWIGLU=False,
                                                  BM=128, BN=128, GROUP_M=8, SPLIT=False, SUM=False, INTERP=False), cap, 8, 4)
        if cap == 90:
            assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx, "expected fp8 wgmma"
        else:
            assert "tcgen05.mma" in ptx
        comp(G._fp8_gemm_kernel, dict(fp8t, A=P("bf16"), SB=P("u8"), C=P("u8")),
             dict(SB_SHIFT=7, A_BF16=True, SB_E8M0=True, SWIGLU=True, BM=16, BN=128, GROUP_M=8, SPLIT=False,
                  SUM=False, INTERP=False), cap, 4)
        # decode: split-K partials (fp32 workspace) summed by each tile's last arriving program
        ptx = comp(G._fp8_gemm_kernel, dict(fp8t, A=P("bf16"), SB=P("u8"), C=P("fp32"), OUT=P("bf16"), CNT=P("i32")),
                   dict(SB_SHIFT=7, A_BF16=True, SB_E8M0=True, SWIGLU=False, BM=16, BN=32, GROUP_M=8, SPLIT=True,
                        SUM=True, INTERP=False), cap, 4, 5)
        assert "atom.global.gpu.acq_rel.add" in ptx, "expected the tile's acq_rel arrival"
        comp(G._splitk_sum, dict(WS=P("fp32"), C=P("bf16")), dict(BLOCK=1024, INTERP=False), cap, 4)
        for fmt, bm in ((0, 16), (1, 16), (2, 64), (1, 64)):
            comp(G._fp4_gemm_kernel, fp4t, dict(FMT=fmt, GROUPED=True, GATHER=False, SWIGLU=False, HAS_PW=False,
                                                USE_ASM=True, BM=bm, BN=128, LOG2G=9, INTERP=False), cap, 4, 3)
        comp(G._fp4_gemm_kernel, dict(fp4t, C=P("u8")), dict(FMT=0, GROUPED=True, GATHER=True, SWIGLU=True,
             HAS_PW=True, USE_ASM=True, BM=16, BN=128, LOG2G=9, INTERP=False), cap, 4, 3)
        for sw in (False, True):
            ptx = comp(G._fp4_scaled_kernel, dict(sct, C=P("u8") if sw else P("bf16")),
                       dict(GROUPED=True, GATHER=True, SWIGLU=sw, HAS_PW=sw, BM=128, BN=128, LOG2G=9, INTERP=False),
                       cap, 8, 3)
            if cap == 100:
                assert re.search(r"tcgen05\\.mma\\S*kind::mxf8f6f4\\.block_scale", ptx), "expected native MXFP4 MMA"
        # decode GEMV (CUDA cores): FP4 grouped split-K partials, FP8 with the prologue act quant
        gvt = dict(A=P("u8"), SA=P("fp32"), W=P("u8"), WS=P("u8"), WS2=P("fp32"), C=P("fp32"), PERM=P("i64"),
                   OFFS=P("i64"), TCUM=P("i64"))
        for wf, ng, gb, bm in ((0, 4, 16, 1), (1, 8, 8, 2), (0, 4, 16, 4)):
            comp(V._gemv_kernel, gvt, dict(WFMT=wf, SB_SHIFT=7, SB_E8M0=False, A_BF16=False, GROUPED=True, GATHER=True,
                 USE_ASM=True, BM=bm, BN=64, NG=ng, GB=gb, LOG2G=9, SPLIT=True, INTERP=False), cap, 8, 1)
        comp(V._gemv_kernel, dict(gvt, A=P("bf16"), WS=P("fp32"), C=P("bf16")), dict(WFMT=3, SB_SHIFT=7, SB_E8M0=False,
             A_BF16=True, GROUPED=False, GATHER=False, USE_ASM=True, BM=1, BN=32, NG=8, GB=16, LOG2G=1, SPLIT=False,
             INTERP=False), cap, 4, 1)
        # decode FP4 on tensor cores (Gluon): grouped split-K partials with the pair gather, plain bf16
        from dsv4.kernels import fp4_mma as F
        mmt = dict(A=P("u8"), SA=P("fp32"), W=P("u8"), WS=P("u8"), WS2=P("fp32"), C=P("fp32"), PERM=P("i64"),
                   OFFS=P("i64"), TCUM=P("i64"))
        for nv, grouped, split, band in ((False, True, True, True), (False, False, False, False),
                                         (True, True, True, False), (True, True, True, True)):
            ptx = comp(F._mma_gemv_kernel,
                       dict(mmt, C=P("fp32") if split else P("bf16"), A=P("fp16") if band else P("u8")),
                       dict(NV=nv, GROUPED=grouped, GATHER=grouped, BM=F.BM_ROWS, BN=64, LOG2G=9, SPLIT=split,
                            NUM_WARPS=4, BAND=band, A16=band), cap, 4)
            assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
            assert "ld.global.v4.b32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
        # decode FP8 on tensor cores (Gluon): in-kernel act quant + in-kernel split-K sum, pre-quantised
        from dsv4.kernels import fp8_mma as F8
        for act, reduce in ((1, True), (0, True), (0, False), (2, True)):
            ptx = comp(F8._fp8_mma_kernel, dict(A=P("bf16") if act else P("u8"), SA=P("fp32"), W=P("u8"), WS=P("u8"),
                       C=P("bf16"), PART=P("fp32"), CNT=P("i32")),
                       dict(ACT=act, SB_E8M0=True, SB_ROW=False, BM=F8.BM_ROWS, BN=64, SPLIT=reduce,
                            REDUCE=reduce, NUM_WARPS=4, UNROLL=1 if act == 2 else 2), cap, 4)
            ab = "bf16" if act == 2 else "f16"
            assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
            assert ("atom.global.gpu.acq_rel.add" in ptx) == reduce
        comp(V._swiglu_quant_kernel, dict(WSP=P("fp32"), H=P("u8"), HS=P("fp32"), PW=P("fp32"), PERM=P("i64"),
             limit="fp32"), dict(GATHER=True, HAS_PW=True, INTERP=False), cap, 4)
        for quant in (False, True):
            comp(Mo._route_kernel, dict(LOGIT=P("fp32"), BIAS=P("fp32"), TID2EID=P("i32"), IDS=P("i64"),
                 IDX=P("i64"), W=P("fp32"), EFLAT=P("i32"), X=P("bf16"), Q=P("u8"), SQ=P("fp32"), route_scale="fp32"),
                 dict(KTOP=6, KP=8, EP=256, HASH=False, QUANT=quant, QB=8, INTERP=False), cap, 4)
        comp(Mo._moe_sort_prep, dict(EFLAT=P("i32"), PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"), INV=P("i32")),
             dict(BM=8, EP=512, PP=512, CH=64), cap, 4)
        comp(Mo._moe_prep, dict(SORTED_E=P("i32"), PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"), INV=P("i32")),
             dict(BM=16, EP=512, LOG2P=15, CH=1024), cap, 4)
        comp(Mo._moe_combine, dict(OUT=P("bf16"), INV=P("i32"), OFFS=P("i64"), SH=P("bf16"), Y=P("bf16")),
             dict(KTOP=6, KP=8, BD=1024, HAS_SHARED=True, SPLIT=False, INTERP=False), cap, 4)
        comp(Mo._moe_combine, dict(OUT=P("fp32"), INV=P("i32"), OFFS=P("i64"), SH=P("bf16"), Y=P("bf16")),
             dict(KTOP=6, KP=8, BD=1024, HAS_SHARED=True, SPLIT=True, INTERP=False), cap, 4)
""")


def test_aot_compile_sm90_sm100():
    """Compile every kernel for GPUTarget('cuda', 90, 32) and ('cuda', 100, 32) on this machine."""
    run_aot_script(_AOT_SCRIPT, REPO, timeout=900)


# ------------------------------------------------------------------------------------------------
# GPU: V4-Flash shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(256, 4096, 4096), (48, 1024, 4096), (1024, 4096, 2048)])
def test_gpu_fp8_gemm_flash_shapes(M, N, K):
    _need_gpu()
    gen = torch.Generator().manual_seed(M + N)
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    wq, ws = quant_fp8_weight(torch.randn(N, K, generator=gen) * 0.02)
    xq, xs = G.act_quant_fp8(x.cuda())
    y = G.fp8_gemm(xq, xs, wq.cuda(), ws.cuda())
    check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws), acc=FP8_ACC)
    yl = G.fp8_linear(x.cuda(), wq.cuda(), ws.cuda())
    assert torch.equal(yl.view(torch.int16), y.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("M", [1, 2, 4])
def test_gpu_gemv_flash_shapes(fmt, M):
    """The decode GEMV at V4-Flash decode shapes (split-K chosen by the launcher) against the exact sum."""
    _need_gpu()
    from dsv4.kernels import gemv as V
    gen = torch.Generator().manual_seed(M + len(fmt))
    shapes = [(1024, 4096), (32768, 1024), (4096, 8192)] if fmt == "fp8" else [(4096, 4096), (4096, 2048)]
    for N, K in shapes:
        x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
        xq, xs = G.act_quant_fp8(x.cuda())
        if fmt == "fp8":
            wq, ws = quant_fp8_weight(torch.randn(N, K, generator=gen) * 0.02)
            y = V.fp8_gemv(x.cuda(), wq.cuda(), ws.cuda())
            check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws))
            assert torch.equal(y.view(torch.int16), G.fp8_linear(x.cuda(), wq.cuda(), ws.cuda(), gemv=True).view(torch.int16))
        else:
            wp, s, s2, Wd = _fp4_weight(fmt, N, K, gen)
            y = V.fp4_gemv(xq, xs, wp.cuda(), s.cuda(), fmt, None if s2 is None else s2.cuda())
            check_gemm(y, xq, xs, Wd)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("M", [1, 16, 64, 300])
def test_gpu_fp4_gemm_flash_shapes(fmt, M):
    _need_gpu()
    gen = torch.Generator().manual_seed(M)
    N, K = 4096, 4096                                  # w1|w3 of one V4-Flash expert
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    wp, s, s2, Wd = _fp4_weight(fmt, N, K, gen)
    xq, xs = G.act_quant_fp8(x.cuda())
    y = G.fp4_gemm(xq, xs, wp.cuda(), s.cuda(), fmt, None if s2 is None else s2.cuda())
    check_gemm(y, xq, xs, Wd)
    if fmt == "mxfp4":   # the portable decode and the dot_scaled path give the same products
        for path, asm in (("dequant", False), ("scaled", None)):
            out = torch.empty_like(y)
            a = G.f16_operand(xq) if path == "dequant" else G._u8(xq)
            G.fp4_launch(a, xs, G._u8(wp).cuda()[None], s.view(torch.uint8).cuda()[None], None, out, None,
                         M, N, K, 0, fmt=fmt, path=path, use_asm=asm)
            check_gemm(out, xq, xs, Wd)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 8, 13])
@pytest.mark.parametrize("fmt,spread", [("mxfp4", "none"), ("mxfp4", "2^16"), ("mxfp4", "2^40"), ("nvfp4", "2^16")])
def test_gpu_mma_gemv_flash_shapes(M, fmt, spread):
    """The tensor-core FP4 decode kernel (fp4_mma.py) at V4-Flash expert shapes against the exact sum:
    1-13 rows (one or two 8-row tiles), MXFP4 group scales spread inside a 128-K block up to the
    folded f16 weights' exact limit (2^16 here; 2^32 in general) and past it (2^40: small groups
    round), NVFP4 with its e4m3 group and fp32 global scales."""
    _need_gpu()
    from dsv4.kernels import fp4_mma as F
    gen = torch.Generator().manual_seed(M)
    for N, K in [(4096, 4096), (4096, 2048), (200, 1024)]:      # w1|w3, w2, N not a multiple of 64
        x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
        W = torch.randn(N, K, generator=gen) * 0.05
        if spread != "none":
            e = 16 if spread == "2^16" else 40
            W[:, 32:64] *= 2.0 ** -12
            W[:, 64:96] *= 2.0 ** -e
        if fmt == "mxfp4":
            wp, sc = quant_mxfp4(W)
            s2, Wd = None, dequant_mxfp4(wp, sc)
        else:
            wp, sc, s2 = quant_nvfp4(W)
            Wd = dequant_nvfp4(wp, sc, s2)
            s2 = s2.float().reshape(-1).expand(N).contiguous()[None].cuda()
        xq, xs = G.act_quant_fp8(x.cuda())
        args = (G._u8(xq), xs, G._u8(wp).cuda()[None], sc.view(torch.uint8).cuda()[None], M, N, K)
        y = F.mma_gemv_launch(*args, fmt=fmt, ws2=s2)
        check_gemm(y, xq, xs, Wd)
        part = F.mma_gemv_launch(*args, fmt=fmt, ws2=s2, partial=True, split=4)
        check_gemm(part.sum(0).bfloat16(), xq, xs, Wd)
        # the f16 activation operand: the same values, products and order, so the same bits
        assert torch.equal(F.mma_gemv_launch(F.act_f16_split(args[0]), *args[1:], fmt=fmt, ws2=s2), y)
        if N % F.BAND_ROWS == 0:   # the band layout: same products in the same order, so the same bits
            sb = 4 if fmt == "mxfp4" else 8
            band = (args[0], args[1], F.band_layout(args[2], 64), F.band_layout(args[3], sb), M, N, K)
            assert torch.equal(F.mma_gemv_launch(*band, fmt=fmt, ws2=s2), y)
            assert torch.equal(F.mma_gemv_launch(*band, fmt=fmt, ws2=s2, partial=True, split=4), part)


@pytest.mark.gpu
@pytest.mark.parametrize("hash_layer,T", [(False, 64), (True, 16), (False, 200), (False, 2)])
def test_gpu_moe_flash_dims(hash_layer, T):
    """V4-Flash dims (d 4096, inter 2048, top-6) with 8 experts (CPU reference time): 1.5 rows per
    expert take the decode path (tensor-core kernel and CUDA-core GEMV), 12 rows the tensor-core
    decode kernel on sm_89+ (else the MMA kernels; both run), 48 the prefill kernel's 64-row tiles,
    150 its 128-row tiles."""
    _need_gpu()
    gen = torch.Generator().manual_seed(T)
    ref = _ref_moe(8, 4096, 2048, 6, gen, hash_layer, vocab=256, dup_row=3)
    w = Mo.MoEWeights.from_reference(ref).to("cuda")
    x = torch.randn(T, 4096, generator=gen).bfloat16()
    ids = torch.randint(0, 256, (T,), generator=gen)
    ids[0] = 3
    y, parts = Mo.moe_forward(x.cuda(), ids.cuda(), w, return_parts=True)
    _check_moe(y, ref(x, ids))
    rows = T * 6 / 8
    from dsv4.kernels import fp4_mma
    gemv_max = Mo.MMA_GEMV_ROWS_PER_EXPERT if fp4_mma.available("cuda") else Mo.GEMV_ROWS_PER_EXPERT
    assert parts["path"] == ("gemv" if rows <= gemv_max else
                             "prefill" if rows > Mo.PREFILL_ROWS_PER_EXPERT else "dequant")
    if parts["path"] == "gemv":
        assert parts["kernel"] == ("mma" if fp4_mma.available("cuda") else "cuda-core")
        y2, parts2 = Mo.moe_forward(x.cuda(), ids.cuda(), w, config={"kernel": "cuda-core"}, return_parts=True)
        assert parts2["kernel"] == "cuda-core"
        _check_moe(y2, ref(x, ids))
    if Mo.GEMV_ROWS_PER_EXPERT < rows <= Mo.PREFILL_ROWS_PER_EXPERT:   # the MMA kernels' own range
        y3, parts3 = Mo.moe_forward(x.cuda(), ids.cuda(), w, path="dequant", return_parts=True)
        assert parts3["path"] == "dequant"
        _check_moe(y3, ref(x, ids))
