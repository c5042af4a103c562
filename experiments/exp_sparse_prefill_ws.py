#!/usr/bin/env python3
"""Experiment: the warp-specialized sparse prefill prototype (``dsv4/kernels/sparse_prefill_ws.py``) against the
product kernel (``sparse_prefill``, Triton) and FlashMLA's figures (shared/spec/flashmla-h200.md, bf16 KV) on the
V4 prefill configs: window 128 + CSA top-512 at h64 and + top-1024 at h128, s_q 4096, s_kv 64K (FlashMLA's
counting: FLOPs = 2 s_q topk H 1024). CUDA-graph replays, L2 flushed.

    PYTHONPATH=. python experiments/exp_sparse_prefill_ws.py [--sq 4096]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), os.path.dirname(os.path.abspath(__file__))]
from attention import PAGE, decode_case  # noqa: E402
from common import gpu_experiment, graph_time  # noqa: E402
from dsv4.formats.kv_entry import read_entries  # noqa: E402
from dsv4.kernels import sparse_attention as sa  # noqa: E402
from dsv4.kernels import sparse_prefill_ws as SP  # noqa: E402

FLASHMLA = {64: 697.0, 128: 2087.0}     # us, s_q 4096, s_kv 64K, topk 640 / 1152 (H200, bf16 KV)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sq", type=int, default=4096)
    ap.add_argument("--heads", default="64,128", help="head counts to run (64: top-512, 128: top-1024)")
    ap.add_argument("--quick", action="store_true", help="the prototype's default and workspace rows only")
    args = ap.parse_args()
    setup = gpu_experiment("exp_sparse_prefill_ws", "an sm_90 GPU")
    if setup is None or not SP.available("cuda"):
        print("exp_sparse_prefill_ws: needs an sm_90 GPU with Gluon")
        return
    dev, gen, _ = setup
    print("| H | list | kernel | us | TFLOP/s | FlashMLA us (H200) | rel. diff to sparse_prefill |\n|---|---|---|---|---|---|---|")
    for H, topk in ((64, 512), (128, 1024)):
        if str(H) not in args.heads.split(","):
            continue
        c = decode_case("csa", H, topk, 1, 65536, args.sq, torch.device(dev), gen)
        a = (c["q"], c["widx"], c["wpages"], PAGE, c["eidx"], c["epages"], PAGE, c["sinks"])
        ref = sa.sparse_prefill(*a)
        us = graph_time(lambda: sa.sparse_prefill(*a)) * 1e3
        tf = c["flops"] / us / 1e6
        lab = f"128 + {topk}"
        print(f"| {H} | {lab} | sparse_prefill (Triton) | {us:.0f} | {tf:.0f} | {FLASHMLA[H]:.0f} | ref |", flush=True)
        ang = torch.rand(args.sq, 32, device=dev) * 6.283185307179586
        fkw = dict(rope=(torch.cos(ang), torch.sin(ang)), q_norm_eps=1e-6)
        fref = sa.sparse_prefill(*a, **fkw)
        us = graph_time(lambda: sa.sparse_prefill(*a, **fkw)) * 1e3
        print(f"| {H} | {lab} | sparse_prefill (Triton), q transform + inverse RoPE fused | {us:.0f} | "
              f"{c['flops'] / us / 1e6:.0f} | {FLASHMLA[H]:.0f} | |", flush=True)
        rkw = dict(rope=fkw["rope"])
        us = graph_time(lambda: sa.sparse_prefill(*a, **rkw)) * 1e3
        print(f"| {H} | {lab} | sparse_prefill (Triton), inverse RoPE only | {us:.0f} | "
              f"{c['flops'] / us / 1e6:.0f} | {FLASHMLA[H]:.0f} | |", flush=True)
        every = lambda p: read_entries(p, torch.arange(p.shape[0] * PAGE, device=p.device), PAGE)
        ws = (every(c["wpages"]), every(c["epages"]))
        us = graph_time(lambda: (every(c["wpages"]), every(c["epages"]))) * 1e3
        print(f"| {H} | {lab} | read_entries (torch) of both pools: {ws[0].shape[0]} + {ws[1].shape[0]} slots | "
              f"{us:.0f} | | | |", flush=True)
        row = lambda label, fn, cfg, kw, r0: _row(H, lab, label, fn, cfg, kw, r0, a, c["flops"])
        for name, kw, cfg in (("bf16 workspace", dict(kv_bf16=ws), None),
                              ("bf16 workspace, production form", dict(kv_bf16=ws, **fkw), None),
                              ("bf16 workspace, production form, 2 stages", dict(kv_bf16=ws, **fkw),
                               {"num_stages": 2})):
            row(f"sparse_prefill (Triton), {name}", sa.sparse_prefill, cfg, kw, fref if "q_norm_eps" in kw else ref)
        for name, cfg, kw in (("bf16 workspace (cp.async producer)", None, dict(kv_bf16=ws)),
                              ("bf16 workspace, production form (q by kv_insert's pass, inverse RoPE fused)", None,
                               dict(kv_bf16=ws, **fkw)),
                              ("bf16 workspace, production form (q transform in the consumers)", {"Q_PASS": False},
                               dict(kv_bf16=ws, **fkw))):
            row(f"sparse_prefill_ws, {name}", SP.sparse_prefill_ws, cfg, kw, fref if "q_norm_eps" in kw else ref)
        base = {"SX_PAD": False, "Q_CONSUMERS": False}     # the first form: q by the producer, unpadded exchange
        for name, cfg, kw in (("default (padded S exchange, q in the consumers)", {}, {}),
                              ("default, production form (q by kv_insert's pass)", {}, fkw),
                              ("default, production form (q transform in the consumers)", {"Q_PASS": False}, fkw),
                              ("default, inverse RoPE only", {}, rkw),
                              ("default, q transform + inverse RoPE, FMA contraction on (timing probe, not the "
                               "bits)", {"FP_FUSION": True, "Q_PASS": False}, fkw),
                              ("default, inverse RoPE only, FMA contraction on (timing probe)", {"FP_FUSION": True},
                               rkw),
                              ("first form (q by the producer, unpadded exchange)", base, {}),
                              ("full QK in both consumers", {"SPLIT_QK": False}, {}),
                              ("padded exchange only", {"Q_CONSUMERS": False}, {}),
                              ("q in the consumers only", {"SX_PAD": False}, {})):
            if args.quick and cfg:
                continue
            r0 = fref if "q_norm_eps" in kw else sa.sparse_prefill(*a, **kw) if kw else ref
            row(f"sparse_prefill_ws, {name}", SP.sparse_prefill_ws, cfg, kw, r0)


def _row(H, lab, label, fn, cfg, kw, r0, a, flops):
    """One table row: fn(*a, config=cfg, **kw) timed, its relative difference to r0; a failure is a row too."""
    try:
        o = fn(*a, config=cfg, **kw)
        torch.cuda.synchronize()
        rel = ((o.float() - r0.float()).norm() / r0.float().norm()).item()
        us = graph_time(lambda: fn(*a, config=cfg, **kw)) * 1e3
        print(f"| {H} | {lab} | {label} | {us:.0f} | {flops / us / 1e6:.0f} | {FLASHMLA[H]:.0f} | {rel:.1e} |",
              flush=True)
    except Exception as e:          # noqa: BLE001 - reported
        print(f"| {H} | {lab} | {label} | failed: {type(e).__name__}: {str(e)[:300]} | | | |", flush=True)

if __name__ == "__main__":
    main()
