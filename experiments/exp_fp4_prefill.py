#!/usr/bin/env python3
"""Experiment: the prefill FP4 expert GEMM (dsv4/kernels/fp4_prefill.py) vs the grouped dequant path
of ``gemm.fp4_launch`` as ``moe.moe_forward`` calls it, at a V4-Flash MoE prefill.

    PYTHONPATH=. python experiments/exp_fp4_prefill.py                 # H200: < 90 s
    PYTHONPATH=. python experiments/exp_fp4_prefill.py --md OUT.md     # ... and append the table there
    TRITON_INTERPRET=1 PYTHONPATH=. python experiments/exp_fp4_prefill.py --smoke   # CPU: code paths only

Case: 4096 tokens, top-6 of 256 experts (uniform random routing, ~96 pair rows per expert), d 4096,
inter 2048, MXFP4 weights with random codes and e8m0 scales 2^-9..2^-4 (``gemm_moe.rand_mx``).
GEMM 1 = grouped w1|w3 (N 2x2048, K 4096) with the gather and the SwiGLU + FP8 epilogue (e4m3 h +
scales), GEMM 2 = grouped w2 (N 4096, K 2048) on the old path's h. Every variant is first checked
against the old path (h: >= 98% identical bytes and every value within one FP8 step; w2: bf16 output
within 2^-7 relative + 2^-10 of the row max) and marked WRONG otherwise, then timed with
``benchmarks.common.graph_time`` (CUDA-graph replays, L2 flushed before each call). TFLOP/s counts
the useful 2 * pairs * N * K. ``prep`` rows: the f16 activation operands (natural: ``f16_operand``, as
moe.py makes them; split: ``f16_operand_split``, needed by the KSPLIT variants instead).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import graph_time  # noqa: E402
from dsv4.kernels.gemm import fp4_prefill as FP  # noqa: E402
from dsv4.kernels.gemm import common as GC, fp4 as G4, fp8 as G8, route as GR  # noqa: E402
from dsv4.kernels import moe as Mo  # noqa: E402
from dsv4.kernels.lib import target  # noqa: E402

T0 = time.time()
BUDGET_S = 80.0            # stop starting new variants past this (the H200 run must end < 90 s)

# (name, BM, num_warps, num_stages, DEC, KSPLIT); GEMM 1 (SwiGLU) and GEMM 2 (plain) lists
VARIANTS_1 = [("bm64.w8.s3.cvt.nat", 64, 8, 3, 0, False), ("bm64.w8.s3.cvt.split", 64, 8, 3, 0, True),
              ("bm64.w8.s3.alu.split", 64, 8, 3, 1, True), ("bm64.w8.s2.cvt.split", 64, 8, 2, 0, True),
              ("bm64.w8.s4.cvt.split", 64, 8, 4, 0, True), ("bm128.w16.s2.cvt.split", 128, 16, 2, 0, True)]
VARIANTS_2 = [("bm64.w4.s3.cvt.nat", 64, 4, 3, 0, False), ("bm64.w4.s3.cvt.split", 64, 4, 3, 0, True),
              ("bm64.w4.s3.alu.split", 64, 4, 3, 1, True), ("bm64.w4.s2.cvt.split", 64, 4, 2, 0, True),
              ("bm128.w8.s3.cvt.split", 128, 8, 3, 0, True), ("bm64.w8.s3.cvt.split", 64, 8, 3, 0, True)]


def log(*a):
    print(f"[{time.time() - T0:5.1f}s]", *a, flush=True)


def rand_mx(E, N, K, dev, gen):
    """random packed MXFP4 weights: uniform codes, e8m0 scales 2^-9..2^-4 (as benchmarks/gemm_moe.py)."""
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev, generator=gen)
    s = torch.randint(118, 124, (E, N, K // 32), dtype=torch.uint8, device=dev, generator=gen)
    return w, s


class Case:
    def __init__(self, T, d, I, E, k, dev, gen):
        self.T, self.d, self.I, self.E, self.k = T, d, I, E, k
        self.P = T * k
        self.limit = 10.0
        self.w13, self.s13 = rand_mx(E, 2 * I, d, dev, gen)
        self.w2, self.s2 = rand_mx(E, d, I, dev, gen)
        x = torch.randn(T, d, device=dev, generator=gen).bfloat16()
        self.xq, self.xs, self.a16 = G8.act_quant_fp8(x, with_f16=True)
        self.a16s = FP.f16_operand_split(self.xq)
        idx = torch.rand(T, E, device=dev, generator=gen).topk(k, dim=1).indices
        self.eflat = idx.reshape(-1).to(torch.int32)
        self.pw = (torch.rand(T, k, device=dev, generator=gen) + 0.5).reshape(-1).contiguous()
        self.routes = {}
        self.dev = dev

    def route(self, bm):
        if bm not in self.routes:
            perm, offs, tcum, _ = Mo.sort_pairs(self.eflat, self.E, bm)
            n_tiles = min(self.P, -(-self.P // bm) + min(self.E, self.P))
            self.routes[bm] = (perm, offs, tcum, n_tiles)
        return self.routes[bm]

    def gemm1(self, launch, a, cfg):
        perm, offs, tcum, n_tiles = self.route(cfg["BM"])
        h = torch.empty(self.P, self.I, dtype=torch.uint8, device=self.dev)
        hs = torch.empty(self.P, self.I // 128, dtype=torch.float32, device=self.dev)

        def run():
            launch(a, self.xs, self.w13, self.s13, None, h, hs, self.P, self.I, self.d, self.I, fmt="mxfp4",
                   swiglu=True, limit=self.limit, perm=perm, offs=offs, tcum=tcum, pw=self.pw, top_k=self.k,
                   n_groups=self.E, n_tiles=n_tiles, config=dict(cfg))
        return run, (h, hs), offs

    def gemm2(self, launch, a, hs, cfg):
        _, offs, tcum, n_tiles = self.route(cfg["BM"])
        out = torch.empty(self.P, self.d, dtype=torch.bfloat16, device=self.dev)

        def run():
            launch(a, hs, self.w2, self.s2, None, out, None, self.P, self.d, self.I, 0, fmt="mxfp4", offs=offs,
                   tcum=tcum, n_groups=self.E, n_tiles=n_tiles, config=dict(cfg))
        return run, out, offs


def old_launch(*args, **kw):
    G4.fp4_launch(*args, path="dequant", **kw)


def rows_valid(offs, P):
    return int(offs[-1].item()) if offs.numel() else P


def check_h(h, hs, h0, hs0, nv):
    """(ok, note): >= 98% identical e4m3 bytes, every value within one FP8 step of the old one."""
    h, hs, h0, hs0 = h[:nv], hs[:nv], h0[:nv], hs0[:nv]
    same = (h == h0).float().mean().item()
    deq = h.view(torch.float8_e4m3fn).float() * hs.repeat_interleave(128, 1)
    ref = h0.view(torch.float8_e4m3fn).float() * hs0.repeat_interleave(128, 1)
    step = 2.0 ** -3 * ref.abs() + hs0.repeat_interleave(128, 1) * 2.0 ** -9
    bad = int(((deq - ref).abs() > 1.01 * step).sum().item())
    ok = same >= 0.98 and bad == 0 and bool(torch.isfinite(deq).all())
    return ok, f"same {same * 100:.2f}%, beyond 1 step {bad}"


def check_out(y, y0, nv):
    y, y0 = y[:nv].float(), y0[:nv].float()
    tol = 2.0 ** -7 * y0.abs() + 2.0 ** -10 * y0.abs().amax(-1, keepdim=True)
    bad = int(((y - y0).abs() > tol).sum().item())
    rel = ((y - y0).norm() / y0.norm().clamp_min(1e-30)).item()
    ok = bad == 0 and rel < 2e-3 and bool(torch.isfinite(y).all())
    return ok, f"rel {rel:.1e}, beyond tol {bad}"


def sweep(rows, tag, gemm, variants, flops, launch, check):
    """Check then time every (name, BM, warps, stages, DEC, KSPLIT) variant of one GEMM: ``launch(cfg,
    ksplit)`` -> (run, output, offs), ``check(output)`` -> (ok, note); rows get (gemm, name, us, flops, status)."""
    for name, bm, nw, ns, dec, ks in variants:
        if time.time() - T0 > BUDGET_S:
            log(f"{tag} {name}: skipped (time budget)")
            continue
        cfg = dict(BM=bm, BN=128, num_warps=nw, num_stages=ns, DEC=dec, KSPLIT=ks)
        try:
            r, out, _offs = launch(cfg, ks)
            r()
            ok, note = check(out)
            t = graph_time(r) * 1e3 if ok else float("nan")
            rows.append((gemm, name, t, flops, ("ok; " if ok else "WRONG; ") + note))
            log(f"{tag} {name}: {t:.1f} us  {'ok' if ok else 'WRONG'} ({note})")
        except Exception as e:      # a variant that fails to compile / launch
            rows.append((gemm, name, float("nan"), flops, f"FAILED {type(e).__name__}"))
            log(f"{tag} {name} failed: {type(e).__name__}: {str(e)[:300]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes under the CPU interpreter (code paths only)")
    ap.add_argument("--md", default=None, help="append the markdown table to this file")
    ap.add_argument("--only", default="1,2", help="GEMMs to run: 1 (w1|w3 + SwiGLU), 2 (w2)")
    args = ap.parse_args()
    smoke = args.smoke
    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if smoke and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("--smoke runs under the interpreter: set TRITON_INTERPRET=1")
    gen = torch.Generator(device=dev).manual_seed(0)
    import triton
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
    log(f"# {gpu}; torch {torch.__version__}; triton {triton.__version__}")
    if smoke:
        c = Case(T=48, d=256, I=128, E=8, k=2, dev=dev, gen=gen)
        v1, v2 = [v for v in VARIANTS_1 if v[1] == 64][:3], [v for v in VARIANTS_2 if v[1] == 64][:3]
        old_cfg = {"BM": 64}
    else:
        c = Case(T=4096, d=4096, I=2048, E=256, k=6, dev=dev, gen=gen)
        v1, v2 = VARIANTS_1, VARIANTS_2
        old_cfg = {"BM": GR.fp4_config(c.P / min(c.E, c.P), target(dev))["BM"]}     # as moe_forward picks it
    log(f"case: {c.T} tokens, top-{c.k} of {c.E} experts, d {c.d}, inter {c.I}; old path tile BM {old_cfg['BM']}")
    rows = []
    fl1 = 2.0 * c.P * (2 * c.I) * c.d
    fl2 = 2.0 * c.P * c.d * c.I
    # activation operand preparation (both paths need one f16 copy of x and of h)
    if not smoke:
        rows.append(("prep", "f16_operand(x) (natural)", graph_time(lambda: GC.f16_operand(c.xq)) * 1e3, None, "-"))
        rows.append(("prep", "f16_operand_split(x)", graph_time(lambda: FP.f16_operand_split(c.xq)) * 1e3, None, "-"))
    h_old = None
    if "1" in args.only or "2" in args.only:
        run, (h0, hs0), offs = c.gemm1(old_launch, c.a16, old_cfg)
        run()
        nv = rows_valid(offs, c.P)
        h_old = (h0, hs0)
    if "1" in args.only:
        t_old = graph_time(run) * 1e3
        rows.append(("w13+SwiGLU", f"old fp4_launch bm{old_cfg['BM']}", t_old, fl1, "ref"))
        log(f"gemm1 old: {t_old:.1f} us")
        sweep(rows, "gemm1", "w13+SwiGLU", v1, fl1,
              lambda cfg, ks: c.gemm1(FP.fp4_prefill_launch, c.a16s if ks else c.a16, cfg),
              lambda out: check_h(*out, h0, hs0, nv))
    if "2" in args.only:
        hq = h_old[0].view(torch.float8_e4m3fn)
        hs = h_old[1]
        a2, a2s = GC.f16_operand(hq), FP.f16_operand_split(hq)
        if not smoke:
            rows.append(("prep", "f16_operand(h) (natural)", graph_time(lambda: GC.f16_operand(hq)) * 1e3, None, "-"))
            rows.append(("prep", "f16_operand_split(h)", graph_time(lambda: FP.f16_operand_split(hq)) * 1e3, None, "-"))
        run, y0, offs = c.gemm2(old_launch, a2, hs, old_cfg)
        run()
        nv = rows_valid(offs, c.P)
        t_old2 = graph_time(run) * 1e3
        rows.append(("w2", f"old fp4_launch bm{old_cfg['BM']}", t_old2, fl2, "ref"))
        log(f"gemm2 old: {t_old2:.1f} us")
        sweep(rows, "gemm2", "w2", v2, fl2, lambda cfg, ks: c.gemm2(FP.fp4_prefill_launch, a2s if ks else a2, hs, cfg),
              lambda y: check_out(y, y0, nv))
    ref = {g: t for g, n, t, f, s in rows if s == "ref"}
    md = [f"\n### FP4 prefill GEMM experiment ({gpu}, triton {triton.__version__}): {c.T} tokens, top-{c.k} of "
          f"{c.E} experts, d {c.d}, inter {c.I}, MXFP4\n",
          "Variant names: bm{BM}.w{num_warps}.s{num_stages}.{cvt|alu decode}.{nat|split K order}; us = "
          "CUDA-graph replay, L2 flushed; TFLOP/s = useful 2*pairs*N*K / time; speedup vs the old path.\n",
          "| GEMM | variant | us | TFLOP/s | speedup | check |", "|---|---|---|---|---|---|"]
    for g, n, t, f, s in rows:
        tf = f"{f / (t * 1e-6) / 1e12:.0f}" if (f and t == t) else "-"
        sp = f"{ref[g] / t:.2f}x" if (g in ref and t == t and s != "ref") else "-"
        md.append(f"| {g} | {n} | {t:.1f} | {tf} | {sp} | {s} |")
    text = "\n".join(md) + "\n"
    print(text)
    if args.md and not smoke:
        with open(args.md, "a") as f:
            f.write(text)
    log("done")


if __name__ == "__main__":
    main()
