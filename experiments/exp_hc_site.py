"""Experiment: where a decode mHC site's time goes (results: docs/benchmarks-2026-12-06.md, 2026-12-06).
``_hc_fused`` took 8.2-8.5 us alone and 10.0 us as ``hc_post_pre`` in the H100's layer profile for ~1.5 MB
of mixing weights (~0.5 us of bytes). One token, CUDA-graph timed, L2 flushed, us:

* hc_pre (iters 20 / iters 1: the Sinkhorn's share), hc_post_pre without / with the previous hc_post
  (the PRE_POST tile's share), each with the L2 hints (``lib.PREFETCH``) on and off;
* hc_pre over split counts and warps (``config``: the split-K fan-out against the last arriver's
  serial tail);
* the three kernels the fused site replaces (hc_post, hc_pre, rms_norm), one graph;
* ``--tokens 2,4,8``: the whole site (``hc_post_pre``) at those row counts on the one-launch fused path
  against the default above ``mhc.FUSED_MAX_T`` (hc_post, the tiled hc_pre's three launches, rms_norm), and
  the fused path's token block of 1 and 2 (the multi-row decode steps: MTP / DSpark verify, small batches).

    PYTHONPATH=. python experiments/exp_hc_site.py [--dims 4096,7168] [--tokens 2,4,8]
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


def inputs(D, dev, gen, T=1):
    x = torch.randn(T, 4, D, device=dev, generator=gen).bfloat16()
    fn = torch.randn(24, 4 * D, device=dev, generator=gen) * (4 * D) ** -0.5
    base = torch.randn(24, device=dev, generator=gen) * 0.3
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    y = torch.randn(T, D, device=dev, generator=gen).bfloat16()
    post = torch.rand(T, 4, device=dev, generator=gen) * 2
    comb = torch.softmax(torch.randn(T, 4, 4, device=dev, generator=gen), -1)
    w = torch.rand(D, device=dev, generator=gen) + 0.5
    return x, fn, base, scale, y, post, comb, w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="4096,7168")
    ap.add_argument("--tokens", default=None, help="row counts: the site fused vs tiled (no one-token cases)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    us = lambda f: graph_time(f) * 1e3          # noqa: E731
    if args.tokens:
        return rows(args, dev, gen, us)
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


def rows(args, dev, gen, us):
    """hc_post_pre at T rows: the default path (tiled above FUSED_MAX_T) against the fused one, token blocks
    of 1 and 2; each fused result checked against the default's (streams equal, normed input within 2 bf16
    ulps: the two paths sum the mix in other orders)."""
    print("| d | T | default (tiled) us | fused, block 1 us | fused, block 2 us |\n|---|---|---|---|---|")
    for D in [int(d) for d in args.dims.split(",")]:
        for T in [int(t) for t in args.tokens.split(",")]:
            x, fn, base, scale, y, post, comb, w = inputs(D, dev, gen, T)
            ref = hc_post_pre(y, x, post, comb, fn, base, scale, w)
            row = [us(lambda: hc_post_pre(y, x, post, comb, fn, base, scale, w))]
            for bt in (1, 2):
                cfg = {"impl": "fused", "block_t": bt}
                got = hc_post_pre(y, x, post, comb, fn, base, scale, w, config=cfg)
                assert torch.equal(got[0], ref[0]), "streams differ"
                assert (got[1].float() - ref[1].float()).abs().max() <= 2 * ref[1].float().abs().max() * 2 ** -8
                assert torch.allclose(got[3], ref[3], atol=1e-5)
                row.append(us(lambda cfg=cfg: hc_post_pre(y, x, post, comb, fn, base, scale, w, config=cfg)))
            print(f"| {D} | {T} | " + " | ".join(f"{v:.1f}" for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
