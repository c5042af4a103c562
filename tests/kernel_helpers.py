"""Shared pieces of the kernel test files: the offline (AOT) compile runner and the GPU guard."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def aot_caps() -> tuple[int, ...]:
    """The compute capabilities an AOT script compiles for: ``run_aot_script``'s share (DSV4_AOT_CAPS),
    else 90 and 100."""
    return tuple(int(c) for c in os.environ.get("DSV4_AOT_CAPS", "90,100").split(","))


def run_aot_script(script: str, repo, timeout: int = 900, **env_extra: str) -> None:
    """Run a kernel file's AOT script (it compiles for GPUTarget('cuda', 90|100, 32)) in a fresh
    interpreter with TRITON_INTERPRET=0; skip when this triton or machine cannot compile offline.
    Scripts that loop over ``aot_caps()`` run as one process per capability, side by side where the
    machine has the cores (the compiles are CPU-bound and independent)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"this triton cannot compile ahead of time: {e}")
    env = dict(os.environ, TRITON_INTERPRET="0", **env_extra)
    shares = ["90", "100"] if "aot_caps()" in script and (os.cpu_count() or 1) > 1 else [env.get("DSV4_AOT_CAPS", "90,100")]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(repo)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(env, DSV4_AOT_CAPS=c)) for c in shares]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0 and ("ptxas" in err and "not found" in err):  # pragma: no cover
            pytest.skip(f"no ptxas for offline compilation: {err[-400:]}")
        assert p.returncode == 0, out + err[-3000:]


def need_gpu() -> None:
    from dsv4.kernels import cuda_ok
    if not cuda_ok():
        pytest.skip("needs a CUDA GPU with TRITON_INTERPRET=0")


def aot_compile(fn, types: dict, const: dict, cap: int, warps: int, stages: int | None = None, div=(),
                shared: bool = False, maxnreg: int | None = None, ir: str | None = None):
    """Compile a Triton kernel for GPUTarget('cuda', cap, 32) without a GPU (called inside the AOT
    scripts, TRITON_INTERPRET=0). Arguments not in ``const`` take ``types`` (default i32); pointer
    arguments and those named in ``div`` get the divisibility-16 hint the runtime would give.
    Asserts a non-empty cubin and no lone ``trap`` (what an over-subscribed resource, e.g. sm_100
    tensor memory, compiles to). -> (ptx, the tensor-core MMA instructions it uses[, the shared
    memory bytes per block it launches with, with ``shared``][, the text of compile stage ``ir``, e.g. "ttgir"])."""
    import re
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    # a constexpr left out would silently compile as a runtime i32 (a stale dict after a kernel change)
    missing = [q.name for q in fn.params if q.is_constexpr and not q.has_default and q.name not in const]
    assert not missing, f"{fn.__name__}: constexpr arguments not given: {missing}"
    # constexprs left out take their defaults (as a launch does), not a runtime i32 argument
    const = dict({q.name: q.default for q in fn.params if q.is_constexpr and q.has_default}, **const)
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if (n in types and str(types[n]).startswith("*")) or n in div}
    opts = {"num_warps": warps}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    if stages:
        opts["num_stages"] = stages
    t0 = time.time()
    src = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():       # Gluon kernels build their IR from their own source class
        from triton.experimental.gluon._runtime import GluonASTSource as src
    k = triton.compile(src(fn, sig, const, attrs), target=GPUTarget("cuda", cap, 32), options=opts)
    ptx = k.asm["ptx"]
    assert len(k.asm["cubin"]) > 0
    assert "trap;" not in ptx, f"{fn.__name__} sm_{cap} compiled to a trap"
    mma = sorted(set(re.findall(r"(wgmma\.mma_async\.\S*|tcgen05\.mma\S*|mma\.sync\.\S*)", ptx)))
    print(f"sm_{cap} {fn.__name__} {const}: {time.time() - t0:.1f}s {mma[:2]}")
    return (ptx, mma) + ((k.metadata.shared,) if shared else ()) + ((k.asm[ir],) if ir else ())


