"""The decode GEMV on CUDA cores (dsv4/kernels/gemm/gemv.py: FP8 and FP4 weights) against the exact sum:
the same products as the GEMMs, another fp32 summation order.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA and the ``gpu``-marked tests add V4-Flash shapes.

Tolerance: ``kernel_helpers.check_gemm`` (one bf16 rounding + fp32 summation order).
"""
import pytest
from kernel_helpers import check_gemm, fp4_weight as _fp4_weight, kernel_device, need_gpu
import torch

pytest.importorskip("triton")

from dsv4.formats.fp8 import act_quant_fp8 as act_quant_ref  # noqa: E402
from dsv4.formats.fp8 import dequant_fp8_weight, quant_fp8_weight  # noqa: E402
from dsv4.kernels.gemm import fp8 as G8  # noqa: E402
from dsv4.twins import gemm as GT  # noqa: E402

DEV = kernel_device()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
@pytest.mark.parametrize("M,split", [(1, None), (3, 2), (5, 1)])
def test_gemv_against_exact(fmt, M, split):
    """Plain (non-grouped) GEMV: 1-, 2- and 4-row tiles (M=3 pads a 4-row tile, M=5 takes two),
    split-K partials summed in split order; FP8 with the activation quantised in the prologue is
    bit-identical to the pre-quantised input."""
    from dsv4.kernels.gemm import gemv as V
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
        twin = GT.fp8_gemm(xq, xs, q, s)
        check_gemm(y, xq, xs, Wd, twin, acc=2.0 ** -16)
    else:
        wp, s, s2, Wd = _fp4_weight(fmt, N, K, gen)
        y = V.fp4_gemv(xq.to(DEV), xs.to(DEV), wp.to(DEV), s.to(DEV), fmt, None if s2 is None else s2.to(DEV),
                       config=cfg)
        check_gemm(y, xq, xs, Wd, GT.fp4_gemm(xq, xs, wp, s, fmt, s2))


def test_gemv_rejects_bad_tile_rows():
    from dsv4.kernels.gemm import gemv as V
    q, s = quant_fp8_weight(torch.randn(128, 128))
    a = torch.zeros(3, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bm must be 1, 2 or 4"):
        V.gemv_launch(a, torch.ones(3, 1), q, s, None, 3, 128, 128, wfmt="fp8", bm=3)


@pytest.mark.parametrize("S,gather", [(1, False), (2, True)])
def test_swiglu_quant_row_tiles(S, gather, monkeypatch):
    """``swiglu_quant`` at 22 rows (16-row programs forced, the last one partial), on bf16 w1|w3 outputs or two
    fp32 partials, routing weights by pair id (gathered) or by row: the reference expert middle's FP8
    quantisation (bf16 w1 / w3 sums, clamped SwiGLU with the routing weight, one bf16 rounding, 1 x 128
    blocks; silu's last fp32 ulp may differ), and one-row programs' bits exactly (the interpreter's time
    grows with the programs: one per row)."""
    from dsv4.kernels.gemm import gemv as V, route as GR
    from dsv4.reference.moe import swiglu
    from dsv4.reference.numerics import Numerics
    gen = torch.Generator().manual_seed(40 + S)
    M, I, limit = 22, 256, 6.0
    parts = torch.randn(S, M, 2 * I, generator=gen) * 3
    if S == 1:
        parts = parts.bfloat16()
    pw = torch.rand(2 * M, generator=gen) + 0.25
    perm = torch.randperm(2 * M, generator=gen)[:M] if gather else None
    assert GR.swiglu_rows(4608) == 1 and GR.swiglu_rows(49152) == 16    # decode / verify sizes keep one row
    monkeypatch.setattr(GR, "SWIGLU_TILE_MIN_ROWS", 16)
    assert GR.swiglu_rows(M) == 16
    h, hs = V.swiglu_quant(parts.to(DEV), limit, pw=pw.to(DEV), perm=None if perm is None else perm.to(DEV))
    tot = parts.float().sum(0)
    href = swiglu(tot[:, :I].bfloat16(), tot[:, I:].bfloat16(), limit, pw[perm] if gather else pw[:M], Numerics())
    got = (h.cpu().view(torch.float8_e4m3fn).float().view(M, I // 128, 128) * hs.cpu()[:, :, None]).view(M, I)
    qr, sr = act_quant_ref(href)
    want = (qr.view(torch.float8_e4m3fn).float().view(M, I // 128, 128) * sr.float()[:, :, None]).view(M, I)
    torch.testing.assert_close(got, want, rtol=0.13, atol=1e-3 * want.abs().max().item())   # one e4m3 step
    monkeypatch.setattr(GR, "SWIGLU_TILE_MIN_ROWS", 10 ** 9)          # one-row programs
    h1, hs1 = V.swiglu_quant(parts.to(DEV), limit, pw=pw.to(DEV), perm=None if perm is None else perm.to(DEV))
    assert torch.equal(h1, h) and torch.equal(hs1, hs)
    # h in fp4_fp8_ws's group split order (16-row and one-row programs): the same bytes, permuted per 32 columns
    from dsv4.kernels.gemm.fp4_fp8_ws import split_k_order
    h2, hs2 = V.swiglu_quant(parts.to(DEV), limit, pw=pw.to(DEV), perm=None if perm is None else perm.to(DEV),
                             split_order=True)
    assert torch.equal(h2, split_k_order(h)) and torch.equal(hs2, hs) and not torch.equal(h2, h)
    monkeypatch.setattr(GR, "SWIGLU_TILE_MIN_ROWS", 16)
    h3, _ = V.swiglu_quant(parts.to(DEV), limit, pw=pw.to(DEV), perm=None if perm is None else perm.to(DEV),
                           split_order=True)
    assert torch.equal(h3, h2)


# ------------------------------------------------------------------------------------------------
# GPU: V4-Flash shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("M", [1, 2, 4])
def test_gpu_gemv_flash_shapes(fmt, M):
    """The decode GEMV at V4-Flash decode shapes (split-K chosen by the launcher) against the exact sum."""
    _need_gpu()
    from dsv4.kernels.gemm import gemv as V
    gen = torch.Generator().manual_seed(M + len(fmt))
    shapes = [(1024, 4096), (32768, 1024), (4096, 8192)] if fmt == "fp8" else [(4096, 4096), (4096, 2048)]
    for N, K in shapes:
        x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
        xq, xs = G8.act_quant_fp8(x.cuda())
        if fmt == "fp8":
            wq, ws = quant_fp8_weight(torch.randn(N, K, generator=gen) * 0.02)
            y = V.fp8_gemv(x.cuda(), wq.cuda(), ws.cuda())
            check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws))
        else:
            wp, s, s2, Wd = _fp4_weight(fmt, N, K, gen)
            y = V.fp4_gemv(xq, xs, wp.cuda(), s.cuda(), fmt, None if s2 is None else s2.cuda())
            check_gemm(y, xq, xs, Wd)
