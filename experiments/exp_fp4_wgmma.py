"""Experiment (not adopted: slower): an FP4 (MXFP4) decode expert GEMM on Hopper's native FP8 wgmma,
the weights placed as e4m3 in registers, against ``kernels/fp4_mma.py`` (f16 ``mma.sync``).

    PYTHONPATH=. python experiments/exp_fp4_wgmma.py --static    # no GPU: sm_90 compile, SASS counts
    PYTHONPATH=. python experiments/exp_fp4_wgmma.py             # H200: correctness + time vs fp4_mma

Why: ``fp4_mma`` is bound by ALU issue (Nsight Compute, session 8 in docs/benchmarks-2026-11-30.md: ~220 SASS
instructions per 128-K block and warp, 48 of them e4m3 -> f16 conversions and 32 f16 multiplies
applying the group scales), and at batch 64 the routed experts are ~73% of a V4-Flash decode step
(session 12). wgmma takes e4m3 A operands from registers (an offline sm_90 compile with Triton 3.6
gives ``QGMMA.64x8x32.F32.E4M3.E4M3 R.., R.., gdesc[..]``; the operand layout needs ``k_width=4``), so
the weights need only the e2m1 -> e4m3 bit placement (value * 2^-6, exact; 5 logic ops per 8 values)
and no f16 conversion or scale multiply:

* one warpgroup per program, 64 weight rows (the M side) x BM = 8 activation rows (the N side, n8);
* per 128-K block, 4 wgmma k32 steps, one per MXFP4 scale group, each into a zeroed accumulator
  (``use_acc=False``), summed as ``blk = sum_g P_g * 2^(s_g - 127)``, then ``acc += blk * 2^6 * sA``:
  the official structure (fp32 promotion per 32-group, power-of-two scales), exact for every scale;
* A fragment (``DotOperandLayout(0, k_width=4)``, linear layout read off the compiler): a thread holds,
  for rows r and r + 8, logical K 4q..4q+3 (registers a0, a1) and 16+4q..16+4q+3 (a2, a3), q = lane % 4.
  One 4-byte load per row and group (bytes 4q..4q+3 of the group's 16) gives both: its low nibbles are
  physical values 8q + 2i (-> a0 / a1), its high nibbles 8q + 2i + 1 (-> a2 / a3);
* so the activations are stored in shared memory in that logical order: logical k of a 32-group is
  physical value 2 (k % 16) + k // 16; the program stages its K range of its (up to 8) activation rows
  in shared memory once (e4m3 bytes, [K / 32, 32, BM], K-major as fp8 wgmma requires).

Offline sm_90 compile (triton 3.6, ``--static``, session 12, before the prefetch below): 63 registers; the K loop is 177 SASS
instructions per 128-K block and thread (64 weight values per thread, as in fp4_mma, whose loop is ~220):
4 QGMMA, 12 LDG, 37 LOP3 + 10 SHF (the placement), 38 IMAD (shifts and moves on the FMA pipe), 16 FFMA +
6 FMUL (scales), 8 ISETP + 8 SEL (the e8m0 = 0 case), ~18 uniform-datapath ops (descriptors). About 77
logic / integer instructions per block; fp4_mma's ~220 hold 34 LOP3 + 10 shifts + 12 PRMT, ~28 integer
ops, and the 48 e4m3 -> f16 conversions and 32 HMUL2 that this loop has no need of.

H200 (session 13, docs/benchmarks-2026-12-01.md): 1.5-2.7x slower than fp4_mma on every case (Flash w1|w3, 32
experts x 1 row: 223 vs 107 us), relative error 3e-4 against the GEMV (fp4_mma: 1e-5; the fp8
accumulation inside a k32 step is not exact). The activation staging (byte loads into shared memory,
a barrier per group) costs about a third; with staging skipped (timing only, wrong values) the main
loop alone is 0.97-1.65x fp4_mma's time (153 vs 107 us; equal only on Flash w2 and at 6 experts): each block waits for its four
wgmmas before the scale math (``warpgroup_mma_wait(0)``), and ptxas issues the next block's weight
loads only after that wait. Split from the conversion with a one-block register prefetch (below),
the loads still land behind the wait. A k-split of 4 (smaller staging, more programs): 179 us.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv4.kernels.lib import QBLOCK, u8  # noqa: E402

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from dsv4.kernels.gemm.fp4_mma import _act_rows
    from dsv4.kernels.gemm.fp8_mma import _cta_barrier      # thread_barrier (triton 3.6) / barrier (3.9)
    from dsv4.kernels.lib import tile_rows as _tile_rows
    GLUON = True
except ImportError:
    GLUON = False

BM = 8          # activation rows per tile (wgmma n8)
ROWS = 64       # weight rows per program (one warpgroup, wgmma m64)

if GLUON:
    _LO = "shl.b32 t, {w}, 2; and.b32 t, t, 0x1C1C1C1C; shl.b32 u, {w}, 4; and.b32 u, u, 0x80808080; or.b32 {o}, t, u;"
    _HI = "shr.b32 t, {w}, 2; and.b32 t, t, 0x1C1C1C1C; and.b32 u, {w}, 0x80808080; or.b32 {o}, t, u;"
    # pack of 16 A elements: a0 (row r), a1 (row r + 8), a2 (row r, K + 16), a3 (row r + 8, K + 16); the
    # pointers of elements 0 (row r) and 4 (row r + 8) address the two 4-byte words. The load writes its
    # words to elements 0 and 4 only; the other 14 outputs are never read (ptxas drops them).
    _LD_ASM = gl.constexpr("ld.global.nc.L2::128B.b32 $0, [$16]; ld.global.nc.L2::128B.b32 $4, [$20];")
    _LD_CONS = gl.constexpr(",".join(["=r"] * 16 + ["l"] * 16))
    _CV_ASM = gl.constexpr("{ .reg .b32 t, u; " + _LO.format(w="$4", o="$0") + _LO.format(w="$8", o="$1")
                           + _HI.format(w="$4", o="$2") + _HI.format(w="$8", o="$3") + " }")
    _CV_CONS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 16))

    @gluon.jit
    def _a_load(p):
        """The raw weight words of one 32-group's A operand (p: its pointer tensor), loaded apart from
        the conversion so the next block's loads can be in flight during this block's work."""
        return gl.inline_asm_elementwise(_LD_ASM, _LD_CONS, [p], dtype=gl.int32, is_pure=True, pack=16)

    @gluon.jit
    def _a_convert(w):
        """[64, 32] e4m3 A operand (value * 2^-6) from the raw words of ``_a_load``."""
        return gl.inline_asm_elementwise(_CV_ASM, _CV_CONS, [w], dtype=gl.float8e4nv, is_pure=True, pack=16)

    @gluon.jit
    def _block_loads(wptr, sptr, saptr, kb):
        """128-K block kb's loads: the four groups' raw weight words, the four e8m0 group scales (one
        int32) and the activation block scales."""
        return (_a_load(wptr + kb * 64), _a_load(wptr + kb * 64 + 16), _a_load(wptr + kb * 64 + 32),
                _a_load(wptr + kb * 64 + 48), gl.load((sptr + kb * 4).to(gl.pointer_type(gl.int32))),
                gl.load(saptr + kb))

    @gluon.jit
    def _e8m0(b):
        """fp32 2^(b - 127) of e8m0 bytes b (b = 0: 2^-127, subnormal), exact."""
        return gl.where(b == 0, 1 << 22, b << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _wg_kernel(A, SA, W, WS, C, PERM, OFFS, TCUM, M, N, K, n_groups, top_k, k_per_split,
                   stride_am, stride_sam, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
                   GROUPED: gl.constexpr, GATHER: gl.constexpr, BM: gl.constexpr, KPS: gl.constexpr,
                   LOG2G: gl.constexpr, SPLIT: gl.constexpr, STAGE: gl.constexpr = True):
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BM, 32])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
        x_l: gl.constexpr = gl.BlockedLayout([1, 1], [32 // BM, BM], [4, 1], [1, 0])
        b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2,
                                                  transposed=True)
        t = gl.program_id(0)
        pid_n = gl.program_id(1)
        ks = gl.program_id(2)
        e, m0, m_end, live = _tile_rows(TCUM, OFFS, M, t, n_groups, BM, LOG2G, GROUPED)
        if live:
            e64 = e.to(gl.int64)
            kb_lo = (ks * k_per_split) // 128
            kb_hi = gl.minimum(K, ks * k_per_split + k_per_split) // 128
            # the split's activations, each 32-group in the A operand's logical K order, into shared memory
            bs = gl.allocate_shared_memory(gl.float8e4nv, [KPS // 32, 32, BM], b_sl)
            if STAGE:
                kx = gl.arange(0, 32, layout=gl.SliceLayout(1, x_l))
                phys = 2 * (kx % 16) + kx // 16
                mx = gl.arange(0, BM, layout=gl.SliceLayout(0, x_l))
                arow_x, vx = _act_rows(PERM, m0 + mx, m_end, top_k, GATHER)
                xptr = A + arow_x[None, :] * stride_am + phys[:, None]
                for g in range(kb_lo * 4, kb_hi * 4):
                    xg = gl.load(xptr + g * 32, mask=vx[None, :], other=0)
                    bs.index(g - kb_lo * 4).store(xg.to(gl.float8e4nv, bitcast=True))
            fence_async_shared()
            _cta_barrier()
            # weight pointers of one group: rows pid_n * 64 + .., bytes 4q..4q+3 of the group's 16
            ra = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, a_l))
            ka = gl.arange(0, 32, layout=gl.SliceLayout(0, a_l))
            wptr = W + e64 * stride_we + gl.minimum(ra, N - 1).to(gl.int64)[:, None] * stride_wn \
                + (ka % 16)[None, :]
            rs = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
            sptr = (WS + e64 * stride_wse + gl.minimum(rs, N - 1).to(gl.int64) * stride_wsn)
            cc = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
            rc = m0 + cc
            arow_c, vc = _act_rows(PERM, rc, m_end, top_k, GATHER)
            saptr = SA + arow_c * stride_sam
            zero = gl.zeros([64, BM], gl.float32, acc_l)
            acc = gl.zeros([64, BM], gl.float32, acc_l)
            w0, w1, w2, w3, sw, sa = _block_loads(wptr, sptr, saptr, kb_lo)
            for kb in range(kb_lo, kb_hi):
                g0 = (kb - kb_lo) * 4
                # the next block's loads, in flight during this one
                n0, n1, n2, n3, nsw, nsa = _block_loads(wptr, sptr, saptr, gl.minimum(kb + 1, kb_hi - 1))
                t0 = warpgroup_mma(_a_convert(w0), bs.index(g0), zero, use_acc=False, is_async=True)
                t1 = warpgroup_mma(_a_convert(w1), bs.index(g0 + 1), zero, use_acc=False, is_async=True)
                t2 = warpgroup_mma(_a_convert(w2), bs.index(g0 + 2), zero, use_acc=False, is_async=True)
                t3 = warpgroup_mma(_a_convert(w3), bs.index(g0 + 3), zero, use_acc=False, is_async=True)
                p0, p1, p2, p3 = warpgroup_mma_wait(num_outstanding=0, deps=(t0, t1, t2, t3))
                blk = p0 * _e8m0(sw & 0xFF)[:, None]
                blk += p1 * _e8m0((sw >> 8) & 0xFF)[:, None]
                blk += p2 * _e8m0((sw >> 16) & 0xFF)[:, None]
                blk += p3 * _e8m0((sw >> 24) & 0xFF)[:, None]
                acc += blk * (sa * 64.0)[None, :]
                w0, w1, w2, w3, sw, sa = n0, n1, n2, n3, nsw, nsa
            out_mask = (rs < N)[:, None] & vc[None, :]
            rn64 = rs.to(gl.int64)
            rc64 = rc.to(gl.int64)
            if SPLIT:
                gl.store(C + ks.to(gl.int64) * M * N + rc64[None, :] * N + rn64[:, None], acc, mask=out_mask)
            else:
                gl.store(C + rc64[None, :] * stride_cm + rn64[:, None], acc.to(gl.bfloat16), mask=out_mask)


def wg_launch(a, sa, w, ws, M, N, K, *, offs, tcum, n_groups, n_tiles, split=None, stage=True):
    """MXFP4 grouped decode GEMM on wgmma: a e4m3 bytes [rows, K], sa fp32 [rows, K/128], w uint8
    [G, N, K/2], ws e8m0 bytes [G, N, K/32]; tiles of BM rows (``tcum`` / ``offs`` as for fp4_mma).
    Returns bf16 [M, N] (split partials summed by ``gemv.sum_splits``)."""
    from dsv4.kernels.gemm.common import launch_plan, sum_splits
    from dsv4.kernels.lib import target
    if K % QBLOCK or N % ROWS:
        raise ValueError(f"wg_launch: K={K} must be a multiple of 128 and N={N} of {ROWS}")
    grid, kps, dst = launch_plan(M, N, K, BM, ROWS, grouped=True, n_tiles=n_tiles, n_groups=n_groups, split=split,
                                 partial=False, out=None, dev=w.device, t=target(w.device))
    _wg_kernel[grid](a, sa, w, ws, dst, sa, offs, tcum, M, N, K, n_groups, 1, kps,
                     a.stride(0), sa.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), dst.stride(-2),
                     GROUPED=True, GATHER=False, BM=BM, KPS=kps, LOG2G=max(1, max(n_groups, 1).bit_length()),
                     SPLIT=dst.dtype == torch.float32, STAGE=stage, num_warps=4)
    return sum_splits(dst, None)


def static(kps=2048):
    """sm_90 compile (no GPU) and the SASS instruction mix of the kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    fn = _wg_kernel
    const = dict(GROUPED=True, GATHER=False, BM=BM, KPS=kps, LOG2G=9, SPLIT=True)
    types = dict(A="*u8", SA="*fp32", W="*u8", WS="*u8", C="*fp32", PERM="*fp32", OFFS="*i64", TCUM="*i64")
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in fn.arg_names}
    div = ("A", "SA", "W", "WS", "C", "K", "N", "stride_am", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
           "k_per_split")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in div}
    k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/")
    path = "/tmp/exp_fp4_wgmma.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([bindir + "cuobjdump", "-sass", path], capture_output=True, text=True).stdout
    res = subprocess.run([bindir + "cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
    ins = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    print(res.strip().splitlines()[-1])
    print("SASS instructions:", len(ins), Counter(i.split(".")[0] for i in ins).most_common(16))
    return sass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--static", action="store_true", help="compile for sm_90 here, print the SASS mix")
    args = ap.parse_args()
    if args.static:
        static()
        return
    if not torch.cuda.is_available():
        print("exp_fp4_wgmma: needs a CUDA GPU (or --static)")
        return
    from benchmarks.common import graph_time, roofline
    from benchmarks.gemm_moe import rand_mx, relerr
    from dsv4.kernels.gemm import fp8 as G8
    from dsv4.kernels.gemm.fp4_mma import BM_ROWS, mma_gemv_launch
    from dsv4.kernels.gemm.gemv import gemv_launch
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    copy_bw, _ = roofline(dev, False)
    cases = [("Flash w1|w3 32 exp x1", 32, 4096, 4096, 1), ("Flash w2 32 exp x1", 32, 4096, 2048, 1),
             ("Flash w1|w3 256 exp x2", 256, 4096, 4096, 2), ("Flash w1|w3 6 exp x1", 6, 4096, 4096, 1),
             ("Flash w1|w3 64 exp x8", 64, 4096, 4096, 8), ("Pro w1|w3 32 exp x1", 32, 6144, 7168, 1)]
    print("| case | kernel | us | % copy | relerr vs gemv |\n|---|---|---|---|---|")
    for name, E, N, K, m in cases:
        w, s = rand_mx(E, N, K, dev, gen)
        R = E * m
        xq, xs = G8.act_quant_fp8(torch.randn(R, K, device=dev, generator=gen).bfloat16())
        xq = u8(xq)
        offs = (torch.arange(E + 1, device=dev) * m).to(torch.int64)
        tiles = dict(offs=offs, tcum=(torch.arange(E + 1, device=dev) * -(-m // BM_ROWS)).to(torch.int64),
                     n_groups=E, n_tiles=E * -(-m // BM_ROWS))
        wbytes = E * (N * K // 2 + N * s.shape[-1])
        ref = gemv_launch(xq, xs, w, s, None, R, N, K, wfmt="mxfp4", offs=offs,
                          tcum=(torch.arange(E + 1, device=dev) * m).to(torch.int64), n_groups=E, n_tiles=E * m, bm=1)
        for kname, fn in (("fp4_mma", lambda: mma_gemv_launch(xq, xs, w, s, R, N, K, fmt="mxfp4", **tiles)),
                          ("wgmma", lambda: wg_launch(xq, xs, w, s, R, N, K, **tiles)),
                          ("wgmma split 4", lambda: wg_launch(xq, xs, w, s, R, N, K, split=4, **tiles)),
                          ("wgmma, no staging (timing only)", lambda: wg_launch(xq, xs, w, s, R, N, K, stage=False,
                                                                                **tiles))):
            try:
                err = relerr(fn().float(), ref.float()) if "timing only" not in kname else float("nan")
                t = graph_time(fn)
                print(f"| {name} | {kname} | {t * 1e3:.1f} | {100 * wbytes / t / 1e6 / (copy_bw / 1e9):.0f} | {err:.2e} |",
                      flush=True)
            except Exception as ex:
                print(f"| {name} | {kname} | failed: {type(ex).__name__}: {str(ex)[:300]} | | |", flush=True)


if __name__ == "__main__":
    main()
