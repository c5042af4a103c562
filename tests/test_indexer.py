"""Indexer kernels (dsv4/kernels/indexer.py: the q prologue, the index scores over the paged FP4 cache,
top-k) against their torch twins.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA, and the ``gpu``-marked tests add the real V4 shapes.
"""
import pytest
from kernel_helpers import kernel_device, max_rel_err as _rel, need_gpu, random_angle_rope as _rope
import torch

triton = pytest.importorskip("triton")

from dsv4.formats.index_key import write_index_entries  # noqa: E402
from dsv4.kernels.indexer import index_q_prologue, index_scores, index_topk  # noqa: E402
from dsv4.twins.indexer import index_q_prologue as index_q_prologue_twin  # noqa: E402
from dsv4.twins.indexer import index_scores as index_scores_twin  # noqa: E402
from dsv4.twins.indexer import index_topk as index_topk_twin  # noqa: E402

DEV = kernel_device()


# ------------------------------------------------------------------------------------------------
# indexer

@pytest.mark.parametrize("T,H", [(2, 64), (3, 8)])
def test_index_q_prologue(T, H):
    gen = torch.Generator().manual_seed(T * H)
    q = (torch.randn(T, H, 128, generator=gen) * torch.rand(T, H, 1, generator=gen) * 4).bfloat16()
    q[0, 0, :32] = 0                                                  # an all-zero FP4 block
    cos, sin = _rope(T, gen, "cpu")
    ref = index_q_prologue_twin(q, cos, sin)
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
    keys = index_q_prologue_twin(keys, ones, zeros)[:, 0]            # FP4-QDQ'd, as the cache holds
    pages = torch.randint(0, 256, (n_blocks, 64 * 68), dtype=torch.uint8, generator=gen).to(device)
    write_index_entries(pages, torch.arange(n, device=device), keys)
    return pages


def _score_inputs(B, H, gen, device=DEV):
    q = (torch.randn(B, H, 128, generator=gen)).bfloat16()
    q = index_q_prologue_twin(q, torch.ones(B, 32), torch.zeros(B, 32))
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
    ref = index_scores_twin(q, w, pages, bt, pos)
    assert sc.shape == (3, 256)
    _check_scores(sc, ref)
    assert torch.isinf(sc[1]).all()
    sc2 = index_scores(q, w, pages, bt, pos, n=200, pages_per_program=2, direct=True)
    _check_scores(sc2, ref[:, :200])
    # the model's form: the fp32 weights_proj output (strided rows of a wider tensor) with w_scale, the
    # head weights formed in the kernel as the twin forms them (bf16, times the scale, bf16)
    z = torch.randn(3, H + 7, generator=gen).to(DEV) * 4
    scale = 128 ** -0.5 * H ** -0.5
    raw = index_scores(q, z[:, 7:], pages, bt, pos, w_scale=scale)
    wb = (z[:, 7:].to(torch.bfloat16) * scale).to(torch.bfloat16)
    assert torch.equal(index_scores_twin(q, z[:, 7:], pages, bt, pos, w_scale=scale),
                       index_scores_twin(q, wb, pages, bt, pos))
    assert torch.equal(raw, index_scores(q, wb, pages, bt, pos))
    with pytest.raises(ValueError, match="fp32 weights_proj output"):
        index_scores(q, wb, pages, bt, pos, w_scale=scale)


@pytest.mark.parametrize("qb", [2, 4])
def test_index_scores_rows_sharing_a_block_table(qb):
    """A prefill chunk's rows (one block table, row stride 0, ascending positions; the first rows see
    nothing yet, the row count not a multiple of the rows per program): ``rows_per_program`` rows per
    program give the twin's scores, and the one-row kernel's up to the head sum's fp32 order."""
    gen = torch.Generator().manual_seed(13 + qb)
    H, B = 16, 11
    pages = _index_cache(5, gen)
    bt = torch.tensor([4, 0, 2, -1], dtype=torch.int32).to(DEV).expand(B, -1)
    pos = (torch.arange(B) * 70 + 1).to(DEV)                         # visible: 0 .. 175 entries
    q, w = _score_inputs(B, H, gen)
    ref = index_scores_twin(q, w, pages, bt, pos)
    one = index_scores(q, w, pages, bt, pos, rows_per_program=1)
    sc = index_scores(q, w, pages, bt, pos, rows_per_program=qb)
    _check_scores(sc, ref)
    assert (sc.float() != one.float()).float().mean() < 2e-3
    assert torch.isinf(sc[0]).all() and torch.isinf(sc[:, 192:]).all()
    z = torch.randn(B, H + 3, generator=gen).to(DEV) * 4                # the model's fp32 weights_proj form
    scale = 128 ** -0.5 * H ** -0.5
    _check_scores(index_scores(q, z[:, 3:], pages, bt, pos, n=150, w_scale=scale, rows_per_program=qb),
                  index_scores_twin(q, z[:, 3:], pages, bt, pos, n=150, w_scale=scale))
    with pytest.raises(ValueError, match="power of two"):
        index_scores(q, w, pages, bt, pos, rows_per_program=3)


