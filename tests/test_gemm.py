"""FP8 / FP4 GEMM kernels (dsv4/kernels/gemm/: act_quant, fp8_gemm, fp4_gemm, the routed FP8 linear) against
their torch twins (dsv4/twins/gemm.py).

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA and the ``gpu``-marked tests add V4-Flash shapes. The AOT test compiles every
GEMM / GEMV / MoE kernel (gemm/fp8.py, fp4.py, gemv.py, fp4_mma.py, fp8_mma.py, moe.py) for sm_90 and sm_100
without a GPU.

Tolerances (documented in the modules): ``act_quant`` is bit-exact; GEMMs are held to the
fp64-accumulated sum of the same (exact) products (``kernel_helpers.check_gemm``): |y - exact| <= 2^-8
|exact| (one bf16 ulp) + 2^-16 sum|products| (fp32 summation order; 2^-12 for FP8 MMAs on CUDA, whose
128-K partials keep ~14 bits), and to the twin within twice that.
"""
import textwrap
from pathlib import Path

import pytest
from kernel_helpers import check_gemm, fp4_weight as _fp4_weight, kernel_device, need_gpu, run_aot_script
import torch

triton = pytest.importorskip("triton")

from dsv4.formats.fp8 import act_quant_fp8 as act_quant_ref  # noqa: E402
from dsv4.formats.fp8 import dequant_fp8_weight, quant_fp8_weight  # noqa: E402
from dsv4.kernels.gemm import common as GC, fp4 as G4, fp8 as G8, linear as GL, route as GR  # noqa: E402
from dsv4.kernels.lib import target, u8  # noqa: E402
from dsv4.twins import gemm as GT  # noqa: E402
from dsv4.reference.linear import Linear  # noqa: E402
from dsv4.reference.numerics import OFFICIAL  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

DEV = kernel_device()

# Hopper's FP8 tensor-core MMA keeps ~14 bits while it sums a 128-K block partial (the DeepSeek-V3
# report; the official kernel promotes to fp32 per 128-K block for that reason, as fp8_gemm does):
# on CUDA the FP8 GEMM's summation term is 2^-12 sum|products| instead of fp32's 2^-16.
FP8_ACC = 2.0 ** -12 if DEV == "cuda" else 2.0 ** -16




def _gemm(xq, xs, w, ws, config=None):
    """The routed FP8 GEMM, or the tile kernel with ``config``."""
    return GL.fp8_gemm(xq, xs, w, ws) if config is None else G8.fp8_gemm(xq, xs, w, ws, config=config)


def _linear(x, w, ws, fuse_quant=True, config=None):
    """The FP8 linear: quantisation fused into the kernel (routed, or the tile kernel with ``config``)
    or ``act_quant_fp8`` + the routed GEMM."""
    if not fuse_quant:
        return GL.fp8_gemm(*G8.act_quant_fp8(x), w, ws)
    return GL.fp8_linear(x, w, ws) if config is None else G8.fp8_gemm_bf16(x, w, ws, config=config)


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


