"""Hot-path Triton kernels II (mHC, compressor decode update, indexer q/scores/top-k) against their twins.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA, and the ``gpu``-marked tests add the real V4 shapes. The AOT test compiles every
kernel for sm_90 and sm_100 without a GPU.
"""
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from kernel_helpers import kernel_device, need_gpu, run_aot_script  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from dsv4.engine.kv_cache import write_index_entries  # noqa: E402
from dsv4.formats.kv_entry import page_bytes, write_kv_entries  # noqa: E402
from dsv4.kernels.compressor import (compress_decode, compress_decode_torch, compress_prefill,  # noqa: E402
                                     compress_prefill_torch)
from dsv4.kernels.indexer import (index_q_prologue, index_q_prologue_torch, index_scores,  # noqa: E402
                                  index_scores_torch, index_topk, index_topk_torch)
from dsv4.kernels.mhc import hc_head, hc_head_torch, hc_post, hc_post_torch, hc_pre, hc_pre_torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

DEV = kernel_device()


def _ordered(x):
    b = x.view(torch.int16).int()
    return torch.where(b < 0, -(b & 0x7FFF), b)


def _ulps(a, b):
    """bf16 ulp distance (sign-aware, +0 == -0)."""
    return (_ordered(a.cpu()) - _ordered(b.cpu())).abs()


def _close_bf16(out, ref, mag, noise=2 ** -20):
    """bf16 results within 1 ulp, or within fp32 rounding noise of the terms summed (``mag``: the
    sum of their magnitudes) where the sum cancels; the 1-ulp flips must be rare."""
    out, ref, mag = out.cpu(), ref.cpu(), mag.cpu()
    u = _ulps(out, ref)
    ok = (u <= 1) | ((out.float() - ref.float()).abs() <= noise * mag)
    assert ok.all(), f"{int((~ok).sum())} values off by more than 1 ulp / fp32 noise"
    assert int((u > 0).sum()) <= max(2, 1e-3 * u.numel())


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _rope(n, gen, device=DEV):
    ang = torch.rand(n, 32, generator=gen) * 1000
    return ang.cos().to(device), ang.sin().to(device)


# ------------------------------------------------------------------------------------------------
# mHC

def _hc_inputs(T, D, gen, nmix=24, device=DEV):
    x = (torch.randn(T, 4, D, generator=gen) * torch.rand(T, 4, 1, generator=gen) * 3).bfloat16()
    fn = torch.randn(nmix, 4 * D, generator=gen) * (4 * D) ** -0.5 * 2
    base = torch.randn(nmix, generator=gen) * 0.5
    scale = torch.rand(3 if nmix == 24 else 1, generator=gen) + 0.5
    return [t.to(device) for t in (x, fn, base, scale)]


def _check_hc_pre(T, D, gen, device=DEV, noise=2 ** -20, **kw):
    x, fn, base, scale = _hc_inputs(T, D, gen, device=device)
    y, post, comb = hc_pre(x, fn, base, scale, **kw)
    yr, pr, cr = hc_pre_torch(x, fn, base, scale)
    assert _rel(post, pr) < 1e-5 and _rel(comb, cr) < 1e-5
    assert torch.isfinite(comb).all()
    # Sinkhorn: columns sum to 1 (the last normalisation), as in the reference
    assert (comb.sum(-2) - 1).abs().max() < 1e-4
    _close_bf16(y, yr, x.float().abs().sum(1), noise)


@pytest.mark.parametrize("T,D", [(3, 256), (20, 192)])
def test_hc_pre(T, D):
    _check_hc_pre(T, D, torch.Generator().manual_seed(T))


def test_hc_pre_split_configs():
    gen = torch.Generator().manual_seed(9)
    _check_hc_pre(2, 128, gen, config={"splits": 1})
    _check_hc_pre(2, 128, gen, config={"splits": 3, "block_d": 64})


def _check_hc_post(T, D, gen, device=DEV):
    res = (torch.randn(T, 4, D, generator=gen) * 2).bfloat16().to(device)
    y = torch.randn(T, D, generator=gen).bfloat16().to(device)
    post = (torch.rand(T, 4, generator=gen) * 2).to(device)
    comb = torch.rand(T, 4, 4, generator=gen).to(device)
    comb = comb / comb.sum(-2, keepdim=True)
    out = hc_post(y, res, post, comb)
    ref = hc_post_torch(y, res, post, comb)
    _close_bf16(out, ref, 2 * y.float().abs()[:, None] + res.float().abs().sum(1, keepdim=True))


def test_hc_post():
    _check_hc_post(3, 320, torch.Generator().manual_seed(1))


def _check_hc_head(T, D, gen, device=DEV, noise=2 ** -20, **kw):
    x, fn, base, scale = _hc_inputs(T, D, gen, nmix=4, device=device)
    y = hc_head(x, fn, base, scale, **kw)
    yr = hc_head_torch(x, fn, base, scale)
    _close_bf16(y, yr, x.float().abs().sum(1), noise)


def test_hc_head():
    _check_hc_head(4, 256, torch.Generator().manual_seed(2))


_HC_IMPL_CONFIGS = {
    "v1": [{"splits": 3}],
    # fused: one launch, last-arriver tail; token blocks of 1 / 4 / 8 (T = 7, 37 not multiples), 1-4 splits
    "fused": [{"block_t": 1, "splits": 4}, {"block_t": 4, "splits": 3, "block_d": 32},
              {"block_t": 8, "splits": 1, "block_k": 16}],
    # tiled: mix GEMM over 16/32-token blocks, per-token finish (4 / default tokens a block), streaming
    # apply (reversed or not)
    "tiled": [{"splits": 3, "apply_block_d": 64, "tokens_block": 4}, {"splits": 1, "reverse": False, "block_t": 32}],
}


@pytest.mark.parametrize("impl", list(_HC_IMPL_CONFIGS))
def test_hc_impls(impl):
    """Each hc_pre / hc_head path (config impl) against the twins at several T and configs."""
    gen = torch.Generator().manual_seed(11)
    for T, D in ((1, 64), (7, 128), (37, 64)):
        for cfg in _HC_IMPL_CONFIGS[impl]:
            _check_hc_pre(T, D, gen, config=dict(cfg, impl=impl))
            _check_hc_head(T, D, gen, config=dict(cfg, impl=impl))


def test_hc_default_paths():
    """The default choice (hc_pre: fused up to FUSED_MAX_T tokens, tiled above; hc_head: v1), both
    sides of the threshold."""
    from dsv4.kernels import mhc
    gen = torch.Generator().manual_seed(12)
    for T in (mhc.FUSED_MAX_T, mhc.FUSED_MAX_T + 1):
        _check_hc_pre(T, 64, gen)
        _check_hc_head(T, 64, gen)
    with pytest.raises(ValueError, match="impl"):
        hc_pre(*_hc_inputs(1, 64, gen), config={"impl": "nope"})


