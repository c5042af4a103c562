"""Experiment: the prefill compressor (kernels/compressor.py ``compress_prefill``) over launch shapes:
fused vs two-kernel, channel block, warps per program. L2 flushed, CUDA-graph timed; % = the fewest
HBM bytes (the K / score rows read once, entries and cache bytes written) / time vs the copy rate.

    PYTHONPATH=. python benchmarks/exp_compress_prefill.py [--T 4096,16384]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import gpu_experiment, graph_time  # noqa: E402
from hotpath import _entry_outputs, _r  # noqa: E402

from dsv4.kernels import compressor as cp  # noqa: E402

# (label, ratio, indexer) -> variants (name, compress_prefill keywords)
VARIANTS = {
    ("CSA main", 4, False): [("fused 8w (default)", {}), ("fused 4w", dict(num_warps=4)),
                             ("fused 16w", dict(num_warps=16)), ("fused 2w", dict(num_warps=2))],
    ("CSA indexer", 4, True): [("fused 4w (default)", {}), ("fused 1w", dict(num_warps=1)),
                               ("fused 2w", dict(num_warps=2)), ("fused 8w", dict(num_warps=8))],
    ("HCA main", 128, False): [("two-kernel cb32 4w (default)", {}), ("cb32 8w", dict(num_warps=8)),
                               ("cb16 4w", dict(block_c=16)), ("cb64 4w", dict(block_c=64)),
                               ("cb64 8w", dict(block_c=64, num_warps=8)), ("cb8 2w", dict(block_c=8, num_warps=2))],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="4096,16384")
    args = ap.parse_args()
    env = gpu_experiment("exp_compress_prefill")
    if env is None:
        return
    dev, gen, copy_bw = env
    print("| case | T | variant | us | % of copy | max diff vs default |")
    print("|---|---|---|---|---|---|")
    for (label, ratio, indexer), variants in VARIANTS.items():
        c = 128 if indexer else 512
        coff = 2 if ratio == 4 else 1
        for T in (int(t) for t in args.T.split(",")):
            n = T // ratio
            rows_k, rows_s = _r(gen, T, coff * c, dev=dev), _r(gen, T, coff * c, dev=dev)
            w, cos, sin, ps, pages, pslots = _entry_outputs(n, c, ratio, indexer, gen, dev)
            nbytes = T * 2 * coff * c * 4 + n * (2 * c + (68 if indexer else 584))
            ref = None
            for name, kw in variants:
                def call(kw=kw):
                    return cp.compress_prefill(rows_k, rows_s, 0, 0, n, w, cos, sin, pages=pages, page_slots=pslots,
                                               page_size=ps, ratio=ratio, indexer=indexer, **kw)
                try:
                    out = call()
                    ref = out if ref is None else ref
                    diff = (out.float() - ref.float()).abs().max().item()
                    ms = graph_time(call)
                    print(f"| {label} | {T} | {name} | {ms * 1e3:.1f} | {100 * nbytes / (ms * 1e-3) / copy_bw:.0f} | "
                          f"{diff:.1e} |", flush=True)
                except Exception as ex:     # a launch shape that does not compile is reported, the sweep goes on
                    print(f"| {label} | {T} | {name} | failed: {type(ex).__name__}: {str(ex)[:120]} | | |", flush=True)


if __name__ == "__main__":
    main()
