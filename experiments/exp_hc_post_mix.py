#!/usr/bin/env python3
"""Experiment (not adopted): hc_post with the next hc_pre's mix GEMM in its pass (``hc_post_mix``
below), so that hc_pre reads x once, against the separate hc_post + hc_pre (tiled: the mix GEMM
reads x, the weighted sum reads it again).

    PYTHONPATH=. python experiments/exp_hc_post_mix.py             # H200, < 2 min
    PYTHONPATH=. python experiments/exp_hc_post_mix.py --smoke     # CPU interpreter: code paths only

Bytes (the floors): hc_post reads y [T, d] and res [T, 4, d], writes out [T, 4, d]; hc_pre reads x
[T, 4, d] once and fn, writes y [T, d] and post / comb; '% copy' = (bytes / copy bandwidth) / time.
The pair's floor is the sum of both. Times: ``benchmarks.common.graph_time`` (CUDA graph, L2 flushed
before every call). Checked first: out equal to hc_post's bit for bit, hc_pre's outputs on the
partials within 1e-5 (post / comb, relative) of hc_pre's own.

H200 (session 13, docs/benchmarks-2026-12-01.md): with the mix done, hc_pre reaches 72-94% of copy at T = 4096 / 8192
(55 vs 102 us at d 4096, T 4096), but hc_post_mix runs at 32-48% of its floor (best: 149 us against
hc_post's 75 at d 4096, T 4096, 4 warps, ptxas ~254 registers: the code below), so the pair is
1.13-1.57x slower than the separate kernels. At 8 warps the kernel holds ~170 registers (one CTA per
SM: y, four res tiles, four outputs and three accumulators), so its loads do not overlap its math and
stores. Tried: a manual one-chunk prefetch of y / res (slower: 149 -> 211 us at 4 warps, 213 -> 232
at 8; not kept), 3 stages, 16-128 token or 16-64 column tiles: no gain. At d 7168, T 8192 its post /
comb differ from hc_pre's own by 2e-5 (longer tensor-core accumulation per split).
Not adopted; hc_pre keeps its own mix GEMM.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.common import graph_time, roofline  # noqa: E402
from dsv4.kernels import interpreting, mhc  # noqa: E402
from dsv4.kernels.kv_insert import _rne_bf16  # noqa: E402
from dsv4.kernels.mhc import _mix_dot  # noqa: E402

HC = mhc.HC


@triton.jit
def _post_loads(yrow, rrow, D, d0, d_hi, tm, BK: tl.constexpr):
    """y and the four res streams of columns d0..d0+BK (< d_hi) as fp32 [BT, BK] tiles."""
    d = d0 + tl.arange(0, BK)
    m2 = tm[:, None] & (d < d_hi)[None, :]
    y = tl.load(yrow + d[None, :], mask=m2, other=0.0).to(tl.float32)
    r0 = tl.load(rrow + d[None, :], mask=m2, other=0.0).to(tl.float32)
    r1 = tl.load(rrow + D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    r2 = tl.load(rrow + 2 * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    r3 = tl.load(rrow + 3 * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    return y, r0, r1, r2, r3

@triton.jit
def _post_stream(POST, COMB, t64, tm, y, r0, r1, r2, r3, k: tl.constexpr):
    """Stream k of hc_post for a [BT, BK] tile, as ``_hc_post_kernel`` computes it (fp32, j in
    order), rounded to bf16 values (fp32)."""
    cb = COMB + t64 * 16 + k
    mixed = tl.zeros_like(y)
    mixed += tl.load(cb, mask=tm, other=0.0)[:, None] * r0
    mixed += tl.load(cb + 4, mask=tm, other=0.0)[:, None] * r1
    mixed += tl.load(cb + 8, mask=tm, other=0.0)[:, None] * r2
    mixed += tl.load(cb + 12, mask=tm, other=0.0)[:, None] * r3
    return _rne_bf16(tl.load(POST + t64 * 4 + k, mask=tm, other=0.0)[:, None] * y + mixed)

@triton.jit
def _hc_post_mix(Yin, RES, POST, COMB, OUT, W, PART, T, D, K, stride_yt, stride_rt, stride_ot, d_per_split,
                 NMIX: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 MODE: tl.constexpr):
    """hc_post of a token block over one d range, grid (S d splits, token blocks of BT), and the
    next hc_pre's mix partial of the streams it writes (``_hc_mix_tile``'s partial layout: split
    s holds the d range s of all four streams). out is computed as ``_hc_post_kernel`` does (fp32,
    j in order, one bf16 rounding); the mix and the sum of squares take the rounded values, as
    the next hc_pre reading them back would."""
    pid_s = tl.program_id(0)
    pid_t = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    tm = t < T
    t64 = t.to(tl.int64)
    n = tl.arange(0, NP)
    nm = n < NMIX
    acc = tl.zeros([BT, NP], tl.float32)
    acc2 = tl.zeros([BT, NP], tl.float32)
    acc3 = tl.zeros([BT, NP], tl.float32)
    sq = tl.zeros([BT, BK], tl.float32)
    d_hi = tl.minimum(D, pid_s * d_per_split + d_per_split)
    yrow = Yin + t64[:, None] * stride_yt
    rrow = RES + t64[:, None] * stride_rt
    orow = OUT + t64[:, None] * stride_ot
    for d0 in range(pid_s * d_per_split, d_hi, BK):
        d = d0 + tl.arange(0, BK)
        dm = d < d_hi
        m2 = tm[:, None] & dm[None, :]
        y, r0, r1, r2, r3 = _post_loads(yrow, rrow, D, d0, d_hi, tm, BK)
        o0 = _post_stream(POST, COMB, t64, tm, y, r0, r1, r2, r3, 0)
        o1 = _post_stream(POST, COMB, t64, tm, y, r0, r1, r2, r3, 1)
        o2 = _post_stream(POST, COMB, t64, tm, y, r0, r1, r2, r3, 2)
        o3 = _post_stream(POST, COMB, t64, tm, y, r0, r1, r2, r3, 3)
        tl.store(orow + d[None, :], o0.to(tl.bfloat16), mask=m2)
        tl.store(orow + D + d[None, :], o1.to(tl.bfloat16), mask=m2)
        tl.store(orow + 2 * D + d[None, :], o2.to(tl.bfloat16), mask=m2)
        tl.store(orow + 3 * D + d[None, :], o3.to(tl.bfloat16), mask=m2)
        sq += o0 * o0 + o1 * o1 + o2 * o2 + o3 * o3
        # the four streams side by side as one [BT, 4 BK] operand: column 4 i + 2 a + b is stream
        # k = a + 2 b at d0 + i, i.e. row k D + d0 + i of the flattened fn
        xv = tl.reshape(tl.join(tl.join(o0, o1), tl.join(o2, o3)), [BT, 4 * BK])
        c = tl.arange(0, 4 * BK)
        kx = ((c % 4) // 2 + 2 * (c % 2)) * D + d0 + c // 4
        km = d0 + c // 4 < d_hi
        if MODE != 0:
            xv = xv.to(tl.bfloat16)
        acc, acc2, acc3 = _mix_dot(xv, W, kx, km, K, n, nm, acc, acc2, acc3, NP, MODE, True)
    if MODE != 0:
        acc = acc + (acc2 + acc3)
    col = PART + pid_s * NP * T + t64
    tl.store(col[:, None] + (n * T)[None, :], acc, mask=tm[:, None] & nm[None, :])
    tl.store(col + (NP - 1) * T, tl.sum(sq, axis=1), mask=tm)



def hc_post_mix(y, res, post, comb, next_fn, config=None):
    """hc_post and the next hc_pre's mix partials in one pass -> (out bf16 [T, 4, d], partials
    [S, NP, T] for ``pre_from_partials``). ``config``: mode, post_block_t, post_block_k, post_splits,
    post_warps, post_stages."""
    T, _, D = res.shape
    cfg = dict(config or {})
    interp = interpreting()
    mode = mhc._mode(cfg)
    np_ = mhc._np(6 * HC)
    BT = cfg.get("post_block_t") or (16 if interp else 64)
    BK = cfg.get("post_block_k") or 32
    n_tb = triton.cdiv(T, BT)
    n_chunks = triton.cdiv(D, BK)
    S = mhc._splits(n_chunks, n_tb, 2, res.device, {"splits": cfg["post_splits"]} if "post_splits" in cfg else {})
    d_per_split = triton.cdiv(n_chunks, S) * BK
    S = triton.cdiv(D, d_per_split)
    out = torch.empty(T, HC, D, dtype=torch.bfloat16, device=res.device)
    part = torch.empty(S, np_, T, dtype=torch.float32, device=res.device)
    w = next_fn.contiguous() if mode == 0 else mhc.prepare_bf16x3(next_fn, np_)
    kw = {} if interp else {"num_warps": cfg.get("post_warps", 8), "num_stages": cfg.get("post_stages", 2)}
    _hc_post_mix[(S, n_tb)](y, res, post, comb, out, w, part, T, D, HC * D, y.stride(0), res.stride(0),
                            out.stride(0), d_per_split, NMIX=6 * HC, NP=np_, BT=BT, BK=BK, MODE=mode, **kw)
    return out, part


def pre_from_partials(x, fn, base, scale, part, iters=20, hc_eps=1e-6, rms_eps=1e-6):
    """hc_pre's tiled path without its mix GEMM (the partials from ``hc_post_mix``): x read once."""
    T, _, D = x.shape
    y = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    post = torch.empty(T, HC, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, HC, HC, dtype=torch.float32, device=x.device)
    mhc._tiled_launch(x, fn, 6 * HC, False, base, scale, y, post, comb, iters, hc_eps, rms_eps, {}, part=part)
    return y, post, comb