def test_hc_fused_counters_reset():
    """The fused path's last arrivers reset the shared arrival counters: a second call (no memset in
    between) gives the same bits."""
    from dsv4.kernels import mhc
    gen = torch.Generator().manual_seed(13)
    x, fn, base, scale = _hc_inputs(5, 64, gen)
    cfg = {"impl": "fused", "block_t": 2, "splits": 3}
    first = hc_pre(x, fn, base, scale, config=cfg)
    assert int(mhc._counters(x.device, 1).abs().sum()) == 0
    second = hc_pre(x, fn, base, scale, config=cfg)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    h1 = hc_head(x, fn[:4].contiguous(), base[:4].contiguous(), scale[:1].contiguous(), config=cfg)
    h2 = hc_head(x, fn[:4].contiguous(), base[:4].contiguous(), scale[:1].contiguous(), config=cfg)
    assert torch.equal(h1, h2) and int(mhc._counters(x.device, 1).abs().sum()) == 0


# ------------------------------------------------------------------------------------------------
# compressor decode update

def _comp_case(ratio, indexer, B, n_slots, positions, gen, device=DEV, page_size=4, n_pages=6):
    c = 128 if indexer else 512
    coff = 2 if ratio == 4 else 1
    state = (torch.randn(n_slots, coff * ratio, 2 * coff * c, generator=gen)).to(device)
    slots = torch.randperm(n_slots, generator=gen)[:B].to(device)
    pos = torch.tensor(positions, dtype=torch.int64).to(device)
    k = (torch.randn(B, coff * c, generator=gen) * 2).to(device)
    s = (torch.randn(B, coff * c, generator=gen) * 2).to(device)
    ape = torch.randn(ratio, coff * c, generator=gen).to(device)
    w = (torch.rand(c, generator=gen) + 0.5).bfloat16().to(device)
    cos, sin = _rope(B, gen, device)
    n_pages = max(n_pages, B // page_size + 2)
    pb = page_size * 68 if indexer else page_bytes(page_size)
    pages = torch.randint(0, 256, (n_pages, pb), dtype=torch.uint8, generator=gen).to(device)
    pslots = torch.randperm(n_pages * page_size, generator=gen)[:B].to(device)
    pslots[0] = -1
    return state, slots, pos, k, s, ape, w, cos, sin, pages, pslots


def _check_compress(ratio, indexer, positions, gen, device=DEV, with_ape=True, page_size=4, n_slots=None,
                    **extra):
    B = len(positions)
    state, slots, pos, k, s, ape, w, cos, sin, pages, pslots = _comp_case(
        ratio, indexer, B, n_slots or B + 2, positions, gen, device, page_size)
    if not with_ape:
        s = s + ape[pos % ratio]
        ape = None
    st1, st2, p1, p2 = state.clone(), state.clone(), pages.clone(), pages.clone()
    kw = dict(ratio=ratio, indexer=indexer, ape=ape, page_size=page_size, return_pooled=True)
    out, done, pooled = compress_decode(st1, slots, pos, k, s, w, cos, sin, pages=p1, page_slots=pslots, **kw,
                                        **extra)
    ref, done_r, pooled_r = compress_decode_torch(st2, slots, pos, k, s, w, cos, sin, pages=p2,
                                                  page_slots=pslots, **kw)
    assert torch.equal(st1, st2)                                     # ring rows written, nothing else
    assert torch.equal(done.cpu(), done_r.cpu())
    assert _rel(pooled, pooled_r) < 1e-5
    # post-processing: bit-exact on the same pooled vector up to rare summation-order flips
    out2 = compress_decode_torch(state.clone(), slots, pos, k, s, w, cos, sin, **dict(kw, return_pooled=False))[0]
    mism = (out.float() != ref.float()).float().mean().item()
    assert mism < 2e-3, f"{mism:.2e} of the entry values differ"
    assert torch.equal(out2.cpu(), ref.cpu())
    assert (out[~done] == 0).all()
    if mism == 0:
        assert torch.equal(p1.cpu(), p2.cpu())
    return out, ref, done


@pytest.mark.parametrize("ratio,indexer", [(4, False), (4, True), (128, False)])
def test_compress_decode(ratio, indexer):
    gen = torch.Generator().manual_seed(ratio + indexer)
    if ratio == 4:
        # first CSA entry (no previous window), later entries, rows that complete nothing
        positions = [3, 7, 5, 1002, 0, 11]
    else:
        positions = [127, 255, 100, 1023]
    out, ref, done = _check_compress(ratio, indexer, positions, gen)
    assert done.sum() >= 2


def test_compress_decode_ape_presummed_and_two_kernel_path():
    _check_compress(4, False, [3, 6, 15], torch.Generator().manual_seed(3), with_ape=False)
    _check_compress(4, True, [3, 6, 15, 19], torch.Generator().manual_seed(3), fused=False, block_c=64)
    _check_compress(4, False, [3, 6, 15, 19], torch.Generator().manual_seed(3), fused=False)


@pytest.mark.parametrize("ratio,indexer", [(4, False), (128, False), (4, True)])
def test_compress_decode_bf16_rows_as_their_fp32_values(ratio, indexer):
    """bf16 K / score rows (the projections' dtype) give exactly what their fp32 values give: the
    kernels convert in the load, and the ring holds the fp32 values."""
    gen = torch.Generator().manual_seed(5 + ratio + indexer)
    positions = [3, 7, 5, 11] if ratio == 4 else [127, 255, 100]
    state, slots, pos, k, s, ape, w, cos, sin, pages, pslots = _comp_case(ratio, indexer, len(positions), 6,
                                                                          positions, gen)
    kb, sb = k.bfloat16(), s.bfloat16()
    runs = []
    for kk, ss in ((kb, sb), (kb.float(), sb.float())):
        st, pg = state.clone(), pages.clone()
        out, done = compress_decode(st, slots, pos, kk, ss, w, cos, sin, ratio=ratio, indexer=indexer, ape=ape,
                                    pages=pg, page_slots=pslots, page_size=4)
        runs.append((out, done, st, pg))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert runs[0][1].any()
    with pytest.raises(ValueError, match="fp32 or bf16"):
        compress_decode(state, slots, pos, k.half(), s.half(), w, cos, sin, ratio=ratio, indexer=indexer)


def test_compress_decode_sequence_vs_reference_update():
    """Token-by-token decode from an empty ring against the reference ``Compressor.update``."""
    from dsv4.reference.compressor import Compressor
    from dsv4.reference.numerics import OFFICIAL
    from dsv4.reference.state import CompressorState
    gen = torch.Generator().manual_seed(4)
    for indexer in (False, True):
        c, m, n = (128 if indexer else 512), 4, 13
        ape = torch.randn(m, 2 * c, generator=gen)
        w = (torch.rand(c, generator=gen) + 0.5).bfloat16()
        freqs = 1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))
        rope = lambda p: torch.polar(torch.ones(p.shape[0], 32), torch.outer(p.float(), freqs))  # noqa: E731
        comp = Compressor(None, None, ape, w, m, c, rope, 1e-6, OFFICIAL, indexer)
        st = CompressorState(m, c, torch.bfloat16, "cpu")
        ring = torch.full((2, 2 * m, 4 * c), float("nan")).to(DEV)      # never read before written
        K = torch.randn(n, 2 * c, generator=gen) * 2
        S = torch.randn(n, 2 * c, generator=gen) * 2 + ape[torch.arange(n) % m]
        got = []
        for p in range(n):
            f = rope(torch.tensor([max(p + 1 - m, 0)]))
            e, done = compress_decode(ring, torch.tensor([1], device=DEV), torch.tensor([p], device=DEV),
                                      K[p:p + 1].to(DEV), S[p:p + 1].to(DEV), w.to(DEV),
                                      f.real.contiguous().to(DEV), f.imag.contiguous().to(DEV),
                                      ratio=m, indexer=indexer)
            ref_entries = comp.update(st, K[p:p + 1], S[p:p + 1], p + 1)
            assert bool(done.item()) == ((p + 1) % m == 0)
            if done.item():
                got.append(e.cpu())
        got = torch.cat(got)
        assert got.shape == ref_entries.shape
        assert (got.float() != ref_entries.float()).float().mean() < 2e-3


