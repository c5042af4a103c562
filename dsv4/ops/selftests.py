"""Self-tests of the op table: per op, small inputs with the real shapes of a model config (widths,
heads, cache layouts, expert formats) and what to compare between the kernel's and the twin's result.

``cases(name, ctx)`` -> ``[Case]``. A case builds fresh arguments on every call (``make``: the ops
write into caches and rings, so kernel and twin each get their own copy of the same values),
names the outputs to compare (``outputs``) and the tolerance of each (``Tol``). Tolerances are the
kernels' stated numerics (their modules' docstrings, their tests): exact for integer ops, a bf16
ulp or two for the elementwise ones, bf16 rounding plus fp32 summation order for the GEMMs, and
rare quantisation-step flips where a bf16 value lands next to an FP8 / FP4 rounding boundary.

Modes: ``fast`` (the engine's start-up default) runs each op at one decode-sized shape: the calls a
decode step makes (and so the kernels the first served step would compile anyway); ``full`` adds
the other sizes the routers send elsewhere (prefill chunks, batched decode, hash-routed experts).
Values are drawn from a generator seeded per op: the same inputs on every run of a device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from ..config import ModelConfig
from ..formats.decode_plan import TABLE_NEG, MetaPlan
from ..formats.index_key import write_index_entries
from ..formats.kv_entry import page_bytes, read_entries, write_kv_entries
from ..formats.paging import BLOCK_TOKENS, INDEX_PAGE, WINDOW, WINDOW_PAGE
from ..parallel import SINGLE

MODES = ("fast", "full")


@dataclass
class Context:
    cfg: ModelConfig
    device: torch.device
    mode: str = "fast"
    expert_format: str = "mxfp4"     # the model's routed experts: "mxfp4" | "nvfp4" | "fp8"
    world: int = 1                   # tensor-parallel ranks: the local heads / groups of one rank
    seed: int = 0


@dataclass(frozen=True)
class Tol:
    """``max_rel``: bound of max|kernel - twin| / max|twin| (finite entries; the non-finite pattern must
    match). ``exact``: the values must be equal (integers, bytes). ``flips``: the fraction of entries
    allowed to differ by more than ``flip_rel`` of their twin value (a bf16 tie moving one FP8 / FP4
    quantisation step); then ``max_rel`` bounds the size of those steps."""
    max_rel: float = 0.0
    exact: bool = False
    flips: float = 0.0
    flip_rel: float = 2.0 ** -7
    per_row: bool = False      # max_rel per row (first dim) of the twin: a token's error against its own scale

    def describe(self) -> str:
        if self.exact:
            return "exact"
        s = f"{self.max_rel:.2g}"
        return s + (f" (flips <= {self.flips:.0%})" if self.flips else "")


@dataclass
class Case:
    label: str
    make: Callable[[], tuple]                       # -> (args tuple, kwargs dict), fresh tensors
    outputs: Callable                              # (result, args, kwargs) -> {name: tensor}
    tols: dict = field(default_factory=dict)       # name -> Tol ("*": every other output)

    def tol(self, name: str) -> Tol:
        return self.tols.get(name) or self.tols["*"]


def compare(k: torch.Tensor, t: torch.Tensor, tol: Tol) -> tuple[float, float, str]:
    """(error, its bound, what failed or '') of a kernel output ``k`` against its twin's ``t``."""
    if tuple(k.shape) != tuple(t.shape):
        return math.inf, 0.0, f"shape {tuple(k.shape)} != {tuple(t.shape)}"
    if k.is_floating_point() or t.is_floating_point():
        k, t = k.detach().double().cpu(), t.detach().double().cpu()
    else:
        k, t = k.detach().long().cpu(), t.detach().long().cpu()
    if tol.exact:
        n = int((k != t).sum())
        return (n / max(1, k.numel()), 0.0, f"{n} of {k.numel()} values differ" if n else "")
    fk, ft = torch.isfinite(k), torch.isfinite(t)
    if torch.isnan(k).any() and not torch.isnan(t).any():
        return math.inf, tol.max_rel, "non-finite values (NaN)"
    if not torch.equal(fk, ft) or not torch.equal(k[~fk], t[~ft]):
        return math.inf, tol.max_rel, "non-finite values where the twin has none (or the reverse)"
    if not ft.any():
        return 0.0, tol.max_rel, ""
    d = (k[ft] - t[ft]).abs()
    scale = float(t[ft].abs().max())
    err = float(d.max()) / max(scale, 1e-30)
    if tol.flips:
        off = d > tol.flip_rel * t[ft].abs() + 1e-6 * scale
        frac = float(off.float().mean())
        if frac > tol.flips:
            return frac, tol.flips, f"{frac:.2%} of the values differ beyond one rounding step"
    if tol.per_row and k.dim() > 1:
        rows_k, rows_t = k.reshape(k.shape[0], -1), t.reshape(t.shape[0], -1)
        dr = (rows_k - rows_t).abs().nan_to_num(0.0).amax(1)
        err = float((dr / rows_t.abs().nan_to_num(0.0).amax(1).clamp(min=1e-30)).max())
    return err, tol.max_rel, "" if err <= tol.max_rel else f"max error {err:.3g} > {tol.max_rel:.3g}"


