#!/usr/bin/env python3
"""Hot-path kernels II on the GPU (dsv4/kernels/mhc.py, compressor.py, indexer.py) next to their
plain-PyTorch twins and the roofline measured in the same run (device copy bandwidth, dense bf16
matmul rate).

    PYTHONPATH=. python benchmarks/hotpath.py --out results.md      # full run (H200: ~1 min)
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/hotpath.py --smoke   # CPU: code paths only

Counting: bytes = the fewest HBM bytes of the operation (each input read once, each output written
once); floor = max(bytes / copy rate, FLOPs / bf16 matmul rate); '% of floor' = floor / time (the
'>= 70% of HBM bandwidth' target for the memory-bound kernels). Times: GPU time per call from
CUDA-graph replays with the L2 flushed (``common.flush_mode``) before every call, flush time subtracted, so
launch gaps inside a graph count but host overhead does not; the PyTorch twin is timed the same way
(eager do_bench where it cannot be captured). The markdown table is printed last and written to
``--out``; add it to a dated ``docs/benchmarks-<date>.md`` note and update BENCHMARKS.md's current table by hand.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from common import flush_mode, graph_time, roofline  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dsv4.kernels import compressor as cp  # noqa: E402
from dsv4.kernels import indexer as ix  # noqa: E402
from dsv4.kernels import interpreting  # noqa: E402
from dsv4.kernels import mhc  # noqa: E402
from dsv4.twins import compressor as cp_twin  # noqa: E402
from dsv4.twins import indexer as ix_twin  # noqa: E402
from dsv4.twins import mhc as mhc_twin  # noqa: E402
from dsv4.formats.kv_entry import page_bytes  # noqa: E402

MODELS = {"Flash": 4096, "Pro": 7168}


def log(*a):
    print(*a, flush=True)


class Timer:
    def __init__(self, smoke):
        self.smoke = smoke

    def eager(self, fn) -> float:
        if self.smoke:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing
        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")

    def graph(self, fn, reps: int = 8) -> tuple[float, str]:
        """(ms per call, 'graph' | 'eager'): ``common.graph_time`` (CUDA graph, L2 flushed before
        every call), eager ``do_bench`` where fn cannot be captured (a host sync in a twin)."""
        if self.smoke:
            return self.eager(fn), "eager"
        try:
            return graph_time(fn, reps), "graph"
        except Exception as e:
            torch.cuda.synchronize()
            log(f"    (graph capture failed: {type(e).__name__}: {str(e)[:80]}; eager timing)")
            return self.eager(fn), "eager"


def relerr(a, b):
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    if not fin.any():
        return 0.0
    return float((a[fin] - b[fin]).norm() / b[fin].norm().clamp(min=1e-30))


# ------------------------------------------------------------------------------------------ cases
# Each generator yields (name, rows, triton fn, torch twin fn | None (config sweep), bytes, flops).
# Inputs are drawn on the device (fresh random data, never zeros).

def _r(gen, *shape, dev):
    return torch.randn(*shape, generator=gen, device=dev)


def mhc_cases(dev, gen, smoke, sweep=False):
    Ts = [2] if smoke else [256, 64, 1, 4096]
    for name, d in MODELS.items():
        if smoke:
            d = 256
        for T in Ts:
            if sweep and (T not in (256, 4096) or name != "Flash" or smoke):
                continue
            x = (_r(gen, T, 4, d, dev=dev) * 2).bfloat16()
            fn = _r(gen, 24, 4 * d, dev=dev) * (4 * d) ** -0.5
            base = _r(gen, 24, dev=dev) * 0.5
            scale = torch.rand(3, generator=gen, device=dev) + 0.5
            fh, bh, sh = fn[:4].contiguous(), base[:4].contiguous(), scale[:1].contiguous()
            y = _r(gen, T, d, dev=dev).bfloat16()
            _, post, comb = mhc_twin.hc_pre(x, fn, base, scale)
            xb = T * 4 * d * 2
            pre_bytes, pre_flops = xb + 24 * 4 * d * 4 + T * d * 2 + T * 80, 2 * T * 4 * d * 24
            post_bytes = T * d * 2 + 2 * xb + T * 80
            if sweep:
                other = "ieee" if mhc.DEFAULT_MODE == "bf16x3" else "bf16x3"
                for cfg in ({"mode": other}, {"mode": "bf16x3", "block_t": 16 if T > 256 else 64},
                            {"mode": "bf16x3", "block_t": 32}):
                    yield (f"hc_pre {name} d{d} {cfg}", T, lambda cfg=cfg: mhc.hc_pre(x, fn, base, scale, config=cfg),
                           None, pre_bytes, pre_flops)
                yield (f"hc_head {name} d{d} {other}", T,
                       lambda: mhc.hc_head(x, fh, bh, sh, config={"mode": other}), None,
                       xb + 4 * 4 * d * 4 + T * d * 2, 2 * T * 4 * d * 4)
                if T != 256:
                    continue
                for bd, nw in ((512, 4), (2048, 8)):
                    yield (f"hc_post {name} d{d} block_d={bd} warps={nw}", T,
                           lambda bd=bd, nw=nw: mhc.hc_post(y, x, post, comb, block_d=bd, num_warps=nw),
                           None, post_bytes, 0)
                continue
            yield (f"hc_pre {name} d{d}", T, lambda: mhc.hc_pre(x, fn, base, scale),
                   lambda: mhc_twin.hc_pre(x, fn, base, scale), pre_bytes, pre_flops)
            yield (f"hc_post {name} d{d}", T, lambda: mhc.hc_post(y, x, post, comb),
                   lambda: mhc_twin.hc_post(y, x, post, comb), post_bytes, 0)
            yield (f"hc_head {name} d{d}", T, lambda: mhc.hc_head(x, fh, bh, sh),
                   lambda: mhc_twin.hc_head(x, fh, bh, sh), xb + 4 * 4 * d * 4 + T * d * 2, 2 * T * 4 * d * 4)


def _entry_outputs(n, c, ratio, indexer, gen, dev):
    """Norm weight, RoPE rows and a paged cache with n random slots for n compressed entries."""
    w = (torch.rand(c, generator=gen, device=dev) + 0.5).bfloat16()
    ang = torch.rand(n, 32, generator=gen, device=dev) * 100
    ps = 256 // ratio
    n_pages = n // ps + 2
    pages = torch.zeros(n_pages, ps * 68 if indexer else page_bytes(ps), dtype=torch.uint8, device=dev)
    pslots = torch.randperm(n_pages * ps, generator=gen, device=dev)[:n]
    return w, ang.cos(), ang.sin(), ps, pages, pslots


def comp_cases(dev, gen, smoke, sweep=False):
    Bs = [3] if smoke else [256, 64, 1024]
    for label, ratio, indexer in (("CSA main", 4, False), ("CSA indexer", 4, True), ("HCA main", 128, False)):
        c = 128 if indexer else 512
        coff = 2 if ratio == 4 else 1
        for B in Bs:
            if sweep and (smoke or B != 256 or ratio != 4):
                continue
            state = _r(gen, B, coff * ratio, 2 * coff * c, dev=dev)
            slots = torch.randperm(B, generator=gen, device=dev)
            pos = torch.randint(1, 1 << 18, (B,), generator=gen, device=dev) * ratio - 1   # all complete
            k = _r(gen, B, coff * c, dev=dev)
            s = _r(gen, B, coff * c, dev=dev)
            w, cos, sin, ps, pages, pslots = _entry_outputs(B, c, ratio, indexer, gen, dev)
            kw = dict(ratio=ratio, indexer=indexer)
            nr = coff * ratio
            # inputs k, s + ring row write + the other pooled rows (K and score halves) + entry + page write
            nbytes = B * (2 * coff * c * 4 * 2 + (nr - 1) * 2 * c * 4 + 2 * c + (68 if indexer else 584) + 300)
            if sweep:   # the other kernel layout (main: two kernels; indexer: fused, 4 and 8 warps)
                alts = [("two-kernel path", dict(fused=False, block_c=c // 4))] if c == 512 else \
                    [(f"fused, {nw} warps", dict(fused=True, block_c=c, fused_warps=nw)) for nw in (4, 8)]
                for lab, akw in alts:
                    yield (f"compress {label} (c{c}, m{ratio}), all rows complete, {lab}", B,
                           lambda akw=akw: cp.compress_decode(state, slots, pos, k, s, w, cos, sin, pages=pages,
                                                              page_slots=pslots, page_size=ps, **akw, **kw),
                           None, nbytes, 0)
                continue
            yield (f"compress {label} (c{c}, m{ratio}), all rows complete", B,
                   lambda: cp.compress_decode(state, slots, pos, k, s, w, cos, sin, pages=pages, page_slots=pslots,
                                              page_size=ps, **kw),
                   lambda: cp_twin.compress_decode(state, slots, pos, k, s, w, cos, sin, **kw), nbytes, 0)


def comp_prefill_cases(dev, gen, smoke):
    """compress_prefill over one T-token chunk starting at 0: every window of the chunk pooled,
    post-processed and written; bytes = the K / score rows read once + entries + page bytes."""
    for label, ratio, indexer in (("CSA main", 4, False), ("CSA indexer", 4, True), ("HCA main", 128, False)):
        c = 128 if indexer else 512
        coff = 2 if ratio == 4 else 1
        for T in ([256] if smoke else [4096, 16384]):
            n = T // ratio
            rows_k, rows_s = _r(gen, T, coff * c, dev=dev), _r(gen, T, coff * c, dev=dev)
            w, cos, sin, ps, pages, pslots = _entry_outputs(n, c, ratio, indexer, gen, dev)
            kw = dict(ratio=ratio, indexer=indexer)
            nbytes = T * 2 * coff * c * 4 + n * (2 * c + (68 if indexer else 584))
            yield (f"compress prefill {label} (c{c}, m{ratio}), T={T}", n,
                   lambda: cp.compress_prefill(rows_k, rows_s, 0, 0, n, w, cos, sin, pages=pages, page_slots=pslots,
                                               page_size=ps, **kw),
                   lambda: cp_twin.compress_prefill(rows_k, rows_s, 0, 0, n, w, cos, sin, **kw), nbytes, 0)


def _score_case(B, N, gen, dev, H=64):
    nb = B * N // 64
    pages = torch.randint(0, 256, (nb, 64 * 68), dtype=torch.uint8, generator=gen, device=dev)
    pages[:, 64 * 64:] = torch.randint(118, 127, (nb, 256), dtype=torch.uint8, generator=gen, device=dev)
    bt = torch.randperm(nb, generator=gen, device=dev).view(B, N // 64).int()
    pos = torch.full((B,), 4 * N - 1, dtype=torch.int64, device=dev)
    q = ix_twin.index_q_prologue(_r(gen, B, H, 128, dev=dev).bfloat16(), torch.ones(B, 32, device=dev),
                                  torch.zeros(B, 32, device=dev))
    w = (_r(gen, B, H, dev=dev) * 0.1).bfloat16()
    return q, w, pages, bt, pos


def topk_cases(dev, gen, smoke, sweep=False):
    cases = [(2, 5000, 64)] if smoke else [(1, 262144, 512), (1, 262144, 1024), (1, 262144, 2048),
                                           (64, 16384, 512), (128, 65536, 1024), (1, 2048, 512),
                                           (1, 4096, 512), (64, 2048, 512), (64, 4096, 512)]
    for B, N, k in cases:
        if sweep and (smoke or B != 1):
            continue
        sc = _r(gen, B, N, dev=dev).bfloat16()
        nbytes = B * N * 2 + B * k * 4
        if sweep:
            variants = ({"chunked": dict(single_max=0)} if N <= ix.SINGLE_MAX else
                        {"chunks=64": dict(chunks=64), "chunks=256": dict(chunks=256),
                         "sort in kernel": dict(sort_max=2048), "rank launch": dict(sort_max=0)})
            for name, kw in variants.items():
                yield (f"top-k k={k} over N={N} {name}", B, lambda kw=kw: ix.index_topk(sc, k, **kw),
                       None, nbytes, 0)
            continue
        yield (f"top-k k={k} over N={N}", B, lambda: ix.index_topk(sc, k), lambda: ix_twin.index_topk(sc, k),
               nbytes, 0)


def index_cases(dev, gen, smoke, sweep=False):
    H = 64
    for B, N in ([(2, 256)] if smoke else [(1, 262144), (64, 16384), (128, 4096)]):
        if sweep and (smoke or B != 1):
            continue
        q, w, pages, bt, pos = _score_case(B, N, gen, dev, H)
        nbytes, flops = B * N * (68 + 2) + B * H * 256, 2 * B * N * H * 128
        if sweep:
            for tpp, nw, dr in ((1, 4, True), (4, 8, True), (1, 4, False), (4, 8, False)):
                yield (f"indexer scores (64 heads, MXFP4 keys, N={N}) pages/program={tpp} warps={nw} direct={dr}", B,
                       lambda tpp=tpp, nw=nw, dr=dr: ix.index_scores(q, w, pages, bt, pos, pages_per_program=tpp,
                                                                     num_warps=nw, direct=dr), None, nbytes, flops)
            continue
        yield (f"indexer scores (64 heads, MXFP4 keys, N={N})", B, lambda: ix.index_scores(q, w, pages, bt, pos),
               lambda: ix_twin.index_scores(q, w, pages, bt, pos), nbytes, flops)
    for T in ([3] if smoke else [128, 4096]):
        if sweep and smoke:
            continue
        q = (_r(gen, T, H, 128, dev=dev) * 2).bfloat16()
        ang = torch.rand(T, 32, generator=gen, device=dev) * 100
        cos, sin = ang.cos(), ang.sin()
        if sweep:      # the default takes 64 heads a program from 128 tokens and the loaded Hadamard operand
            yield ("indexer q prologue (64 heads) 16 heads/program", T,
                   lambda: ix.index_q_prologue(q, cos, sin, heads_per_program=16), None,
                   2 * T * H * 128 * 2 + T * 256, 0)
            yield ("indexer q prologue (64 heads) Hadamard operand built in the kernel", T,
                   lambda: ix.index_q_prologue(q, cos, sin, load_h=False), None, 2 * T * H * 128 * 2 + T * 256, 0)
            continue
        yield ("indexer q prologue (64 heads)", T, lambda: ix.index_q_prologue(q, cos, sin),
               lambda: ix_twin.index_q_prologue(q, cos, sin), 2 * T * H * 128 * 2 + T * 256, 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter ok")
    ap.add_argument("--out", default=None, help="write the markdown section here")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated substrings: run only matching cases")
    ap.add_argument("--mhc-mode", default=None, choices=["ieee", "bf16x3"], help="mix GEMM mode of the main rows")
    args = ap.parse_args()
    if args.mhc_mode:
        mhc.DEFAULT_MODE = args.mhc_mode
    smoke = args.smoke or interpreting()
    dev = torch.device("cpu" if interpreting() else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    timer = Timer(smoke)
    copy_bw, mm_rate = roofline(dev, smoke, mm_reps=100)
    log(f"roofline: copy {copy_bw / 1e12:.2f} TB/s (read+write), bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s")
    rows = []
    phases = [lambda: topk_cases(dev, gen, smoke), lambda: mhc_cases(dev, gen, smoke),
              lambda: comp_cases(dev, gen, smoke), lambda: comp_prefill_cases(dev, gen, smoke),
              lambda: index_cases(dev, gen, smoke),
              lambda: topk_cases(dev, gen, smoke, sweep=True), lambda: mhc_cases(dev, gen, smoke, sweep=True),
              lambda: comp_cases(dev, gen, smoke, sweep=True), lambda: index_cases(dev, gen, smoke, sweep=True)]
    for phase in phases:
        for name, n, fn_tr, fn_ref, nbytes, flops in phase():
            if args.only and not any(o in name for o in args.only.split(",")):
                continue
            try:
                out_tr = fn_tr()
                err, t_ref, how_ref = float("nan"), float("nan"), "-"
                if fn_ref is not None:
                    out_ref = fn_ref()
                    a = out_tr[0] if isinstance(out_tr, tuple) else out_tr
                    b = out_ref[0] if isinstance(out_ref, tuple) else out_ref
                    if a.dtype in (torch.int32, torch.int64):
                        err = float((a.long() != b.long()).float().mean())
                    else:
                        err = relerr(a, b)
                t_tr, how_tr = timer.graph(fn_tr)
                if fn_ref is not None:
                    t_ref, how_ref = timer.graph(fn_ref)
            except Exception as e:  # report and go on
                log(f"{name} n={n}: FAILED {type(e).__name__}: {e}")
                rows.append(dict(name=name, n=n, error=f"{type(e).__name__}: {str(e)[:100]}"))
                torch.cuda.synchronize() if dev.type == "cuda" else None
                continue
            floor_ms = max(nbytes / copy_bw, flops / mm_rate) * 1e3
            r = dict(name=name, n=n, us=t_tr * 1e3, how=how_tr, torch_us=t_ref * 1e3, torch_how=how_ref,
                     bytes=nbytes, flops=flops, gbps=nbytes / (t_tr * 1e-3) / 1e9, floor_us=floor_ms * 1e3,
                     pct=floor_ms / t_tr * 100, err=err,
                     bound="mem" if nbytes / copy_bw >= flops / mm_rate else "mma")
            rows.append(r)
            report(rows, copy_bw, mm_rate, dev, args)
            log(f"{name:60s} n={n:6d}: {r['us']:9.1f} us ({how_tr}) {r['gbps']:7.0f} GB/s  floor {r['floor_us']:7.1f} us "
                f"({r['pct']:5.1f}%)  torch {r['torch_us']:9.1f} us ({how_ref})  err {err:.1e}")
    print(report(rows, copy_bw, mm_rate, dev, args))


def report(rows, copy_bw, mm_rate, dev, args):
    """Markdown section (written to --out / --json after every row, so a timeout keeps the rows done)."""
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)"
    import triton
    L = [f"## Hot-path kernels II: mHC, compressor decode update, indexer (dsv4/kernels), "
         f"{datetime.date.today().isoformat()}, {gpu}", "",
         f"Command: `PYTHONPATH=. python benchmarks/hotpath.py`; torch {torch.__version__}, triton {triton.__version__}. "
         f"Roofline measured in this run: copy {copy_bw / 1e12:.2f} TB/s (read+write), dense bf16 matmul "
         f"{mm_rate / 1e12:.0f} TFLOP/s; floor = max(bytes / copy rate, FLOPs / matmul rate) with the fewest HBM "
         f"bytes of the operation. Times: GPU time per call from CUDA-graph replays, L2 flushed "
         f"({flush_mode()}) before every call (flush subtracted). PyTorch = the torch twin (reference numerics) "
         f"timed the same way. "
         f"err = relative L2 error vs the twin (top-k: fraction of differing indices).", "",
         "| kernel | rows (T / B) | Triton us | GB/s | floor us | % of floor | PyTorch us | speedup | err |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" not in r and r["torch_how"] == "-":
            continue
        if "error" in r:
            L.append(f"| {r['name']} | {r['n']} | FAILED: {r['error']} | | | | | | |")
            continue
        L.append(f"| {r['name']} | {r['n']} | {r['us']:.1f} | {r['gbps']:.0f} | {r['floor_us']:.1f} ({r['bound']}) | "
                 f"{r['pct']:.0f}% | {r['torch_us']:.1f}{'' if r['torch_how'] == 'graph' else ' (eager)'} | "
                 f"{r['torch_us'] / r['us']:.1f}x | {r['err']:.1e} |")
    sw = [r for r in rows if "error" not in r and r["torch_how"] == "-"]
    if sw:
        L += ["", "<details><summary>config sweep (defaults in the table above)</summary>", "",
              "| kernel / config | rows | Triton us | GB/s | % of floor |", "|---|---|---|---|---|"]
        L += [f"| {r['name']} | {r['n']} | {r['us']:.1f} | {r['gbps']:.0f} | {r['pct']:.0f}% |" for r in sw]
        L += ["", "</details>"]
    text = "\n".join(L) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy_bw=copy_bw, mm_rate=mm_rate, rows=rows), indent=1))
    return text


if __name__ == "__main__":
    main()
