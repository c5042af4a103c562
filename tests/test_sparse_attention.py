"""Sparse attention kernels (dsv4/kernels/sparse_attention.py: decode and prefill over the paged FP8
window and compressed caches) against the torch twin.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA, and the ``gpu``-marked tests add real shapes. The AOT test compiles every
attention-path kernel (kv_insert, sparse attention + combine, inverse RoPE) for sm_90 and sm_100
without a GPU.
"""
import textwrap
from pathlib import Path

import pytest
from kernel_helpers import bits, kernel_device, need_gpu, run_aot_script
import torch

triton = pytest.importorskip("triton")

from dsv4.formats.kv_entry import page_bytes, write_kv_entries  # noqa: E402
from dsv4.kernels.sparse_attention import sparse_decode, sparse_prefill  # noqa: E402
from dsv4.twins.sparse_attention import sparse_decode as sparse_attention_twin  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

DEV = kernel_device()


class Caches:
    """Per-sequence window rings (128 slots) and compressed entries, each behind a shuffled page
    table, in two paged FP8 caches filled with poison bytes except where entries were written."""

    def __init__(self, n_seq, n_extra, wB, eB, gen, device=DEV, win=128):
        self.wB, self.eB, self.win = wB, eB, win
        w_pages_per_seq = -(-win // wB)
        e_pages_per_seq = max(1, -(-n_extra // eB))
        nw, ne = n_seq * w_pages_per_seq + 1, n_seq * e_pages_per_seq + 1
        self.w_table = torch.randperm(nw, generator=gen)[:n_seq * w_pages_per_seq].view(n_seq, -1)
        self.e_table = torch.randperm(ne, generator=gen)[:n_seq * e_pages_per_seq].view(n_seq, -1)
        wp = torch.randint(0, 256, (nw, page_bytes(wB)), dtype=torch.uint8, generator=gen)
        ep = torch.randint(0, 256, (ne, page_bytes(eB)), dtype=torch.uint8, generator=gen)
        for s in range(n_seq):
            wslots = self.wslot(s, torch.arange(win))
            write_kv_entries(wp, wslots, self._rows(win, gen), wB)
            if n_extra:
                eslots = self.eslot(s, torch.arange(n_extra))
                write_kv_entries(ep, eslots, self._rows(n_extra, gen), eB)
        self.wp, self.ep = wp.to(device), ep.to(device)
        self.wp_cpu, self.ep_cpu = wp, ep

    @staticmethod
    def _rows(n, gen):
        x = torch.randn(n, 512, generator=gen) * torch.rand(n, 1, generator=gen) * 3
        return x.bfloat16()

    def wslot(self, s, ring):
        return self.w_table[s, ring // self.wB] * self.wB + ring % self.wB

    def eslot(self, s, j):
        return self.e_table[s, j // self.eB] * self.eB + j % self.eB

    def window_idx(self, s, pos):
        """decode layout: oldest -> newest ring slots of positions pos-127..pos, -1 padded."""
        k = torch.arange(self.win)
        p = pos - (self.win - 1) + k if pos >= self.win - 1 else k
        ok = p <= pos
        return torch.where(ok, self.wslot(s, p.clamp(min=0) % self.win), -1)

    def extra_idx(self, s, n_avail, width, kind, gen):
        """CSA: random top-k order over the available entries; HCA: all of them in order; -1 pad."""
        out = torch.full((width,), -1, dtype=torch.int64)
        if kind == "csa":
            pick = torch.randperm(n_avail, generator=gen)[:width] if n_avail else torch.zeros(0, dtype=torch.long)
        else:
            pick = torch.arange(min(n_avail, width))
        if len(pick):
            out[:len(pick)] = self.eslot(s, pick)
        return out


def _decode_case(n_seq, s_q, H, extra_width, kind, gen, positions, n_extra=None, device=DEV,
                 wB=16, eB=8):
    n_extra = n_extra if n_extra is not None else max(1, extra_width)
    cache = Caches(n_seq, n_extra, wB, eB, gen, device)
    widx, eidx = [], []
    ratio = 4 if kind == "csa" else 128
    for s in range(n_seq):
        for i in range(s_q):
            pos = positions[s] - (s_q - 1) + i
            widx.append(cache.window_idx(s, pos))
            n_avail = min(n_extra, (pos + 1) // ratio)
            eidx.append(cache.extra_idx(s, n_avail, extra_width, kind, gen))
    widx = torch.stack(widx).int()
    eidx = torch.stack(eidx).int()
    T = n_seq * s_q
    q = (torch.randn(T, H, 512, generator=gen) * 0.5).bfloat16()
    sinks = torch.randn(H, generator=gen)
    return cache, q, widx, eidx, sinks


def _compare(out, ref, tol=1e-2):
    out, ref = out.float().cpu(), ref.float().cpu()
    assert torch.isfinite(out).all()
    err = (out - ref).norm() / ref.norm().clamp(min=1e-30)
    assert err < tol, f"relative error {err:.3e}"
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max() + 1e-6


def _run_decode(cache, q, widx, eidx, sinks, device=DEV, **kw):
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=device)  # poison
    o = sparse_decode(q.to(device), widx.to(device), cache.wp, cache.wB, eidx.to(device), cache.ep,
                      cache.eB, sinks.to(device), out=out, **kw)
    ref = sparse_attention_twin(q, widx, cache.wp_cpu, cache.wB, eidx, cache.ep_cpu, cache.eB, sinks)
    return o, ref


@pytest.mark.parametrize("H,s_q,kind", [(8, 1, "csa"), (8, 2, "hca"), (64, 2, "csa"), (128, 1, "hca")])
def test_sparse_decode(H, s_q, kind):
    gen = torch.Generator().manual_seed(H + s_q)
    # seq 0: window wrapped (pos >= 127), more entries than the list holds; seq 1: short prompt
    # (window -1 padded, fewer compressed entries than the list width); seq 2 (H=8): no entry yet
    small = H == 8
    positions = [300, 40, 2][: (3 if small else 2)]
    width = 24 if small else 16
    cache, q, widx, eidx, sinks = _decode_case(len(positions), s_q, H, width, kind, gen, positions,
                                               n_extra=80)
    if small:
        eidx[0, 3] = -1                                     # a hole inside a list
    for ns in ([1, 3, None] if small else [None]):
        o, ref = _run_decode(cache, q, widx, eidx, sinks, num_splits=ns)
        _compare(o, ref)


def test_sparse_decode_block32_dsplit_and_no_extra():
    gen = torch.Generator().manual_seed(7)
    cache, q, widx, eidx, sinks = _decode_case(2, 2, 8, 20, "csa", gen, [200, 3], n_extra=60)
    o, ref = _run_decode(cache, q, widx, eidx, sinks, num_splits=2, config={"block_n": 32})
    _compare(o, ref)
    for ns in (1, 2):   # output dims in two launches (the sm_100 layout); list prefetch on/off
        o, ref = _run_decode(cache, q, widx, eidx, sinks, num_splits=ns,
                             config={"d_parts": 2, "prefetch": ns == 1})
        _compare(o, ref)
        o, ref = _run_decode(cache, q, widx, eidx, sinks, num_splits=ns, config={"prefetch": True})
        _compare(o, ref)
    # SWA layer: no extra cache at all
    o = sparse_decode(q.to(DEV), widx.to(DEV), cache.wp, cache.wB, None, None, 64, sinks.to(DEV))
    ref = sparse_attention_twin(q, widx, cache.wp_cpu, cache.wB, None, None, 64, sinks)
    _compare(o, ref)


def test_twin_cuts_unused_block_runs_to_the_same_bits(monkeypatch):
    """The twin cuts every run of 64-column blocks that no row uses to its first block
    (``_collapse_masked_runs``): the reference's bits, sign of zero included. At the reference: keys with -0.0
    and negative values in row 0 (the masked keys' row), runs before, between and after used blocks, a used
    block straddling the lists' boundary, the first block unused, a partial last block, a row with no used
    column. At the twin: decode lists of a wide HCA extra list at short positions, cut against uncut."""
    from dsv4.reference.attention import sparse_attention
    from dsv4.reference.numerics import OFFICIAL
    import dsv4.twins.sparse_attention as tw
    gen = torch.Generator().manual_seed(5)
    kv = (torch.randn(40, 512, generator=gen) * 0.3).bfloat16()
    kv[0, :64] = -kv[0, :64].abs()
    kv[:, 64:80] = -0.0                                # columns of negative zeros in every key
    q = (torch.randn(3, 4, 512, generator=gen) * 0.5).bfloat16()
    sink = torch.randn(4, generator=gen)
    for Kw, Ke, used in ((144, 700, {0: [3, 130], 1: [140, 150, 500], 2: []}),
                         (64, 630, {0: [200], 1: [629], 2: [640]}),
                         (192, 0, {0: [150], 1: [160], 2: []})):
        idx = torch.full((3, Kw + Ke), -1, dtype=torch.int64)
        for r, cols in used.items():
            for c in cols:
                idx[r, c] = int(torch.randint(0, 40, (1,), generator=gen))
        w, e = tw._collapse_masked_runs(idx[:, :Kw], idx[:, Kw:] if Ke else None)
        cut = torch.cat([w] + ([e] if e is not None else []), 1)
        assert cut.shape[1] < idx.shape[1]
        want = sparse_attention(q, kv, idx, sink, 512 ** -0.5, OFFICIAL)
        got = sparse_attention(q, kv, cut, sink, 512 ** -0.5, OFFICIAL)
        assert torch.equal(bits(got), bits(want))
    cache, q, widx, eidx, sinks = _decode_case(2, 1, 8, 1000, "hca", gen, positions=[200, 700], n_extra=1000,
                                               device="cpu")
    got = sparse_attention_twin(q, widx, cache.wp_cpu, cache.wB, eidx, cache.ep_cpu, cache.eB, sinks)
    monkeypatch.setattr(tw, "_collapse_masked_runs", lambda w, e: (w, e))
    want = sparse_attention_twin(q, widx, cache.wp_cpu, cache.wB, eidx, cache.ep_cpu, cache.eB, sinks)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_sparse_decode_all_masked(num_splits):
    gen = torch.Generator().manual_seed(11)
    cache, q, widx, eidx, sinks = _decode_case(2, 1, 8, 8, "csa", gen, [150, 150], n_extra=8)
    widx[1] = -1
    eidx[1] = -1
    sinks[0] = float("-inf")                                # even a -inf sink gives 0, not NaN
    o, ref = _run_decode(cache, q, widx, eidx, sinks, num_splits=num_splits)
    o = o.cpu()
    assert not torch.isnan(o).any()
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    _compare(o[0, 1:], ref[0, 1:])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sparse_decode_fused_inverse_rope(num_splits):
    """``rope=(cos, sin)`` at decode: the output's last 64 dims rotated by -theta in the combine's epilogue (split)
    or the kernel's (one split). Under the interpreter the bits of ``inverse_rope`` on the plain output, and a row
    with every entry masked stays 0; compiled (the rotating launch without FMA contraction) within tolerance. The
    twin's ``rope`` is its ``inverse_rope``."""
    from dsv4.kernels import sparse_attention as sa
    from dsv4.kernels.inverse_rope import inverse_rope
    gen = torch.Generator().manual_seed(17)
    cache, q, widx, eidx, sinks = _decode_case(3, 1, 8, 24, "csa", gen, [300, 40, 150], n_extra=80)
    widx[2] = -1
    eidx[2] = -1
    ang = torch.rand(q.shape[0], 32, generator=gen) * 6.283185307179586
    cos, sin = torch.cos(ang), torch.sin(ang)
    rope = (cos.to(DEV), sin.to(DEV))
    fused, _ = _run_decode(cache, q, widx, eidx, sinks, num_splits=num_splits, rope=rope)
    assert sa.LAST_LAUNCH["num_splits"] == num_splits
    plain, ref = _run_decode(cache, q, widx, eidx, sinks, num_splits=num_splits)
    want = inverse_rope(plain, *rope).view(plain.shape)
    if DEV == "cpu":
        assert torch.equal(fused, want)
    else:
        _compare(fused, want, tol=4e-3)
    assert torch.equal(fused[2].float().cpu(), torch.zeros(8, 512))
    assert not torch.equal(fused[:2, :, 448:], plain[:2, :, 448:])
    from dsv4.twins.inverse_rope import inverse_rope as inverse_rope_twin
    twin = sparse_attention_twin(q, widx, cache.wp_cpu, cache.wB, eidx, cache.ep_cpu, cache.eB, sinks, rope=(cos, sin))
    assert torch.equal(twin, inverse_rope_twin(ref, cos, sin).view(ref.shape))
    _compare(fused[:2], twin[:2])
    with pytest.raises(ValueError, match="cos"):
        _run_decode(cache, q, widx, eidx, sinks, num_splits=num_splits, rope=(rope[0][:2], rope[1]))


def _prefill_case(gen, H=8, n=6):
    """Prefill rows at positions 120..: window (positions max(0, i-127)..i), an HCA-like extra part."""
    cache = Caches(1, 12, 16, 8, gen)
    widx, eidx = [], []
    for i in range(120, 120 + n):
        widx.append(cache.window_idx(0, i))
        eidx.append(cache.extra_idx(0, (i + 1) // 16, 12, "hca", gen))
    widx, eidx = torch.stack(widx).int(), torch.stack(eidx).int()
    q = (torch.randn(n, H, 512, generator=gen) * 0.5).bfloat16()
    return cache, q, widx, eidx, torch.randn(H, generator=gen)


def test_sparse_prefill():
    cache, q, widx, eidx, sinks = _prefill_case(torch.Generator().manual_seed(5))
    o = sparse_prefill(q.to(DEV), widx.to(DEV), cache.wp, 16, eidx.to(DEV), cache.ep, 8, sinks.to(DEV))
    ref = sparse_attention_twin(q, widx, cache.wp_cpu, 16, eidx, cache.ep_cpu, 8, sinks)
    _compare(o, ref)


@pytest.mark.parametrize("d_parts", [1, 2])
def test_sparse_prefill_fused_inverse_rope(d_parts):
    """``rope=(cos, sin)``: the output's last 64 dims of every head rotated by -theta in the kernel's epilogue.
    Under the interpreter the bits of ``inverse_rope`` on the plain output (the same products and sums, rounded
    separately); compiled, the fused launch disables FMA contraction in the whole kernel, so its attention values
    may move by an ulp: within the twin's tolerance there. Every dim but the rotated ones is the plain output's."""
    from dsv4.kernels.inverse_rope import inverse_rope
    from dsv4.twins.sparse_attention import sparse_prefill as twin_prefill
    gen = torch.Generator().manual_seed(11)
    cache, q, widx, eidx, sinks = _prefill_case(gen)
    ang = torch.rand(q.shape[0], 32, generator=gen) * 6.283185307179586
    cos, sin = torch.cos(ang), torch.sin(ang)
    args = (q.to(DEV), widx.to(DEV), cache.wp, 16, eidx.to(DEV), cache.ep, 8, sinks.to(DEV))
    cfg = {"d_parts": d_parts}
    fused = sparse_prefill(*args, config=cfg, rope=(cos.to(DEV), sin.to(DEV)))
    plain = sparse_prefill(*args, config=cfg)
    want = inverse_rope(plain, cos.to(DEV), sin.to(DEV)).view(plain.shape)
    if DEV == "cpu":
        assert torch.equal(fused, want)
    else:
        _compare(fused, want, tol=4e-3)
    assert not torch.equal(fused[..., 448:], plain[..., 448:])
    _compare(fused, twin_prefill(q, widx, cache.wp_cpu, 16, eidx, cache.ep_cpu, 8, sinks, rope=(cos, sin)))
    with pytest.raises(ValueError, match="cos"):
        sparse_prefill(*args, rope=(cos[:2].to(DEV), sin.to(DEV)))


@pytest.mark.parametrize("d_parts", [1, 2])
def test_sparse_prefill_fused_q_transform(d_parts):
    """``q_norm_eps``: q is wq_b's raw output and the kernel applies ``kv_insert``'s q transform (weightless
    head RMSNorm, bf16 op chain, then RoPE) as it loads it. Equal, within the 1-ulp freedom of the squares'
    summation order, to ``kv_insert``'s q fed to the plain kernel, and within tolerance of the twin; the
    transform changes the output (raw q of scale 3, rotated rope dims)."""
    from dsv4.kernels.kv_insert import kv_insert
    from dsv4.twins.sparse_attention import sparse_prefill as twin_prefill
    gen = torch.Generator().manual_seed(13)
    cache, q, widx, eidx, sinks = _prefill_case(gen)
    q = (q.float() * 6).bfloat16()
    ang = torch.rand(q.shape[0], 32, generator=gen) * 6.283185307179586
    cos, sin = torch.cos(ang).to(DEV), torch.sin(ang).to(DEV)
    rest = (widx.to(DEV), cache.wp, 16, eidx.to(DEV), cache.ep, 8, sinks.to(DEV))
    cfg = {"d_parts": d_parts}
    fused = sparse_prefill(q.to(DEV), *rest, config=cfg, rope=(cos, sin), q_norm_eps=1e-6)
    scratch = torch.zeros(1, cache.wp.shape[1], dtype=torch.uint8, device=DEV)
    qn, _ = kv_insert(q.to(DEV), torch.zeros(q.shape[0], 512, dtype=torch.bfloat16, device=DEV), cos, sin,
                      scratch, torch.full((q.shape[0],), -1, dtype=torch.int64, device=DEV), 16)
    two_pass = sparse_prefill(qn, *rest, config=cfg, rope=(cos, sin))
    _compare(fused, two_pass, tol=4e-3)
    if DEV == "cpu":    # a mean one bf16 ulp apart moves a head's whole row: most rows stay bit-equal
        assert (fused == two_pass).all(-1).float().mean() > 0.9
    twin = twin_prefill(q, widx, cache.wp_cpu, 16, eidx, cache.ep_cpu, 8, sinks, rope=(cos.cpu(), sin.cpu()),
                        q_norm_eps=1e-6)
    _compare(fused, twin)
    raw = sparse_prefill(q.to(DEV), *rest, config=cfg, rope=(cos, sin))
    assert (raw.float() - fused.float()).norm() > 0.1 * fused.float().norm()
    for fn in (sparse_prefill, twin_prefill):
        with pytest.raises(ValueError, match="q_norm_eps"):
            fn(q.to(DEV) if fn is sparse_prefill else q, *(rest if fn is sparse_prefill else
               (widx, cache.wp_cpu, 16, eidx, cache.ep_cpu, 8, sinks)), q_norm_eps=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_sparse_prefill_from_bf16_workspaces_gives_the_pages_bits(fused):
    """``kv_bf16``: the lists' entries read from dense bf16 workspaces (``read_entries``: the whole window pool;
    the extra pool's listed slots compacted, the list remapped to their rows) instead of the FP8 pages: the same
    dequantised values, so the same output bits under the interpreter, plain and in the production form (compiled
    for a 16-head tile, Triton's MMA lowering of the two forms differs: an H200 moved 4 of 24,576 outputs by one
    bf16 ulp); a wrong workspace is refused."""
    from dsv4.formats.kv_entry import read_entries
    gen = torch.Generator().manual_seed(17)
    cache, q, widx, eidx, sinks = _prefill_case(gen)
    q = (q.float() * 6).bfloat16()
    ang = torch.rand(q.shape[0], 32, generator=gen) * 6.283185307179586
    kw = dict(rope=(torch.cos(ang).to(DEV), torch.sin(ang).to(DEV)), q_norm_eps=1e-6) if fused else {}
    args = (q.to(DEV), widx.to(DEV), cache.wp, 16, eidx.to(DEV), cache.ep, 8, sinks.to(DEV))
    want = sparse_prefill(*args, **kw)
    uniq, rows = torch.unique(eidx[eidx >= 0], return_inverse=True)
    compact = torch.full_like(eidx, -1)
    compact[eidx >= 0] = rows.int()
    ws = (read_entries(cache.wp, torch.arange(cache.wp.shape[0] * 16, device=DEV), 16),
          read_entries(cache.ep, torch.cat([uniq, uniq.new_full((1,), -1)]).to(DEV), 8))
    assert ws[1].shape == (len(uniq) + 1, 512) and not ws[1][-1].any()      # a -1 slot is a zero row
    got = sparse_prefill(q.to(DEV), widx.to(DEV), cache.wp, 16, compact.to(DEV), cache.ep, 8, sinks.to(DEV),
                         kv_bf16=ws, **kw)
    if DEV == "cpu":
        assert torch.equal(got, want)
    else:
        _compare(got, want, tol=4e-3)
        assert (got == want).float().mean() > 0.99
    from dsv4.twins.sparse_attention import sparse_prefill as twin_prefill
    ckw = {k: tuple(x.cpu() for x in v) if k == "rope" else v for k, v in kw.items()}
    assert torch.equal(twin_prefill(q, widx, cache.wp_cpu, 16, compact, cache.ep_cpu, 8, sinks,
                                    kv_bf16=tuple(w.cpu() for w in ws), **ckw),
                       twin_prefill(q, widx, cache.wp_cpu, 16, eidx, cache.ep_cpu, 8, sinks, **ckw))
    for fn in (sparse_prefill, twin_prefill):
        with pytest.raises(ValueError, match="extra workspace"):
            fn(*args, kv_bf16=(ws[0], ws[1].float()), **kw)


# ------------------------------------------------------------------------------------------------
# ahead-of-time compilation for Hopper and Blackwell (no GPU needed)

_AOT_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    import triton.language as tl
    from kernel_helpers import aot_caps, aot_compile
    from dsv4.kernels import kv_insert as ki, sparse_attention as sa, inverse_rope as ir

    P = lambda t: "*" + t
    cases = [
        (ki._kv_insert_kernel, dict(Q=P("bf16"), KV=P("bf16"), COS=P("fp32"), SIN=P("fp32"), PAGES=P("u8"),
                                    SLOTS=P("i64"), QO=P("bf16"), KVO=P("bf16"), eps="fp32"), dict(HPB=8), 4),
        (sa._sparse_fwd, dict(Q=P("bf16"), WIDX=P("i32"), EIDX=P("i32"), WPAGES=P("u8"), EPAGES=P("u8"),
                              SINK=P("fp32"), O=P("bf16"), OP=P("fp32"), MLP=P("fp32"), COS=P("fp32"),
                              SIN=P("fp32"), qk_scale="fp32"), None, 8),
        # the prefill form: no split, q's norm + RoPE at its load, the fused inverse RoPE in the epilogue
        (sa._sparse_fwd, dict(Q=P("bf16"), WIDX=P("i32"), EIDX=P("i32"), WPAGES=P("u8"), EPAGES=P("u8"),
                              SINK=P("fp32"), O=P("bf16"), OP=P("fp32"), MLP=P("fp32"), COS=P("fp32"),
                              SIN=P("fp32"), qk_scale="fp32", q_eps="fp32"), "prefill", 8),
        # the prefill form reading bf16 workspaces (kv_bf16)
        (sa._sparse_fwd, dict(Q=P("bf16"), WIDX=P("i32"), EIDX=P("i32"), WPAGES=P("bf16"), EPAGES=P("bf16"),
                              SINK=P("fp32"), O=P("bf16"), OP=P("fp32"), MLP=P("fp32"), COS=P("fp32"),
                              SIN=P("fp32"), qk_scale="fp32", q_eps="fp32"), "prefill_bf16", 8),
        (sa._combine, dict(OP=P("fp32"), MLP=P("fp32"), SINK=P("fp32"), O=P("bf16")), dict(HB=8), 4),
        # the decode form: the output's inverse RoPE in the combine
        (sa._combine, dict(OP=P("fp32"), MLP=P("fp32"), SINK=P("fp32"), O=P("bf16"), COS=P("fp32"),
                           SIN=P("fp32")), dict(HB=8, ROPE=True), 4),
        (ir._inverse_rope_kernel, dict(O=P("bf16"), COS=P("fp32"), SIN=P("fp32"), Y=P("bf16"), YQ=P("u8"),
                                       YS=P("fp32")), dict(HPB=4, FP8=True), 4),
    ]
    for cap in aot_caps():
        for fn, types, const, warps in cases:
            if const in (None, "prefill", "prefill_bf16"):   # the tile the launcher picks for 64 heads here
                cfg = sa.default_config(64, (cap // 10, cap % 10))
                pre = const is not None
                const = dict(HB=cfg["block_h"], BN=cfg["block_n"], SPLIT=not pre, DT=tl.bfloat16,
                             INTERP=False, DP=cfg["d_parts"], DHALF=cfg["d_parts"] - 1,
                             PREFETCH=bool(cfg.get("prefetch", False)), ROPE=pre, QNORM=pre,
                             BF16_KV=const == "prefill_bf16")
            ptx, mma = aot_compile(fn, types, const, cap, warps)
            if fn is sa._sparse_fwd:
                assert mma, "the attention kernel should use tensor-core MMAs"
                if cap == 90:
                    assert "wgmma" in ptx, "expected Hopper wgmma for the 64-head tile"
""")


def test_aot_compile_sm90_sm100():
    """Compile every kernel for GPUTarget('cuda', 90, 32) and ('cuda', 100, 32) on this machine."""
    run_aot_script(_AOT_SCRIPT, REPO, timeout=600, TRITON_DEFAULT_FP_FUSION="1")


# ------------------------------------------------------------------------------------------------
# GPU: real shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("H,extra_width,kind,n_seq", [(64, 512, "csa", 8), (128, 1024, "csa", 4),
                                                      (64, 2048, "hca", 2), (8, 512, "csa", 4)])
def test_gpu_sparse_decode_real_shapes(H, extra_width, kind, n_seq):
    _need_gpu()
    gen = torch.Generator().manual_seed(H + extra_width)
    positions = [5000 + 37 * s for s in range(n_seq)]
    positions[-1] = 90                                     # a short sequence in the batch
    n_extra = extra_width + 64 if kind == "csa" else extra_width
    if kind == "hca":
        positions = [p * 128 for p in positions]           # enough tokens for every HCA entry
    cache, q, widx, eidx, sinks = _decode_case(n_seq, 2, H, extra_width, kind, gen, positions,
                                               n_extra=n_extra, device="cuda", wB=64, eB=64)
    for ns in (None, 1):
        o, ref = _run_decode(cache, q, widx, eidx, sinks, device="cuda", num_splits=ns)
        _compare(o, ref)


@pytest.mark.gpu
def test_gpu_sparse_prefill_real_shapes():
    _need_gpu()
    gen = torch.Generator().manual_seed(3)
    H, n, topk = 64, 256, 512
    cache = Caches(1, 2048, 64, 64, gen, device="cuda")
    widx = torch.stack([cache.window_idx(0, 1000 + i) for i in range(n)]).int()
    eidx = torch.stack([cache.extra_idx(0, 2048, topk, "csa", gen) for _ in range(n)]).int()
    q = (torch.randn(n, H, 512, generator=gen) * 0.5).bfloat16()
    sinks = torch.randn(H, generator=gen)
    o = sparse_prefill(q.cuda(), widx.cuda(), cache.wp, 64, eidx.cuda(), cache.ep, 64, sinks.cuda())
    ref = sparse_attention_twin(q, widx, cache.wp_cpu, 64, eidx, cache.ep_cpu, 64, sinks)
    _compare(o, ref)
    # the production prefill form: q's norm + RoPE at its load, the inverse RoPE in the epilogue
    from dsv4.twins.sparse_attention import sparse_prefill as twin_prefill
    ang = torch.rand(n, 32, generator=gen) * 6.283185307179586
    cos, sin = torch.cos(ang), torch.sin(ang)
    o = sparse_prefill(q.cuda() * 4, widx.cuda(), cache.wp, 64, eidx.cuda(), cache.ep, 64, sinks.cuda(),
                       rope=(cos.cuda(), sin.cuda()), q_norm_eps=1e-6)
    _compare(o, twin_prefill(q * 4, widx, cache.wp_cpu, 64, eidx, cache.ep_cpu, 64, sinks, rope=(cos, sin),
                             q_norm_eps=1e-6))