# ---------------------------------------------------------------------------------------------- inputs
class _Gen:
    """Random inputs on the device, seeded per op (the same values on every run)."""

    def __init__(self, ctx: Context, salt: str):
        self.dev = ctx.device
        seed = (ctx.seed * 1_000_003 + sum(ord(c) * 131 ** i for i, c in enumerate(salt))) % (2 ** 62)
        self.g = torch.Generator(device=self.dev).manual_seed(seed)

    def randn(self, *shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=self.g, device=self.dev) * scale).to(dtype)

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.g, device=self.dev)

    def randint(self, lo, hi, shape, dtype=torch.int64):
        return torch.randint(lo, hi, shape, generator=self.g, device=self.dev, dtype=dtype)

    def perm(self, n):
        return torch.randperm(n, generator=self.g, device=self.dev)

    def rope(self, n):
        """(cos, sin) fp32 [n, 32] of random positions below 2^20 (V4's compressor theta)."""
        pos = self.randint(0, 1 << 20, (n,)).float()
        freqs = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, device=self.dev).float() / 64))
        ang = torch.outer(pos, freqs)
        return ang.cos().contiguous(), ang.sin().contiguous()

    def kv_rows(self, n, dim=512):
        return (self.randn(n, dim) * self.rand(n, 1) * 3).bfloat16()

    def fp8_weight(self, N, K):
        """(e4m3 [N, K], fp32 power-of-two block scales [N/128, K/128]): random finite codes."""
        codes = self.randint(0, 256, (N, K), dtype=torch.int32)
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
        scale = torch.exp2(self.randint(-12, -8, (-(-N // 128), K // 128)).float())
        return codes.view(torch.float8_e4m3fn), scale

    def fp4_weight(self, E, N, K, fmt):
        """Packed FP4 [E, N, K/2] with MXFP4 (e8m0 per 32) or NVFP4 (e4m3 per 16 + fp32 per row) scales."""
        codes = self.randint(0, 256, (E, N, K // 2), dtype=torch.int32).to(torch.uint8)
        if fmt == "mxfp4":
            return codes, (127 + self.randint(-9, -5, (E, N, K // 32))).to(torch.uint8), None
        sc = (self.rand(E, N, K // 16) * 3 + 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
        s2 = torch.exp2(self.randint(-10, -7, (E, 1)).float()).expand(E, N).contiguous()
        return codes, sc, s2


def _cache_pages(gen, n_pages, page_size, n_entries):
    """A paged FP8 cache of random bytes with ``n_entries`` real entries at shuffled slots -> (pages, slots)."""
    pages = gen.randint(0, 256, (n_pages, page_bytes(page_size)), dtype=torch.int32).to(torch.uint8)
    slots = gen.perm(n_pages * page_size)[:n_entries]
    write_kv_entries(pages, slots, gen.kv_rows(n_entries), page_size)
    return pages, slots


def _local(n: int, world: int) -> int:
    return max(1, n // world)


def _both(name):
    return lambda r, a, kw: {name: r}


def _tuple(*names):
    return lambda r, a, kw: dict(zip(names, r))


BF16 = Tol(max_rel=2.0 ** -6)            # one bf16 rounding (+ fp32 summation order) of the largest value


# ---------------------------------------------------------------------------------------------- per op
def _rows(ctx, fast, full):
    return fast if ctx.mode == "fast" else full


def rms_norm(ctx: Context):
    c = ctx.cfg
    out = []
    for D in sorted({c.hidden_size, c.q_lora_rank, c.head_dim}):
        for T in _rows(ctx, (2,), (1, 2, 64)):
            def make(D=D, T=T):
                g = _Gen(ctx, f"rms_norm{D}{T}")
                return (g.randn(T, D, scale=3, dtype=torch.bfloat16), g.randn(D, scale=0.1) + 1, c.rms_norm_eps), {}
            out.append(Case(f"T={T} D={D}", make, _both("y"), {"y": BF16}))
    return out


def rms_norm_pair(ctx: Context):
    c = ctx.cfg
    DA, DB = c.q_lora_rank, c.head_dim           # q_norm, kv_norm of the wq_a|wkv output

    def case(T):
        def make():
            g = _Gen(ctx, f"rms_norm_pair{T}")
            return (g.randn(T, DA + DB, scale=3, dtype=torch.bfloat16), g.randn(DA, scale=0.1) + 1,
                    g.randn(DB, scale=0.1) + 1, c.rms_norm_eps), {}
        return Case(f"T={T} D={DA}+{DB}", make, _tuple("q", "kv"), {"*": BF16})
    return [case(T) for T in _rows(ctx, (1,), (1, 2, 64))]


def _hc(ctx, n_mix, salt, T):
    c = ctx.cfg
    g = _Gen(ctx, salt)
    d = c.hidden_size
    x = g.randn(T, c.hc_mult, d, dtype=torch.bfloat16)
    fn = g.randn(n_mix, c.hc_mult * d, scale=(c.hc_mult * d) ** -0.5)
    base = g.randn(n_mix, scale=0.3)
    scale = g.rand(3 if n_mix > c.hc_mult else 1) + 0.5
    return x, fn, base, scale


def hc_pre(ctx: Context):
    c = ctx.cfg

    def case(T):
        def make():
            x, fn, base, scale = _hc(ctx, c.hc_mix_dim, f"hc_pre{T}", T)
            return (x, fn, base, scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps), {}
        return Case(f"T={T}", make, _tuple("y", "post", "comb"),
                    {"y": BF16, "post": Tol(max_rel=1e-4), "comb": Tol(max_rel=1e-4)})
    return [case(T) for T in _rows(ctx, (1,), (1, 4, 300))]


def hc_head(ctx: Context):
    c = ctx.cfg

    def case(T):
        def make():
            x, fn, base, scale = _hc(ctx, c.hc_mult, f"hc_head{T}", T)
            return (x, fn, base, scale, c.hc_eps, c.rms_norm_eps), {}
        return Case(f"T={T}", make, _both("y"), {"y": BF16})
    return [case(T) for T in _rows(ctx, (2,), (1, 2, 64))]


def hc_post(ctx: Context):
    c = ctx.cfg

    def case(T):
        def make():
            g = _Gen(ctx, f"hc_post{T}")
            d, hc = c.hidden_size, c.hc_mult
            y = g.randn(T, d, dtype=torch.bfloat16)
            res = g.randn(T, hc, d, dtype=torch.bfloat16)
            post = g.rand(T, hc) * 2
            comb = torch.softmax(g.randn(T, hc, hc), dim=-1)
            return (y, res, post, comb), {}
        return Case(f"T={T}", make, _both("out"), {"out": BF16})
    return [case(T) for T in _rows(ctx, (2,), (1, 2, 64))]


def hc_post_pre(ctx: Context):
    c = ctx.cfg

    def case(T, post):
        def make():
            g = _Gen(ctx, f"hc_post_pre{T}{post}")
            d, hc = c.hidden_size, c.hc_mult
            x, fn, base, scale = _hc(ctx, c.hc_mix_dim, f"hc_post_pre_w{T}", T)
            y = g.randn(T, d, dtype=torch.bfloat16) if post else None
            p = g.rand(T, hc) * 2 if post else None
            comb = torch.softmax(g.randn(T, hc, hc), dim=-1) if post else None
            w = g.randn(d, scale=0.1) + 1
            return (y, x, p, comb, fn, base, scale, w, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                    c.rms_norm_eps), {}
        # post / comb: above one token hc_pre's tiled bf16x3 sums on the summed streams (up to 1.01e-4 of the
        # twin's at d 7168, tests/test_mhc.py on the H100)
        return Case(f"T={T} {'post+pre' if post else 'pre'}", make, _tuple("h", "a", "post", "comb"),
                    {"h": BF16, "a": BF16, "post": Tol(max_rel=2e-4), "comb": Tol(max_rel=2e-4)})
    return [case(T, post) for T in _rows(ctx, (1,), (1, 4)) for post in (True, False)]


def kv_insert(ctx: Context):
    c = ctx.cfg
    H = _local(c.num_attention_heads, ctx.world)

    def case(T, with_q=True):
        def make():
            g = _Gen(ctx, f"kv_insert{T}")
            n_pages = -(-(T + 2) // WINDOW_PAGE) + 1
            pages = g.randint(0, 256, (n_pages, page_bytes(WINDOW_PAGE)), dtype=torch.int32).to(torch.uint8)
            slots = g.perm(n_pages * WINDOW_PAGE)[:T].clone()
            if T > 1:
                slots[-1] = -1                                   # a row that writes nothing
            cos, sin = g.rope(T)
            q = g.randn(T, H, c.head_dim, scale=2, dtype=torch.bfloat16)
            return (q if with_q else None,
                    g.randn(T, c.head_dim, scale=2, dtype=torch.bfloat16), cos, sin, pages, slots, WINDOW_PAGE,
                    c.rms_norm_eps), {}
        # q: the 512-term square sum's order can move the bf16 mean by one ulp (2 ulps in a head)
        if not with_q:      # the prefill form: kv only (the attention transforms q)
            return Case(f"T={T} kv only", make, lambda r, a, kw: {"kv": r[1], "pages": a[4]},
                        {"kv": BF16, "pages": Tol(exact=True)})
        return Case(f"T={T} H={H}", make, lambda r, a, kw: {"q": r[0], "kv": r[1], "pages": a[4]},
                    {"q": Tol(max_rel=2.0 ** -5), "kv": BF16, "pages": Tol(exact=True)})
    return [case(T) for T in _rows(ctx, (2,), (1, 2, 64))] + [case(T, False) for T in _rows(ctx, (3,), (64,))]


def inverse_rope(ctx: Context):
    c = ctx.cfg
    H = _local(c.num_attention_heads, ctx.world)

    def case(T):
        def make():
            g = _Gen(ctx, f"inverse_rope{T}")
            cos, sin = g.rope(T)
            return (g.randn(T, H, c.head_dim, dtype=torch.bfloat16), cos, sin), {}
        return Case(f"T={T} H={H}", make, _both("y"), {"y": BF16})
    return [case(T) for T in _rows(ctx, (2,), (1, 2, 64))]


def entry_ids(ctx: Context):
    cases = []
    for ratio in sorted({r for r in ctx.cfg.compress_ratios if r}):
        per_block = BLOCK_TOKENS // ratio

        def make(ratio=ratio, per_block=per_block):
            g = _Gen(ctx, f"entry_ids{ratio}")
            B, W, n = 3, 6, 40
            bt = g.perm(4 * W)[:B * W].view(B, W).clone()
            bt[1, 4:] = -1
            e = g.randint(-1, W * per_block, (B, n))
            return (bt, e, per_block, ratio), {}
        cases.append(Case(f"ratio={ratio}", make, _both("ids"), {"ids": Tol(exact=True)}))
    return cases


def _attention_case(ctx, name, T, prefill: bool, rope: bool = False, ws: bool = False):
    c = ctx.cfg
    H = _local(c.num_attention_heads, ctx.world)
    K = min(c.index_topk, 128)
    epb = BLOCK_TOKENS // 4

    def make():
        g = _Gen(ctx, f"{name}{T}")
        n_w = WINDOW if not prefill else T
        wpages, wslots = _cache_pages(g, -(-n_w // WINDOW_PAGE) + 1, WINDOW_PAGE, n_w)
        epages, eslots = _cache_pages(g, -(-K // epb) + 1, epb, K)
        if prefill:     # causal window lists over the chunk's own entries
            j = torch.arange(n_w, device=ctx.device)
            widx = torch.where(j[None, :] <= torch.arange(T, device=ctx.device)[:, None], wslots[j][None, :], -1)
        else:
            widx = wslots[g.randint(0, n_w, (T, WINDOW))]
            widx[0, WINDOW // 2:] = -1                           # a sequence shorter than the window
        eidx = eslots[g.randint(0, K, (T, K))]
        eidx[:, K - 3:] = -1
        sinks = g.randn(H)
        kw = dict(sinks=sinks, scale=c.head_dim ** -0.5)
        if rope:            # the inverse RoPE of the output (and in the prefill form q's norm + RoPE at its load)
            ang = g.rand(T, 32) * 6.283185307179586
            kw["rope"] = (torch.cos(ang), torch.sin(ang))
            if prefill:
                kw["q_norm_eps"] = c.rms_norm_eps
        if ws:              # the entries from bf16 workspaces of every slot (a slot id is a row)
            every = lambda p, n: read_entries(p, torch.arange(p.shape[0] * n, device=p.device), n)
            kw["kv_bf16"] = (every(wpages, WINDOW_PAGE), every(epages, epb))
        return (g.randn(T, H, c.head_dim, dtype=torch.bfloat16), widx.to(torch.int32).contiguous(), wpages,
                WINDOW_PAGE, eidx.to(torch.int32).contiguous(), epages, epb), kw
    # the attention kernels round probabilities to bf16 per block of the running max; the twin per 64
    # entries of the reference's blocks: results agree to bf16 tolerance (tests/test_sparse_attention.py)
    form = ((" q-norm" if prefill else "") + " rope" if rope else "") + (" bf16 workspaces" if ws else "")
    return Case(f"T={T} H={H} K={WINDOW if not prefill else T}+{K}{form}", make, _both("o"),
                {"o": Tol(max_rel=0.05)})


def sparse_decode(ctx: Context):
    return [_attention_case(ctx, "sparse_decode", T, False) for T in _rows(ctx, (2,), (1, 2, 32))] + [
        _attention_case(ctx, "sparse_decode", 2, False, rope=True)]     # the decode form: inverse RoPE in the combine


def sparse_prefill(ctx: Context):
    return [_attention_case(ctx, "sparse_prefill", T, True, rope) for T in _rows(ctx, (8,), (8, 64))
            for rope in (False, True)] + [_attention_case(ctx, "sparse_prefill", 8, True, True, ws=True)]


def _compress_variants(ctx):
    ratios = sorted({r for r in ctx.cfg.compress_ratios if r})
    out = [(r, False) for r in ratios]
    if 4 in ratios:
        out.append((4, True))
    return out


# a bf16 value that lands next to an FP8 / FP4 rounding boundary moves one quantisation step: rare flips
_QDQ = Tol(max_rel=0.5, flips=0.02, flip_rel=2.0 ** -6)


def compress_decode(ctx: Context):
    c = ctx.cfg
    out = []
    for ratio, indexer in _compress_variants(ctx):
        def make(ratio=ratio, indexer=indexer):
            g = _Gen(ctx, f"compress_decode{ratio}{indexer}")
            dim = c.index_head_dim if indexer else c.head_dim
            coff = 2 if ratio == 4 else 1
            B = 2
            n_slots = B + 1
            state = g.randn(n_slots, coff * ratio, 2 * coff * dim, scale=2)
            slots = g.perm(n_slots)[:B]
            pos = torch.tensor([5 * ratio - 1, 7 * ratio + 1], device=ctx.device)   # one completes, one does not
            ps = INDEX_PAGE if indexer else BLOCK_TOKENS // ratio
            pb = ps * 68 if indexer else page_bytes(ps)
            pages = g.randint(0, 256, (B + 1, pb), dtype=torch.int32).to(torch.uint8)
            cos, sin = g.rope(B)
            return (state, slots, pos, g.randn(B, coff * dim, scale=2), g.randn(B, coff * dim, scale=2),
                    g.rand(dim) + 0.5, cos, sin), \
                dict(ratio=ratio, indexer=indexer, eps=c.rms_norm_eps, pages=pages, page_slots=g.perm(B * ps)[:B],
                     page_size=ps)
        out.append(Case(f"ratio={ratio}{' indexer' if indexer else ''}", make,
                        lambda r, a, kw: {"entries": r[0], "complete": r[1], "ring": a[0], "pages": kw["pages"]},
                        {"entries": _QDQ, "complete": Tol(exact=True), "ring": Tol(exact=True),
                         "pages": Tol(max_rel=1.0, flips=0.02, flip_rel=0.0)}))
    return out


def compress_prefill(ctx: Context):
    c = ctx.cfg
    out = []
    for ratio, indexer in _compress_variants(ctx):
        def make(ratio=ratio, indexer=indexer):
            g = _Gen(ctx, f"compress_prefill{ratio}{indexer}")
            dim = c.index_head_dim if indexer else c.head_dim
            coff = 2 if ratio == 4 else 1
            first, last = (1, 3) if ratio == 4 else (0, 1)
            base = (first - 1) * ratio if ratio == 4 else 0
            R = last * ratio - base
            n = last - first
            ps = INDEX_PAGE if indexer else BLOCK_TOKENS // ratio
            pb = ps * 68 if indexer else page_bytes(ps)
            pages = g.randint(0, 256, (n + 1, pb), dtype=torch.int32).to(torch.uint8)
            cos, sin = g.rope(n)
            return (g.randn(R, coff * dim, scale=2), g.randn(R, coff * dim, scale=2), base, first, last,
                    g.rand(dim) + 0.5, cos, sin), \
                dict(ratio=ratio, indexer=indexer, eps=c.rms_norm_eps, pages=pages, page_slots=g.perm(n * ps)[:n],
                     page_size=ps)
        out.append(Case(f"ratio={ratio}{' indexer' if indexer else ''}", make,
                        lambda r, a, kw: {"entries": r, "pages": kw["pages"]},
                        {"entries": _QDQ, "pages": Tol(max_rel=1.0, flips=0.02, flip_rel=0.0)}))
    return out


def index_q_prologue(ctx: Context):
    c = ctx.cfg

    def case(T):
        def make():
            g = _Gen(ctx, f"index_q{T}")
            cos, sin = g.rope(T)
            return (g.randn(T, c.index_n_heads, c.index_head_dim, scale=2, dtype=torch.bfloat16), cos, sin), {}
        return Case(f"T={T}", make, _both("q"), {"q": _QDQ})
    return [case(T) for T in _rows(ctx, (2,), (1, 2, 128))]


def _index_pages(g, n_blocks, dim):
    n = n_blocks * INDEX_PAGE
    pages = g.randint(0, 256, (n_blocks, INDEX_PAGE * 68), dtype=torch.int32).to(torch.uint8)
    keys = (g.randn(n, dim) * g.rand(n, 1)).bfloat16()
    write_index_entries(pages, torch.arange(n, device=keys.device), keys)
    return pages


def index_scores(ctx: Context):
    c = ctx.cfg

    def case(B, raw):
        def make():
            g = _Gen(ctx, f"index_scores{B}{raw}")
            W = 4
            pages = _index_pages(g, B * W + 1, c.index_head_dim)
            bt = g.perm(B * W + 1)[:B * W].view(B, W).clone()
            bt[-1, W - 1] = -1
            pos = g.randint(4, W * BLOCK_TOKENS, (B,))
            q = g.randn(B, c.index_n_heads, c.index_head_dim, dtype=torch.bfloat16)
            kw = dict(n=W * INDEX_PAGE)
            if raw:   # the model's form: the fp32 weights_proj output, rounded and scaled by the op
                w = g.randn(B, c.index_n_heads, scale=4.0)
                kw["w_scale"] = c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5
            else:
                w = g.randn(B, c.index_n_heads, scale=0.1, dtype=torch.bfloat16)
            return (q, w, pages, bt, pos), kw
        # one bf16 rounding point (dot, relu * w, head sum) can move by an ulp next to a tie
        return Case(f"B={B}{' w_scale' if raw else ''}", make, _both("scores"),
                    {"scores": Tol(max_rel=2.0 ** -5, flips=0.01)})
    return [case(B, raw) for B in _rows(ctx, (2,), (1, 2, 16)) for raw in (True, False)]


def index_topk(ctx: Context):
    c = ctx.cfg

    def case(B, N):
        def make():
            g = _Gen(ctx, f"index_topk{B}{N}")
            scores = g.randn(B, N, dtype=torch.bfloat16)
            n_valid = g.randint(1, N + 1, (B,), dtype=torch.int32)
            return (scores, min(c.index_topk, N)), dict(n_valid=n_valid)
        return Case(f"B={B} N={N}", make, _both("picks"), {"picks": Tol(exact=True)})
    return [case(B, N) for B, N in _rows(ctx, ((2, 2048),), ((2, 2048), (1, 16384), (64, 1024)))]


def decode_meta(ctx: Context):
    c = ctx.cfg

    def make():
        g = _Gen(ctx, "decode_meta")
        ratios = sorted({r for r in c.compress_ratios if r})
        B, W, max_pos = 3, 8, 8 * BLOCK_TOKENS
        rope_reqs = [(0, 0)] + [(1, 1 - r) for r in ratios]
        write_reqs = [(r, BLOCK_TOKENS // r) for r in ratios]
        vis = [(r, BLOCK_TOKENS // r) for r in ratios if r != 4][:2]
        plan = MetaPlan(rope_reqs, write_reqs, vis, W, ctx.device)
        tables = g.randn(2, TABLE_NEG + max_pos, 64)
        bt = g.perm(4 * W)[:B * W].view(B, W).clone()
        bt[2, 3:] = -1
        return (g.randint(0, max_pos - 1, (B,)), g.perm(B + 2)[:B], bt, tables, plan, 4 * W), {}

    def outputs(m, a, kw):
        d = {"win_slot": m.win_slot, "widx": m.widx, "n_valid": m.n_valid}
        for i, (cs, sn) in enumerate(m.rope):
            d[f"rope{i}"] = torch.cat([cs, sn], 1)
        d.update({f"write{i}": w for i, w in enumerate(m.write_ids)})
        d.update({f"visible{i}": v for i, v in enumerate(m.visible)})
        return d

    return [Case("B=3", make, outputs, {"*": Tol(exact=True)})]


class _Lin(SimpleNamespace):
    """A linear layer's stored form, as ``layers.linear`` holds it (kind, weight, scale, members)."""

    def spans(self):
        r = 0
        for n, o in self.members:
            yield n, r, r + o
            r += o


def _fp8_lin(g, members, K):
    N = sum(o for _, o in members)
    w, s = g.fp8_weight(N, K)
    return _Lin(kind="fp8", weight=w, scale=s, members=members, out_features=N, in_features=K)


def linear(ctx: Context):
    c = ctx.cfg
    H = _local(c.num_attention_heads, ctx.world)
    G = _local(c.o_groups, ctx.world)
    shapes = [("wq_a|wkv", [("wq_a", c.q_lora_rank), ("wkv", c.head_dim)], c.hidden_size),
              ("wq_b", [("wq_b", H * c.head_dim)], c.q_lora_rank),
              ("wo_b", [("wo_b", c.hidden_size)], G * c.o_lora_rank)]
    rows = _rows(ctx, (2,), (1, 4, 16, 64, 65, 256))
    out = []
    for label, members, K in shapes:
        for M in rows:
            def make(members=members, K=K, M=M):
                g = _Gen(ctx, f"linear{members[0][0]}{M}")
                return (_fp8_lin(g, members, K), g.randn(M, K, dtype=torch.bfloat16)), {}
            # one bf16 rounding, plus the FP8 MMA's ~14-bit 128-K partials on Hopper (tests/test_gemm.py)
            out.append(Case(f"{label} M={M}", make, _both("y"), {"y": Tol(max_rel=2.0 ** -5, per_row=True)}))

    def make_bf16(M=rows[0]):                     # the fp32-output GEMM of a bf16-stored linear (compressor proj)
        g = _Gen(ctx, f"linear_bf16{M}")
        N = 2 * c.head_dim
        lin = _Lin(kind="fp32", weight=g.randn(N, c.hidden_size, scale=0.05, dtype=torch.bfloat16), scale=None,
                   members=[("proj", N)], out_features=N, in_features=c.hidden_size)
        return (lin, g.randn(M, c.hidden_size, dtype=torch.bfloat16)), {}
    out.append(Case(f"bf16->fp32 M={rows[0]}", make_bf16, _both("y"), {"y": Tol(max_rel=1e-4)}))
    return out


def wo_a(ctx: Context):
    c = ctx.cfg
    H = _local(c.num_attention_heads, ctx.world)
    G = _local(c.o_groups, ctx.world)
    D = H * c.head_dim // G

    def case(T):
        def make():
            g = _Gen(ctx, f"wo_a{T}")
            lin = _fp8_lin(g, [("wo_a", G * c.o_lora_rank)], D)
            grp = SimpleNamespace(groups=G, rank=c.o_lora_rank, fmt="fp8", lin=lin)
            return (grp, g.randn(T, G, D, dtype=torch.bfloat16)), {}
        return Case(f"T={T} G={G}", make, _both("z"), {"z": Tol(max_rel=2.0 ** -5, per_row=True)})
    return [case(T) for T in _rows(ctx, (2,), (1, 2, 64, 256))]


def moe(ctx: Context):
    c = ctx.cfg
    fmt = ctx.expert_format
    E = min(c.n_routed_experts, 8)
    k = min(c.num_experts_per_tok, E)
    d, I = c.hidden_size, c.moe_intermediate_size

    def layer(g, hash_layer):
        w13, w13_s, w13_s2 = g.fp4_weight(E, 2 * I, d, fmt)
        w2, w2_s, w2_s2 = g.fp4_weight(E, d, I, fmt)
        sh13, sh13_s = g.fp8_weight(2 * I, d)
        sh2, sh2_s = g.fp8_weight(d, I)
        tid2eid = torch.stack([g.perm(E)[:k] for _ in range(64)]).to(torch.int32) if hash_layer else None
        return SimpleNamespace(
            gate_w=g.randn(E, d, scale=d ** -0.5), bias=None if hash_layer else g.randn(E, scale=0.1),
            tid2eid=tid2eid, topk=k, route_scale=float(c.routed_scaling_factor), limit=float(c.swiglu_limit),
            fmt=fmt, w13=w13, w13_s=w13_s, w13_s2=w13_s2, w2=w2, w2_s=w2_s, w2_s2=w2_s2, sh13=sh13, sh13_s=sh13_s,
            sh2=sh2, sh2_s=sh2_s, expert0=0, n_experts=E, n_total=E, inter=I, dim=d, group=SINGLE)

    def case(T, hash_layer):
        def make():
            g = _Gen(ctx, f"moe{T}{hash_layer}")
            return (layer(g, hash_layer), g.randn(T, d, dtype=torch.bfloat16), g.randint(0, 64, (T,))), {}
        # routing ids equal (barring a near-tie within an ulp of the scores), each expert output within
        # bf16 rounding (a one-ulp flip of a bf16 w1 / w3 output can move h by one FP8 step, which moves
        # the whole row a little): each token within 5% of its largest value (tests/test_moe.py's bound)
        return Case(f"T={T} E={E}{' hash' if hash_layer else ''} {fmt}", make, _both("y"),
                    {"y": Tol(max_rel=0.05, per_row=True)})
    return [case(T, h) for T, h in _rows(ctx, ((2, False),), ((1, False), (2, True), (16, False), (256, False)))]


CASES = {f.__name__: f for f in (hc_pre, hc_post, hc_head, hc_post_pre, rms_norm, rms_norm_pair, kv_insert, entry_ids, inverse_rope,
                                  sparse_decode, sparse_prefill, compress_decode, compress_prefill, index_q_prologue,
                                  index_scores, index_topk, decode_meta, linear, wo_a, moe)}


def cases(name: str, ctx: Context) -> list[Case]:
    if ctx.mode not in MODES:
        raise ValueError(f"kernel check mode must be one of {MODES}, got {ctx.mode!r}")
    return CASES[name](ctx)


__all__ = ["CASES", "Case", "Context", "MODES", "Tol", "cases", "compare"]
