"""Prefill FP4 expert GEMM (dsv4/kernels/fp4_prefill.py) against the exact product sum, the torch twin
and the existing ``gemm.fp4_launch`` (dequant path).

CPU: the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1 when no CUDA
device is present) at small shapes, with the portable (no inline PTX) decode. GPU (plain ``pytest``): the
same tests run compiled, and the ``gpu``-marked ones add the V4-Flash prefill dims. The AOT test compiles the
kernel for sm_90 and sm_100 without a GPU and checks the Hopper loop runs on wgmma.

Tolerances: the contract of ``kernel_helpers.check_gemm``: |y - exact| <= 2^-8
|exact| + 2^-16 sum|products| (every product exact, fp32 sums in another order), twice that vs the twin
or the old kernel; SwiGLU: the e4m3 h within one FP8 step of the twin's (a one-ulp flip of a
bf16-rounded w1/w3 output can move h by one step), the rest identical.
"""
import functools  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from kernel_helpers import check_gemm, gemm_exact, kernel_device, need_gpu, run_aot_script  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from dsv4.formats.fp4 import dequant_mxfp4, dequant_nvfp4, quant_mxfp4, quant_nvfp4  # noqa: E402
from dsv4.formats.fp8 import act_quant_fp8 as act_quant_ref  # noqa: E402
from dsv4.kernels.gemm import common as GC, fp4 as G4  # noqa: E402
from dsv4.kernels import lib as L  # noqa: E402
from dsv4.kernels.lib import target, u8  # noqa: E402
from dsv4.twins import gemm as GT  # noqa: E402
from dsv4.kernels.gemm import fp4_prefill as P  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEV = kernel_device()
VARIANTS = [dict(DEC=0, KSPLIT=False), dict(DEC=1, KSPLIT=False), dict(DEC=0, KSPLIT=True), dict(DEC=1, KSPLIT=True)]
VID = ["cvt-natural", "alu-natural", "cvt-split", "alu-split"]


