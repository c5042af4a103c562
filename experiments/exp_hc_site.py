"""Experiment: where a decode mHC site's time goes (results: docs/benchmarks-2026-12-06.md, 2026-12-06).
``_hc_fused`` took 8.2-8.5 us alone and 10.0 us as ``hc_post_pre`` in the H100's layer profile for ~1.5 MB
of mixing weights (~0.5 us of bytes). One token, CUDA-graph timed, L2 flushed, us:

* hc_pre (iters 20 / iters 1: the Sinkhorn's share), hc_post_pre without / with the previous hc_post
  (the PRE_POST tile's share), each with the L2 hints (``lib.PREFETCH``) on and off;
* hc_pre over split counts and warps (``config``: the split-K fan-out against the last arriver's
  serial tail);
* the three kernels the fused site replaces (hc_post, hc_pre, rms_norm), one graph.

    PYTHONPATH=. python experiments/exp_hc_site.py [--dims 4096,7168]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import graph_time  # noqa: E402
from dsv4.kernels import lib  # noqa: E402
from dsv4.kernels.mhc import hc_post, hc_post_pre, hc_pre  # noqa: E402
from dsv4.kernels.norm import rms_norm  # noqa: E402


def inputs(D, dev, gen):
    x = torch.randn(1, 4, D, device=dev, generator=gen).bfloat16()
    fn = torch.randn(24, 4 * D, device=dev, generator=gen) * (4 * D) ** -0.5
    base = torch.randn(24, device=dev, generator=gen) * 0.3
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    y = torch.randn(1, D, device=dev, generator=gen).bfloat16()
    post = torch.rand(1, 4, device=dev, generator=gen) * 2
    comb = torch.softmax(torch.randn(1, 4, 4, device=dev, generator=gen), -1)
    w = torch.rand(D, device=dev, generator=gen) + 0.5
    return x, fn, base, scale, y, post, comb, w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="4096,7168")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    us = lambda f: graph_time(f) * 1e3          # noqa: E731
    print("| d | case | L2 hints on us | off us |\n|---|---|---|---|")
    for D in [int(d) for d in args.dims.split(",")]:
        x, fn, base, scale, y, post, comb, w = inputs(D, dev, gen)
        cases = [
            ("hc_pre, iters 20", lambda: hc_pre(x, fn, base, scale, 20)),
            ("hc_pre, iters 1", lambda: hc_pre(x, fn, base, scale, 1)),
            ("hc_post_pre, no hc_post", lambda: hc_post_pre(None, x, None, None, fn, base, scale, w)),
            ("hc_post_pre", lambda: hc_post_pre(y, x, post, comb, fn, base, scale, w)),
            ("hc_post + hc_pre + rms_norm", lambda: rms_norm(hc_pre(hc_post(y, x, post, comb), fn, base, scale)[0],
                                                             w, 1e-6)),
        ]
        for S in (32, 64, 128):
            for nw in (4, 8):
                cfg = {"impl": "fused", "splits": S, "num_warps": nw}
                cases.append((f"hc_pre, {S} splits, {nw} warps", lambda cfg=cfg: hc_pre(x, fn, base, scale, config=cfg)))
        for name, f in cases:
            row = []
            for on in (True, False):
                lib.PREFETCH = on
                row.append(us(f))
            print(f"| {D} | {name} | {row[0]:.1f} | {row[1]:.1f} |", flush=True)
    lib.PREFETCH = lib.PDL_ON


if __name__ == "__main__":
    main()
