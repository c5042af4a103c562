"""Shared benchmark pieces: the roofline measured in the same run as the kernels."""
from __future__ import annotations

import os

import torch


def roofline(dev, smoke, mm_reps: int = 200):
    """(copy bandwidth B/s counting read + write, dense bf16 matmul FLOP/s) of this GPU."""
    if smoke:
        return 1e12, 1e14
    import triton.testing
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    a.random_(0, 255)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=100, return_mode="median")
    copy_bw = 2 * n / (ms * 1e-3)
    del a, b
    m = 8192
    x = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: x @ y, warmup=20, rep=mm_reps, return_mode="median")
    mm = 2 * m ** 3 / (ms * 1e-3)
    del x, y
    torch.cuda.empty_cache()
    return copy_bw, mm


def fp8_peak(dev, timer, size: int = 8192) -> float:
    """FP8 FLOP/s of ``torch._scaled_mm`` (e4m3, per-tensor scales) on size^3 with ``timer`` (fn -> ms):
    the peak the FP8 GEMMs are compared with."""
    a = torch.randn(size, size, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    t = timer(lambda: torch._scaled_mm(a, b.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * size ** 3 / (t * 1e-3)


_FLUSH = None
_FLUSH_READ = None


def flush_mode() -> str:
    """How ``graph_time`` empties the L2 before each call (env ``DSV4_BENCH_FLUSH``): ``read`` (default:
    a 256 MB zero fill, then a 256 MB read, so L2 holds clean lines, as after Nsight Compute's cache
    invalidation) or ``write`` (the fill alone, sessions 1-8: its last ~50 MB stay dirty in L2 and
    the timed kernel also pays their write-back, up to ~10 us of HBM time that is not its own;
    docs/benchmarks-2026-11-30.md, session 9, has both)."""
    mode = os.environ.get("DSV4_BENCH_FLUSH", "read")
    if mode not in ("write", "read"):
        raise ValueError(f"DSV4_BENCH_FLUSH must be 'write' or 'read', got {mode!r}")
    return mode


def graph_time(fn, reps=3):
    """GPU ms of fn from CUDA-graph replays with the L2 flushed before every call (``flush_mode``;
    the flush timed alone in its own graph and subtracted): no call finds weights left in L2 by
    the previous one, and no host launch overhead is counted."""
    global _FLUSH, _FLUSH_READ
    if not torch.cuda.is_available():       # smoke run (CPU interpreter): runs, does not time
        fn()
        return float("nan")
    import triton.testing
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        _FLUSH_READ = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")
    read = flush_mode() == "read"

    def flush():
        _FLUSH.zero_()
        if read:
            torch.amax(_FLUSH_READ)

    def capture(body):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                flush()
                body()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                flush()
                body()
        t = triton.testing.do_bench(g.replay, warmup=5, rep=100, return_mode="median") / reps
        del g
        return t
    return max(capture(fn) - capture(lambda: None), 1e-6)


def eager_ms(fn) -> float:
    """Median ms of eager calls of ``fn`` (``triton.testing.do_bench``: host time included where the
    GPU waits on it); on a CPU one call, and NaN."""
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=60, return_mode="median")


def gpu_experiment(script: str, why: str = ""):
    """(device, seeded generator, copy bandwidth) for a GPU-only experiment, the copy bandwidth printed;
    None (after saying so) without a GPU."""
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU{f' ({why})' if why else ''}")
        return None
    dev = "cuda"
    copy_bw, _ = roofline(dev, False)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    return dev, torch.Generator(device=dev).manual_seed(0), copy_bw


GEMV_MAX_ROWS = 4     # rows up to which the benchmarks sweep the decode GEMV


def fp8_gemm(xq, xs, w, ws, config=None):
    """The FP8 GEMM the benchmarks time: routed (``kernels.gemm.linear``) without ``config``, else the
    tile kernel with it."""
    from dsv4.kernels.gemm import fp8 as G8
    from dsv4.kernels.gemm import linear as GL
    return GL.fp8_gemm(xq, xs, w, ws) if config is None else G8.fp8_gemm(xq, xs, w, ws, config=config)


def fp8_linear(x, w, ws, config=None, gemv=False):
    """The FP8 linear the benchmarks time: routed without ``config``; with it the tile kernel (the
    quantisation fused in its prologue up to 64 rows, a separate act quant above) or, with ``gemv``,
    the CUDA-core GEMV."""
    from dsv4.kernels.gemm import fp8 as G8
    from dsv4.kernels.gemm import gemv as V
    from dsv4.kernels.gemm import linear as GL
    if config is None and not gemv:
        return GL.fp8_linear(x, w, ws)
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K).to(torch.bfloat16).contiguous()
    if gemv:
        y = V.fp8_gemv(x2, w, ws, config=config)
    elif x2.shape[0] <= 64:
        y = G8.fp8_gemm_bf16(x2, w, ws, config=config)
    else:
        y = G8.fp8_gemm(*G8.act_quant_fp8(x2), w, ws, config=config)
    return y.reshape(*x.shape[:-1], N)


def kernel_totals(prof) -> dict[str, tuple[int, float]]:
    """{CUDA kernel name: (launches, GPU us)} of a finished ``torch.profiler.profile``."""
    agg: dict[str, tuple[int, float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, t = agg.get(e.name, (0, 0.0))
            agg[e.name] = (n + 1, t + (getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)))
    return agg
