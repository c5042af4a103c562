"""Experiment: the compressor kernels (kernels/compressor.py) over launch shapes, optionally next to
another version of the module. Prefill (``compress_prefill``, one T-token chunk from position 0):
fused vs two-kernel, channel block, warps per program; decode (``compress_decode``, B tokens that all
complete a window): the default launch. L2 flushed, CUDA-graph timed; % = the fewest HBM bytes (the
K / score rows read once, entries and cache bytes written) / time vs the copy rate.

    PYTHONPATH=. python experiments/exp_compress_prefill.py [--T 4096,16384] [--B 256,1024]
        [--baseline FILE] [--rounds R]

``--baseline FILE``: a copy of compressor.py with absolute imports (e.g. ``git show
REV:dsv4/kernels/compressor.py | sed 's/from \\. import/from dsv4.kernels import/; s/from \\.\\([a-z]\\)/from
dsv4.kernels.\\1/; s/from \\.\\./from dsv4./'``); its default launch is timed as the row "baseline" and
every row's max diff is taken against it. Each prefill case also times plain reads of the same number
of bytes ("read-only reference": a Triton sum of 8 / 32 KB blocks, and ``torch.amax``), and the run
starts with an empty Triton kernel: the fixed cost of one launch as this timing method counts it.
``--rounds R`` times each case's rows R times, in a new random order per round, and prints the median
(the H200's clock drifts between back-to-back timings).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import gpu_experiment, graph_time  # noqa: E402
from hotpath import _entry_outputs, _r  # noqa: E402

from dsv4.kernels import compressor as cp  # noqa: E402

# (label, ratio, indexer) -> prefill variants (name, compress_prefill keywords); the first is the default
VARIANTS = {
    ("CSA main", 4, False): [("fused 2w (default)", {}), ("fused 4w", dict(num_warps=4)),
                             ("fused 1w", dict(num_warps=1))],
    ("CSA indexer", 4, True): [("fused 1w (default)", {}), ("fused 2w", dict(num_warps=2))],
    ("HCA main", 128, False): [("cb32 4w (default)", {}), ("cb32 2w", dict(num_warps=2)),
                               ("cb64 4w", dict(block_c=64)), ("cb16 4w", dict(block_c=16))],
}


if torch.cuda.is_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(X):
        tl.store(X, 0.0)

    @triton.jit
    def _read_sum(X, OUT, BLOCK: tl.constexpr):
        """Plain streaming read: program i sums X[i*BLOCK : (i+1)*BLOCK] (16-byte loads) into OUT[i]."""
        i = tl.program_id(0).to(tl.int64)
        tl.store(OUT + i, tl.sum(tl.load(X + i * BLOCK + tl.arange(0, BLOCK)), axis=0))


def _read_refs(nbytes, dev):
    """(name, call) pairs that only read ~nbytes: torch.amax and a Triton streaming sum of 8 / 32 KB blocks."""
    buf = torch.ones(nbytes // 4, device=dev)
    refs = [("read-only reference: torch.amax, same bytes", lambda: buf.amax()[None])]
    for block in (2048, 8192):
        n = buf.numel() // block
        part = torch.empty(n, device=dev)
        refs.append((f"read-only reference: Triton sum of {block * 4 // 1024} KB blocks, same bytes",
                     lambda block=block, n=n, part=part: (_read_sum[(n,)](buf, part, BLOCK=block, num_warps=4),
                                                          part[:1])[1]))
    return refs


def _load_baseline(path):
    spec = importlib.util.spec_from_file_location("compressor_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(name_calls, nbytes, copy_bw, rounds, rng):
    """Time every (name, call) `rounds` times in shuffled order; -> [(name, median us, % of copy, diff)]
    (diff: max abs difference to the first call's output; "-" for outputs of another shape, the reads)."""
    ref = name_calls[0][1]()
    diffs, times, live = {}, {}, []
    for name, call in name_calls:
        try:
            got = call()
            diffs[name] = (got.float() - ref.float()).abs().max().item() if got.shape == ref.shape else "-"
            times[name] = []
            live.append((name, call))
        except Exception as ex:     # a launch shape that does not compile is reported, the sweep goes on
            diffs[name] = f"failed: {type(ex).__name__}: {str(ex)[:100]}"
    for _ in range(rounds):
        order = list(live)
        rng.shuffle(order)
        for name, call in order:
            times[name].append(graph_time(call))
    out = []
    for name, _call in name_calls:
        if name not in times:
            out.append((name, None, None, diffs[name]))
            continue
        ms = statistics.median(times[name])
        out.append((name, ms * 1e3, 100 * nbytes / (ms * 1e-3) / copy_bw, diffs[name]))
    return out


def _print_rows(kind, label, size, rows):
    for name, us, pct, diff in rows:
        cell = f"{us:.1f} | {pct:.0f}" if us is not None else " | "
        print(f"| {kind} {label} | {size} | {name} | {cell} | {diff if isinstance(diff, str) else f'{diff:.1e}'} |",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="4096,16384")
    ap.add_argument("--B", default="256,1024", help="decode batch sizes ('' = no decode rows)")
    ap.add_argument("--baseline", default=None, help="compressor.py copy (absolute imports) to time beside")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    env = gpu_experiment("exp_compress_prefill")
    if env is None:
        return
    dev, gen, copy_bw = env
    base = _load_baseline(args.baseline) if args.baseline else None
    rng = random.Random(0)
    sink = torch.zeros(1, device=dev)
    print(f"empty Triton kernel: {graph_time(lambda: _empty[(1,)](sink)) * 1e3:.1f} us per call "
          f"(same timing method: CUDA graph, L2 flushed, flush subtracted)")
    print(f"| case | T / B | variant | us (median of {args.rounds}) | % of copy | max diff vs first row |")
    print("|---|---|---|---|---|---|")
    for (label, ratio, indexer), variants in VARIANTS.items():
        c = 128 if indexer else 512
        coff = 2 if ratio == 4 else 1
        for T in (int(t) for t in args.T.split(",") if t):
            n = T // ratio
            rows_k, rows_s = _r(gen, T, coff * c, dev=dev), _r(gen, T, coff * c, dev=dev)
            w, cos, sin, ps, pages, pslots = _entry_outputs(n, c, ratio, indexer, gen, dev)
            nbytes = T * 2 * coff * c * 4 + n * (2 * c + (68 if indexer else 584))
            calls = [("baseline", base, {})] if base else []
            calls += [(name, cp, kw) for name, kw in variants]
            name_calls = [(name, lambda mod=mod, kw=kw: mod.compress_prefill(
                rows_k, rows_s, 0, 0, n, w, cos, sin, pages=pages, page_slots=pslots, page_size=ps, ratio=ratio,
                indexer=indexer, **kw)) for name, mod, kw in calls]
            name_calls += _read_refs(nbytes, dev)
            _print_rows("prefill", label, T, _rows(name_calls, nbytes, copy_bw, args.rounds, rng))
        for B in (int(b) for b in args.B.split(",") if b):
            state = _r(gen, B, coff * ratio, 2 * coff * c, dev=dev)
            slots = torch.randperm(B, generator=gen, device=dev)
            pos = torch.randint(1, 1 << 18, (B,), generator=gen, device=dev) * ratio - 1   # all complete
            k, s = _r(gen, B, coff * c, dev=dev), _r(gen, B, coff * c, dev=dev)
            w, cos, sin, ps, pages, pslots = _entry_outputs(B, c, ratio, indexer, gen, dev)
            nr = coff * ratio
            nbytes = B * (2 * coff * c * 4 * 2 + (nr - 1) * 2 * c * 4 + 2 * c + (68 if indexer else 584) + 300)
            mods = ([("baseline", base)] if base else []) + [("default", cp)]
            name_calls = [(name, lambda mod=mod: mod.compress_decode(
                state, slots, pos, k, s, w, cos, sin, pages=pages, page_slots=pslots, page_size=ps, ratio=ratio,
                indexer=indexer)[0]) for name, mod in mods]
            _print_rows("decode", label, B, _rows(name_calls, nbytes, copy_bw, args.rounds, rng))


if __name__ == "__main__":
    main()