# ------------------------------------------------------------------------------------------------
# compressor prefill chunk

def _rope_table(p):
    freqs = 1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))
    return torch.polar(torch.ones(p.shape[0], 32), torch.outer(p.float(), freqs))


def _pref_case(ratio, indexer, base, first, last, tail, gen, device=DEV, page_size=4, joined=False):
    """Rows for positions base .. last*ratio + tail - 1, rope rows for entries first .. last-1, pages."""
    c, coff = (128 if indexer else 512), (2 if ratio == 4 else 1)
    W, R, n = coff * c, last * ratio - base + tail, last - first
    kv = torch.randn(R, 2 * W, generator=gen) * 2
    kv[:, W:] += torch.randn(ratio, W, generator=gen)[(base + torch.arange(R)) % ratio]     # "ape"
    kv = kv.to(device)
    rk, rs = (kv[:, :W], kv[:, W:]) if joined else (kv[:, :W].contiguous(), kv[:, W:].contiguous())
    w = (torch.rand(c, generator=gen) + 0.5).bfloat16().to(device)
    f = _rope_table(torch.arange(first, last) * ratio)
    cos, sin = f.real.contiguous().to(device), f.imag.contiguous().to(device)
    n_pages = n // page_size + 2
    pb = page_size * 68 if indexer else page_bytes(page_size)
    pages = torch.randint(0, 256, (n_pages, pb), dtype=torch.uint8, generator=gen).to(device)
    pslots = torch.randperm(n_pages * page_size, generator=gen)[:n].to(device)
    pslots[0] = -1
    return rk, rs, w, cos, sin, pages, pslots


def _check_compress_prefill(ratio, indexer, base, first, last, gen, tail=0, device=DEV, page_size=4, joined=False, **extra):
    from dsv4.reference.compressor import Compressor
    from dsv4.reference.numerics import OFFICIAL
    rk, rs, w, cos, sin, pages, pslots = _pref_case(ratio, indexer, base, first, last, tail, gen, device,
                                                    page_size, joined)
    p1, p2, p3 = pages.clone(), pages.clone(), pages.clone()
    kw = dict(ratio=ratio, indexer=indexer, page_size=page_size, return_pooled=True)
    out, pooled = compress_prefill(rk, rs, base, first, last, w, cos, sin, pages=p1, page_slots=pslots, **kw,
                                   **extra)
    ref, pooled_r = compress_prefill_torch(rk, rs, base, first, last, w, cos, sin, pages=p2, page_slots=pslots,
                                           **kw)
    assert out.shape == ref.shape == (last - first, w.shape[0]) and out.dtype == torch.bfloat16
    assert _rel(pooled, pooled_r) < 1e-5
    mism = (out.float() != ref.float()).float().mean().item()
    assert mism < 2e-3, f"{mism:.2e} of the entry values differ"
    # post-processing of the kernel's own pooled vectors: the reference's, up to rare summation-order flips
    c, coff = w.shape[0], (2 if ratio == 4 else 1)
    freqs = torch.complex(cos.cpu(), sin.cpu())
    comp = Compressor(None, None, torch.zeros(ratio, coff * c), w.cpu(), ratio, c, lambda _p: freqs, 1e-6,
                      OFFICIAL, indexer)
    post = comp.postprocess(pooled.cpu(), torch.arange(first, last) * ratio)
    assert (post.float() != out.cpu().float()).float().mean() < 2e-3
    # page bytes: exactly the encoding of the kernel's entries (and the twin's where those agree)
    sel = pslots >= 0
    if indexer:
        write_index_entries(p3, pslots[sel], out[sel], page_size)
    else:
        write_kv_entries(p3, pslots, out, page_size)
    assert torch.equal(p1.cpu(), p3.cpu())
    if mism == 0:
        assert torch.equal(p1.cpu(), p2.cpu())
    return out, ref


@pytest.mark.parametrize("ratio,indexer", [(4, False), (4, True), (128, False)])
def test_compress_prefill(ratio, indexer):
    gen = torch.Generator().manual_seed(20 + ratio + indexer)
    m = ratio
    if ratio == 4:
        # a chunk from position 0 (entry 0 has no previous window), rows of [K | score] views, a
        # pending tail; then the next chunk from the previous chunk's kept rows (the last window)
        _check_compress_prefill(m, indexer, 0, 0, 9, gen, tail=3, joined=True)
        _check_compress_prefill(m, indexer, 8 * m, 9, 17, gen, tail=2)
        _check_compress_prefill(m, indexer, 5 * m - 3, 7, 10, gen, tail=1)           # rows from before the window
    else:
        _check_compress_prefill(m, indexer, 0, 0, 2, gen, tail=5, joined=True)
        _check_compress_prefill(m, indexer, 2 * m, 2, 3, gen, tail=0)
    # the other path for CSA: channel blocks, the entry's last block program post-processing; HCA with
    # 128-channel blocks; the per-entry arrival counters are left zeroed
    from dsv4.kernels.counters import arrival_counters
    if ratio == 4:
        _check_compress_prefill(m, indexer, 4 * m, 5, 9, gen, fused=False, block_c=64)
    else:
        _check_compress_prefill(m, indexer, m, 1, 2, gen, block_c=128)
    assert not arrival_counters(DEV, 64)[:64].any()


@pytest.mark.parametrize("ratio,indexer,chunks", [(4, False, (37, 100, 5)), (4, True, (37, 100, 5)),
                                                  (128, False, (37, 200, 150, 5))])