def _weight(fmt, N, K, gen, spread=0):
    W = torch.randn(N, K, generator=gen) * 0.05
    if spread:       # per-32 scales up to 2^spread apart inside a 128-block
        W[:, 32:64] *= 2.0 ** -(spread // 2)
        W[:, 64:96] *= 2.0 ** -spread
    if fmt == "mxfp4":
        wp, s = quant_mxfp4(W)
        return wp, s, None, dequant_mxfp4(wp, s)
    wp, s, s2 = quant_nvfp4(W)
    return wp, s, s2, dequant_nvfp4(wp, s, s2)


def _operand(xq, v):
    return P.f16_operand_split(xq) if v["KSPLIT"] else GC.f16_operand(xq)


def _plain(xq, xs, wp, s, s2, fmt, cfg, old=False):
    M, K = xq.shape
    N = wp.shape[0]
    w = u8(wp).contiguous().to(DEV)[None]
    ws = u8(s).contiguous().to(DEV)[None]
    ws2 = None if s2 is None else s2.float().reshape(-1).expand(N).contiguous().to(DEV)[None]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
    if old:
        G4.fp4_launch(GC.f16_operand(xq.to(DEV)), xs.float().to(DEV), w, ws, ws2, out, None, M, N, K, 0, fmt=fmt,
                     path="dequant", config=cfg)
    else:
        P.fp4_prefill_launch(_operand(xq.to(DEV), cfg), xs.float().to(DEV), w, ws, ws2, out, None, M, N, K, 0,
                             fmt=fmt, config=cfg)
    return out


# ------------------------------------------------------------------------------------------------
# plain mode

@pytest.mark.parametrize("v", VARIANTS, ids=VID)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_plain_against_exact_twin_and_old(fmt, v):
    """64-row tiles over 70 rows (a partial tile), 96 columns (a partial column block), K 256."""
    gen = torch.Generator().manual_seed(3 + len(fmt))
    M, N, K = 70, 96, 256
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    wp, s, s2, Wd = _weight(fmt, N, K, gen)
    xq, xs = act_quant_ref(x)
    cfg = dict(v, BM=64, BN=64)
    y = _plain(xq, xs, wp, s, s2, fmt, cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    check_gemm(y, xq, xs, Wd, GT.fp4_gemm(xq, xs, wp, s, fmt, s2))
    check_gemm(y, xq, xs, Wd, _plain(xq, xs, wp, s, s2, fmt, dict(BM=64, BN=64), old=True))


@pytest.mark.parametrize("v", VARIANTS[:1] + VARIANTS[3:], ids=[VID[0], VID[3]])
@pytest.mark.parametrize("spread", [16, 26])
def test_mxfp4_scale_spread(spread, v):
    """Group scales 2^16 (the old fold's exact limit) and 2^26 apart inside a 128-block: exact here
    (the relative scale is folded with a 2^14 bias: exact up to 2^28)."""
    gen = torch.Generator().manual_seed(spread)
    x = (torch.randn(6, 256, generator=gen) * 2).bfloat16()
    wp, s, _, Wd = _weight("mxfp4", 64, 256, gen, spread=spread)
    xq, xs = act_quant_ref(x)
    sb = s.view(torch.uint8).int().view(64, 2, 4)
    assert (sb.amax(-1) - sb.amin(-1)).max() >= spread - 1
    y = _plain(xq, xs, wp, s, None, "mxfp4", dict(v, BM=64, BN=64))
    check_gemm(y, xq, xs, Wd, GT.fp4_gemm(xq, xs, wp, s))


def test_split_operand_is_a_permutation():
    gen = torch.Generator().manual_seed(1)
    xq, _ = act_quant_ref((torch.randn(3, 256, generator=gen) * 3).bfloat16())
    a = P.f16_operand_split(xq)
    ref = xq.float().view(3, 8, 16, 2).transpose(-1, -2).reshape(3, 256)
    assert a.dtype == torch.float16 and a.is_contiguous() and torch.equal(a.float(), ref)


def test_decode_bit_trick_all_codes():
    """The integer-only e2m1 decode (portable form, the one the interpreter runs; the PTX form is
    compared with it on the GPU) against the e2m1 table for every byte."""
    import triton.language as tl

    @triton.jit
    def k(B, LO, HI, DEC: tl.constexpr, USE_ASM: tl.constexpr):
        i = tl.arange(0, 256)
        b = tl.load(B + i)
        if DEC == 1:
            lo, hi = P._e2m1_f16_alu(b[None, :], USE_ASM)
        else:
            lo, hi = L.e2m1_f16(b[None, :], USE_ASM)
        tl.store(LO + i[None, :], lo)
        tl.store(HI + i[None, :], hi)

    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    for asm in ((False, True) if DEV == "cuda" else (False,)):
        for dec, shift in ((0, 2.0 ** -6), (1, 2.0 ** -14)):
            lo = torch.empty(256, dtype=torch.float16, device=DEV)
            hi = torch.empty(256, dtype=torch.float16, device=DEV)
            k[(1,)](b.to(DEV), lo, hi, DEC=dec, USE_ASM=asm)
            assert torch.equal(lo.cpu().float(), table[b.long() & 15] * shift)
            assert torch.equal(hi.cpu().float(), table[b.long() >> 4] * shift)
            assert torch.equal(lo.cpu().view(torch.int16) < 0, (b & 8) > 0)    # signed zeros too


# ------------------------------------------------------------------------------------------------
# grouped mode (+ gather, SwiGLU epilogue)

def _grouped_case(E, counts, d, I, top_k, fmt, gen):
    """Sorted pair rows of E experts (``counts`` rows each; pair p -> token p // top_k), packed
    w13 [E, 2I, d/2] / w2 [E, d, I/2] weights with their dequantised copies."""
    P_ = sum(counts)
    T = -(-P_ // top_k)
    x = (torch.randn(T, d, generator=gen) * 1.5).bfloat16()
    xq, xs = act_quant_ref(x)
    perm = torch.randperm(T * top_k, generator=gen)[:P_]          # sorted row -> pair id
    offs = torch.tensor([0] + list(counts)).cumsum(0)
    pw = torch.rand(T * top_k, generator=gen) + 0.25
    w13, s13, g13, W13, w2, s2, g2, W2 = [], [], [], [], [], [], [], []
    for _ in range(E):
        a, b_, c, Wa = _weight(fmt, 2 * I, d, gen)
        w13.append(a), s13.append(b_), g13.append(c), W13.append(Wa)
        a, b_, c, Wa = _weight(fmt, d, I, gen)
        w2.append(a), s2.append(b_), g2.append(c), W2.append(Wa)
    st = lambda v: torch.stack([u8(t) for t in v])
    gl = (lambda v, n: None if v[0] is None else torch.stack([t.float().reshape(1).expand(n) for t in v]))
    return dict(xq=xq, xs=xs, perm=perm, offs=offs, pw=pw, w13=st(w13), s13=st(s13), g13=gl(g13, 2 * I), W13=W13,
                w2=st(w2), s2=st(s2), g2=gl(g2, d), W2=W2, P=P_, T=T)


def _tcum(offs, bm):
    cnt = offs[1:] - offs[:-1]
    return torch.cat([torch.zeros(1, dtype=torch.long), ((cnt + bm - 1) // bm).cumsum(0)])


def _launch_grouped(c, fn, a, cfg, fmt, I, d, top_k, E, limit, stage):
    bm = cfg["BM"]
    tc = _tcum(c["offs"], bm).to(DEV)
    n_tiles = min(c["P"], -(-c["P"] // bm) + min(E, c["P"]))
    kw = dict(fmt=fmt, offs=c["offs"].to(DEV), tcum=tc, n_groups=E, n_tiles=n_tiles, config=dict(cfg))
    if stage == 1:
        h = torch.empty(c["P"], I, dtype=torch.uint8, device=DEV)
        hs = torch.empty(c["P"], I // 128, dtype=torch.float32, device=DEV)
        fn(a, c["xs"].float().to(DEV), c["w13"].to(DEV), c["s13"].to(DEV),
           None if c["g13"] is None else c["g13"].to(DEV), h, hs, c["P"], I, d, I, swiglu=True, limit=limit,
           perm=c["perm"].to(DEV), pw=c["pw"].to(DEV), top_k=top_k, **kw)
        return h, hs
    out = torch.empty(c["P"], d, dtype=torch.bfloat16, device=DEV)
    fn(a, stage[1].to(DEV), c["w2"].to(DEV), c["s2"].to(DEV), None if c["g2"] is None else c["g2"].to(DEV), out, None,
       c["P"], d, I, 0, **kw)
    return out


_OLD_RUNS: dict = {}


def _old_grouped(c, a, cfg, fmt, I, d, top_k, E, limit, stage):
    """``_launch_grouped`` on the old kernel (``gemm.fp4_launch``, the reference of the test below), run once
    per input: the variants of a format share its case, and their GEMM 1 outputs are mostly the same bits, so
    the w2 operand too (the inputs' bytes are the key)."""
    import hashlib
    key = hashlib.sha256()
    for t in (a, c["xs"], c["w13"], c["s13"], c["w2"], c["s2"], c["perm"], c["pw"], c["offs"]) + \
            (() if stage == 1 else (stage[1],)):
        key.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    key = (fmt, stage if stage == 1 else 2, str(sorted(cfg.items())), key.hexdigest())
    if key not in _OLD_RUNS:
        _OLD_RUNS[key] = _launch_grouped(c, G4.fp4_launch, a, cfg, fmt, I, d, top_k, E, limit, stage)
    return _OLD_RUNS[key]


def _swiglu_twin(c, I, top_k, limit):
    """The expert middle of every sorted row from exact w1 / w3 sums (fp64 -> fp32 -> bf16), then
    the official clamp / SwiGLU / routing weight / bf16 / 1x128 FP8 quantisation."""
    h = torch.empty(c["P"], I)
    for e in range(len(c["W13"])):
        rows = range(int(c["offs"][e]), int(c["offs"][e + 1]))
        if not len(rows):
            continue
        pair = c["perm"][list(rows)]
        tok = pair // top_k
        ex, _ = gemm_exact(c["xq"].view(torch.uint8)[tok].view(torch.float8_e4m3fn), c["xs"][tok], c["W13"][e])
        gu = ex.float().bfloat16().float()
        g, u = gu[:, :I].clamp(max=limit), gu[:, I:].clamp(-limit, limit)
        h[list(rows)] = (c["pw"][pair, None] * (g / (1 + torch.exp(-g)) * u)).bfloat16().float()
    return act_quant_ref(h.bfloat16())


def _check_h(h, hs, hq_ref, hs_ref):
    hb, hsc = h.cpu(), hs.cpu()
    same = (hb == hq_ref.view(torch.uint8)).float().mean().item()
    assert same > 0.98, same
    deq = hb.view(torch.float8_e4m3fn).float() * hsc.repeat_interleave(128, 1)
    ref = hq_ref.float() * hs_ref.repeat_interleave(128, 1)
    step = 2.0 ** -3 * ref.abs() + hs_ref.repeat_interleave(128, 1) * 2.0 ** -9 + 1e-30
    assert ((deq - ref).abs() <= 1.01 * step).all()


@functools.lru_cache(maxsize=None)
def _swiglu_case(fmt):
    """The case of the test below and its twin's h (built once per format, read only by its variants)."""
    gen = torch.Generator().manual_seed(11 + len(fmt))
    E, d, I, top_k, limit = 5, 256, 128, 2, 6.0
    c = _grouped_case(E, [0, 1, 64, 70, 5], d, I, top_k, fmt, gen)
    return c, _swiglu_twin(c, I, top_k, limit)


@pytest.mark.parametrize("v", VARIANTS, ids=VID)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_grouped_swiglu_and_w2(fmt, v):
    """Grouped + gather + SwiGLU (w1|w3 -> e4m3 h + scales) and grouped w2 (bf16), 5 experts with
    0 / 1 / 64 / 70 / 5 rows at 64-row tiles: h against the twin (one FP8 step), w2 against the exact
    sum of its (kernel-made) h operand, both against the old kernel."""
    E, d, I, top_k, limit = 5, 256, 128, 2, 6.0
    c, (hq_ref, hs_ref) = _swiglu_case(fmt)
    cfg = dict(v, BM=64, BN=128)
    a = _operand(c["xq"].to(DEV), v)
    h, hs = _launch_grouped(c, P.fp4_prefill_launch, a, cfg, fmt, I, d, top_k, E, limit, 1)
    _check_h(h, hs, hq_ref, hs_ref)
    ho, hso = _old_grouped(c, GC.f16_operand(c["xq"].to(DEV)), dict(BM=64, BN=128), fmt, I, d, top_k, E, limit, 1)
    _check_h(h, hs, ho.cpu().view(torch.float8_e4m3fn), hso.cpu())
    # w2 on the kernel's own h
    hq = h.view(torch.float8_e4m3fn)
    out = _launch_grouped(c, P.fp4_prefill_launch, _operand(hq, v), dict(v, BM=64, BN=64), fmt, I, d, top_k, E,
                          limit, (2, hs))
    old = _old_grouped(c, GC.f16_operand(hq), dict(BM=64, BN=64), fmt, I, d, top_k, E, limit, (2, hs))
    hq_c, hs_c = hq.cpu(), hs.cpu()
    for e in range(E):
        r = slice(int(c["offs"][e]), int(c["offs"][e + 1]))
        if r.stop > r.start:
            check_gemm(out.cpu()[r], hq_c[r], hs_c[r], c["W2"][e], old.cpu()[r])


def test_plain_rejects_bad_inputs():
    a = torch.zeros(2, 200, dtype=torch.float16)
    with pytest.raises(ValueError, match="multiple of 128"):
        P.fp4_prefill_launch(a, None, None, None, None, None, None, 2, 64, 200, 0, fmt="mxfp4")
    with pytest.raises(ValueError, match="must be f16"):
        P.fp4_prefill_launch(a.float(), None, None, None, None, None, None, 2, 64, 256, 0, fmt="mxfp4")
    with pytest.raises(ValueError, match="fmt"):
        P.fp4_prefill_launch(a, None, None, None, None, None, None, 2, 64, 256, 0, fmt="fp8")


# ------------------------------------------------------------------------------------------------
# ahead-of-time compilation (no GPU needed)

_AOT_SCRIPT = textwrap.dedent("""
    import os, re, sys
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    from kernel_helpers import aot_caps, aot_compile
    from dsv4.kernels.gemm import fp4_prefill as F

    DIV = ("K", "N_out", "n_half", "stride_am", "stride_sam", "stride_we", "stride_wn", "stride_wse",
           "stride_wsn", "stride_w2e", "stride_cm", "stride_csm")
    P = lambda t: "*" + t
    t = dict(A16=P("fp16"), SA=P("fp32"), W=P("u8"), WS=P("u8"), WS2=P("fp32"), C=P("bf16"), CS=P("fp32"),
             PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"), PW=P("fp32"), limit="fp32")
    cases = [  # (SWIGLU, FMT, DEC, KSPLIT, BM, warps, stages)
        (True, 2, 0, False, 64, 8, 3), (False, 2, 0, False, 64, 4, 3), (True, 2, 1, True, 64, 8, 3),
        (False, 2, 0, True, 128, 8, 3), (True, 1, 0, False, 64, 8, 3), (False, 1, 1, True, 64, 4, 3)]
    for cap in aot_caps():
        for sw, fmt, dec, ks, bm, warps, stages in cases:
            const = dict(FMT=fmt, GROUPED=True, GATHER=sw, SWIGLU=sw, HAS_PW=sw, USE_ASM=True, DEC=dec, KSPLIT=ks,
                         BM=bm, BN=128, LOG2G=9, RB=14 if fmt == 2 else 0, SB_SCALE=2.0 ** -14, INTERP=False)
            ptx, mma = aot_compile(F._fp4_prefill_kernel, dict(t, C=P("u8")) if sw else t, const, cap, warps,
                                   stages, div=DIV)
            if cap == 90:   # one k16 wgmma per 16 K of every dot: 8 per 128-K block and weight tile
                assert any(m.startswith("wgmma.mma_async") and ".f16.f16" in m for m in mma), mma
                n = len(re.findall(r"wgmma\\.mma_async", ptx))
                assert n == 8 * (2 if sw else 1) * (2 if bm == 128 and warps == 4 else 1), n
""")


def test_aot_compile_sm90_sm100():
    """Compile the prefill kernel's variants for GPUTarget('cuda', 90 | 100, 32) on this machine."""
    run_aot_script(_AOT_SCRIPT, REPO, timeout=900)


# ------------------------------------------------------------------------------------------------
# GPU: V4-Flash prefill dims

@pytest.mark.gpu
@pytest.mark.parametrize("v", VARIANTS, ids=VID)
def test_gpu_flash_prefill_dims(v):
    """Grouped w1|w3 + SwiGLU and w2 at V4-Flash dims (d 4096, inter 2048, top-6), 8 experts with
    ~96 rows each (one with 150, one with 0), MXFP4 with a spread of scales: h against the twin,
    w2 against the exact sum, both against the old kernel; the PTX decode against the portable one."""
    need_gpu()
    gen = torch.Generator().manual_seed(5)
    E, d, I, top_k, limit = 8, 4096, 2048, 6, 10.0
    counts = [96, 150, 0, 90, 101, 96, 64, 97]
    c = _grouped_case(E, counts, d, I, top_k, "mxfp4", gen)
    for e in range(E):              # a spread of group scales inside 128-blocks
        c["s13"][e, :, 1::4] -= 5
        c["s13"][e, :, 2::8] -= 11
        c["W13"][e] = dequant_mxfp4(c["w13"][e], c["s13"][e])
    hq_ref, hs_ref = _swiglu_twin(c, I, top_k, limit)
    for cfg in (dict(v, BM=64, num_warps=8, num_stages=3), dict(v, BM=128, num_warps=16, num_stages=2)):
        a = _operand(c["xq"].cuda(), v)
        h, hs = _launch_grouped(c, P.fp4_prefill_launch, a, cfg, "mxfp4", I, d, top_k, E, limit, 1)
        _check_h(h, hs, hq_ref, hs_ref)
        if v["DEC"] == 1:           # the PTX and the portable decode: same bits
            h2, hs2 = _launch_grouped(c, lambda *x, **k: P.fp4_prefill_launch(*x, use_asm=False, **k), a, cfg,
                                      "mxfp4", I, d, top_k, E, limit, 1)
            assert torch.equal(h2, h) and torch.equal(hs2, hs)
        hq = h.view(torch.float8_e4m3fn)
        out = _launch_grouped(c, P.fp4_prefill_launch, _operand(hq, v), dict(cfg, num_warps=cfg["BM"] // 16),
                              "mxfp4", I, d, top_k, E, limit, (2, hs))
        old = _launch_grouped(c, G4.fp4_launch, GC.f16_operand(hq), dict(BM=64, BN=128, num_warps=4, num_stages=3),
                              "mxfp4", I, d, top_k, E, limit, (2, hs))
        hq_c, hs_c = hq.cpu(), hs.cpu()
        for e in (0, 1, 3, 7):
            r = slice(int(c["offs"][e]), int(c["offs"][e + 1]))
            check_gemm(out.cpu()[r], hq_c[r], hs_c[r], c["W2"][e], old.cpu()[r])