CONFIGS = [("bt64 bk32 w8 s2 (default)", {}), ("bt64 bk32 w4", {"post_warps": 4}),
           ("bt64 bk32 w4 s3", {"post_warps": 4, "post_stages": 3}), ("bt64 bk64 w8", {"post_block_k": 64}),
           ("bt128 bk32 w8", {"post_block_t": 128}), ("bt64 bk32 w8 s1", {"post_stages": 1})]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    copy_bw, _ = roofline(dev, args.smoke)
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 16, 1)] if args.smoke else [(4096, 64, 6), (4096, 256, 6), (4096, 4096, 6), (4096, 8192, 2),
                                               (7168, 4096, 6), (7168, 8192, 2)]
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print("| d | T | path | hc_post us (% copy) | hc_pre us (% copy) | pair us (% copy) |")
    print("|---|---|---|---|---|---|")
    for D, T, n_cfg in shapes:
        res = (torch.randn(T, 4, D, generator=gen) * 2).bfloat16().to(dev)
        y = torch.randn(T, D, generator=gen).bfloat16().to(dev)
        post = (torch.rand(T, 4, generator=gen) * 2).to(dev)
        comb = torch.rand(T, 4, 4, generator=gen)
        comb = (comb / comb.sum(-2, keepdim=True)).to(dev)
        fn = (torch.randn(24, 4 * D, generator=gen) * (4 * D) ** -0.5 * 2).to(dev)
        base = (torch.randn(24, generator=gen) * 0.5).to(dev)
        scale = (torch.rand(3, generator=gen) + 0.5).to(dev)
        b_post = (T * D + 2 * T * 4 * D) * 2 + T * 20 * 4
        b_pre = T * 4 * D * 2 + fn.numel() * 4 + T * D * 2 + T * 20 * 4

        def pct(b, ms):
            return 100 * b / copy_bw / (ms * 1e-3)
        out = mhc.hc_post(y, res, post, comb)
        ref = mhc.hc_pre(out, fn, base, scale)
        t_post = graph_time(lambda: mhc.hc_post(y, res, post, comb))
        t_pre = graph_time(lambda: mhc.hc_pre(out, fn, base, scale))
        print(f"| {D} | {T} | separate | {t_post * 1e3:.1f} ({pct(b_post, t_post):.0f}) | "
              f"{t_pre * 1e3:.1f} ({pct(b_pre, t_pre):.0f}) | {(t_post + t_pre) * 1e3:.1f} "
              f"({pct(b_post + b_pre, t_post + t_pre):.0f}) |", flush=True)
        for label, cfg in CONFIGS[:n_cfg]:
            cfg = dict(cfg)
            per_sm = cfg.pop("post_per_sm", None)
            if per_sm is not None:
                n_tb = -(-T // 64)
                sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 4
                cfg["post_splits"] = max(1, per_sm * sms // n_tb)
            o2, part = hc_post_mix(y, res, post, comb, fn, config=cfg)
            got = pre_from_partials(o2, fn, base, scale, part)
            errs = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got[1:], ref[1:])]
            ok = torch.equal(o2, out) and max(errs) < 1e-5
            if not ok:
                print(f"  {label}: out equal {torch.equal(o2, out)}, post / comb rel err {errs}", flush=True)
            t_pm = graph_time(lambda: hc_post_mix(y, res, post, comb, fn, config=cfg))
            t_pr = graph_time(lambda: pre_from_partials(o2, fn, base, scale, part))
            mark = "" if ok else " WRONG"
            print(f"| {D} | {T} | post+mix {label}{mark} | {t_pm * 1e3:.1f} ({pct(b_post, t_pm):.0f}) | "
                  f"{t_pr * 1e3:.1f} ({pct(b_pre, t_pr):.0f}) | {(t_pm + t_pr) * 1e3:.1f} "
                  f"({pct(b_post + b_pre, t_pm + t_pr):.0f}) |", flush=True)


if __name__ == "__main__":
    main()