def test_compress_prefill_sequence_vs_reference_update(ratio, indexer, chunks):
    """Chunked prefill (odd chunk sizes) against the reference ``Compressor.update``; the kernel's
    caller keeps the pending rows as ``CompressorState`` does."""
    from dsv4.reference.compressor import Compressor
    from dsv4.reference.numerics import OFFICIAL
    from dsv4.reference.state import CompressorState
    gen = torch.Generator().manual_seed(30 + ratio + indexer)
    c, m = (128 if indexer else 512), ratio
    coff = 2 if m == 4 else 1
    n = sum(chunks)
    ape = torch.randn(m, coff * c, generator=gen)
    w = (torch.rand(c, generator=gen) + 0.5).bfloat16()
    comp = Compressor(None, None, ape, w, m, c, _rope_table, 1e-6, OFFICIAL, indexer)
    st = CompressorState(m, c, torch.bfloat16, "cpu")
    K = torch.randn(n, coff * c, generator=gen) * 2
    S = torch.randn(n, coff * c, generator=gen) * 2 + ape[torch.arange(n) % m]
    pk, ps, start, done, got = K[:0], S[:0], 0, 0, []
    end = 0
    for T in chunks:
        p0, end = end, end + T
        ref_entries = comp.update(st, K[p0:end], S[p0:end], end)
        rows_k, rows_s = torch.cat([pk, K[p0:end]]), torch.cat([ps, S[p0:end]])
        last = end // m
        f = _rope_table(torch.arange(done, last) * m)
        e = compress_prefill(rows_k.to(DEV), rows_s.to(DEV), start, done, last, w.to(DEV),
                             f.real.contiguous().to(DEV), f.imag.contiguous().to(DEV), ratio=m, indexer=indexer)
        assert e.shape == (last - done, c)
        got.append(e.cpu())
        keep = m * max(0, last - 1) if m == 4 else m * last
        pk, ps, start, done = rows_k[keep - start:], rows_s[keep - start:], keep, last
    got = torch.cat(got)
    assert got.shape == ref_entries.shape == (n // m, c)
    assert (got.float() != ref_entries.float()).float().mean() < 2e-3


def test_compress_prefill_errors():
    gen = torch.Generator().manual_seed(40)
    rk, rs, w, cos, sin, _, _ = _pref_case(4, False, 4, 2, 5, 0, gen)      # rows: positions 4 .. 19
    kw = dict(ratio=4)
    assert compress_prefill(rk, rs, 4, 2, 5, w, cos, sin, **kw).shape == (3, 512)
    with pytest.raises(ValueError, match="cover"):                          # entry 2 needs position 4 .. 7
        compress_prefill(rk[1:], rs[1:], 5, 2, 5, w, cos, sin, **kw)
    with pytest.raises(ValueError, match="cover"):                          # entry 4 needs positions up to 19
        compress_prefill(rk[:-1], rs[:-1], 4, 2, 5, w, cos, sin, **kw)
    with pytest.raises(ValueError, match="cover"):                          # the twin checks the same
        compress_prefill_torch(rk[:-1], rs[:-1], 4, 2, 5, w, cos, sin, **kw)
    with pytest.raises(ValueError, match="cover"):                          # CSA: the previous window too
        compress_prefill(rk[4:], rs[4:], 8, 2, 5, w, cos, sin, **kw)
    with pytest.raises(ValueError, match="cos"):
        compress_prefill(rk, rs, 4, 2, 4, w, cos, sin, **kw)
    with pytest.raises(ValueError, match="rows_k"):                         # indexer needs c = 128
        compress_prefill(rk, rs, 4, 2, 5, w, cos, sin, indexer=True, **kw)
    with pytest.raises(ValueError, match="page_slots"):
        compress_prefill(rk, rs, 4, 2, 5, w, cos, sin, pages=torch.zeros(2, page_bytes(64), dtype=torch.uint8,
                                                                          device=DEV), **kw)
    # HCA: base <= first*m suffices (no overlap), and is needed
    rk, rs, w, cos, sin, _, _ = _pref_case(128, False, 128, 1, 2, 0, gen)
    assert compress_prefill(rk, rs, 128, 1, 2, w, cos, sin, ratio=128).shape == (1, 512)
    with pytest.raises(ValueError, match="cover"):
        compress_prefill(rk[1:], rs[1:], 129, 1, 2, w, cos, sin, ratio=128)
    # no entries: nothing to cover
    e = compress_prefill(rk[:0], rs[:0], 0, 3, 3, w, cos[:0], sin[:0], ratio=128)
    assert e.shape == (0, 512)


# ------------------------------------------------------------------------------------------------
# indexer

@pytest.mark.parametrize("T,H", [(2, 64), (3, 8)])
def test_index_q_prologue(T, H):
    gen = torch.Generator().manual_seed(T * H)
    q = (torch.randn(T, H, 128, generator=gen) * torch.rand(T, H, 1, generator=gen) * 4).bfloat16()
    q[0, 0, :32] = 0                                                  # an all-zero FP4 block
    cos, sin = _rope(T, gen, "cpu")
    ref = index_q_prologue_torch(q, cos, sin)
    first = None
    for hpp in (16, 64):
        for load_h in (True, False):       # Hadamard operand read from a tensor or built in the kernel: same bits
            out = index_q_prologue(q.to(DEV), cos.to(DEV), sin.to(DEV), heads_per_program=hpp, load_h=load_h).cpu()
            assert (out.float() != ref.float()).float().mean() < 2e-3
            assert _rel(out, ref) < 0.2
            first = out if first is None else first
            assert torch.equal(out, first), (hpp, load_h)


def _index_cache(n_blocks, gen, device=DEV):
    n = n_blocks * 64
    keys = (torch.randn(n, 1, 128, generator=gen) * torch.rand(n, 1, 1, generator=gen)).bfloat16().to(device)
    ones, zeros = torch.ones(n, 32, device=device), torch.zeros(n, 32, device=device)
    keys = index_q_prologue_torch(keys, ones, zeros)[:, 0]            # FP4-QDQ'd, as the cache holds
    pages = torch.randint(0, 256, (n_blocks, 64 * 68), dtype=torch.uint8, generator=gen).to(device)
    write_index_entries(pages, torch.arange(n, device=device), keys)
    return pages


def _score_inputs(B, H, gen, device=DEV):
    q = (torch.randn(B, H, 128, generator=gen)).bfloat16()
    q = index_q_prologue_torch(q, torch.ones(B, 32), torch.zeros(B, 32))
    w = (torch.randn(B, H, generator=gen) * 0.1).bfloat16()
    return q.to(device), w.to(device)


def _check_scores(sc, ref):
    sc, ref = sc.float().cpu(), ref.float().cpu()
    assert torch.equal(torch.isinf(sc), torch.isinf(ref))
    fin = torch.isfinite(ref)
    diff = (sc[fin] - ref[fin]).abs()
    assert (diff > 0).float().mean() < 2e-3
    assert (diff <= 2 ** -6 * ref[fin].abs().clamp(min=1e-3)).all()


def test_index_scores():
    gen = torch.Generator().manual_seed(5)
    H = 16
    pages = _index_cache(6, gen)
    # row 0: two full pages + a partial one (block -1 past it); row 1: nothing visible yet (pos 2);
    # row 2: pages in shuffled order, visible count inside the second page
    bt = torch.tensor([[3, 1, 0, -1], [2, -1, -1, -1], [5, 4, -1, -1]], dtype=torch.int32).to(DEV)
    pos = torch.tensor([700, 2, 300]).to(DEV)
    q, w = _score_inputs(3, H, gen)
    sc = index_scores(q, w, pages, bt, pos)
    ref = index_scores_torch(q, w, pages, bt, pos)
    assert sc.shape == (3, 256)
    _check_scores(sc, ref)
    assert torch.isinf(sc[1]).all()
    sc2 = index_scores(q, w, pages, bt, pos, n=200, pages_per_program=2, direct=True)
    _check_scores(sc2, ref[:, :200])


_TOPK_PATHS = {"auto": {}, "chunked": dict(single_max=0), "chunked+rank": dict(single_max=0, sort_max=0)}


@pytest.mark.parametrize("path", list(_TOPK_PATHS))
@pytest.mark.parametrize("B,N,k,tie_every", [(3, 1000, 50, 3), (2, 300, 400, 2), (2, 5000, 64, 1)])
def test_index_topk(B, N, k, tie_every, path):
    """Every path (one-program rows, chunked passes with the in-kernel sort or the rank launch)
    equals the stable descending sort, ties and masking included."""
    gen = torch.Generator().manual_seed(N + k)
    s = torch.randn(B, N, generator=gen).bfloat16()
    s[0, ::tie_every] = 0.5                                          # many ties (all equal for 1)
    s[:, 7] = -0.0                                                   # -0.0 ranks as +0.0
    s[-1, 11] = float("-inf")                                        # a -inf entry inside the valid range
    s[-1, 12] = 0.0
    nv = torch.tensor([N, N // 3, 0][:B], dtype=torch.int32)         # full, partial, all masked
    if B == 2:
        nv[1] = 13 if N < k else N // 3
    out = index_topk(s.to(DEV), k, nv.to(DEV), **_TOPK_PATHS[path]).cpu()
    ref = index_topk_torch(s, k, nv)
    assert torch.equal(out, ref)


def test_index_topk_many_rows_sort_in_kernel():
    """>= 32 rows sort more than 512 picks inside the last pass (no rank launch): 1024-wide codes."""
    gen = torch.Generator().manual_seed(9)
    s = torch.randn(32, 1500, generator=gen).bfloat16()
    s[3, ::2] = 0.25                                                 # ties across the threshold
    nv = torch.randint(500, 1501, (32,), generator=gen).int()
    out = index_topk(s.to(DEV), 600, nv.to(DEV), single_max=0).cpu()
    assert torch.equal(out, index_topk_torch(s, 600, nv))


def test_index_topk_no_valid_and_small_k():
    gen = torch.Generator().manual_seed(6)
    s = torch.randn(2, 777, generator=gen).bfloat16()
    out = index_topk(s.to(DEV), 1).cpu()
    assert torch.equal(out, index_topk_torch(s, 1))
    out = index_topk(s.to(DEV), 20, torch.zeros(2, dtype=torch.int32, device=DEV)).cpu()
    assert (out == -1).all()
    out = index_topk(s.to(DEV), 40, chunks=7).cpu()
    assert torch.equal(out, index_topk_torch(s, 40))


def test_index_topk_workspace_reset():
    """The chunked passes keep their counters, row fields and histogram in the shared arrival-counter
    buffer: the last pass leaves it zeroed, so back-to-back calls (other data, other row counts, with
    and without n_valid, both sort paths) stay exact with no memset launch."""
    from dsv4.kernels.counters import arrival_counters
    from dsv4.kernels.indexer import _TOPK_WS
    gen = torch.Generator().manual_seed(11)
    for B, N, k, sort_max in ((3, 3000, 100, 512), (1, 9000, 700, 512), (2, 5000, 600, 0), (3, 3000, 100, 512)):
        s = torch.randn(B, N, generator=gen).bfloat16()
        s[0, ::5] = 1.0                                              # ties across the threshold
        nv = torch.randint(N // 2, N + 1, (B,), generator=gen).int()
        for n_valid in (nv, None):
            out = index_topk(s.to(DEV), k, None if n_valid is None else n_valid.to(DEV), single_max=0,
                             sort_max=sort_max).cpu()
            assert torch.equal(out, index_topk_torch(s, k, n_valid))
            ws = arrival_counters(DEV, B * _TOPK_WS)[:B * _TOPK_WS]
            assert not ws.any(), "index_topk left its workspace dirty"


def test_index_scores_topk_match_fast_decoder_rule():
    """scores + top-k == the reference path of FastDecoder._indexer (stable sort, -1 past visible)."""
    gen = torch.Generator().manual_seed(8)
    pages = _index_cache(4, gen)
    bt = torch.tensor([[2, 0, 3], [1, -1, -1]], dtype=torch.int32).to(DEV)
    pos = torch.tensor([600, 9]).to(DEV)
    q, w = _score_inputs(2, 16, gen)
    sc = index_scores(q, w, pages, bt, pos)
    vis = ((pos + 1) // 4).to(torch.int32)
    idx = index_topk(sc, 64, vis).cpu()
    ref_sc = index_scores_torch(q, w, pages, bt, pos).cpu()
    ref = ref_sc.sort(dim=-1, descending=True, stable=True).indices[:, :64]
    ref = ref.masked_fill(ref >= vis.cpu().long()[:, None], -1)
    if torch.equal(sc.cpu().float(), ref_sc.float()):
        assert torch.equal(idx.long(), ref)


# ------------------------------------------------------------------------------------------------
# ahead-of-time compilation for Hopper and Blackwell (no GPU needed)

# ------------------------------------------------------------------------------------------------
# compressed-cache entry ids through the block table

def _check_entry_ids(device=DEV):
    from dsv4.engine.kv_cache import BLOCK_TOKENS
    from dsv4.kernels import paging
    assert paging.BLOCK_TOKENS == BLOCK_TOKENS
    gen = torch.Generator().manual_seed(5)
    bt = torch.randint(-1, 50, (3, 9), generator=gen)
    bt[:, 7:] = -1                                        # unallocated tail blocks
    for ratio, per_block, dtype in ((4, 64, torch.int32), (128, 2, torch.int64)):
        e = torch.randint(-3, 9 * BLOCK_TOKENS // ratio + 5, (3, 1100), generator=gen)   # past the table too
        got = paging.entry_ids(bt.to(device), e.to(dtype).to(device), per_block, ratio)
        want = paging.entry_ids_torch(bt, e, per_block, ratio)
        assert got.dtype == torch.int32 and torch.equal(got.cpu().long(), want)
        assert (want >= 0).any() and (want < 0).any()


def test_entry_ids():
    _check_entry_ids()


def test_entry_ids_rejects_mismatched_rows():
    from dsv4.kernels.paging import entry_ids
    with pytest.raises(ValueError, match="expected e"):
        entry_ids(torch.zeros(2, 4, dtype=torch.long, device=DEV), torch.zeros(3, 5, dtype=torch.long, device=DEV), 64, 4)


# ------------------------------------------------------------------------------------------------
# RMSNorm

def _check_rms_norm(T, D, dtype, gen, device=DEV):
    """Against the reference RMSNorm (official numerics): at most one bf16 rounding step apart
    (the fp32 sum of squares is ordered differently), equal in almost every element."""
    from dsv4.kernels.norm import rms_norm, rms_norm_torch
    x = (torch.randn(T, D, generator=gen) * torch.rand(T, 1, generator=gen) * 8).to(dtype)
    x[0] = 0                                           # an all-zero row: rsqrt(eps), finite zeros
    w = torch.rand(D, generator=gen) + 0.5
    y = rms_norm(x.to(device), w.to(device), 1e-6).cpu().float()
    r = rms_norm_torch(x, w, 1e-6).float()
    assert torch.isfinite(y).all() and torch.equal(y[0], torch.zeros(D))
    assert ((y - r).abs() <= r.abs() * 2.0 ** -7 + 1e-30).all()        # one bf16 ulp (8 significant bits)
    assert (y != r).float().mean().item() < 0.01


@pytest.mark.parametrize("T,D,dtype", [(3, 512, torch.bfloat16), (2, 1024, torch.float32), (1, 7168, torch.bfloat16)])
def test_rms_norm(T, D, dtype):
    _check_rms_norm(T, D, dtype, torch.Generator().manual_seed(T * D))


def test_rms_norm_rejects_wrong_weight():
    from dsv4.kernels.norm import rms_norm
    with pytest.raises(ValueError, match="weight has 64 elements"):
        rms_norm(torch.zeros(2, 128, dtype=torch.bfloat16, device=DEV), torch.ones(64, device=DEV), 1e-6)


_AOT_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    import triton.language as tl
    from kernel_helpers import aot_compile
    from dsv4.kernels import mhc, compressor as cp, indexer as ix, norm as nm, paging as pg

    P = lambda t: "*" + t
    F = P("fp32")
    PREF = dict(RK=F, RS=F, POOLED=F, NORMW=F, COS=F, SIN_=F, OUT=P("bf16"), PAGES=P("u8"), PSLOTS=P("i64"),
                CNT=P("i32"), eps="fp32")
    cases = [
        (mhc._hc_mix_partial, dict(X=P("bf16"), FN=F, PART=F, SQ=F),
         dict(NMIX=24, NP=32, BT=16, BK=64, MODE=0), 4, False),
        (mhc._hc_mix_partial, dict(X=P("bf16"), FN=P("bf16"), PART=F, SQ=F),
         dict(NMIX=24, NP=32, BT=16, BK=64, MODE=1), 4, True),
        (mhc._hc_mix_partial, dict(X=P("bf16"), FN=F, PART=F, SQ=F),
         dict(NMIX=4, NP=16, BT=64, BK=64, MODE=0), 4, False),
        (mhc._hc_finish, dict(X=P("bf16"), PART=F, SQ=F, BASE=F, SCALE=F, Y=P("bf16"), POST=F, COMB=F,
                              inv_k="fp32", rms_eps="fp32", hc_eps="fp32"),
         dict(NP=32, SP=64, BD=512, HEAD=False), 4, False),
        (mhc._hc_post_kernel, dict(Yin=P("bf16"), RES=P("bf16"), POST=F, COMB=F, OUT=P("bf16")), dict(BD=1024), 4, False),
        (mhc._hc_mix_tile, dict(X=P("bf16"), W=P("bf16"), PART=F),
         dict(NMIX=24, NP=32, BT=128, BK=64, MODE=1), 8, True),
        (mhc._hc_mix_tile, dict(X=P("bf16"), W=P("bf16"), PART=F),
         dict(NMIX=4, NP=16, BT=64, BK=64, MODE=1), 4, True),
        (mhc._hc_mix_tile, dict(X=P("bf16"), W=F, PART=F),
         dict(NMIX=24, NP=32, BT=128, BK=64, MODE=0), 8, False),
        (mhc._hc_tokens, dict(PART=F, BASE=F, SCALE=F, PRE=F, POST=F, COMB=F, inv_k="fp32", rms_eps="fp32",
                               hc_eps="fp32"), dict(NMIX=24, NP=32, SP=8, BT=16, HEAD=False), 4, False),
        (mhc._hc_tokens, dict(PART=F, BASE=F, SCALE=F, PRE=F, POST=F, COMB=F, inv_k="fp32", rms_eps="fp32",
                               hc_eps="fp32"), dict(NMIX=4, NP=16, SP=64, BT=4, HEAD=True), 4, False),
        (mhc._hc_apply, dict(X=P("bf16"), PRE=F, Y=P("bf16")), dict(BD=2048, REVERSE=True), 4, False),
        (mhc._hc_fused, dict(X=P("bf16"), FN=F, PART=F, CNT=P("i32"), BASE=F, SCALE=F, Y=P("bf16"), POST=F,
                             COMB=F, inv_k="fp32", rms_eps="fp32", hc_eps="fp32"),
         dict(NMIX=24, NP=32, SP=128, BT=1, BK=128, BD=2048, HEAD=False), 4, False),
        (mhc._hc_fused, dict(X=P("bf16"), FN=F, PART=F, CNT=P("i32"), BASE=F, SCALE=F, Y=P("bf16"), POST=F,
                             COMB=F, inv_k="fp32", rms_eps="fp32", hc_eps="fp32"),
         dict(NMIX=24, NP=32, SP=128, BT=4, BK=64, BD=2048, HEAD=False), 8, False),
        (mhc._hc_fused, dict(X=P("bf16"), FN=F, PART=F, CNT=P("i32"), BASE=F, SCALE=F, Y=P("bf16"), POST=F,
                             COMB=F, inv_k="fp32", rms_eps="fp32", hc_eps="fp32"),
         dict(NMIX=4, NP=8, SP=128, BT=2, BK=128, BD=2048, HEAD=True), 4, False),
        (cp._comp_pool, dict(STATE=F, SLOTS=P("i64"), POS=P("i64"), KIN=F, SIN_=F, APE=F, POOLED=F),
         dict(M=4, C=512, OVERLAP=True, HAS_APE=True, CB=512, FAST=True), 4, False),
        (cp._comp_pool, dict(STATE=F, SLOTS=P("i64"), POS=P("i64"), KIN=F, SIN_=F, APE=F, POOLED=F),
         dict(M=128, C=512, OVERLAP=False, HAS_APE=False, CB=32, FAST=True), 4, False),
        (cp._comp_post, dict(POOLED=F, NORMW=F, COS=F, SIN_=F, POS=P("i64"), OUT=P("bf16"), COMPLETE=P("i8"),
                             PAGES=P("u8"), PSLOTS=P("i64"), eps="fp32"),
         dict(M=128, C=512, INDEXER=False, WRITE=True, FAST=True), 4, False),
        (cp._comp_fused, dict(STATE=F, SLOTS=P("i64"), POS=P("i64"), KIN=F, SIN_=F, APE=F, POOLED=F, NORMW=F,
                              COS=F, COSIN_=F, OUT=P("bf16"), COMPLETE=P("i8"), PAGES=P("u8"), PSLOTS=P("i64"),
                              eps="fp32"),
         dict(M=4, C=512, OVERLAP=True, HAS_APE=False, INDEXER=False, WRITE=True, STORE_POOLED=False,
              FAST=True), 8, False),
        (cp._comp_fused, dict(STATE=F, SLOTS=P("i64"), POS=P("i64"), KIN=F, SIN_=F, APE=F, POOLED=F, NORMW=F,
                              COS=F, COSIN_=F, OUT=P("bf16"), COMPLETE=P("i8"), PAGES=P("u8"), PSLOTS=P("i64"),
                              eps="fp32"),
         dict(M=4, C=128, OVERLAP=True, HAS_APE=True, INDEXER=True, WRITE=True, STORE_POOLED=True,
              FAST=True), 8, False),
        (cp._comp_post, dict(POOLED=F, NORMW=F, COS=F, SIN_=F, POS=P("i64"), OUT=P("bf16"), COMPLETE=P("i8"),
                             PAGES=P("u8"), PSLOTS=P("i64"), eps="fp32"),
         dict(M=4, C=128, INDEXER=True, WRITE=True, FAST=True), 4, False),
        (cp._pref_pool, PREF, dict(M=4, C=512, OVERLAP=True, CB=512, POST=True, INDEXER=False, WRITE=True,
                                   STORE_POOLED=False, FAST=True), 8, False),
        (cp._pref_pool, PREF, dict(M=4, C=128, OVERLAP=True, CB=128, POST=True, INDEXER=True, WRITE=True,
                                   STORE_POOLED=True, FAST=True), 4, False),
        (cp._pref_pool, PREF, dict(M=128, C=512, OVERLAP=False, CB=32, POST=True, INDEXER=False, WRITE=True,
                                   STORE_POOLED=True, FAST=True), 4, False),
        (cp._pref_pool, PREF, dict(M=4, C=128, OVERLAP=True, CB=32, POST=True, INDEXER=True, WRITE=True,
                                   STORE_POOLED=True, FAST=True), 4, False),
        (ix._index_q_kernel, dict(Q=P("bf16"), COS=F, SIN=F, OUT=P("bf16"), HMAT=P("bf16")),
         dict(HB=16, INTERP=False, LOAD_H=False), 4, True),
        (ix._index_q_kernel, dict(Q=P("bf16"), COS=F, SIN=F, OUT=P("bf16"), HMAT=P("bf16")),
         dict(HB=64, INTERP=False, LOAD_H=True), 8, True),
        (ix._index_scores_kernel, dict(Q=P("bf16"), W=P("bf16"), PAGES=P("u8"), BT=P("i32"), POS=P("i64"),
                                       OUT=P("bf16")), dict(TPP=2, HP=64, INTERP=False), 4, True),
        (ix._index_scores_kernel, dict(Q=P("bf16"), W=P("bf16"), PAGES=P("u8"), BT=P("i64"), POS=P("i64"),
                                       OUT=P("bf16")), dict(TPP=1, HP=64, INTERP=False, DIRECT=False), 8, True),
        (ix._topk_pass1, dict(SC=P("i16"), NV=P("i32"), WS=P("i32")), dict(WSTRIDE=264, TILE=2048, HAS_NV=True),
         8, False),
        (ix._topk_pass2, dict(SC=P("i16"), NV=P("i32"), WS=P("i32"), H2=P("i32"), BASE=P("i32")),
         dict(WSTRIDE=264, G=32, TILE=2048, HAS_NV=False), 8, False),
        (ix._topk_pass3, dict(SC=P("i16"), NV=P("i32"), WS=P("i32"), BASE=P("i32"), BUF=P("i64"), OUT=P("i32")),
         dict(WSTRIDE=264, KP=512, TILE=2048, SORT=True, HAS_NV=True), 8, False),
        (ix._topk_rank, dict(BUF=P("i64"), NV=P("i32"), OUT=P("i32")), dict(KP=2048, RB=16, HAS_NV=True), 8, False),
        (ix._topk_single, dict(SC=P("i16"), NV=P("i32"), BUF=P("i64"), OUT=P("i32")),
         dict(KP=2048, TILE=4096, HAS_NV=True), 8, False),
        (nm._rms_norm_kernel, dict(X=P("bf16"), W=F, Y=P("bf16"), eps="fp32"), dict(BD=8192, INTERP=False), 8, False),
        (pg._entry_ids_kernel, dict(BT=P("i64"), E=P("i32"), OUT=P("i32")), dict(BLOCK=1024), 4, False),
    ]
    for cap in (90, 100):
        for fn, types, const, warps, want_mma in cases:
            _ptx, mma = aot_compile(fn, types, const, cap, warps)
            if want_mma:
                assert mma, f"{fn.__name__} should use tensor-core MMAs"
""")


def test_aot_compile_sm90_sm100():
    """Compile every hot-path kernel for GPUTarget('cuda', 90, 32) and ('cuda', 100, 32) here."""
    run_aot_script(_AOT_SCRIPT, REPO, timeout=600, TRITON_DEFAULT_FP_FUSION="1")


# ------------------------------------------------------------------------------------------------
# GPU: real shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("D,T", [(4096, 1), (4096, 128), (7168, 64), (4096, 2048)])
def test_gpu_mhc_real_shapes(D, T):
    """Default (bf16x3 tensor-core) mode: post/comb within 1e-5, outputs within 1 ulp or 1e-5 of the
    summed magnitudes (cancelling sums)."""
    _need_gpu()
    gen = torch.Generator().manual_seed(D + T)
    _check_hc_pre(T, D, gen, device="cuda", noise=1e-5)
    _check_hc_post(T, D, gen, device="cuda")
    _check_hc_head(T, D, gen, device="cuda", noise=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("D,T", [(4096, 256), (4096, 2048)])
def test_gpu_hc_ieee_mode(D, T):
    """The fp32 FMA mode: the reference's fp32 accuracy (2^-20 of the summed magnitudes)."""
    _need_gpu()
    gen = torch.Generator().manual_seed(T)
    _check_hc_pre(T, D, gen, device="cuda", config={"mode": "ieee"})
    _check_hc_head(T, D, gen, device="cuda", config={"mode": "ieee"})


@pytest.mark.gpu
@pytest.mark.parametrize("D", [4096, 7168])
def test_gpu_mhc_paths(D):
    """Each hc_pre / hc_head path in both modes at the real widths: fused at T 1 / 5 / 16 (token blocks
    of 1 and 2; ragged), tiled at T 17 / 300 (ragged token blocks), v1. The fused path and the ieee
    mode: fp32 FMA products, 2^-20 of the summed magnitudes; bf16x3 tiled: 1e-5."""
    _need_gpu()
    gen = torch.Generator().manual_seed(D)
    for impl, Ts in (("fused", (1, 5, 16)), ("tiled", (17, 300)), ("v1", (5,))):
        for mode in ("bf16x3", "ieee"):
            noise = 1e-5 if mode == "bf16x3" and impl != "fused" else 2 ** -20
            for T in Ts:
                cfg = {"impl": impl, "mode": mode}
                _check_hc_pre(T, D, gen, device="cuda", noise=noise, config=cfg)
                _check_hc_head(T, D, gen, device="cuda", noise=noise, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("T,impl", [(4, "fused"), (300, "tiled"), (64, "tiled")])
def test_gpu_mhc_cuda_graph(T, impl):
    """hc_pre (fused: the counters the last arrivers reset inside the graph; tiled) and the default
    hc_head captured in a CUDA graph: replays on new inputs equal eager calls bit for bit."""
    _need_gpu()
    gen = torch.Generator().manual_seed(T)
    x, fn, base, scale = _hc_inputs(T, 4096, gen, device="cuda")
    fh, bh, sh = fn[:4].contiguous(), base[:4].contiguous(), scale[:1].contiguous()
    cfg = {"impl": impl}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                     # warm-up: compiles, the bf16x3 split, the counters
        hc_pre(x, fn, base, scale, config=cfg)
        hc_head(x, fh, bh, sh)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = hc_pre(x, fn, base, scale, config=cfg) + (hc_head(x, fh, bh, sh),)
    for _ in range(3):
        x.copy_(_hc_inputs(T, 4096, gen, device="cuda")[0])
        g.replay()
        ref = hc_pre(x, fn, base, scale, config=cfg) + (hc_head(x, fh, bh, sh),)
        for a, b in zip(out, ref):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4, 200])
def test_gpu_q_prologue_cuda_graph(T):
    """index_q_prologue captured in a CUDA graph before its cached Hadamard operand exists (the kernel
    then builds the operand itself) and after: replays on new inputs equal eager calls bit for bit."""
    _need_gpu()
    import dsv4.kernels.indexer as ixm
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(T, 64, 128, generator=gen).bfloat16().cuda()
    cos, sin = (t.cuda() for t in _rope(T, gen, "cpu"))
    for cached in (False, True):
        if not cached:
            ixm._HMAT.clear()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                 # warm-up: compiles both kernel variants
            index_q_prologue(q, cos, sin, load_h=False)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = index_q_prologue(q, cos, sin)
        assert bool(ixm._HMAT) == cached           # no operand tensor made inside the capture
        for _ in range(2):
            q.copy_(torch.randn(T, 64, 128, generator=gen).bfloat16().cuda())
            g.replay()
            assert torch.equal(out, index_q_prologue(q, cos, sin))     # eager: the loaded operand


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,indexer", [(4, False), (4, True), (128, False)])
def test_gpu_compress_decode_real_shapes(ratio, indexer):
    _need_gpu()
    gen = torch.Generator().manual_seed(ratio * 3 + indexer)
    B = 128
    pos = torch.randint(0, 1 << 20, (B,), generator=gen)
    pos[: B // 2] = (pos[: B // 2] // ratio) * ratio + ratio - 1      # half the rows complete a window
    pos[0] = ratio - 1                                                 # the first entry
    _check_compress(ratio, indexer, pos.tolist(), gen, device="cuda", page_size=256 // ratio,
                    n_slots=B + 8)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,indexer", [(4, False), (4, True), (128, False)])
def test_gpu_compress_prefill_real_shapes(ratio, indexer):
    """An 8K-token chunk from position 0 and one deep into a 1M context (rows from the previous chunk's tail)."""
    _need_gpu()
    gen = torch.Generator().manual_seed(50 + ratio + indexer)
    m, T = ratio, 8192
    ps = 256 // ratio
    _check_compress_prefill(m, indexer, 0, 0, T // m, gen, tail=m - 1, device="cuda", page_size=ps)
    first = (1 << 20) // m + 3
    base = (first - 1) * m if m == 4 else first * m
    _check_compress_prefill(m, indexer, base, first, first + T // m, gen, tail=1, device="cuda", page_size=ps,
                            joined=True)


@pytest.mark.gpu
def test_gpu_indexer_real_shapes():
    _need_gpu()
    gen = torch.Generator().manual_seed(11)
    T, H = 64, 64
    q = (torch.randn(T, H, 128, generator=gen) * 3).bfloat16()
    cos, sin = _rope(T, gen, "cpu")
    out = index_q_prologue(q.cuda(), cos.cuda(), sin.cuda()).cpu()
    ref = index_q_prologue_torch(q, cos, sin)
    assert (out.float() != ref.float()).float().mean() < 2e-3
    # scores over 256K candidates (1M context) for 2 rows, one of them shorter
    n_blocks = 4096
    pages = _index_cache(n_blocks, gen, device="cuda")
    bt = torch.stack([torch.randperm(n_blocks, generator=gen) for _ in range(2)]).int().cuda()
    pos = torch.tensor([4 * 262144 - 1, 123457]).cuda()
    q, w = _score_inputs(2, H, gen, device="cuda")
    sc = index_scores(q, w, pages, bt, pos)
    ref = index_scores_torch(q, w, pages, bt, pos)
    _check_scores(sc, ref)
    # top-k 512 / 2048 over 256K candidates, batch 1 and 2
    vis = ((pos + 1) // 4).int()
    for k in (512, 2048):
        idx = index_topk(sc, k, vis)
        assert torch.equal(idx.cpu(), index_topk_torch(sc.cpu(), k, vis.cpu()))
        idx1 = index_topk(sc[:1], k)
        assert torch.equal(idx1.cpu(), index_topk_torch(sc[:1].cpu(), k))
    # heavy ties: quantised scores (few distinct values)
    s = (torch.randint(-3, 4, (4, 262144), generator=gen).float() * 0.25).bfloat16().cuda()
    idx = index_topk(s, 1024)
    assert torch.equal(idx.cpu(), index_topk_torch(s.cpu(), 1024))
    for n, k in ((4096, 512), (2048, 2048), (4096, 1024)):             # one-program rows, incl. ties
        for sc_ in (s[:, :n].contiguous(), sc[:, :n].contiguous()):
            assert torch.equal(index_topk(sc_, k).cpu(), index_topk_torch(sc_.cpu(), k))
    # 64 rows: picks above 512 sorted inside the last pass (uint32 codes), not by the rank launch
    s64 = torch.randn(64, 65536, generator=gen).bfloat16().cuda()
    for k in (1024, 2048):
        assert torch.equal(index_topk(s64, k).cpu(), index_topk_torch(s64.cpu(), k))


@pytest.mark.gpu
@pytest.mark.parametrize("T,D", [(1, 1024), (64, 512), (2048, 4096), (64, 7168)])
def test_gpu_rms_norm_real_shapes(T, D):
    _need_gpu()
    _check_rms_norm(T, D, torch.bfloat16, torch.Generator().manual_seed(T + D), device="cuda")


@pytest.mark.gpu
def test_gpu_entry_ids():
    _need_gpu()
    _check_entry_ids(device="cuda")