_TOPK_PATHS = {"auto": dict(full_sort=False), "auto+full-sort": dict(full_sort=True), "chunked": dict(single_max=0),
               "chunked+rank": dict(single_max=0, sort_max=0)}


@pytest.mark.parametrize("path", list(_TOPK_PATHS))
@pytest.mark.parametrize("B,N,k,tie_every", [(3, 1000, 50, 3), (2, 150, 200, 2), (2, 5000, 64, 1), (2, 100, 300, 4)])
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
    ref = index_topk_twin(s, k, nv)
    assert torch.equal(out, ref)


@pytest.mark.slow
def test_index_topk_many_rows_sort_in_kernel():
    """>= 32 rows sort more than 512 picks inside the last pass (no rank launch): 1024-wide codes."""
    gen = torch.Generator().manual_seed(9)
    s = torch.randn(32, 1500, generator=gen).bfloat16()
    s[3, ::2] = 0.25                                                 # ties across the threshold
    nv = torch.randint(500, 1501, (32,), generator=gen).int()
    out = index_topk(s.to(DEV), 600, nv.to(DEV), single_max=0).cpu()
    assert torch.equal(out, index_topk_twin(s, 600, nv))


def test_index_topk_twin_sorts_the_valid_prefix_as_the_whole_row():
    """The twin sorts only the first max(n_valid) columns: the full stable sort's picks, -1 padding included
    (ties, -inf inside the valid range, rows of 0 / some / all valid columns, k above and below max(n_valid))."""
    def full_sort(scores, k, nv):
        B, N = scores.shape
        j = torch.arange(N)[None, :]
        s = scores.float().masked_fill(j >= nv.long()[:, None], float("-inf"))
        idx = s.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        idx = idx.masked_fill(idx >= nv.long()[:, None], -1)
        if idx.shape[1] < k:
            idx = torch.cat([idx, idx.new_full((B, k - idx.shape[1]), -1)], dim=1)
        return idx.int()
    gen = torch.Generator().manual_seed(4)
    s = torch.randn(4, 3000, generator=gen).bfloat16()
    s[1, ::5] = 0.5
    s[2, 3] = float("-inf")
    s[:, 2500:] = float("-inf")                                       # the unwritten tail of a decode row
    for nv, k in (([0, 40, 300, 17], 64), ([0, 40, 300, 17], 512), ([3000, 0, 5, 2999], 100), ([0, 0, 0, 0], 8)):
        nv = torch.tensor(nv, dtype=torch.int32)
        assert torch.equal(index_topk_twin(s, k, nv), full_sort(s, k, nv))


def test_index_topk_no_valid_and_small_k():
    gen = torch.Generator().manual_seed(6)
    s = torch.randn(2, 777, generator=gen).bfloat16()
    out = index_topk(s.to(DEV), 1).cpu()
    assert torch.equal(out, index_topk_twin(s, 1))
    out = index_topk(s.to(DEV), 20, torch.zeros(2, dtype=torch.int32, device=DEV)).cpu()
    assert (out == -1).all()
    out = index_topk(s.to(DEV), 40, chunks=7).cpu()
    assert torch.equal(out, index_topk_twin(s, 40))


