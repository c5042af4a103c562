"""Device-side helpers shared by the kernel files, and the one device probe.

Every name here is public: kernel files import them from here and never from each other.

* ``triton_available()`` / ``interpreting()``: triton imports; the CPU interpreter is on
  (``TRITON_INTERPRET=1``: kernels then take their fp32 paths for dots and integer rounding for
  casts, because the interpreter mishandles bf16 arithmetic, bf16 ``tl.dot`` and fp8 casts).
* ``target(device)``: the one probe of where a launch runs (``Target``: compiled CUDA, the
  interpreter, or neither; compute capability, SM count, shared memory per block, name), cached per
  device. Launchers and routers read only this; ``aot_target(cap)`` builds the same facts for an
  offline compile target (the AOT tests and the routers' enumeration of their choices).
* bit-exact number helpers (``rne_bf16``, ``e4m3_bits``, ``ue8m0_exp``, ``exp2i``, ``quant_rows``,
  ``store_bf16``, FP4 ``e2m1_*`` / ``fp4_qdq_blocks``), RoPE rows, the SwiGLU middle, the grouped
  (MoE) tile enumeration, and ``asm_text`` for inline PTX blocks.
* programmatic dependent launch (``DSV4_PDL``, on by default on sm_90+): ``pdl_wait()`` opens every launched
  kernel, ``PDL_LAUNCH`` goes into every launch (module ``pdl_mode`` doc).

Numbers are rounded on their bits (round to nearest even) so that the GPU and the CPU interpreter,
whose bf16 and fp8 casts truncate / mis-round, give the same values.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..formats.kv_entry import NOPE_DIM

QBLOCK = 128        # FP8 activation / weight block

# the largest shared memory one block may use (opt-in), bytes, by compute capability: what a
# kernel's compiled ``shared`` must not exceed to launch there (CUDA programming guide, table of
# technical specifications per compute capability)
SMEM_PER_BLOCK = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 103: 232448,
                  120: 101376, 121: 101376}


@lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Triton's Gluon language (the tensor-core decode kernels) imports."""
    if not triton_available():
        return False
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Target:
    """Where kernels launch: ``kind`` 'cuda' (compiled for ``capability``), 'interpreter' (the CPU
    interpreter) or 'none' (no triton, or a CPU tensor without the interpreter). Off a GPU the
    capability is (0, 0) and ``sm_count`` 4 (small, so the CPU tests take the split-K paths)."""
    kind: str
    capability: tuple[int, int] = (0, 0)
    sm_count: int = 4
    smem_per_block: int = 0
    name: str = ""
    hip: bool = False

    @property
    def compiled(self) -> bool:
        return self.kind == "cuda"

    @property
    def sm(self) -> int:
        """The capability as one number (sm_90 -> 90)."""
        return self.capability[0] * 10 + self.capability[1]

    def at_least(self, cap: tuple[int, int]) -> bool:
        return self.compiled and tuple(self.capability) >= tuple(cap)

    @property
    def use_asm(self) -> bool:
        """Inline PTX may be used (compiled for NVIDIA)."""
        return self.compiled and not self.hip

    @property
    def gluon_mma(self) -> bool:
        """The Gluon ``mma.sync`` decode kernels run here: NVIDIA sm_89+ (e4m3 -> f16 conversions)."""
        return self.use_asm and self.capability >= (8, 9) and gluon_available()

    def describe(self) -> str:
        if self.compiled:
            return f"{self.name} (sm_{self.sm})"
        return "the Triton interpreter (CPU)" if self.kind == "interpreter" else "no kernels (CPU)"


@lru_cache(maxsize=None)
def _cuda_target(index: int) -> Target:
    p = torch.cuda.get_device_properties(index)
    cap = (p.major, p.minor)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or SMEM_PER_BLOCK.get(cap[0] * 10 + cap[1], 0)
    return Target("cuda", cap, p.multi_processor_count, int(smem), p.name, torch.version.hip is not None)


def target(device) -> Target:
    """The probe (module doc): one per device, cached."""
    device = torch.device(device)
    if interpreting():
        return Target("interpreter", name="Triton interpreter") if triton_available() else Target("none")
    if device.type != "cuda" or not triton_available():
        return Target("none", name=device.type)
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


