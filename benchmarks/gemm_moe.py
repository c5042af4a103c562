#!/usr/bin/env python3
"""FP8 / FP4 GEMMs and the MoE layer (dsv4/kernels/gemm.py, moe.py) on the GPU, at V4-Flash and
V4-Pro shapes, next to plain PyTorch and the rooflines measured in the same run.

    PYTHONPATH=. python benchmarks/gemm_moe.py --out DIR        # full run; writes DIR/gemm_moe.md
    PYTHONPATH=. python benchmarks/gemm_moe.py --md docs/benchmarks-DATE.md   # ... and appends it to a dated log note
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/gemm_moe.py --smoke   # CPU: code paths only

Sections:
* roofline: device copy bandwidth (bytes read + written), FP8 peak = ``torch._scaled_mm`` e4m3
  8192^3 (per-tensor scales), dense bf16 matmul rate.
* FP8 GEMM at prefill (M = 4096 / 8192): ``fp8_gemm`` (block-scaled, official accumulation) and
  ``fp8_linear`` (+ act quant) vs ``torch._scaled_mm`` at the same shape and a bf16 matmul on the
  dequantised weights. Target: >= 60% of the measured FP8 peak.
* FP4 expert GEMM at decode (1-64 tokens per expert, E experts in one grouped launch): weight bytes
  per second vs the copy bandwidth (target >= 70%), next to ``torch.bmm`` on bf16-dequantised
  weights. Variants (PTX / portable e2m1 decode, ``tl.dot_scaled``, tiles) are checked and timed
  in-run; the fastest correct one is used for the sweep.
* FP4 routed-expert GEMMs at prefill (64 .. 16384 tokens): ``fp4_fp8`` (FP8 wgmma) and ``fp4_prefill``
  (f16 MMA) beside ``torch._scaled_mm`` on the dense FP8 problem of the same size (``--only prefill``).
* MoE layer (route + sort + 2 grouped FP4 GEMMs + shared FP8 expert + combine) vs the Python loop
  over experts with bf16-dequantised weights (plain PyTorch), CUDA-graph replay and eager; floor =
  bytes of the experts actually hit / copy bandwidth.
Times: medians of ``triton.testing.do_bench`` (L2 cleared before every call).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import fp8_peak, graph_time  # noqa: E402
from dsv4.formats.fp4 import dequant_mxfp4, dequant_nvfp4  # noqa: E402
from dsv4.formats.fp8 import dequant_fp8_weight, quant_fp8_weight  # noqa: E402
from dsv4.kernels.gemm import fp4 as G4, fp8 as G8, route as GR  # noqa: E402
from dsv4.kernels import moe as Mo  # noqa: E402
from dsv4.kernels.gemm.gemv import gemv_launch  # noqa: E402
from dsv4.kernels.gemm.route import rows_tile  # noqa: E402
from benchmarks.common import GEMV_MAX_ROWS, fp8_gemm, fp8_linear  # noqa: E402
from dsv4.kernels.lib import target, u8  # noqa: E402

MODELS = {"flash": dict(d=4096, I=2048, E=256, k=6, rs=1.5), "pro": dict(d=7168, I=3072, E=384, k=6, rs=2.5)}


def log(*a):
    print(*a, flush=True)


class Timer:
    def __init__(self, smoke):
        self.smoke = smoke

    def __call__(self, fn, rep=60) -> float:
        if self.smoke:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def relerr(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rand_mx(E, N, K, dev, gen):
    """random packed MXFP4 weights: uniform codes, e8m0 scales 2^-9..2^-4."""
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev, generator=gen)
    s = torch.randint(118, 124, (E, N, K // 32), dtype=torch.uint8, device=dev, generator=gen)
    return w, s


def rand_nv(E, N, K, dev, gen):
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(E, N, K // 16, device=dev, generator=gen) * 300 + 20).to(torch.float8_e4m3fn).view(torch.uint8)
    s2 = torch.full((E, N), 1e-4, device=dev)
    return w, s, s2


def roofline(dev, timer, smoke):
    if smoke:
        return 1e12, 1e15, 1e15
    n = 1 << 28                                                 # 1 GiB of fp32
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    copy_bw = 2 * n * 4 / (t * 1e-3)
    del src, dst
    S = 8192
    fp8 = fp8_peak(dev, timer, S)
    ab, bb = torch.randn(S, S, device=dev).bfloat16(), torch.randn(S, S, device=dev).bfloat16()
    tb = timer(lambda: ab @ bb)
    bf16 = 2 * S ** 3 / (tb * 1e-3)
    return copy_bw, fp8, bf16


# ------------------------------------------------------------------------------------------- FP8

FP8_SHAPES = [("Flash shared w1|w3", 4096, 4096), ("Flash wo_b", 4096, 8192), ("Flash wq_b", 32768, 1024),
              ("Pro shared w1|w3", 6144, 7168), ("Pro wo_b", 7168, 16384), ("Pro wq_b", 65536, 1536)]
FP8_CONFIGS = {"bm128.bn128.w8.s4": dict(BM=128, BN=128, num_warps=8, num_stages=4),
               "bm128.bn128.w8.s3": dict(BM=128, BN=128, num_warps=8, num_stages=3),
               "bm64.bn128.w4.s4": dict(BM=64, BN=128, num_warps=4, num_stages=4)}


def fp8_case(M, N, K, dev, gen):
    x = (torch.randn(M, K, device=dev, generator=gen) * 2).bfloat16()
    wq, ws = quant_fp8_weight(torch.randn(N, K, device=dev, generator=gen) * 0.02)
    xq, xs = G8.act_quant_fp8(x)
    return x, xq, xs, wq, ws


def fp8_check(y, xq, xs, wq, ws, rows=64):
    Wd = dequant_fp8_weight(wq, ws).double()
    r = min(rows, xq.shape[0])
    xd = (xq[:r].double().view(r, -1, 128) * xs[:r].double()[..., None]).view(r, -1)
    return relerr(y[:r], xd @ Wd.T)


def bench_fp8(dev, gen, timer, smoke, fp8_peak, bf16_rate, sweep_rows):
    rows = []
    if smoke:
        shapes, Ms = [("tiny", 256, 256)], [32]
    else:
        shapes, Ms = FP8_SHAPES, [4096]
    # in-run tile sweep on the first shape
    name, N, K = shapes[0]
    M = Ms[0]
    x, xq, xs, wq, ws = fp8_case(M, N, K, dev, gen)
    best, best_t = None, None
    for cname, cfg in (FP8_CONFIGS.items() if not smoke else [("default", None)]):
        try:
            y = fp8_gemm(xq, xs, wq, ws, config=cfg)
            err = fp8_check(y, xq, xs, wq, ws)
            t = timer(lambda: fp8_gemm(xq, xs, wq, ws, config=cfg))
            ok = err < 5e-3
            sweep_rows.append((f"fp8 {name} M{M}", cname, t * 1e3, err, "ok" if ok else "WRONG"))
            log(f"fp8 sweep {cname}: {t * 1e3:.1f} us err {err:.1e}")
            if ok and (best_t is None or t < best_t):
                best, best_t = cfg, t
        except Exception as e:
            sweep_rows.append((f"fp8 {name} M{M}", cname, float("nan"), float("nan"), f"{type(e).__name__}"))
            log(f"fp8 sweep {cname} failed: {e}")
    del x, xq, xs, wq, ws
    one = torch.ones((), device=dev)
    plan = [(s, M) for s in shapes for M in Ms]
    if not smoke:
        plan += [(shapes[0], 8192)]
    for (name, N, K), M in plan:
        try:
            x, xq, xs, wq, ws = fp8_case(M, N, K, dev, gen)
            y = fp8_gemm(xq, xs, wq, ws, config=best)
            err = fp8_check(y, xq, xs, wq, ws)
            t = timer(lambda: fp8_gemm(xq, xs, wq, ws, config=best))
            tl_ = timer(lambda: fp8_linear(x, wq, ws, config=best))
            fl = 2.0 * M * N * K
            row = dict(name=name, M=M, N=N, K=K, us=t * 1e3, tf=fl / (t * 1e-3) / 1e12, lin_us=tl_ * 1e3, err=err)
            if not smoke:
                wt = wq.T
                ts = timer(lambda: torch._scaled_mm(xq, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
                wb = dequant_fp8_weight(wq, ws).bfloat16()
                tb = timer(lambda: x @ wb.T)
                row.update(sm_us=ts * 1e3, sm_tf=fl / (ts * 1e-3) / 1e12, bf_us=tb * 1e3,
                           pct_peak=100 * fl / (t * 1e-3) / fp8_peak)
                del wb
            rows.append(row)
            log(f"fp8 {name:20s} M{M:5d} N{N:6d} K{K:6d}: {row['us']:9.1f} us {row['tf']:6.1f} TF "
                f"| linear {row['lin_us']:9.1f} us | _scaled_mm {row.get('sm_us', 0):9.1f} us "
                f"{row.get('sm_tf', 0):6.1f} TF | bf16 {row.get('bf_us', 0):9.1f} us | err {err:.1e}")
            del x, xq, xs, wq, ws
        except Exception as e:
            log(f"fp8 {name} M{M} failed: {type(e).__name__}: {e}")
            traceback.print_exc()
    return rows, best


FP8_DECODE_SHAPES = [("Flash wq_a", 1024, 4096), ("Flash wq_b", 32768, 1024), ("Flash wkv", 512, 4096),
                     ("Flash wo_b", 4096, 8192), ("Flash indexer wq_b", 8192, 1024),
                     ("Flash shared w1|w3", 4096, 4096), ("Flash shared w2", 4096, 2048)]
FP8_DECODE_CONFIGS = {f"bn{bn}.w{w}.s{st}": dict(BM=16, BN=bn, num_warps=w, num_stages=st)
                      for bn in (32, 64, 128) for w in (4,) for st in (3, 5)}
FP8_GEMV_CONFIGS = {f"gemv.bn{bn}.w{w}": dict(BN=bn, num_warps=w, num_stages=1)
                    for bn, w in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8))}


def bench_fp8_decode(dev, gen, timer, copy_bw, Ms=(1, 4, 8, 64)):
    """fp8_linear (act quant fused into the GEMM) at decode batch sizes over the V4-Flash decode
    linears: weight bytes / time against the copy bandwidth, default tile vs an in-run sweep (the
    MMA tiles, the CUDA-core GEMV, and at <= 8 rows the tensor-core kernel's variants)."""
    from dsv4.kernels.gemm import fp8_mma as F8
    rows = []
    for name, N, K in FP8_DECODE_SHAPES:
        for M in Ms:
            x, xq, xs, wq, ws = fp8_case(M, N, K, dev, gen)
            nbytes = wq.numel() + ws.numel() * 4 + x.numel() * 2 + M * N * 2
            res = {}
            calls = [("default", lambda: fp8_linear(x, wq, ws))]
            for cname, cfg in list(FP8_DECODE_CONFIGS.items()) + (
                    list(FP8_GEMV_CONFIGS.items()) if M <= GEMV_MAX_ROWS else []):
                if M > 16 and not cname.startswith("gemv"):
                    cfg = dict(cfg, BM=64)
                calls.append((cname, lambda cfg=cfg, g=cname.startswith("gemv"): fp8_linear(x, wq, ws, config=cfg,
                                                                                               gemv=g)))
            if M <= GR.MMA_MAX_ROWS and target(dev).gluon_mma:
                for cname, kw in (("mma.bn32.w2", dict(config=dict(BN=32, num_warps=2))),
                                  ("mma.k1", dict(split=1)), ("mma.k2", dict(split=2)), ("mma.k4", dict(split=4)),
                                  ("mma.k8", dict(split=8)), ("mma.k16", dict(split=16))):
                    calls.append((cname, lambda kw=kw: F8.fp8_mma(wq, ws, x_bf16=x, **kw)))
            for cname, fn in calls:
                try:
                    y = fn()
                    err = fp8_check(y, xq, xs, wq, ws)
                    # CUDA-graph replays with the L2 flushed before every call: the weights (<= 32 MB)
                    # would otherwise come from the 50 MB L2, and a decode step runs as a graph
                    t = graph_time(fn) if not timer.smoke else timer(fn)
                    res[cname] = (t, err)
                except Exception as e:
                    log(f"fp8 decode {name} M{M} {cname} failed: {type(e).__name__}: {e}")
            log(f"fp8 decode {name} M{M}: " + ", ".join(f"{k} {v[0] * 1e3:.1f}" for k, v in res.items()))
            ok = {k: v for k, v in res.items() if v[1] < 5e-3}
            best = min(ok, key=lambda k: ok[k][0])
            td, tb = res["default"][0], ok[best][0]
            rows.append(dict(name=name, M=M, N=N, K=K, default_us=td * 1e3, best=best, best_us=tb * 1e3,
                             bw_default=nbytes / (td * 1e-3) / copy_bw * 100, bw_best=nbytes / (tb * 1e-3) / copy_bw * 100,
                             err=res["default"][1]))
            log(f"fp8 decode {name:20s} M{M:3d}: default {td * 1e3:7.1f} us ({rows[-1]['bw_default']:4.0f}% BW)"
                f"  best {best} {tb * 1e3:7.1f} us ({rows[-1]['bw_best']:4.0f}% BW)  err {res['default'][1]:.1e}")
    md = ["", "### FP8 linear at decode batch sizes (fp8_linear, quantisation fused into the GEMM)", "",
          "GB moved = e4m3 weight + scales + activations + output; % BW = that / time / copy bandwidth. "
          "Times: CUDA-graph replays (no host launch overhead), L2 flushed before every call.", "",
          "| linear | M | N | K | default us | % BW | best tile (sweep) | us | % BW | err |", "|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['name']} | {r['M']} | {r['N']} | {r['K']} | {r['default_us']:.1f} | {r['bw_default']:.0f}% | "
           f"{r['best']} | {r['best_us']:.1f} | {r['bw_best']:.0f}% | {r['err']:.1e} |" for r in rows]
    return rows, "\n".join(md) + "\n"


# ------------------------------------------------------------------------------------------- FP4

FP4_SHAPES = [("Flash w1|w3", 4096, 4096, 32), ("Flash w2", 4096, 2048, 64),
              ("Pro w1|w3", 6144, 7168, 16), ("Pro w2", 7168, 3072, 32)]


def fp4_variants(m):
    gemv = {f"gemv.bn{bn}.w{w}": (dict(BM=rows_tile(m), BN=bn, num_warps=w, num_stages=1),
                                  "gemv", True)
            for bn, w in ((64, 4), (64, 8), (128, 8), (256, 8), (128, 16))} if m <= GEMV_MAX_ROWS else {}
    big = m > 32
    bm = 64 if big else (32 if m > 16 else 16)
    base = dict(BM=bm)
    if big:
        return {"ptx.bn128.w4.s3": (dict(base, BN=128, num_warps=4, num_stages=3), "dequant", True),
                "ptx.bn128.w8.s3": (dict(base, BN=128, num_warps=8, num_stages=3), "dequant", True),
                "dot_scaled.bn128.w4.s3": (dict(base, BN=128, num_warps=4, num_stages=3), "scaled", None)}
    return {**gemv, "ptx.bn128.w4.s3": (dict(base, BN=128, num_warps=4, num_stages=3), "dequant", True),
            "ptx.bn128.w4.s4": (dict(base, BN=128, num_warps=4, num_stages=4), "dequant", True),
            "ptx.bn64.w4.s4": (dict(base, BN=64, num_warps=4, num_stages=4), "dequant", True),
            "portable.bn128.w4.s3": (dict(base, BN=128, num_warps=4, num_stages=3), "dequant", False),
            "dot_scaled.bn128.w4.s3": (dict(base, BN=128, num_warps=4, num_stages=3), "scaled", None)}


class Fp4Case:
    def __init__(self, E, N, K, m, fmt, dev, gen):
        self.E, self.N, self.K, self.m, self.fmt = E, N, K, m, fmt
        if fmt == "mxfp4":
            self.w, self.s = rand_mx(E, N, K, dev, gen)
            self.s2 = None
        else:
            self.w, self.s, self.s2 = rand_nv(E, N, K, dev, gen)
        R = E * m
        x = (torch.randn(R, K, device=dev, generator=gen)).bfloat16()
        self.xq, self.xs, self.a16 = G8.act_quant_fp8(x, with_f16=True)
        self.R = R
        self.offs = (torch.arange(E + 1, device=dev) * m).to(torch.int64)
        self.out = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
        self.wbytes = E * (N * K // 2 + self.s.shape[-1] * N)

    def run(self, cfg, path, asm):
        bm = cfg["BM"]
        tiles = -(-self.m // bm)
        tcum = (torch.arange(self.E + 1, device=self.w.device) * tiles).to(torch.int64)
        if path == "gemv":
            c = {k: v for k, v in cfg.items() if k != "BM"}
            return gemv_launch(u8(self.xq), self.xs, self.w, self.s, self.s2, self.R, self.N, self.K, wfmt=self.fmt,
                               out=self.out, offs=self.offs, tcum=tcum, n_groups=self.E, n_tiles=self.E * tiles,
                               bm=bm, config=c)
        a = self.a16 if path == "dequant" else u8(self.xq)
        G4.fp4_launch(a, self.xs, self.w, self.s, self.s2, self.out, None, self.R, self.N, self.K, 0,
                     fmt=self.fmt, offs=self.offs, tcum=tcum, n_groups=self.E, n_tiles=self.E * tiles,
                     path=path, config=dict(cfg), use_asm=asm)
        return self.out

    def check(self, y):
        errs = []
        for e in (0, self.E - 1):
            if self.fmt == "mxfp4":
                W = dequant_mxfp4(self.w[e], self.s[e])
            else:
                W = dequant_nvfp4(self.w[e], self.s[e].view(torch.float8_e4m3fn), self.s2[e, 0])
            r = slice(e * self.m, (e + 1) * self.m)
            xd = (self.xq[r].double().view(self.m, -1, 128) * self.xs[r].double()[..., None]).view(self.m, -1)
            errs.append(relerr(y[r], xd @ W.double().T))
        return max(errs)

    def torch_baseline(self, timer):
        """bf16 bmm over the dequantised experts (weights cached, dequant not timed)."""
        Wb = torch.stack([(dequant_mxfp4(self.w[e], self.s[e]) if self.fmt == "mxfp4" else
                           dequant_nvfp4(self.w[e], self.s[e].view(torch.float8_e4m3fn), self.s2[e, 0])).bfloat16()
                          for e in range(self.E)])
        xb = (self.xq.float().view(self.R, -1, 128) * self.xs[..., None]).view(self.E, self.m, self.K).bfloat16()
        WbT = Wb.transpose(1, 2)
        t = timer(lambda: torch.bmm(xb, WbT))
        del Wb, WbT
        return t


def bench_fp4(dev, gen, timer, smoke, copy_bw, sweep_rows, quick=False):
    rows = []
    if smoke:
        shapes, ms = [("tiny", 64, 256, 3)], [1, 5]
    elif quick:
        shapes, ms = FP4_SHAPES[:1], [1, 16, 64]
    else:
        shapes, ms = FP4_SHAPES, [1, 4, 16, 64]
    best, best_mma = {}, {}
    # variant sweep at the first shape: small m (16-row tiles) and m = 64
    name, N, K, E = shapes[0]
    for m in ([1, 64] if not (smoke or quick) else [1]):
        case = Fp4Case(E, N, K, m, "mxfp4", dev, gen)
        bt, bcfg = None, None
        for vname, (cfg, path, asm) in fp4_variants(m).items():
            if smoke and vname.startswith(("ptx", "dot_scaled")):
                continue
            try:
                y = case.run(cfg, path, asm)
                err = case.check(y)
                t = timer(lambda: case.run(cfg, path, asm))
                ok = err < 5e-3
                gbs = case.wbytes / (t * 1e-3) / 1e9
                sweep_rows.append((f"fp4 {name} m{m}", vname, t * 1e3, err,
                                   f"{gbs:.0f} GB/s" + ("" if ok else " WRONG")))
                log(f"fp4 sweep m{m} {vname}: {t * 1e3:.1f} us {gbs:.0f} GB/s err {err:.1e}")
                if ok and (bt is None or t < bt):
                    bt, bcfg = t, (cfg, path, asm, vname)
                if ok and path != "gemv" and (m not in best_mma or t < best_mma[m][4]):
                    best_mma[m] = (cfg, path, asm, vname, t)
            except Exception as e:
                sweep_rows.append((f"fp4 {name} m{m}", vname, float("nan"), float("nan"), type(e).__name__))
                log(f"fp4 sweep m{m} {vname} failed: {type(e).__name__}: {str(e)[:300]}")
        best[m] = bcfg
        del case
    def pick(m):
        b = best.get(1 if m <= 16 else 64) or best.get(1)
        if b[1] == "gemv" and m > GEMV_MAX_ROWS:
            b = best_mma.get(1 if m <= 16 else 64)
        return b
    for name, N, K, E in shapes:
        for fmt in (("mxfp4", "nvfp4") if name.endswith("w1|w3") else ("mxfp4",)):
            for m in ms:
                if fmt == "nvfp4" and m not in (1, 16):
                    continue
                try:
                    case = Fp4Case(E, N, K, m, fmt, dev, gen)
                    cfg, path, asm, vname = pick(m)[:4]
                    if path == "gemv":
                        cfg = dict(cfg, BM=rows_tile(m))
                    else:
                        cfg = dict(cfg, BM=64 if m > 32 else (32 if m > 16 else 16))
                    if fmt == "nvfp4" and path != "gemv":
                        path, asm = "dequant", True if not smoke else None
                    y = case.run(cfg, path, asm)
                    err = case.check(y)
                    t = timer(lambda: case.run(cfg, path, asm))
                    gbs = case.wbytes / (t * 1e-3) / 1e9
                    row = dict(name=name, fmt=fmt, E=E, m=m, us=t * 1e3, gbs=gbs, pct=100 * gbs * 1e9 / copy_bw,
                               err=err, variant=vname if fmt == "mxfp4" else "ptx (nvfp4)", wmb=case.wbytes / 1e6)
                    if not smoke:
                        row["torch_us"] = case.torch_baseline(timer) * 1e3
                    rows.append(row)
                    log(f"fp4 {name:12s} {fmt} E{E:3d} m{m:3d}: {row['us']:8.1f} us {gbs:6.0f} GB/s "
                        f"({row['pct']:.0f}% of copy) | bf16 bmm {row.get('torch_us', 0):8.1f} us | err {err:.1e}")
                    del case
                except Exception as e:
                    log(f"fp4 {name} {fmt} m{m} failed: {type(e).__name__}: {e}")
                    traceback.print_exc()
    return rows


# ------------------------------------------------------------------------------------------- FP4 prefill

PREFILL_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SWEEP_TOKENS = 8192
# in-run tile sweep of fp4_fp8 (V4-Flash, 8192 tokens): (BM, num_warps, num_stages, SWAP)
# in-run tile sweep of the pre-decoded path (V4-Flash, 8192 tokens): (BM, num_warps, num_stages)
PREDEC_SWEEP = [(64, 8, 3, True), (64, 8, 3, False), (64, 8, 4, True), (64, 4, 3, True), (128, 8, 3, True)]
FP8MMA_SWEEP = [(64, 8, 3, False), (64, 4, 3, False), (64, 8, 4, False), (128, 8, 3, False), (32, 8, 3, True),
                (64, 4, 4, True)]


class PrefillCase:
    """The routed-expert GEMMs of one prefill chunk: T tokens x top-k pairs spread evenly over E experts
    (counts differ by at most one), random MXFP4 weights, gathered activations (GEMM 1 + SwiGLU) and
    sorted h rows (GEMM 2), as ``moe_forward`` runs them."""

    def __init__(self, model, T, dev, gen, weights):
        c = MODELS[model]
        self.d, self.I, self.E, self.k = c["d"], c["I"], c["E"], c["k"]
        self.T, self.P = T, T * self.k
        self.w13, self.s13, self.w2, self.s2 = weights
        eflat = (torch.randperm(self.P, device=dev, generator=gen) % self.E).to(torch.int32)
        self.eflat = eflat
        x = torch.randn(T, self.d, device=dev, generator=gen).bfloat16()
        self.xq, self.xs = G8.act_quant_fp8(x)
        self.pw = torch.rand(self.P, device=dev, generator=gen) + 0.5
        self.h = torch.empty(self.P, self.I, dtype=torch.uint8, device=dev)
        self.hs = torch.empty(self.P, self.I // 128, dtype=torch.float32, device=dev)
        self.out = torch.empty(self.P, self.d, dtype=torch.bfloat16, device=dev)
        self.rows = self.P / self.E

    def plan(self, bm):
        perm, offs, tcum, _ = Mo.sort_pairs(self.eflat, self.E, bm)
        n_tiles = min(self.P, -(-self.P // bm) + min(self.E, self.P))
        return perm, dict(offs=offs, tcum=tcum, n_groups=self.E, n_tiles=n_tiles)

    def fp8mma(self, cfg13, cfg2):
        from dsv4.kernels.gemm.fp4_fp8 import fp4_fp8_launch
        perm, g = self.plan(cfg13["BM"])
        a = self.xq
        f1 = lambda: fp4_fp8_launch(a, self.xs, self.w13, self.s13, None, self.h, self.hs, self.P, self.I, self.d,
                                    self.I, fmt="mxfp4", swiglu=True, limit=10.0, perm=perm, pw=self.pw,
                                    top_k=self.k, config=dict(cfg13), **g)
        f2 = lambda: fp4_fp8_launch(self.h, self.hs, self.w2, self.s2, None, self.out, None, self.P, self.d, self.I,
                                    0, fmt="mxfp4", config=dict(cfg2), **g)
        return f1, f2

    def predec(self, cfg13, cfg2):
        """(decode, GEMM 1, GEMM 2) of the pre-decoded path: ``predecode`` of w1|w3 and w2 (timed as one),
        then the FP8 GEMMs on the e4m3 tiles (``moe_forward(path="predec")``'s calls)."""
        from dsv4.kernels.gemm.fp4_fp8 import fp4_fp8_launch, predecode
        perm, g = self.plan(cfg13["BM"])
        w13, f13 = predecode(self.w13, self.s13)
        w2, f2_ = predecode(self.w2, self.s2)
        f0 = lambda: (predecode(self.w13, self.s13), predecode(self.w2, self.s2))

        def f1():     # ATMA: GEMM 1's rows gathered into sorted order first (timed with it)
            a, sa, pm, pw = self.xq, self.xs, perm, self.pw
            if cfg13.get("ATMA"):
                rows = perm // self.k
                a, sa, pm, pw = self.xq.index_select(0, rows), self.xs.index_select(0, rows), None, self.pw[perm]
            fp4_fp8_launch(a, sa, w13, f13, None, self.h, self.hs, self.P, self.I, self.d, self.I, fmt="mxfp4",
                           swiglu=True, limit=10.0, perm=pm, pw=pw, top_k=self.k, config=dict(cfg13),
                           predecoded=True, **g)
        f2 = lambda: fp4_fp8_launch(self.h, self.hs, w2, f2_, None, self.out, None, self.P, self.d, self.I,
                                    0, fmt="mxfp4", config=dict(cfg2), predecoded=True, **g)
        return f0, f1, f2

    def f16(self, cfg13, cfg2):
        from dsv4.kernels.gemm.fp4_prefill import f16_operand_split, fp4_prefill_launch
        perm, g = self.plan(cfg13["BM"])
        a = f16_operand_split(self.xq.view(torch.float8_e4m3fn))
        h16 = f16_operand_split(self.h.view(torch.float8_e4m3fn))
        f1 = lambda: fp4_prefill_launch(a, self.xs, self.w13, self.s13, None, self.h, self.hs, self.P, self.I,
                                        self.d, self.I, fmt="mxfp4", swiglu=True, limit=10.0, perm=perm, pw=self.pw,
                                        top_k=self.k, config=dict(cfg13), **g)
        f2 = lambda: fp4_prefill_launch(h16, self.hs, self.w2, self.s2, None, self.out, None, self.P, self.d, self.I,
                                        0, fmt="mxfp4", config=dict(cfg2), **g)
        return f1, f2

    def err(self):
        """GEMM 2 on the first rows of expert 0 against the fp64 product of its (kernel-made) h operand."""
        _, g = self.plan(64)
        n = min(32, int(g["offs"][1]))
        hq = self.h[:n].view(torch.float8_e4m3fn).double()
        hd = (hq.view(n, -1, 128) * self.hs[:n].double()[..., None]).view(n, -1)
        return relerr(self.out[:n], hd @ dequant_mxfp4(self.w2[0], self.s2[0]).double().T)

    def flops(self):
        return 2.0 * self.P * self.d * 2 * self.I + 2.0 * self.P * self.I * self.d


def bench_prefill(dev, gen, timer, smoke, sweep_rows):
    """Routed-expert GEMMs at prefill sizes: ``fp4_fp8`` (FP8 wgmma) beside ``fp4_prefill`` (f16 MMA) and
    ``torch._scaled_mm`` on the dense FP8 problem of the same size (GEMM 1 [P, d] x [d, 2I], GEMM 2
    [P, I] x [I, d], per-tensor scales: no block scaling, no gather, one weight)."""
    from dsv4.kernels.gemm.route import expert_path, fp4_fp8_config, fp4_prefill_config, fp8_predec_config
    rows = []
    t = target(dev)
    for model in (("flash", "pro") if not smoke else ()):
        c = MODELS[model]
        d, I, E = c["d"], c["I"], c["E"]
        try:
            w13, s13 = rand_mx(E, 2 * I, d, dev, gen)
            w2, s2 = rand_mx(E, d, I, dev, gen)
        except Exception as e:
            log(f"prefill {model}: setup failed: {e}")
            continue
        wts = (w13, s13, w2, s2)
        if model == "flash":
            case = PrefillCase(model, SWEEP_TOKENS, dev, gen, wts)
            variants = [("fp8mma", f"bm{bm}.w{nw}.s{st}" + ("" if swap else ".noswap"),
                         dict(BM=bm, BN=128, num_warps=nw, num_stages=st, SWAP=swap)) for bm, nw, st, swap in FP8MMA_SWEEP]
            variants += [("predec", f"predec.bm{bm}.w{nw}.s{st}" + (".atma" if atma else ""),
                          dict(BM=bm, BN=128, num_warps=nw, num_stages=st, SWAP=False, WTMA=True, ATMA=atma))
                         for bm, nw, st, atma in PREDEC_SWEEP]
            for path, name, cfg in variants:
                try:
                    f1, f2 = case.fp8mma(cfg, cfg) if path == "fp8mma" else case.predec(cfg, cfg)[1:]
                    f1(), f2()
                    t1, t2 = timer(f1), timer(f2)
                    sweep_rows.append((f"{path} flash T8192 gemm1", name, t1 * 1e3, case.err(), ""))
                    sweep_rows.append((f"{path} flash T8192 gemm2", name, t2 * 1e3, case.err(), ""))
                    log(f"prefill sweep {name}: gemm1 {t1 * 1e3:.1f} us gemm2 {t2 * 1e3:.1f} us")
                    del f1, f2
                except Exception as e:
                    log(f"prefill sweep {name} failed: {type(e).__name__}: {str(e)[:300]}")
            del case
        one = torch.ones((), device=dev)
        for T in PREFILL_TOKENS:
            try:
                case = PrefillCase(model, T, dev, gen, wts)
                r = case.rows
                f1, f2 = case.fp8mma(fp4_fp8_config(r, t, swiglu=True), fp4_fp8_config(r, t))
                f1(), f2()
                err = case.err()
                t1, t2 = timer(f1), timer(f2)
                row = dict(model=model, T=T, rows=r, path=expert_path(r, "mxfp4", t), g1=t1 * 1e3, g2=t2 * 1e3,
                           us=(t1 + t2) * 1e3, tf=case.flops() / ((t1 + t2) * 1e-3) / 1e12, err=err)
                a1 = torch.randint(-100, 100, (case.P, d), device=dev).to(torch.float8_e4m3fn)
                b1 = torch.randint(-100, 100, (2 * I, d), device=dev).to(torch.float8_e4m3fn)
                a2 = torch.randint(-100, 100, (case.P, I), device=dev).to(torch.float8_e4m3fn)
                b2 = torch.randint(-100, 100, (d, I), device=dev).to(torch.float8_e4m3fn)
                s1 = timer(lambda: torch._scaled_mm(a1, b1.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
                s2_ = timer(lambda: torch._scaled_mm(a2, b2.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
                del a1, b1, a2, b2
                row.update(sm_us=(s1 + s2_) * 1e3, sm_tf=case.flops() / ((s1 + s2_) * 1e-3) / 1e12)
                row["pct"] = 100 * row["sm_us"] / row["us"]
                try:      # the pre-decoded path: its decode pass and its GEMMs
                    f0, p1, p2 = case.predec(fp8_predec_config(r, t, swiglu=True), fp8_predec_config(r, t))
                    p1(), p2()
                    row.update(pd_us=timer(f0) * 1e3, pg_us=(timer(p1) + timer(p2)) * 1e3)
                    del f0, p1, p2
                except Exception as e:
                    log(f"prefill {model} T{T} predec failed: {type(e).__name__}: {str(e)[:300]}")
                if r > 16:
                    o1, o2 = case.f16(fp4_prefill_config(r, t, swiglu=True), fp4_prefill_config(r, t))
                    o1(), o2()
                    row["f16_us"] = (timer(o1) + timer(o2)) * 1e3
                rows.append(row)
                log(f"prefill {model} T{T:6d} rows/expert {r:7.1f} [{row['path']}]: fp8mma {row['g1']:9.1f} + "
                    f"{row['g2']:9.1f} us = {row['tf']:6.0f} TF | _scaled_mm {row['sm_us']:9.1f} us "
                    f"{row['sm_tf']:6.0f} TF ({row['pct']:.0f}%) | fp4_prefill {row.get('f16_us', 0):9.1f} us | "
                    f"predec {row.get('pd_us', 0):8.1f} + {row.get('pg_us', 0):9.1f} us | err {err:.1e}")
                del case
            except Exception as e:
                log(f"prefill {model} T{T} failed: {type(e).__name__}: {e}")
                traceback.print_exc()
        del wts, w13, s13, w2, s2
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for model in ("flash", "pro"):
        ts = [(r["T"], r["us"]) for r in rows if r["model"] == model]
        bad = [(a, b) for (a, ta), (b, tb) in zip(ts, ts[1:]) if ta > tb]
        log(f"prefill {model}: monotonic in T: {'yes' if not bad else 'NO ' + str(bad)}")
    return rows


# ------------------------------------------------------------------------------------------- MoE

def make_moe(model, dev, gen, smoke):
    c = dict(MODELS[model]) if not smoke else dict(d=256, I=128, E=8, k=2, rs=1.5)
    d, I, E, k = c["d"], c["I"], c["E"], c["k"]
    w13, s13 = rand_mx(E, 2 * I, d, dev, gen)
    w2, s2 = rand_mx(E, d, I, dev, gen)
    sh13, sh13s = quant_fp8_weight(torch.randn(2 * I, d, device=dev, generator=gen) * 0.02)
    sh2, sh2s = quant_fp8_weight(torch.randn(d, I, device=dev, generator=gen) * 0.02)
    w = Mo.MoEWeights(gate_w=torch.randn(E, d, device=dev, generator=gen) * 0.02,
                      bias=torch.randn(E, device=dev, generator=gen) * 0.01, tid2eid=None, topk=k,
                      route_scale=c["rs"], limit=10.0, fmt="mxfp4", w13=w13, w13_s=s13, w13_s2=None,
                      w2=w2, w2_s=s2, w2_s2=None, sh13=sh13, sh13_s=sh13s.float(), sh2=sh2, sh2_s=sh2s.float())
    dense = {"w13": torch.empty(E, 2 * I, d, dtype=torch.bfloat16, device=dev),
             "w2": torch.empty(E, d, I, dtype=torch.bfloat16, device=dev)}
    for e in range(E):                                   # setup only
        dense["w13"][e] = dequant_mxfp4(w13[e], s13[e]).bfloat16()
        dense["w2"][e] = dequant_mxfp4(w2[e], s2[e]).bfloat16()
    dense["sh13"] = dequant_fp8_weight(sh13, sh13s).bfloat16()
    dense["sh2"] = dequant_fp8_weight(sh2, sh2s).bfloat16()
    return w, dense, c


def moe_loop_torch(x: torch.Tensor, ids, w, dense: dict) -> torch.Tensor:
    """Plain-PyTorch baseline on the device (the speed reference of ``bench_moe``): the reference's Python
    loop over experts (same numerics: FP8 QDQ of x and h, bf16-rounded w1/w3 outputs, fp32 SwiGLU, weight
    before w2, fp32 accumulation in increasing expert order), with bf16 matmuls on dequantised weights
    (``dense``: {'w13': [E, 2I, d], 'w2': [E, d, I], 'sh13': [2I, d], 'sh2': [d, I]} bf16; QDQ'd
    activations are exact in bf16, the products exact in fp32)."""
    import torch.nn.functional as F

    from dsv4.reference.linear import dequant_activation_fp8
    idx, rw = Mo.route(x, ids, w)
    T, d = x.shape
    xq = dequant_activation_fp8(x).bfloat16()
    y = torch.zeros(T, d, dtype=torch.float32, device=x.device)

    def expert(xe, w13, w2, weight):
        gu = (xe @ w13.T).float()
        Ie = gu.shape[1] // 2
        g, u = gu[:, :Ie], gu[:, Ie:].clamp(-w.limit, w.limit)
        hh = F.silu(g.clamp(max=w.limit)) * u
        if weight is not None:
            hh = weight[:, None] * hh
        hq = dequant_activation_fp8(hh.to(torch.bfloat16)).bfloat16()
        return (hq @ w2.T).float()

    for e in range(w.n_experts):
        hit = idx == e
        rows = hit.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        col = hit[rows].float().argmax(dim=1)
        y[rows] += expert(xq[rows], dense["w13"][e], dense["w2"][e], rw[rows, col])
    if "sh13" in dense:
        y += expert(xq, dense["sh13"], dense["sh2"], None)
    return y.to(torch.bfloat16)


def bench_moe(dev, gen, timer, smoke, copy_bw, quick=False):
    rows = []
    for model in (("flash", "pro") if not smoke else ("flash",)):
        Ts = [1, 64, 256, 512, 4096] if not smoke else [1, 5]
        if quick and not smoke:
            Ts = [1, 64, 256, 512, 1024, 4096] if model == "flash" else [1, 64]
        try:
            w, dense, c = make_moe(model, dev, gen, smoke)
        except Exception as e:
            log(f"moe {model}: setup failed: {type(e).__name__}: {e}")
            continue
        E, d, I, k = c["E"], c["d"], c["I"], c["k"]
        per_expert = 3 * I * d // 2 + 3 * I * d // 32
        shared_bytes = 3 * I * d
        for T in Ts:
            try:
                x = torch.randn(T, d, device=dev, generator=gen).bfloat16()
                y = Mo.moe_forward(x, None, w)
                yl = moe_loop_torch(x, None, w, dense)
                err = relerr(y, yl)
                idx, _ = Mo.route(x, None, w)
                active = int(torch.unique(idx).numel())
                nbytes = active * per_expert + shared_bytes
                floor = nbytes / copy_bw * 1e6
                tg = None if timer.smoke else graph_time(lambda: Mo.moe_forward(x, None, w))
                te = timer(lambda: Mo.moe_forward(x, None, w), rep=100)
                tl_ = timer(lambda: moe_loop_torch(x, None, w, dense), rep=200)
                best = tg * 1e3 if tg is not None else te * 1e3
                variants = {}
                if T <= 1024 and not timer.smoke:   # the decode kernels vs the MMA kernels, tile rows
                    paths = [("mma", dict(path=GR.fp4_path(w.fmt, target(dev)))), ("gemv.tensor-core", dict(path="gemv"))]
                    if T <= 64:
                        paths += [(f"gemv.cuda-core.bm{r}", dict(path="gemv", config={"kernel": "cuda-core", "BM": r}))
                                  for r in (1, 2, 4)]
                    for vn, kw in paths:
                        variants[vn] = graph_time(lambda kw=kw: Mo.moe_forward(x, None, w, **kw)) * 1e3
                    log(f"moe {model} T{T} variants (graph us): " + ", ".join(f"{k} {v:.1f}" for k, v in variants.items()))
                row = dict(model=model, T=T, E=E, active=active, graph_us=None if tg is None else tg * 1e3,
                           eager_us=te * 1e3, loop_us=tl_ * 1e3, speedup=tl_ * 1e3 / best, floor_us=floor,
                           pct_floor=100 * floor / best, err=err, gb=nbytes / 1e9, variants=variants)
                rows.append(row)
                log(f"moe {model} T{T:5d}: graph {row['graph_us'] or 0:9.1f} us eager {row['eager_us']:9.1f} us | "
                    f"loop {row['loop_us']:9.1f} us x{row['speedup']:.1f} | active {active} floor {floor:.1f} us "
                    f"({row['pct_floor']:.0f}%) | err vs loop {err:.1e}")
            except Exception as e:
                log(f"moe {model} T{T} failed: {type(e).__name__}: {e}")
                traceback.print_exc()
        del w, dense
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------- report

def markdown(meta, fp8_rows, fp4_rows, moe_rows, sweep_rows, prefill_rows=()):
    L = [f"\n## FP8 / FP4 GEMMs and MoE layer (dsv4/kernels/gemm.py, moe.py), {meta['date']}, {meta['gpu']}\n"]
    L.append(f"Command: `{meta['cmd']}`; torch {meta['torch']}, triton {meta['triton']}. Medians of "
             "`triton.testing.do_bench` (L2 cleared before every call). Roofline measured in this run: copy "
             f"{meta['copy_bw'] / 1e12:.2f} TB/s (read+write, 1 GiB), FP8 peak {meta['fp8_peak'] / 1e12:.0f} TFLOP/s "
             f"(`torch._scaled_mm` e4m3 8192^3, per-tensor scales), bf16 matmul {meta['bf16'] / 1e12:.0f} TFLOP/s.\n")
    L.append("### FP8 block-scaled GEMM at prefill (target >= 60% of the FP8 peak)\n")
    L.append("Triton = `fp8_gemm` (1x128 activation / 128x128 weight scales, fp32 promotion per 128-K block, "
             f"tile `{meta.get('fp8_cfg')}` from the in-run sweep); linear = `fp8_linear` (act quant + GEMM); "
             "`_scaled_mm` = torch FP8 with per-tensor scales (no block scaling) at the same shape; bf16 = "
             "matmul on the dequantised weight; err = relative error of 64 rows vs the fp64 product.\n")
    L.append("| shape | M | N | K | Triton us | TFLOPS | % FP8 peak | linear us | _scaled_mm us (TFLOPS) | % of _scaled_mm | bf16 us | err |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in fp8_rows:
        L.append(f"| {r['name']} | {r['M']} | {r['N']} | {r['K']} | {r['us']:.1f} | {r['tf']:.0f} | "
                 f"{r.get('pct_peak', 0):.0f}% | {r['lin_us']:.1f} | {r.get('sm_us', 0):.1f} ({r.get('sm_tf', 0):.0f}) | "
                 f"{100 * r.get('sm_us', 0) / r['us']:.0f}% | {r.get('bf_us', 0):.1f} | {r['err']:.1e} |")
    L.append("\n### FP4 routed-expert GEMM at decode (target >= 70% of the copy bandwidth on the weight bytes)\n")
    L.append("One grouped launch over E experts with m tokens each (random codes, e8m0 scales 2^-9..2^-4); "
             "GB/s = packed weight + scale bytes / time; bf16 bmm = `torch.bmm` over the bf16-dequantised "
             "experts (4x the bytes); err vs fp64 on two experts.\n")
    L.append("| shape | fmt | experts | tokens/expert | weight MB | Triton us | GB/s | % of copy BW | bf16 bmm us | speedup | variant | err |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in fp4_rows:
        tu = r.get("torch_us", 0)
        L.append(f"| {r['name']} | {r['fmt']} | {r['E']} | {r['m']} | {r['wmb']:.0f} | {r['us']:.1f} | {r['gbs']:.0f} | "
                 f"{r['pct']:.0f}% | {tu:.1f} | {tu / r['us']:.1f}x | {r['variant']} | {r['err']:.1e} |")
    if prefill_rows:
        L.append("\n### FP4 routed-expert GEMMs at prefill (targets: >= 60% of `_scaled_mm` at >= 192 rows per expert, "
                 ">= 40% at 64; time non-decreasing in T)\n")
        L.append("GEMM 1 (w1|w3 + SwiGLU + FP8 quantisation of h, gathered rows) + GEMM 2 (w2, bf16 out) over E experts, "
                 "T x 6 pairs spread evenly, random MXFP4 weights; fp8mma = `fp4_fp8` (e2m1 -> e4m3 in registers, FP8 "
                 "wgmma, per-128 promotion) at the router's tile; `_scaled_mm` = torch FP8 (per-tensor scales) on the "
                 "dense problem of the same size; fp4_prefill = the f16-MMA kernel; path = the router's choice at "
                 "that size; predec = `fp4_fp8.predecode` of w1|w3 and w2 to e4m3 tiles (decode us) + the same "
                 "kernel's GEMMs on those tiles (GEMMs us); err = GEMM 2 rows vs fp64.\n")
        L.append("| model | T | rows / expert | path | fp8mma GEMM1 us | GEMM2 us | total us | TFLOP/s | _scaled_mm us (TFLOP/s) | % of _scaled_mm | fp4_prefill us | speedup | predec decode us | predec GEMMs us | predec total us (% of _scaled_mm) | err |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in prefill_rows:
            f16 = r.get("f16_us")
            pd, pg = r.get("pd_us"), r.get("pg_us")
            L.append(f"| {r['model']} | {r['T']} | {r['rows']:.1f} | {r['path']} | {r['g1']:.1f} | {r['g2']:.1f} | "
                     f"{r['us']:.1f} | {r['tf']:.0f} | {r['sm_us']:.1f} ({r['sm_tf']:.0f}) | {r['pct']:.0f}% | "
                     + (f"{f16:.1f} | {f16 / r['us']:.1f}x" if f16 else "- | -")
                     + (f" | {pd:.1f} | {pg:.1f} | {pd + pg:.1f} ({100 * r['sm_us'] / (pd + pg):.0f}%)" if pd else
                        " | - | - | -") + f" | {r['err']:.1e} |")
    L.append("\n### MoE layer (route + sort + grouped FP4 w1|w3+SwiGLU + grouped FP4 w2 + shared FP8 expert + combine)\n")
    L.append("Triton graph = CUDA-graph replay (no host overhead, L2 flushed before every call), eager = plain call; loop = the reference's "
             "Python loop over experts in plain PyTorch on the GPU (same numerics: FP8 QDQ of x and h, bf16 "
             "matmuls on bf16-dequantised weights, eager); floor = bytes of the experts hit + shared expert / "
             "copy bandwidth; err = relative difference to the loop.\n")
    L.append("| model | tokens | active experts | weight GB | Triton graph us | eager us | Python loop us | speedup | floor us | % of floor | err vs loop |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in moe_rows:
        g = f"{r['graph_us']:.1f}" if r["graph_us"] is not None else "-"
        L.append(f"| {r['model']} | {r['T']} | {r['active']} | {r['gb']:.2f} | {g} | {r['eager_us']:.1f} | "
                 f"{r['loop_us']:.1f} | {r['speedup']:.1f}x | {r['floor_us']:.1f} | {r['pct_floor']:.0f}% | {r['err']:.1e} |")
    var = [r for r in moe_rows if r.get("variants")]
    if var:
        L.append("\nExpert-GEMM path per batch (CUDA-graph us, L2 flushed): `mma` = the MMA FP4 kernels (`gemm.py`), "
                 "`gemv.tensor-core` = the decode kernel of `fp4_mma.py`, `gemv.cuda-core.bmN` = the GEMV of `gemv.py` "
                 "with N-row tiles (the default picks by rows per expert).\n")
        names = list(dict.fromkeys(k for r in var for k in r["variants"]))
        L.append("| model | tokens | " + " | ".join(names) + " |")
        L.append("|---|---|" + "---|" * len(names))
        for r in var:
            L.append(f"| {r['model']} | {r['T']} | " + " | ".join(
                f"{r['variants'][n]:.1f}" if n in r["variants"] else "-" for n in names) + " |")
    if sweep_rows:
        L.append("\n<details><summary>in-run variant sweep</summary>\n")
        L.append("| shape | variant | us | err | note |")
        L.append("|---|---|---|---|---|")
        for s in sweep_rows:
            L.append(f"| {s[0]} | {s[1]} | {s[2]:.1f} | {s[3]:.1e} | {s[4]} |")
        L.append("\n</details>")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (code paths only)")
    ap.add_argument("--md", default=None, help="append the markdown section to this file")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--only", default="fp8,fp4,prefill,moe")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (FP4: V4-Flash w1|w3; MoE: fewer T)")
    args = ap.parse_args()
    smoke = args.smoke
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    timer = Timer(smoke or dev.type == "cpu")
    import triton
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
    log(f"# {gpu}; torch {torch.__version__}; triton {triton.__version__}")
    copy_bw, fp8_peak, bf16 = roofline(dev, timer, smoke or dev.type == "cpu")
    log(f"roofline: copy {copy_bw / 1e12:.2f} TB/s, fp8 {fp8_peak / 1e12:.0f} TFLOP/s, bf16 {bf16 / 1e12:.0f} TFLOP/s")
    sweep_rows, fp8_rows, fp4_rows, moe_rows, fp8_cfg = [], [], [], [], None
    only = set(args.only.split(","))
    dec_md = ""
    if "fp8dec" in only:
        _rows, dec_md = bench_fp8_decode(dev, gen, timer, copy_bw)
    if "fp8" in only:
        fp8_rows, fp8_cfg = bench_fp8(dev, gen, timer, smoke, fp8_peak, bf16, sweep_rows)
    if "fp4" in only:
        fp4_rows = bench_fp4(dev, gen, timer, smoke, copy_bw, sweep_rows, args.quick)
    prefill_rows = []
    if "prefill" in only:
        prefill_rows = bench_prefill(dev, gen, timer, smoke, sweep_rows)
    if "moe" in only:
        moe_rows = bench_moe(dev, gen, timer, smoke, copy_bw, args.quick)
    meta = dict(date=datetime.date.today().isoformat(), gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                cmd="PYTHONPATH=. python benchmarks/gemm_moe.py " + " ".join(sys.argv[1:]), copy_bw=copy_bw,
                fp8_peak=fp8_peak, bf16=bf16, fp8_cfg=fp8_cfg)
    md = markdown(meta, fp8_rows, fp4_rows, moe_rows, sweep_rows, prefill_rows) + dec_md
    print(md)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemm_moe.md").write_text(md)
        (Path(args.out) / "gemm_moe.json").write_text(json.dumps(
            dict(meta=meta, fp8=fp8_rows, fp4=fp4_rows, moe=moe_rows, sweep=sweep_rows, prefill=prefill_rows), default=str, indent=1))
    if args.md and not smoke:
        with open(args.md, "a") as f:
            f.write(md)


if __name__ == "__main__":
    main()
