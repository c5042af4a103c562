"""Experiment: where a prefill compressor launch spends its time, program by program.

Instrumented copies of ``compress_prefill``'s kernels (the same ``_pool_rows`` / ``_entry`` code,
compiled path) read the GPU's ``%globaltimer`` when a program starts, when its pooled vector exists
(i.e. its K / score loads have arrived) and when its entry is stored (HCA: the last-arriving channel
block post-processes). One launch after an L2 flush (fill + read), not in a graph; times relative to
the earliest program start. Entries are checked equal to ``compress_prefill``'s. The timer ticks in
~0.26 us steps on the H200.

    PYTHONPATH=. python experiments/exp_compress_timeline.py [--T 4096,16384]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import gpu_experiment  # noqa: E402
from hotpath import _entry_outputs, _r  # noqa: E402

from dsv4.kernels import compressor as cp  # noqa: E402
from dsv4.kernels.counters import arrival_counters  # noqa: E402

if torch.cuda.is_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _now(dep):
        """%globaltimer (ns) read after ``dep`` [1] exists (a data dependence orders it)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [dep], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def _after(v):
        """A [1] int32 that depends on the float tensor v (for ``_now``)."""
        return (tl.full([1], 0.0, tl.float32) + tl.sum(v.to(tl.float32), axis=0)).to(tl.int32, bitcast=True)

    @triton.jit
    def _stamp(TS, row, t0, t1, t2, flag):
        k = tl.arange(0, 1)
        tl.store(TS + row * 4 + k, t0)
        tl.store(TS + row * 4 + 1 + k, t1)
        tl.store(TS + row * 4 + 2 + k, t2)
        tl.store(TS + row * 4 + 3 + k, tl.zeros([1], tl.int64) + flag)

    @triton.jit
    def _csa_timeline(RK, RS, NORMW, COS, SIN_, OUT, PAGES, PSLOTS, TS, stride_rk, stride_rs, stride_ob,
                      page_size, page_nbytes, eps, C: tl.constexpr, INDEXER: tl.constexpr):
        """``_pref_pool`` fused CSA (one program per entry, chunk from position 0)."""
        i64 = tl.program_id(0).to(tl.int64)
        t0 = _now(tl.full([1], 0, tl.int32) + tl.program_id(0))
        pooled = cp._pool_rows(RK, RS, i64, 0, 0, stride_rk, stride_rs, 4, C, True, C, True)
        t1 = _now(_after(pooled))
        cp._entry(pooled, i64, NORMW, COS, SIN_, OUT, PAGES, PSLOTS, stride_ob, page_size, page_nbytes, eps,
                  C, INDEXER, True, True)
        t2 = _now(_after(tl.load(OUT + i64 * stride_ob + tl.arange(0, 1))))
        _stamp(TS, i64, t0, t1, t2, 1)

    @triton.jit
    def _hca_timeline(RK, RS, POOLED, NORMW, COS, SIN_, OUT, PAGES, PSLOTS, CNT, TS, stride_rk, stride_rs,
                      stride_pb, stride_ob, page_size, page_nbytes, eps, CB: tl.constexpr):
        """``_pref_pool`` HCA (program (entry, channel block); the last arriver post-processes)."""
        C: tl.constexpr = 512
        i64 = tl.program_id(0).to(tl.int64)
        cb = tl.program_id(1)
        t0 = _now(tl.full([1], 0, tl.int32) + tl.program_id(0))
        pooled = cp._pool_rows(RK, RS, i64, 0, cb, stride_rk, stride_rs, 128, C, False, CB, True)
        t1 = _now(_after(pooled))
        tl.store(POOLED + i64 * stride_pb + cb * CB + tl.arange(0, CB), pooled)
        last = 0
        if cp.arrive(CNT + i64) == C // CB - 1:
            x = tl.load(POOLED + i64 * stride_pb + tl.arange(0, C), cache_modifier=".cg")
            cp._entry(x, i64, NORMW, COS, SIN_, OUT, PAGES, PSLOTS, stride_ob, page_size, page_nbytes, eps,
                      C, False, True, True)
            tl.store(CNT + i64, 0)
            last = 1
        t2 = _now(_after(tl.load(OUT + i64 * stride_ob + tl.arange(0, 1))))
        _stamp(TS, i64 * (C // CB) + cb, t0, t1, t2, last)


def _report(label, ts, equal):
    t = ts.cpu().double()
    t0 = t[:, 0].min()
    start, pooled, end = ((t[:, i] - t0) / 1e3 for i in range(3))
    post = t[:, 3] == 1                       # programs that post-processed an entry
    q = torch.tensor([0.1, 0.5, 0.9, 1.0], dtype=torch.float64)

    def qs(v):
        return "/".join(f"{x:.1f}" for x in v.quantile(q).tolist())

    span = float(end.max())
    bins = lambda v: torch.histc(v.float(), bins=12, min=0, max=span).int().tolist()  # noqa: E731
    print(f"| {label} | {len(start)} | {equal} | {span:.1f} | {qs(start)} | {qs(pooled - start)} | {qs(pooled)} | "
          f"{qs((end - pooled)[post])} | {bins(pooled)} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="4096,16384")
    args = ap.parse_args()
    env = gpu_experiment("exp_compress_timeline")
    if env is None:
        return
    dev, gen, _bw = env
    flush = torch.empty(64 << 20, dtype=torch.float32, device=dev)
    print("us from the first program's start; quantiles 10/50/90/100%; histogram: programs whose pooled vector "
          "exists per twelfth of the span")
    print("| kernel | programs | entries equal | span us | start | load (pooled - start) | pooled at | "
          "post-processing (end - pooled) | pooled-at histogram |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in (int(t) for t in args.T.split(",")):
        for label, ratio, indexer, nw in (("CSA main, 2 warps", 4, False, 2), ("CSA indexer, 1 warp", 4, True, 1),
                                          ("HCA main, cb32, 4 warps", 128, False, 4)):
            c = 128 if indexer else 512
            coff = 2 if ratio == 4 else 1
            n = T // ratio
            rk, rs = _r(gen, T, coff * c, dev=dev), _r(gen, T, coff * c, dev=dev)
            w, cos, sin, ps, pages, pslots = _entry_outputs(n, c, ratio, indexer, gen, dev)
            w, pslots = w.float(), pslots.to(torch.int64)
            out = torch.empty(n, c, dtype=torch.bfloat16, device=dev)
            kw = dict(num_warps=nw, enable_fp_fusion=False)
            if ratio == 4:
                ts = torch.zeros(n, 4, dtype=torch.int64, device=dev)

                def launch():
                    _csa_timeline[(n,)](rk, rs, w, cos, sin, out, pages, pslots, ts, rk.stride(0), rs.stride(0),
                                        out.stride(0), ps, pages.shape[1], 1e-6, C=c, INDEXER=indexer, **kw)
            else:
                CB = 32
                ts = torch.zeros(n * (c // CB), 4, dtype=torch.int64, device=dev)
                pooled = torch.empty(n, c, device=dev)
                cnt = arrival_counters(dev, n)

                def launch():
                    _hca_timeline[(n, c // CB)](rk, rs, pooled, w, cos, sin, out, pages, pslots, cnt, ts,
                                                rk.stride(0), rs.stride(0), pooled.stride(0), out.stride(0), ps,
                                                pages.shape[1], 1e-6, CB=CB, **kw)
            for _ in range(3):            # the last of three (compiled, warm clocks)
                flush.fill_(1.0)
                flush.amax()
                torch.cuda.synchronize()
                launch()
                torch.cuda.synchronize()
            ref = cp.compress_prefill(rk, rs, 0, 0, n, w, cos, sin, ratio=ratio, indexer=indexer)
            _report(f"{label}, T={T}", ts, torch.equal(out, ref))


if __name__ == "__main__":
    main()