def ptxas_report(ptx: str, arch: str = "sm_90a") -> str:
    """ptxas -v's report (registers, spill bytes) of a compiled kernel's PTX, from Triton's own ptxas."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        return subprocess.run([get_ptxas(int(arch[3:5])).path, f"-arch={arch}", "-v", src, "-o",
                               os.path.join(tmp, "k.cubin")], capture_output=True, text=True).stderr


def kernel_device() -> str:
    """Where a kernel test file's kernels run: 'cpu' under the interpreter, 'cuda' compiled; with
    TRITON_INTERPRET=0 and no GPU nothing can run and the whole module is skipped."""
    import torch

    from dsv4.kernels import interpreting
    if interpreting():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)


def gemm_exact(xq, xs, W):
    """fp64 (exact sum, sum of |products|) of e4m3 activations xq [M, K] with 1x128 scales xs against
    the dequantised weight W [N, K]."""
    M, K = xq.shape
    x = (xq.double().view(M, K // 128, 128) * xs.double()[..., None]).view(M, K)
    return x @ W.double().T, x.abs() @ W.double().abs().T


def check_gemm(y, xq, xs, W, twin=None, acc=2.0 ** -16):
    """The block-scaled GEMM contract: |y - exact| <= 2^-8 |exact| (one bf16 rounding) + acc * sum of
    |products| (fp32 summation order; tensor-core accumulation on CUDA), within twice that of a twin,
    relative L2 error < 4e-3."""
    ex, mag = gemm_exact(xq.cpu(), xs.cpu(), W.cpu())
    y = y.cpu().double()
    bound = 2.0 ** -8 * ex.abs() + acc * mag + 1e-30
    assert torch.isfinite(y).all()
    assert ((y - ex).abs() <= bound).all(), f"max excess {((y - ex).abs() - bound).max().item()}"
    if twin is not None:
        assert ((y - twin.cpu().double()).abs() <= 2 * bound).all()
    rel = ((y - ex).norm() / ex.norm()).item()
    assert rel < 4e-3, rel


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-exact comparison (distinguishes -0 / +0, compares NaN payloads)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def max_rel_err(a, b):
    """max |a - b| over max |b| (in fp64 on the CPU)."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def random_angle_rope(n, gen, device):
    """(cos, sin) [n, 32] of uniform random angles in [0, 1000)."""
    ang = torch.rand(n, 32, generator=gen) * 1000
    return ang.cos().to(device), ang.sin().to(device)


def random_position_rope(T, gen, device):
    """(cos, sin) [T, 32] of V4's RoPE (theta 160000, 64 rotary dims) at random positions below 2^20."""
    pos = torch.randint(0, 1 << 20, (T,), generator=gen).float()
    freqs = 1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))
    ang = torch.outer(pos, freqs)
    return ang.cos().to(device), ang.sin().to(device)


def fp4_weight(fmt, N, K, gen, spread=False):
    """A random [N, K] weight in ``fmt`` ("mxfp4" | "nvfp4") -> (packed, scales, global scale or None,
    the exact dequantised weight)."""
    from dsv4.formats.fp4 import dequant_mxfp4, dequant_nvfp4, quant_mxfp4, quant_nvfp4
    W = torch.randn(N, K, generator=gen) * 0.05
    if spread:     # per-32 scales 2^16 apart inside a 128-block (the folded path's exact limit)
        W[:, 32:64] *= 2.0 ** -12
        W[:, 64:96] *= 2.0 ** -16
    if fmt == "mxfp4":
        wp, s = quant_mxfp4(W)
        return wp, s, None, dequant_mxfp4(wp, s)
    wp, s, s2 = quant_nvfp4(W)
    return wp, s, s2, dequant_nvfp4(wp, s, s2)


def mx_expert_problem(E: int, N: int, K: int, rows: list[int]):
    """A grouped MXFP4 expert GEMM problem on the GPU (the in-kernel-decode kernels' tests): (a in group split
    order, xs, w, ws, tile_smax, offs) for the kernel, and (xq, Wd) for ``check_expert_sums``."""
    from dsv4.formats.fp4 import dequant_mxfp4, quant_mxfp4
    from dsv4.kernels.gemm import fp4_fp8 as F
    from dsv4.kernels.gemm import fp8 as G8
    from dsv4.kernels.gemm.fp4_fp8_ws import split_k_order
    gen = torch.Generator().manual_seed(E + N + K)
    P = sum(rows)
    offs = torch.tensor([0] + rows).cumsum(0)
    Wf = torch.randn(E, N, K, generator=gen) * 0.05
    q, s = zip(*(quant_mxfp4(Wf[e]) for e in range(E)))
    w, ws = torch.stack(q).cuda(), torch.stack(s).cuda()
    xq, xs = G8.act_quant_fp8((torch.randn(P, K, generator=gen) * 2).bfloat16().cuda())
    Wd = torch.stack([dequant_mxfp4(q[e], s[e]) for e in range(E)])
    return (split_k_order(xq.view(torch.uint8)), xs, w, ws, F.tile_max(ws), offs.cuda()), (xq, Wd)


def check_expert_sums(y, args, extra) -> None:
    """Each expert's rows of ``y`` [P, N] against the exact sums of its dequantised weights (2% of the largest)."""
    xs, offs = args[1], args[5].cpu()
    xq, Wd = extra
    for e in range(Wd.shape[0]):
        r0, r1 = int(offs[e]), int(offs[e + 1])
        if r1 > r0:
            ex = xq[r0:r1].float().cpu() * xs[r0:r1].cpu().repeat_interleave(128, 1) @ Wd[e].T
            torch.testing.assert_close(y[r0:r1].float().cpu(), ex, rtol=2e-2, atol=2e-2 * ex.abs().max().item())


class InlineFork:
    """A stand-in for ``dsv4.streams.Fork`` that reports a side stream and runs the branch inline, so that code taken
    only where a step forks (never on a CPU) runs in CPU tests. Records every fork made (``made``, cleared by the
    caller) and whether it was joined."""
    made: list = []

    def __init__(self, dev, rows):
        self.s = "side"
        self.joined = False
        InlineFork.made.append(self)

    def side(self):
        import contextlib
        return contextlib.nullcontext()

    def sync(self):
        pass

    def join(self):
        self.joined = True
