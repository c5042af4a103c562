"""Is hc_pre's tiled path deterministic run to run, and which stage is not? For each T, d and mix
variant (mode, separate MMA chains or one, pipeline stages): N eager calls on the same input, with
every fp32 workspace poisoned with NaN before it is written. Per stage, the number of distinct
results over the N calls (1 = deterministic) of the mix GEMM's written partials, and of the full
outputs, whether any unwritten (NaN) partial was read, and the median time of the full call. GPU
only. Prints a table; ``--ptx DIR`` also saves the mix kernel's PTX / TTGIR per variant."""
import contextlib
import hashlib
import sys

import torch
import triton

from dsv4.kernels import mhc

N = int(sys.argv[1]) if len(sys.argv) > 1 else 30
PTX_DIR = sys.argv[sys.argv.index("--ptx") + 1] if "--ptx" in sys.argv else None
VARIANTS = {
    "bf16x3 sep s3 (default)": {"mode": "bf16x3", "sep": True, "num_stages": 3},
    "bf16x3 sep s1": {"mode": "bf16x3", "sep": True, "num_stages": 1},
    "bf16x3 chain s3": {"mode": "bf16x3", "sep": False, "num_stages": 3},
    "ieee s3": {"mode": "ieee", "num_stages": 3},
    "v1 bf16x3 s3": {"impl": "v1", "mode": "bf16x3", "num_stages": 3},
    "hc_head (default)": {"head": True},
}


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty of fp32 returns NaN-filled tensors: a read of an unwritten element shows."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        if t.dtype == torch.float32:
            t.fill_(float("nan"))
        return t
    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def inputs(T, D, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, 4, D, generator=g) * torch.rand(T, 4, 1, generator=g) * 3).bfloat16()
    fn = torch.randn(24, 4 * D, generator=g) * (4 * D) ** -0.5 * 2
    base = torch.randn(24, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    return [t.cuda() for t in (x, fn, base, scale)]


def digest(ts) -> str:
    h = hashlib.sha1()
    for t in ts:
        h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def written(part):
    """The mix columns and the sum-of-squares column of the partials [S, NP, T]."""
    return torch.cat([part[:, :24], part[:, -1:]], dim=1)


print(f"{'T':>5} {'d':>5} {'variant':<26} {'mix distinct':>12} {'mix NaN':>8} {'full distinct':>13} {'diff rows':>18}"
      f" {'us':>8}", flush=True)
for D in (4096, 7168):
    for T in (64, 300, 320, 1024, 4096):
        x, fn, base, scale = inputs(T, D, T + D)
        for name, cfg in VARIANTS.items():
            cfg = dict(cfg)
            head = cfg.pop("head", False)
            tiled = not head and cfg.setdefault("impl", "tiled") == "tiled"
            if head:
                f4, b4, s1 = fn[:4], base[:4], scale[:1]
                call = lambda: (mhc.hc_head(x, f4, b4, s1, config=cfg),)  # noqa: E731
            else:
                call = lambda: mhc.hc_pre(x, fn, base, scale, config=cfg)  # noqa: E731
            with poisoned_empty():
                parts = [written(mhc._tiled_mix(x, fn, 24, mhc._np(24), cfg)[0]) for _ in range(N)] if tiled else []
                full = [tuple(t.clone() for t in call()) for _ in range(N)]
            nan = sum(bool(p.isnan().any()) for p in parts)
            rows = set()
            for f in full[1:]:
                for a, b in zip(full[0], f):
                    rows |= set((a != b).reshape(T, -1).any(dim=1).nonzero().flatten().tolist())
            rows = sorted(rows)
            us = triton.testing.do_bench(call, return_mode="median") * 1e3
            print(f"{T:>5} {D:>5} {name:<26} {len({digest([p]) for p in parts}) if tiled else '-':>12} {nan:>8} "
                  f"{len({digest(f) for f in full}):>13} {str(rows[:4]) + ('..' if len(rows) > 4 else ''):>18}"
                  f" {us:>8.1f}", flush=True)

if PTX_DIR:     # every compiled variant of the mix kernel, mix<n>.ttgir / .ptx in compile order
    import os
    os.makedirs(PTX_DIR, exist_ok=True)
    n = 0
    for caches in mhc._hc_mix_tile.device_caches.values():
        for k in caches[0].values():
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(PTX_DIR, f"mix{n}.{ext}"), "w") as fh:
                    fh.write(k.asm[ext])
            n += 1
    print(f"saved {n} mix kernel variants to {PTX_DIR}")