@pytest.mark.parametrize("N,K,per_row,e8m0", [(300, 512, False, True), (256, 384, True, False), (130, 256, False, False)])
def test_dequant_bf16_is_torch_s_formula_bit_for_bit(N, K, per_row, e8m0):
    """``fp8.dequant_bf16`` (one kernel pass; ``wo_a`` at prefill) = ``w.to(bf16) * s.to(bf16)`` with the
    scales expanded, on every e4m3 byte (subnormals, -0, the largest) and on 128x128 block / per-row,
    e8m0 / non-power-of-two fp32 scales (rounded once, to nearest even), partial row blocks."""
    g = torch.Generator().manual_seed(N + K)
    wb = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8)
    wb[(wb & 0x7F) == 0x7F] = 0x7E                          # e4m3fn has no infinities; 0x7F / 0xFF are NaN
    wb[0, :256] = torch.arange(256, dtype=torch.uint8).clamp(max=0x7E)
    w = wb.view(torch.float8_e4m3fn)
    rows = N if per_row else -(-N // 128)
    if e8m0:
        s = torch.randint(100, 140, (rows, K // 128), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    else:
        s = torch.rand(rows, K // 128, generator=g) * 0.01 + 1e-4
    y = G8.dequant_bf16(w.to(DEV), s.to(DEV)).cpu()
    full = s.float().repeat_interleave(1 if per_row else 128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    ref = w.to(torch.bfloat16) * full.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("M,K", [(5, 256), (1, 384)])
def test_act_quant_bit_exact(M, K):
    gen = torch.Generator().manual_seed(M + K)
    x = _act_inputs(M, K, gen)
    q, s, a16 = G8.act_quant_fp8(x.to(DEV), with_f16=True)
    qr, sr = act_quant_ref(x)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s.cpu(), sr)
    assert a16.dtype == torch.float16 and torch.equal(a16.cpu().float(), qr.float())
    # leading dims are kept
    q3, s3 = G8.act_quant_fp8(x.view(1, M, K).to(DEV))
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
    y = _gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV))
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    twin = GT.fp8_gemm(xq, xs, wq, ws)
    ref = Linear(Wd, "fp8", OFFICIAL)(x)              # the reference Linear (official numerics)
    check_gemm(y, xq, xs, Wd, twin, acc=FP8_ACC)
    check_gemm(ref, xq, xs, Wd)
    # fp32 scales and e8m0 scales give the same bits; fused quant == two-step quant
    y32 = _gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.float().to(DEV))
    assert torch.equal(y32.cpu().view(torch.int16), y.cpu().view(torch.int16))
    for fuse in (True, False):
        yl = _linear(x.to(DEV), wq.to(DEV), ws.to(DEV), fuse_quant=fuse)
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
    part = G8.fp8_gemm_partials(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), config=cfg)
    n_split = part.shape[0]
    assert part.dtype == torch.float32 and part.shape[1:] == (M, N)
    assert n_split == S if S else n_split > 1          # the default splits at this size
    acc = torch.zeros(M, N, device=part.device)
    for p in part:
        acc = acc + p
    # fp8_gemm sums the same partials in its tiles' last arriving programs; twice: the counters reset
    for _ in range(2):
        y = _gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), config={"SPLIT_K": n_split})
        assert torch.equal(acc.bfloat16().cpu().view(torch.int16), y.cpu().view(torch.int16))
    check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws), GT.fp8_gemm(xq, xs, wq, ws), acc=FP8_ACC)


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
        assert GR.fp8_split_k(M, N, K, 16, 64, target(DEV)) > 1    # the default splits here
    cfg = None if S is None else {"SPLIT_K": S}
    y = _gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), config=cfg)
    y1 = _gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), config={"SPLIT_K": 1})
    check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws), GT.fp8_gemm(xq, xs, wq, ws), acc=FP8_ACC)
    check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws), y1.cpu(), acc=FP8_ACC)
    yl = _linear(x.to(DEV), wq.to(DEV), ws.to(DEV), fuse_quant=True, config=cfg)
    assert torch.equal(yl.cpu().view(torch.int16), y.cpu().view(torch.int16))


def test_fp8_gemm_matches_official_order_twin_closely():
    """Same per-128-block fp32 partials as the official order: at most 1 bf16 ulp apart."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 256, generator=gen).bfloat16()
    wq, ws = quant_fp8_weight(torch.randn(64, 256, generator=gen) * 0.1)
    xq, xs = act_quant_ref(x)
    y = _gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV)).cpu()
    t = GT.fp8_gemm(xq, xs, wq, ws)
    b = lambda v: v.view(torch.int16).int()
    if DEV == "cpu":
        assert ((b(y) - b(t)).abs() <= 1).all()
    else:    # FP8 MMA partials (see FP8_ACC): a few ulps on near-cancelling sums
        check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws), t, acc=FP8_ACC)


# ------------------------------------------------------------------------------------------------
# FP4 GEMM

@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("M,N,K", [(5, 96, 256), (17, 64, 128)])
def test_fp4_gemm(fmt, M, N, K):
    gen = torch.Generator().manual_seed(M + N + K + len(fmt))
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    wp, s, s2, Wd = _fp4_weight(fmt, N, K, gen)
    xq, xs = act_quant_ref(x)
    y = G4.fp4_gemm(xq.to(DEV), xs.to(DEV), wp.to(DEV), s.to(DEV), fmt, None if s2 is None else s2.to(DEV))
    twin = GT.fp4_gemm(xq, xs, wp, s, fmt, s2)
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
    y = G4.fp4_gemm(xq.to(DEV), xs.to(DEV), wp.to(DEV), s.to(DEV), "mxfp4", config={"BM": bm})
    check_gemm(y, xq, xs, Wd, GT.fp4_gemm(xq, xs, wp, s))


def test_fp4_gemm_pure_triton_decode_path():
    """The portable (no inline PTX) e2m1 decode gives the same bits as the default path."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 128, generator=gen).bfloat16()
    wp, s, _, _ = _fp4_weight("mxfp4", 32, 128, gen)
    xq, xs = act_quant_ref(x)
    outs = []
    for use_asm in ((False, True) if DEV == "cuda" else (False,)):
        a16 = GC.f16_operand(xq.to(DEV))
        out = torch.empty(4, 32, dtype=torch.bfloat16, device=DEV)
        G4.fp4_launch(a16, xs.to(DEV), u8(wp).to(DEV)[None], s.view(torch.uint8).to(DEV)[None], None,
                     out, None, 4, 32, 128, 0, fmt="mxfp4", path="dequant", use_asm=use_asm)
        outs.append(out.cpu())
    assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs)