def test_index_topk_workspace_reset():
    """The chunked passes keep their counters, row fields and histogram in the shared arrival-counter
    buffer: the last pass leaves it zeroed, so back-to-back calls (other data, other row counts, with
    and without n_valid, both sort paths) stay exact with no memset launch: 3 rows, then 1 (fewer), then 2 (more)."""
    from dsv4.kernels.counters import arrival_counters
    from dsv4.kernels.indexer import _TOPK_WS
    gen = torch.Generator().manual_seed(11)
    for B, N, k, sort_max in ((3, 1200, 100, 512), (1, 2600, 300, 512), (2, 1500, 200, 0)):
        s = torch.randn(B, N, generator=gen).bfloat16()
        s[0, ::5] = 1.0                                              # ties across the threshold
        nv = torch.randint(N // 2, N + 1, (B,), generator=gen).int()
        for n_valid in (nv, None):
            out = index_topk(s.to(DEV), k, None if n_valid is None else n_valid.to(DEV), single_max=0,
                             sort_max=sort_max).cpu()
            assert torch.equal(out, index_topk_twin(s, k, n_valid))
            ws = arrival_counters(DEV, B * _TOPK_WS)[:B * _TOPK_WS]
            assert not ws.any(), "index_topk left its workspace dirty"


def test_index_scores_topk_match_the_reference_rule():
    """scores + top-k == ``reference.indexer.Indexer.select``'s rule (stable sort, -1 past visible)."""
    gen = torch.Generator().manual_seed(8)
    pages = _index_cache(4, gen)
    bt = torch.tensor([[2, 0, 3], [1, -1, -1]], dtype=torch.int32).to(DEV)
    pos = torch.tensor([600, 9]).to(DEV)
    q, w = _score_inputs(2, 16, gen)
    sc = index_scores(q, w, pages, bt, pos)
    vis = ((pos + 1) // 4).to(torch.int32)
    idx = index_topk(sc, 64, vis).cpu()
    ref_sc = index_scores_twin(q, w, pages, bt, pos).cpu()
    ref = ref_sc.sort(dim=-1, descending=True, stable=True).indices[:, :64]
    ref = ref.masked_fill(ref >= vis.cpu().long()[:, None], -1)
    if torch.equal(sc.cpu().float(), ref_sc.float()):
        assert torch.equal(idx.long(), ref)


# ------------------------------------------------------------------------------------------------
# GPU: real shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


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
def test_gpu_indexer_real_shapes():
    _need_gpu()
    gen = torch.Generator().manual_seed(11)
    T, H = 64, 64
    q = (torch.randn(T, H, 128, generator=gen) * 3).bfloat16()
    cos, sin = _rope(T, gen, "cpu")
    out = index_q_prologue(q.cuda(), cos.cuda(), sin.cuda()).cpu()
    ref = index_q_prologue_twin(q, cos, sin)
    assert (out.float() != ref.float()).float().mean() < 2e-3
    # scores over 256K candidates (1M context) for 2 rows, one of them shorter
    n_blocks = 4096
    pages = _index_cache(n_blocks, gen, device="cuda")
    bt = torch.stack([torch.randperm(n_blocks, generator=gen) for _ in range(2)]).int().cuda()
    pos = torch.tensor([4 * 262144 - 1, 123457]).cuda()
    q, w = _score_inputs(2, H, gen, device="cuda")
    sc = index_scores(q, w, pages, bt, pos)
    ref = index_scores_twin(q, w, pages, bt, pos)
    _check_scores(sc, ref)
    # top-k 512 / 2048 over 256K candidates, batch 1 and 2
    vis = ((pos + 1) // 4).int()
    for k in (512, 2048):
        idx = index_topk(sc, k, vis)
        assert torch.equal(idx.cpu(), index_topk_twin(sc.cpu(), k, vis.cpu()))
        idx1 = index_topk(sc[:1], k)
        assert torch.equal(idx1.cpu(), index_topk_twin(sc[:1].cpu(), k))
    # heavy ties: quantised scores (few distinct values)
    s = (torch.randint(-3, 4, (4, 262144), generator=gen).float() * 0.25).bfloat16().cuda()
    idx = index_topk(s, 1024)
    assert torch.equal(idx.cpu(), index_topk_twin(s.cpu(), 1024))
    for n, k in ((4096, 512), (2048, 2048), (4096, 1024)):             # one-program rows, incl. ties
        for sc_ in (s[:, :n].contiguous(), sc[:, :n].contiguous()):
            assert torch.equal(index_topk(sc_, k).cpu(), index_topk_twin(sc_.cpu(), k))
    # 64 rows: picks above 512 sorted inside the last pass (uint32 codes), not by the rank launch
    s64 = torch.randn(64, 65536, generator=gen).bfloat16().cuda()
    for k in (1024, 2048):
        assert torch.equal(index_topk(s64, k).cpu(), index_topk_twin(s64.cpu(), k))


@pytest.mark.gpu
@pytest.mark.parametrize("qb", [2, 4])
def test_gpu_index_scores_rows_sharing_a_block_table(qb):
    """V4's indexer (64 heads) on a 512-row prefill chunk from position 3000 (one block table): the rows
    kernel's scores against the twin's and the one-row kernel's."""
    _need_gpu()
    gen = torch.Generator().manual_seed(21)
    B, H = 512, 64
    n = (3000 + B) // 4
    nb = -(-n // 64)
    pages = _index_cache(nb, gen, device="cuda")
    bt = torch.randperm(nb, generator=gen).int().cuda().expand(B, -1)
    pos = torch.arange(3000, 3000 + B).cuda()
    q, w = _score_inputs(B, H, gen, device="cuda")
    sc = index_scores(q, w, pages, bt, pos, n=n, rows_per_program=qb)
    _check_scores(sc, index_scores_twin(q, w, pages, bt, pos, n=n))
    one = index_scores(q, w, pages, bt, pos, n=n, rows_per_program=1)
    assert (sc.float() != one.float()).float().mean() < 2e-3
