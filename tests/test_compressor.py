"""Compressor kernels (dsv4/kernels/compressor.py: the decode update and the prefill chunk) against
their torch twins and the reference ``Compressor.update``.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA, and the ``gpu``-marked tests add the real V4 shapes.
"""
import pytest
from kernel_helpers import kernel_device, max_rel_err as _rel, need_gpu, random_angle_rope as _rope
import torch

triton = pytest.importorskip("triton")

from dsv4.formats.index_key import write_index_entries  # noqa: E402
from dsv4.formats.kv_entry import page_bytes, write_kv_entries  # noqa: E402
from dsv4.kernels.compressor import compress_decode, compress_prefill  # noqa: E402
from dsv4.twins.compressor import compress_decode as compress_decode_twin  # noqa: E402
from dsv4.twins.compressor import compress_prefill as compress_prefill_twin  # noqa: E402

DEV = kernel_device()


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
    ref, done_r, pooled_r = compress_decode_twin(st2, slots, pos, k, s, w, cos, sin, pages=p2,
                                                  page_slots=pslots, **kw)
    assert torch.equal(st1, st2)                                     # ring rows written, nothing else
    assert torch.equal(done.cpu(), done_r.cpu())
    assert _rel(pooled, pooled_r) < 1e-5
    # post-processing: bit-exact on the same pooled vector up to rare summation-order flips
    out2 = compress_decode_twin(state.clone(), slots, pos, k, s, w, cos, sin, **dict(kw, return_pooled=False))[0]
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
    ref, pooled_r = compress_prefill_twin(rk, rs, base, first, last, w, cos, sin, pages=p2, page_slots=pslots,
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
        compress_prefill_twin(rk[:-1], rs[:-1], 4, 2, 5, w, cos, sin, **kw)
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
# GPU: real shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


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
