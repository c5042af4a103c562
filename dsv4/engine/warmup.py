"""Start-up warm-up, so that no kernel compiles while requests are served, and compile-time
accounting.

A Triton / Gluon kernel compiles once per variant: per set of constexpr values (tiles that the
launchers pick from the call's sizes) and per specialisation of its integer / pointer arguments.
The kernels of the prefill path mark their size arguments (token rows, segments, context lengths)
``do_not_specialize`` and pick their tiles from a few buckets, so the variants a prefill chunk or a
decode step can select are a small set, which ``warm_up`` reaches before the engine serves: it runs
requests over the buckets the scheduler can produce (``warmup_plan``: prompt lengths up to
``max_num_batched_tokens``, batches of sequences up to ``max_num_seqs``, long prompts whose chunks
see long contexts), each with two output tokens (a decode step too), and then leaves no trace: the
engine's counters, its prefix cache and its queues are as a fresh engine's. The decode step's
variants compile when its CUDA graphs are captured (``CudaGraphDecoder``). Triton's on-disk cache
(``TRITON_CACHE_DIR``) makes a restart's warm-up load the binaries instead of compiling them.

``CompileLog`` installs Triton's ``jit_post_compile_hook`` (``triton.knobs.runtime``; called once per
in-memory cache miss of a ``@triton.jit`` / ``@gluon.jit`` function, whether the binary then comes
from the on-disk cache or from the compiler) and records one ``Compiled`` entry per variant. A
hook that was already installed keeps being called. Without Triton (or under the interpreter,
which compiles nothing) the log stays empty.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Compiled:
    name: str          # the kernel's qualified name
    signature: str     # Triton's description of the variant: launch options and argument types
    t: float           # time.monotonic() when it finished compiling


def _describe(rep: str, comp: dict) -> str:
    """The launch options of ``rep`` and the variant's constexpr values, argument types and the
    arguments Triton specialised on (``tt.divisibility`` 16 and the like)."""
    opts = rep[rep.find("["):rep.find("]") + 1] if "[" in rep else ""
    sig = comp.get("signature") or {}
    consts = {k if isinstance(k, str) else (list(sig)[k[0]] if isinstance(k, tuple) and k and k[0] < len(sig)
                                            else k): v for k, v in (comp.get("constants") or {}).items()}
    names = list(sig)
    attrs = []
    for cfg in comp.get("configs") or []:
        for k, v in (cfg.items() if isinstance(cfg, dict) else []):
            i = k[0] if isinstance(k, tuple) and k else k
            attrs.append(f"{names[i] if isinstance(i, int) and i < len(names) else i}:{v}")
    types = ",".join(f"{n}:{t}" for n, t in sig.items() if t != "constexpr")
    return f"{opts} consts={consts} spec=[{' '.join(attrs)}] types=({types})"


class CompileLog:
    """Context manager: ``with CompileLog() as log: ...``; ``log.entries`` [Compiled]."""

    def __init__(self):
        self.entries: list[Compiled] = []
        self._lock = threading.Lock()
        self._prev = None
        self._knobs = None

    def __enter__(self) -> "CompileLog":
        try:
            from triton import knobs
        except ImportError:
            return self
        self._knobs = knobs
        self._prev = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._prev
            self._knobs = None

    def _hook(self, *args, **kw):
        fn, rep = kw.get("fn"), kw.get("repr", "")
        name = getattr(fn, "name", None) or rep.split("[", 1)[0]
        with self._lock:
            self.entries.append(Compiled(name, _describe(rep, kw.get("compile") or {}), time.monotonic()))
        if self._prev is not None:
            return self._prev(*args, **kw)
        return None

    def __len__(self) -> int:
        return len(self.entries)

    def since(self, n: int) -> list[Compiled]:
        """The entries recorded after the first ``n``."""
        with self._lock:
            return self.entries[n:]


# prompt lengths whose single chunk covers the row buckets of the prefill kernels (tile choices by
# token rows and by rows per expert, pow2 tiles of rows and of context entries)
def _single_lengths(budget: int, limit: int) -> list[int]:
    out = set()
    p = 1
    while p <= budget:
        out |= {p, p + 1, p + p // 2}
        p *= 2
    out |= set(range(256, min(budget, 4096) + 1, 256))
    top = min(budget, limit)
    out.add(top)
    return sorted(n for n in out if n <= top)


def warmup_plan(budget: int, max_num_seqs: int, max_model_len: int) -> list[list[int]]:
    """Groups of prompt lengths; each group is submitted together (module doc). ``budget``:
    ``max_num_batched_tokens``; prompts stay within ``max_model_len`` - 2 (two output tokens)."""
    limit = max_model_len - 2
    if limit < 1:
        return []
    groups = [[n] for n in _single_lengths(budget, limit)]
    k = 2
    while True:
        k = min(k, max_num_seqs)
        # k sequences in one step, of unequal lengths (segments of different sizes and contexts)
        groups.append([max(1, min(limit, 3 + (37 * i) % max(1, min(budget // k, 1024)))) for i in range(k)])
        if k == max_num_seqs:
            break
        k *= 2
    # chunked prompts: chunks after the first see contexts of several budgets, and past the
    # one-launch top-k range (4096 compressed entries: 16K tokens)
    for n in (2 * budget + budget // 3, 20000):
        if budget < n <= limit:
            groups.append([n])
    return groups


def warm_up(engine, log=None) -> dict:
    """Run ``warmup_plan``'s requests on ``engine`` (idle, just built), then reset what they
    touched (module doc). Returns {requests, prompt_tokens, variants (kernel variants compiled or
    loaded from the on-disk cache meanwhile), seconds}."""
    from .sampling_params import SamplingParams
    if engine.has_unfinished_requests() or engine.requests:
        raise RuntimeError("warm_up needs an idle engine")
    cfg = engine.cfg
    groups = warmup_plan(cfg.max_num_batched_tokens, cfg.max_num_seqs, engine.max_model_len)
    g = torch.Generator().manual_seed(0)
    V = min(engine.model_config.vocab_size, 128000)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    t0, n_req, n_tok = time.perf_counter(), 0, 0
    with CompileLog() as clog:
        for gi, lengths in enumerate(groups):
            for j, n in enumerate(lengths):
                ids = torch.randint(3, V, (n,), generator=g).tolist()
                engine.add_request(f"__warmup_{gi}_{j}", {"prompt_token_ids": ids}, sp)
                n_req, n_tok = n_req + 1, n_tok + n
            while engine.has_unfinished_requests():
                engine.step()
            engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    for k, v in engine.stats.items():
        engine.stats[k] = [0] * len(v) if isinstance(v, list) else type(v)(0)
    engine.scheduler.num_preemptions = 0
    if engine.prefix is not None:
        engine.prefix.reset()
    out = {"requests": n_req, "prompt_tokens": n_tok, "variants": len(clog), "seconds": time.perf_counter() - t0}
    if log is not None:
        log(f"warm-up: {n_req} requests, {n_tok} prompt tokens, {out['variants']} kernel variants compiled or "
            f"loaded, {out['seconds']:.1f} s")
    return out


__all__ = ["CompileLog", "Compiled", "warm_up", "warmup_plan"]
