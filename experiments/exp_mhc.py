#!/usr/bin/env python3
"""Experiment: the v2 mHC paths (dsv4/kernels/mhc.py) against the v1 two-launch hc_pre / hc_head.

    PYTHONPATH=. python experiments/exp_mhc.py                  # H200: < 2 min
    PYTHONPATH=. python experiments/exp_mhc.py --md OUT.md      # ... and write the table there too
    PYTHONPATH=. python experiments/exp_mhc.py --smoke          # CPU interpreter: code paths only

For d in (4096, 7168) and T in (1, 8, 64, 256, 4096, 8192): hc_pre with ``config={"impl": "v1"}``
(split-K mix GEMM + finish, the previous default), the new default (``config=None``: the fused
one-launch path up to ``mhc.FUSED_MAX_T`` tokens, the tiled path above: mix GEMM, per-token finish,
streaming apply) and the other new path; at d 4096 also tile / split variants of both; hc_head the
same (fewer variants); hc_post (two tile configs at d 4096). Every variant is first checked against
v1 (``err/tol``: the largest of |y - y_v1| / (2^-7 |y_v1| + 1e-5 sum_j |x_j|) and, for post / comb,
max|diff| / max|v1| / 1e-5; > 1 is marked WRONG) and then timed with ``benchmarks.common.graph_time``
(CUDA-graph replays, L2 flushed before every call). Bytes (hc_pre): x read once + fn + y + post/comb
(the floor of ``benchmarks/hotpath.py``); '% copy' = (bytes / copy bandwidth) / time; '% 2-read' the
same with x counted twice (the cap of a pass that cannot keep x on chip: mix, then weighted sum).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import graph_time, roofline  # noqa: E402
from dsv4.kernels import interpreting, mhc  # noqa: E402

T0 = time.time()
BUDGET_S = 110.0          # stop starting new cases past this (the H200 run must end < 2 min)


def log(*a):
    print(f"[{time.time() - T0:5.1f}s]", *a, file=sys.stderr, flush=True)


def pre_variants(T, full):
    """(label, config) of hc_pre at T: v1 first (the reference of the check), the default, the other
    v2 path; ``full``: the tile / split variants too."""
    fused_default = T <= mhc.FUSED_MAX_T
    v = [("v1", {"impl": "v1"}), ("default", None)]
    if T <= 64 and not fused_default:
        v.append(("fused", {"impl": "fused"}))
    if T >= 8 and fused_default:
        v.append(("tiled", {"impl": "tiled"}))
    if not full:
        return v
    if T <= 64:
        v += [(f"fused bt{bt}", {"impl": "fused", "block_t": bt}) for bt in (1, 4) if bt < T or bt == 1]
    if 8 <= T <= 256:
        v.append(("tiled bt16", {"impl": "tiled", "block_t": 16}))
        v.append(("tiled splits64", {"impl": "tiled", "splits": 64}))
    if T == 256:
        v.append(("tiled bt128", {"impl": "tiled", "block_t": 128}))
    if T >= 256:
        v.append(("tiled bt64", {"impl": "tiled", "block_t": 64}))
        v.append(("tiled bk128", {"impl": "tiled", "block_k": 128}))
        v.append(("tiled stages4", {"impl": "tiled", "num_stages": 4}))
        n_tb = -(-T // (128 if T >= 1024 else 64))          # the default token blocks
        v.append(("tiled 4/SM", {"impl": "tiled", "splits": max(1, 4 * _sms() // n_tb)}))
        v.append(("tiled fwd", {"impl": "tiled", "reverse": False}))
        v.append(("tiled apply1024", {"impl": "tiled", "apply_block_d": 1024}))
        v += [(f"tiled tok{b}", {"impl": "tiled", "tokens_block": b}) for b in (4, 8, 16)]
        v.append(("tiled splits8", {"impl": "tiled", "splits": 8}))
        v.append(("tiled splits8 tok8", {"impl": "tiled", "splits": 8, "tokens_block": 8}))
    if T in (256, 4096):
        v.append(("v1 ieee", {"impl": "v1", "mode": "ieee"}))
        v.append(("tiled ieee", {"impl": "tiled", "mode": "ieee"}))
    return v


def head_variants(T, full):
    v = pre_variants(T, False)
    if full and T == 4096:
        v += [("v1 ieee", {"impl": "v1", "mode": "ieee"}), ("tiled ieee", {"impl": "tiled", "mode": "ieee"})]
    return v


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4


def ratio_y(y, y0, x):
    tol = 2.0 ** -7 * y0.float().abs() + 1e-5 * x.float().abs().sum(1)
    return float(((y.float() - y0.float()).abs() / tol).max())


def ratio_rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) / 1e-5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--only", default=None, help="comma-separated substrings of the row names to run")
    args = ap.parse_args()
    smoke = args.smoke or interpreting()
    dev = torch.device("cpu" if interpreting() else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    copy_bw, _ = roofline(dev, smoke)
    log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write); FUSED_MAX_T={mhc.FUSED_MAX_T}")
    dims = (64,) if smoke else (4096, 7168)
    Ts = (1, 8, 256) if smoke else (1, 8, 64, 256, 4096, 8192)
    rows = []

    def run(name, T, call, nbytes, x_bytes, check):
        if args.only and not any(o in name for o in args.only.split(",")):
            return
        if time.time() - T0 > BUDGET_S:
            log(f"{name} T={T}: skipped (time budget)")
            return
        try:
            bad = check()
            ms = graph_time(call)
        except Exception as e:  # report and go on
            log(f"{name} T={T}: FAILED {type(e).__name__}: {str(e)[:200]}")
            rows.append((name, T, float("nan"), float("nan"), float("nan"), float("nan"), float("nan"), "FAILED"))
            return
        us = ms * 1e3
        gbs = nbytes / (ms * 1e-3) / 1e9
        pct = nbytes / copy_bw / (ms * 1e-3) * 100
        pct2 = (nbytes + x_bytes) / copy_bw / (ms * 1e-3) * 100 if x_bytes else float("nan")
        status = "ok" if bad is None or bad <= 1 else "WRONG"
        rows.append((name, T, us, gbs, pct, pct2, bad if bad is not None else float("nan"), status))
        log(f"{name} T={T}: {us:.1f} us {gbs:.0f} GB/s {pct:.0f}% err/tol {bad} {status}")

    for d in dims:
        for T in Ts:
            x = (torch.randn(T, 4, d, device=dev, generator=gen) * 2).bfloat16()
            fn = torch.randn(24, 4 * d, device=dev, generator=gen) * (4 * d) ** -0.5
            base = torch.randn(24, device=dev, generator=gen) * 0.5
            scale = torch.rand(3, device=dev, generator=gen) + 0.5
            fh, bh, sh = fn[:4].contiguous(), base[:4].contiguous(), scale[:1].contiguous()
            xb = T * 4 * d * 2
            pre_bytes = xb + 24 * 4 * d * 4 + T * d * 2 + T * 80
            head_bytes = xb + 4 * 4 * d * 4 + T * d * 2
            post_bytes = T * d * 2 + 2 * xb + T * 80
            y0, p0, c0 = mhc.hc_pre(x, fn, base, scale, config={"impl": "v1"})
            h0 = mhc.hc_head(x, fh, bh, sh, config={"impl": "v1"})
            full = d == dims[0]           # the tile / split sweep at d 4096 only (time budget)
            for label, cfg in pre_variants(T, full):
                def chk(cfg=cfg):
                    y, p, c = mhc.hc_pre(x, fn, base, scale, config=cfg)
                    return max(ratio_y(y, y0, x), ratio_rel(p, p0), ratio_rel(c, c0))
                run(f"hc_pre d{d} {label}", T, lambda cfg=cfg: mhc.hc_pre(x, fn, base, scale, config=cfg),
                    pre_bytes, xb, chk)
            for label, cfg in head_variants(T, full):
                run(f"hc_head d{d} {label}", T, lambda cfg=cfg: mhc.hc_head(x, fh, bh, sh, config=cfg),
                    head_bytes, xb, lambda cfg=cfg: ratio_y(mhc.hc_head(x, fh, bh, sh, config=cfg), h0, x))
            y = torch.randn(T, d, device=dev, generator=gen).bfloat16()
            for bd, nw in ((1024, 4), (2048, 8)) if full else ((1024, 4),):
                run(f"hc_post d{d} block_d={bd} warps={nw}", T,
                    lambda bd=bd, nw=nw: mhc.hc_post(y, x, p0, c0, block_d=bd, num_warps=nw), post_bytes, 0,
                    lambda: None)
    lines = ["| case | T | us | GB/s | % copy | % 2-read | err/tol | check |", "|---|---|---|---|---|---|---|---|"]
    for name, T, us, gbs, pct, pct2, bad, status in rows:
        lines.append(f"| {name} | {T} | {us:.1f} | {gbs:.0f} | {pct:.0f}% | {pct2:.0f}% | {bad:.2f} | {status} |")
    table = "\n".join(lines)
    print(table, flush=True)
    if args.md:
        Path(args.md).write_text(table + "\n")
    log("done")
    if any(r[-1] != "ok" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