# ------------------------------------------------------------------------------------------------
# ahead-of-time compilation for Hopper and Blackwell (no GPU needed)

_AOT_SCRIPT = textwrap.dedent("""
    import os, re, sys
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    from kernel_helpers import aot_caps, aot_compile
    from dsv4.kernels.gemm import common as GC, fp4 as G4, fp8 as G8, gemv as V
    from dsv4.kernels import moe as Mo

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
    for cap in aot_caps():
        comp(G8._act_quant_kernel, dict(X=P("bf16"), Q=P("u8"), S=P("fp32")), dict(BLOCKS=8, INTERP=False), cap, 4)
        ptx = comp(G8._fp8_gemm_kernel, fp8t, dict(SB_SHIFT=7, A_BF16=False, SB_E8M0=False, SWIGLU=False,
                                                  BM=128, BN=128, GROUP_M=8, SPLIT=False, SUM=False, INTERP=False), cap, 8, 4)
        if cap == 90:
            assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx, "expected fp8 wgmma"
        else:
            assert "tcgen05.mma" in ptx
        comp(G8._fp8_gemm_kernel, dict(fp8t, A=P("bf16"), SB=P("u8"), C=P("u8")),
             dict(SB_SHIFT=7, A_BF16=True, SB_E8M0=True, SWIGLU=True, BM=16, BN=128, GROUP_M=8, SPLIT=False,
                  SUM=False, INTERP=False), cap, 4)
        # decode: split-K partials (fp32 workspace) summed by each tile's last arriving program
        ptx = comp(G8._fp8_gemm_kernel, dict(fp8t, A=P("bf16"), SB=P("u8"), C=P("fp32"), OUT=P("bf16"), CNT=P("i32")),
                   dict(SB_SHIFT=7, A_BF16=True, SB_E8M0=True, SWIGLU=False, BM=16, BN=32, GROUP_M=8, SPLIT=True,
                        SUM=True, INTERP=False), cap, 4, 5)
        assert "atom.global.gpu.acq_rel.add" in ptx, "expected the tile's acq_rel arrival"
        comp(GC.splitk_sum_kernel, dict(WS=P("fp32"), C=P("bf16")), dict(BLOCK=1024, INTERP=False), cap, 4)
        for fmt, bm in ((0, 16), (1, 16), (2, 64), (1, 64)):
            comp(G4._fp4_gemm_kernel, fp4t, dict(FMT=fmt, GROUPED=True, GATHER=False, SWIGLU=False, HAS_PW=False,
                                                USE_ASM=True, BM=bm, BN=128, LOG2G=9, INTERP=False), cap, 4, 3)
        comp(G4._fp4_gemm_kernel, dict(fp4t, C=P("u8")), dict(FMT=0, GROUPED=True, GATHER=True, SWIGLU=True,
             HAS_PW=True, USE_ASM=True, BM=16, BN=128, LOG2G=9, INTERP=False), cap, 4, 3)
        for sw in (False, True):
            ptx = comp(G4._fp4_scaled_kernel, dict(sct, C=P("u8") if sw else P("bf16")),
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
        from dsv4.kernels.gemm import fp4_mma as F
        mmt = dict(A=P("u8"), SA=P("fp32"), W=P("u8"), WS=P("u8"), WS2=P("fp32"), C=P("fp32"), PERM=P("i64"),
                   OFFS=P("i64"), TCUM=P("i64"))
        for nv, grouped, split, band in ((False, True, True, True), (False, False, False, False),
                                         (True, True, True, False), (True, True, True, True)):
            ptx = comp(F._mma_gemv_kernel,
                       dict(mmt, C=P("fp32") if split else P("bf16"), A=P("fp16") if band else P("u8")),
                       dict(NV=nv, GROUPED=grouped, GATHER=grouped, BM=F.BM_ROWS, BN=64, LOG2G=9, SPLIT=split,
                            NUM_WARPS=4, BAND=band, A16=band, VEC_TILES=grouped), cap, 4)
            assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
            assert "ld.global.v4.b32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
        # decode FP8 on tensor cores (Gluon): in-kernel act quant + in-kernel split-K sum, pre-quantised
        from dsv4.kernels.gemm import fp8_mma as F8
        for act, reduce in ((1, True), (0, True), (0, False), (2, True)):
            ptx = comp(F8._fp8_mma_kernel, dict(A=P("bf16") if act else P("u8"), SA=P("fp32"), W=P("u8"), WS=P("u8"),
                       C=P("bf16"), PART=P("fp32"), CNT=P("i32")),
                       dict(ACT=act, SB_E8M0=True, SB_ROW=False, BM=F8.BM_ROWS, BN=64, SPLIT=reduce,
                            REDUCE=reduce, NUM_WARPS=4, UNROLL=1 if act == 2 else 2), cap, 4)
            ab = "bf16" if act == 2 else "f16"
            assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
            assert ("atom.global.gpu.acq_rel.add" in ptx) == reduce
        for split in (False, True):
            comp(V._swiglu_quant_kernel, dict(WSP=P("fp32"), H=P("u8"), HS=P("fp32"), PW=P("fp32"), PERM=P("i64"),
                 limit="fp32"), dict(GATHER=True, HAS_PW=True, BR=16, INTERP=False, SPLIT=split), cap, 4)
        for quant in (False, True):
            comp(Mo._route_kernel, dict(LOGIT=P("fp32"), BIAS=P("fp32"), TID2EID=P("i32"), IDS=P("i64"),
                 IDX=P("i64"), W=P("fp32"), EFLAT=P("i32"), X=P("bf16"), Q=P("u8"), SQ=P("fp32"), route_scale="fp32"),
                 dict(KTOP=6, KP=8, EP=256, HASH=False, QUANT=quant, QB=8, INTERP=False), cap, 4)
        comp(Mo._moe_sort_prep, dict(EFLAT=P("i32"), PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"), INV=P("i32")),
             dict(BM=8, EP=512, PP=512, CH=64), cap, 4)
        comp(Mo._moe_prep, dict(SORTED_E=P("i32"), PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"), INV=P("i32")),
             dict(BM=16, EP=512, LOG2P=15, CH=1024), cap, 4)
        comp(Mo._moe_combine, dict(OUT=P("bf16"), INV=P("i32"), OFFS=P("i64"), SH=P("bf16"), Y=P("bf16")),
             dict(KTOP=6, KP=8, BD=1024, HAS_SHARED=True, SPLIT=False, F32=False, INTERP=False), cap, 4)
        comp(Mo._moe_combine, dict(OUT=P("fp32"), INV=P("i32"), OFFS=P("i64"), SH=P("bf16"), Y=P("bf16")),
             dict(KTOP=6, KP=8, BD=1024, HAS_SHARED=True, SPLIT=True, F32=False, INTERP=False), cap, 4)
        comp(Mo._moe_combine, dict(OUT=P("fp32"), INV=P("i32"), OFFS=P("i64"), SH=P("fp32"), Y=P("fp32")),
             dict(KTOP=6, KP=8, BD=1024, HAS_SHARED=False, SPLIT=True, F32=True, INTERP=False), cap, 4)
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
    xq, xs = G8.act_quant_fp8(x.cuda())
    y = _gemm(xq, xs, wq.cuda(), ws.cuda())
    check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws), acc=FP8_ACC)
    yl = _linear(x.cuda(), wq.cuda(), ws.cuda())
    assert torch.equal(yl.view(torch.int16), y.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("M", [1, 16, 64, 300])
def test_gpu_fp4_gemm_flash_shapes(fmt, M):
    _need_gpu()
    gen = torch.Generator().manual_seed(M)
    N, K = 4096, 4096                                  # w1|w3 of one V4-Flash expert
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    wp, s, s2, Wd = _fp4_weight(fmt, N, K, gen)
    xq, xs = G8.act_quant_fp8(x.cuda())
    y = G4.fp4_gemm(xq, xs, wp.cuda(), s.cuda(), fmt, None if s2 is None else s2.cuda())
    check_gemm(y, xq, xs, Wd)
    if fmt == "mxfp4":   # the portable decode and the dot_scaled path give the same products
        for path, asm in (("dequant", False), ("scaled", None)):
            out = torch.empty_like(y)
            a = GC.f16_operand(xq) if path == "dequant" else u8(xq)
            G4.fp4_launch(a, xs, u8(wp).cuda()[None], s.view(torch.uint8).cuda()[None], None, out, None,
                         M, N, K, 0, fmt=fmt, path=path, use_asm=asm)
            check_gemm(out, xq, xs, Wd)