def aot_target(cap: int, sm_count: int = 132) -> Target:
    """The ``Target`` of an offline compile for sm_``cap`` (routers enumerate their choices on it)."""
    return Target("cuda", (cap // 10, cap % 10), sm_count, SMEM_PER_BLOCK[cap], f"sm_{cap}")


@dataclass(frozen=True)
class Choice:
    """One kernel configuration a router can pick (the AOT tests compile each one per target): the
    kernel (a name the tests map to its jitted function), the constexprs that change its code, its
    launch warps and pipelining stages, and why it is picked."""
    kernel: str
    const: tuple = ()
    num_warps: int = 4
    num_stages: int | None = None
    why: str = field(default="", compare=False)

    @classmethod
    def of(cls, kernel: str, const: dict, cfg: dict, why: str = "") -> "Choice":
        return cls(kernel, tuple(sorted(const.items())), cfg.get("num_warps", 4), cfg.get("num_stages"), why)

    @property
    def constexprs(self) -> dict:
        return dict(self.const)


def cuda_ok(min_capability: tuple[int, int] = (8, 0)) -> bool:
    """A CUDA GPU of compute capability >= ``min_capability`` runs compiled Triton kernels."""
    if not torch.cuda.is_available():
        return False
    return target("cuda").at_least(min_capability)


def u8(t: torch.Tensor) -> torch.Tensor:
    """The uint8 view of a byte tensor (e4m3, e8m0, packed FP4)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def pdl_mode() -> bool:
    """Programmatic dependent launch (sm_90+), read once from ``DSV4_PDL`` at import. Unset (the default),
    '1' or 'on': on where the first CUDA device is sm_90 or newer and the interpreter is off; '0' / 'off'
    turns it off; 'force' turns it on regardless (offline compiles for sm_90 / sm_100). On by default
    because the H200 measured it (2026-12-05): the same tokens and log-probs as off (GPU test), the
    batch-1 decode step 5.5% faster, the batch-64 step unchanged.

    Contract when on: every Triton launch of the package carries ``launch_pdl=True`` (``PDL_LAUNCH``)
    and every launched kernel's first statement is ``pdl_wait()``: ``griddepcontrol.wait`` (nothing of
    the kernel, no load and no store, runs before its predecessor in the stream has finished and its
    writes are visible), then ``griddepcontrol.launch_dependents`` (the next launch may be scheduled
    as soon as all of this grid's programs have started, so its launch and ramp overlap this kernel's
    run). Waiting first makes each kernel as ordered as a plain launch: the gain is the launch gap, not
    early reads. Kernels launched without the attribute (torch's, cuBLAS, NCCL, the Gluon kernels)
    start only after their predecessor completes, as always; a kernel after them waits on them.
    Any other value is refused (a typo must not silently pick a mode)."""
    mode = os.environ.get("DSV4_PDL", "").strip().lower()
    if mode == "force":
        return True
    if mode in ("0", "off", "false"):
        return False
    if mode not in ("", "1", "on", "true"):
        raise ValueError(f"DSV4_PDL={mode!r}: expected 1 / on (the default), 0 / off, or force")
    if interpreting() or not triton_available():
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (9, 0)


PDL_ON = pdl_mode()
PDL_LAUNCH = {"launch_pdl": True} if PDL_ON else {}
# The Gluon decode GEMVs (``fp4_mma``'s grouped GEMV, ``fp8_mma``) launch with PDL only up to this many programs
# per SM (``pdl_launch``). H100, ``decode_step.py --layers 4 --ctx 8192`` (2026-12-06, one process, the attribute
# dropped per module): the grouped GEMV with PDL 1069.9 / 6223.7 us at batch 1 / 64, without 1095.8 / 5695.5;
# fp8_mma 1069.9 / 6223.7 with, 1076.1 / 6141.5 without. At batch 1 their grids are ~6 programs per SM; at batch
# 64 the grouped GEMV's is ~19,000 (~150 per SM; a host bound of 304 m-tiles, ~200 of them with rows, x 64 columns).
PDL_MAX_PROGRAMS_PER_SM = 8


def pdl_launch(grid, t) -> dict:
    """``PDL_LAUNCH`` for a grid of at most ``PDL_MAX_PROGRAMS_PER_SM`` programs per SM of ``t``
    (``lib.Target``), no attribute above (the kernel's ``pdl_wait()`` is then a no-op: a plain launch)."""
    return PDL_LAUNCH if math.prod(grid) <= PDL_MAX_PROGRAMS_PER_SM * t.sm_count else {}


# Static weights' L2 prefetch before ``pdl_wait()`` (``prefetch_l2``): the weight kernels of the decode step
# (hc_post_pre's mixing weights, the dense FP8 GEMV and MMA kernels, the router's gate) hint their first
# weight lines while their predecessor still runs. Only with PDL (without it nothing runs before the wait
# anyway); read at each launch (benchmarks/decode_step.py --prefetch toggles it in one process). Off by
# default: H100, ``decode_step.py --layers 4 --ctx 8192 --prefetch on,off`` (2026-12-06, one process) 1093.6 vs
# 1094.5 us at batch 1, 6301.2 vs 6157.0 at batch 64 (per-op mHC sites: 6277.1 vs 6185.4).
PREFETCH = False


def prefetch_on() -> bool:
    return PREFETCH and PDL_ON


def asm_text(lines) -> str:
    """One inline-PTX block of ``lines``."""
    return "{ " + "\n".join(lines) + " }"


if triton_available():
    import triton
    import triton.language as tl

    NOPE_DIM_C = tl.constexpr(NOPE_DIM)
    PDL_C = tl.constexpr(PDL_ON)

    @triton.jit
    def prefetch_l2(ptrs, mask):
        """An L2 prefetch hint (``prefetch.global.L2::evict_last``) of the lines holding ``ptrs`` where
        ``mask``: no value, no ordering. The one thing a kernel may do before ``pdl_wait()`` (test_pdl),
        on static weights: their bytes are not written by the predecessor, and a hint returns nothing
        that could be stale (the later loads read L2, the point of coherence). sm_80+."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.b32 $0, 0; }",
            "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def split_live(mask, s, S):
        """``mask & (s < S)`` as a tensor of mask's shape (the interpreter mishandles a scalar condition in
        a load mask): the split-K tails' masked extra loads, a row block's rows past the last."""
        return mask & ((mask.to(tl.int32) * 0 + s) < S)

    @triton.jit
    def add_splits4(acc, ptrs, plane, mask, s0, S):
        """acc + the fp32 split-K partials at ``ptrs + j * plane`` for splits s0 + j < S, j = 0..3, added in
        split order (a masked one adds +0.0: the bits of one load a step); the four loads issue together,
        one L2 round trip instead of four (``.cg``: written by other programs)."""
        v0 = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        v1 = tl.load(ptrs + plane, mask=split_live(mask, s0 + 1, S), other=0.0, cache_modifier=".cg")
        v2 = tl.load(ptrs + 2 * plane, mask=split_live(mask, s0 + 2, S), other=0.0, cache_modifier=".cg")
        v3 = tl.load(ptrs + 3 * plane, mask=split_live(mask, s0 + 3, S), other=0.0, cache_modifier=".cg")
        acc += v0
        acc += v1
        acc += v2
        acc += v3
        return acc

    @triton.jit
    def pdl_wait():
        """The first statement of every launched kernel (``pdl_mode`` doc); nothing when PDL is off."""
        if PDL_C:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    # ------------------------------------------------------------------------------ numbers
    @triton.jit
    def rne_bf16(x):
        """fp32 -> the fp32 value of its bf16 round-to-nearest-even (finite inputs), on the bits."""
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def e4m3_bits(v):
        """fp32 v (|v| <= 448, finite) -> e4m3fn byte (int32) with round-to-nearest-even, in integer
        arithmetic: the same bytes as ``torch.float8_e4m3fn`` casts and the GPU's cvt.rn.satfinite,
        and also right under the CPU interpreter (whose fp8 cast mis-rounds exponent carries)."""
        b = v.to(tl.uint32, bitcast=True)
        sign = ((b >> 31) << 7).to(tl.int32)
        a = tl.abs(v)
        ab = a.to(tl.int32, bitcast=True)
        # normal range (|v| >= 2^-6): round the fp32 mantissa to 3 bits; carries move the exponent
        r = ab + 0x7FFFF + ((ab >> 20) & 1)
        normal = (r >> 20) - ((127 - 7) << 3)
        # subnormal range: an integer multiple of 2^-9 (exact product; + 2^23 rounds to even)
        sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        mag = tl.where(a < 0.015625, sub, normal)
        return sign | mag

    @triton.jit
    def ue8m0_exp(amax):
        """e with 2^e = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))), read off the fp32 bits (exact)."""
        v = tl.maximum(amax, 1e-4) * (1.0 / 448.0)          # fp32 product, as the official code
        bits = v.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def exp2i(e):
        """exact fp32 2^e for integer e in [-126, 127]."""
        return ((127 + e) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def quant_rows(x, INTERP: tl.constexpr):
        """fp32 x [R, 128] (one quantisation block per row) -> (e4m3 [R, 128], e int32 [R]);
        scale = 2^e, values clamp(x * 2^-e, +-448) rounded to nearest even (the official act_quant)."""
        e = ue8m0_exp(tl.max(tl.abs(x), axis=1))
        v = x * exp2i(-e)[:, None]
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        if INTERP:   # the interpreter's fp8 cast mis-rounds: integer RNE (e4m3_bits)
            q = e4m3_bits(v).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        else:        # cvt.rn.satfinite: round to nearest even
            q = v.to(tl.float8e4nv)
        return q, e

    @triton.jit
    def quant_blocks(X, Q, S, row, b0, nb, stride_x, stride_q, stride_s, BLOCKS: tl.constexpr,
                     INTERP: tl.constexpr):
        """Row ``row``'s 128-blocks b0 .. b0 + BLOCKS (< nb) of bf16 X -> e4m3 bytes Q and fp32 scales S."""
        blk = b0 + tl.arange(0, BLOCKS)
        bm = blk < nb
        cols = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
        x = tl.load(X + row * stride_x + cols, mask=bm[:, None], other=0.0).to(tl.float32)
        q, e = quant_rows(x, INTERP)
        tl.store(S + row * stride_s + blk, exp2i(e), mask=bm)
        tl.store(Q + row * stride_q + cols, q.to(tl.uint8, bitcast=True), mask=bm[:, None])

    @triton.jit
    def store_bf16(ptrs, acc, mask, INTERP: tl.constexpr):
        """Store fp32 ``acc`` as bf16, round to nearest even (also under the interpreter)."""
        if INTERP:   # the interpreter's bf16 cast truncates
            acc = rne_bf16(acc)
        tl.store(ptrs, acc.to(tl.bfloat16), mask=mask)

    # ------------------------------------------------------------------------------ FP4 (e2m1)
    @triton.jit
    def e2m1_code(a):
        """|v| (<= 6) -> e2m1 magnitude code 0..7, nearest, ties to the even code (fp4_qdq's rule)."""
        c = (a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
            + (a > 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) \
            + (a > 5.0).to(tl.int32)
        c += ((a == 0.75) | (a == 1.75) | (a == 3.5)).to(tl.int32)
        return c

    @triton.jit
    def e2m1_value(c):
        """e2m1 magnitude code 0..7 -> its value (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
        cf = c.to(tl.float32)
        return tl.where(c < 4, cf * 0.5, tl.where(c < 7, cf - 2.0, 6.0))

    @triton.jit
    def ue8m0_exp6(amax):
        """e with 2^e = pow2_ceil(max(amax, 6*2^-126) * fp32(1/6)) (fp4_qdq's scale), from the bits."""
        v = tl.maximum(amax, 6.0 * 2.0 ** -126) * (1.0 / 6.0)
        bits = v.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def fp4_qdq_blocks(xb):
        """fp4_qdq of xb [NB, 32] fp32 (bf16 values): returns (qdq fp32, code|sign<<3 int32, scale exp)."""
        e = ue8m0_exp6(tl.max(tl.abs(xb), axis=1))
        v = tl.minimum(tl.maximum(xb * exp2i(-e)[:, None], -6.0), 6.0)
        code = e2m1_code(tl.abs(v))
        sgn = v.to(tl.uint32, bitcast=True) & 0x80000000
        q = (e2m1_value(code).to(tl.uint32, bitcast=True) | sgn).to(tl.float32, bitcast=True)
        return q * exp2i(e)[:, None], code | (sgn >> 28).to(tl.int32), e

    @triton.jit
    def e2m1_f16(b, USE_ASM: tl.constexpr):
        """packed e2m1 bytes [R, C] -> (low nibbles, high nibbles) as f16 [R, C], value * 2^-6, exact:
        a code c becomes the e4m3 byte (c & 8) << 4 | (c & 7) << 2 (0.5 lands on the e4m3 subnormal
        2^-7), whose f16 conversion is exact; USE_ASM: four bytes per word in inline PTX."""
        if USE_ASM:
            lo = tl.inline_asm_elementwise(
                "{ .reg .b32 t, u; .reg .b16 l, h;\n"
                "and.b32 t, $2, 0x08080808; shl.b32 t, t, 4;\n"
                "and.b32 u, $2, 0x07070707; shl.b32 u, u, 2; or.b32 t, t, u;\n"
                "mov.b32 {l, h}, t; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
                "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t, u; .reg .b16 l, h;\n"
                "and.b32 t, $2, 0x80808080; shr.b32 u, $2, 2; and.b32 u, u, 0x1C1C1C1C; or.b32 t, t, u;\n"
                "mov.b32 {l, h}, t; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
                "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
        else:
            lo8 = ((b & 8) << 4) | ((b & 7) << 2)
            hi8 = (b & 0x80) | ((b >> 2) & 0x1C)
            lo = lo8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            hi = hi8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return lo, hi

    # ------------------------------------------------------------------------------ RoPE, SwiGLU
    @triton.jit
    def rotate_pairs(x0, x1, c, s):
        """(x0 c - x1 s, x0 s + x1 c): interleaved pairs (x0 even, x1 odd dims) rotated; each product and
        sum rounded on its own where the launch disables FMA contraction (the reference's complex64 multiply)."""
        return x0 * c - x1 * s, x0 * s + x1 * c

    @triton.jit
    def rope_rows(x, cos_ptr, sin_ptr, ROWS: tl.constexpr, NEG_SIN: tl.constexpr):
        """Rotate the interleaved pairs of the last 64 of 512 dims of x [ROWS, 512] fp32; returns
        fp32 [ROWS, 512] (dims 0..447 untouched, also the sign of zeros)."""
        x2 = tl.reshape(x, [ROWS, 256, 2])
        x0, x1 = tl.split(x2)                               # [ROWS, 256] even / odd dims
        j = tl.arange(0, 256)
        is_rope = j >= (NOPE_DIM_C // 2)
        c = tl.load(cos_ptr + (j - NOPE_DIM_C // 2), mask=is_rope, other=1.0)
        s = tl.load(sin_ptr + (j - NOPE_DIM_C // 2), mask=is_rope, other=0.0)
        if NEG_SIN:
            s = -s
        y0, y1 = rotate_pairs(x0, x1, c[None, :], s[None, :])
        y0 = tl.where(is_rope[None, :], y0, x0)
        y1 = tl.where(is_rope[None, :], y1, x1)
        return tl.reshape(tl.join(y0, y1), [ROWS, 512])

    @triton.jit
    def swiglu_h(g_acc, u_acc, pw, limit, HAS_W: tl.constexpr):
        """Official routed/shared expert middle (spec §8): w1/w3 outputs rounded to bf16, upcast,
        u clamped to +-limit, g to <= limit, silu(g) * u in fp32, times the routing weight, rounded
        to bf16 once. Returns the fp32 value of that bf16 [BM, 128]."""
        g = rne_bf16(g_acc)
        u = rne_bf16(u_acc)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
        h = tl.math.div_rn(g, 1.0 + tl.exp(-g)) * u
        if HAS_W:
            h = pw[:, None] * h
        return rne_bf16(h)

    # ------------------------------------------------------------------------------ tiles
    @triton.jit
    def find_tile(TCUM, OFFS, t, n_groups, BM: tl.constexpr, LOG2G: tl.constexpr):
        """grouped mode: (expert, first row, end row) of m-tile t (binary search in TCUM, the
        inclusive prefix sum of per-expert tile counts, TCUM[0] = 0)."""
        lo = 0
        hi = n_groups
        for _ in tl.static_range(LOG2G):
            mid = (lo + hi) // 2
            right = tl.load(TCUM + mid + 1) <= t
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(right, hi, mid)
        e = tl.minimum(lo, n_groups - 1)
        m0 = tl.load(OFFS + e) + (t - tl.load(TCUM + e)) * BM
        m_end = tl.load(OFFS + e + 1)
        return e, m0, m_end

    @triton.jit
    def tile_rows(TCUM, OFFS, M, t, n_groups, BM: tl.constexpr, LOG2G: tl.constexpr, GROUPED: tl.constexpr):
        """(expert, first row, end row, live) of m-tile t: grouped (``find_tile``; tiles past the
        real count are not live) or plain (tile t of M rows, expert 0)."""
        if GROUPED:
            live = t < tl.load(TCUM + n_groups)
            e, m0, m_end = find_tile(TCUM, OFFS, t, n_groups, BM, LOG2G)
        else:
            live = t >= 0
            e = t * 0
            m0 = t * BM
            m_end = M + t * 0
        return e, m0, m_end, live

    @triton.jit
    def grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of output tile ``tile`` in grouped order (GROUP_M row blocks per group: the
        programs running together share weight column blocks in L2)."""
        width = GROUP_M * num_n
        first_m = (tile // width) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % width) % gsize, (tile % width) // gsize


__all__ = ["Choice", "PDL_LAUNCH", "PDL_MAX_PROGRAMS_PER_SM", "PDL_ON", "PREFETCH", "QBLOCK", "SMEM_PER_BLOCK", "Target", "aot_target", "asm_text", "pdl_launch", "cuda_ok",
           "gluon_available", "interpreting", "pdl_mode", "prefetch_on", "target", "triton_available", "u8"]
