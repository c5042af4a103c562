"""MoE kernels (dsv4/kernels/moe.py: routing, the pair sort, combine, the expert layer) against the
reference MoE.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA and the ``gpu``-marked tests add V4-Flash shapes.

Tolerances (documented in the modules): routing is bit-exact; the MoE layer matches the reference
within FP8-step tolerance (a one-ulp bf16 difference in a w1/w3 output can move h by one FP8 step).
"""
import pytest
from kernel_helpers import kernel_device, need_gpu
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from dsv4.formats.fp4 import dequant_mxfp4, dequant_nvfp4, quant_mxfp4, quant_nvfp4  # noqa: E402
from dsv4.formats.fp8 import dequant_fp8_weight, quant_fp8_weight  # noqa: E402
from dsv4.kernels.gemm import fp8 as G8, route as GR  # noqa: E402
from dsv4.kernels.lib import target, u8  # noqa: E402
from dsv4.kernels import moe as Mo  # noqa: E402
from dsv4.reference.linear import Linear  # noqa: E402
from dsv4.reference.moe import Expert, MoE  # noqa: E402
from dsv4.reference.numerics import OFFICIAL  # noqa: E402
from dsv4.twins import moe as twin  # noqa: E402

DEV = kernel_device()


def _mx(w):
    q, s = quant_mxfp4(w)
    return dequant_mxfp4(q, s)


def _f8(w):
    q, s = quant_fp8_weight(w)
    return dequant_fp8_weight(q, s)


def _ref_moe(E, d, I, k, gen, hash_layer, vocab=64, shared=True, dup_row=None):
    lin = lambda o, i, f, fmt: Linear(f(torch.randn(o, i, generator=gen) * 0.06), fmt, OFFICIAL)
    experts = [Expert(lin(I, d, _mx, "fp4"), lin(d, I, _mx, "fp4"), lin(I, d, _mx, "fp4"), 10.0, OFFICIAL)
               for _ in range(E)]
    sh = Expert(lin(I, d, _f8, "fp8"), lin(d, I, _f8, "fp8"), lin(I, d, _f8, "fp8"), 10.0, OFFICIAL) if shared else None
    gate = torch.randn(E, d, generator=gen) * 0.1
    bias = None if hash_layer else torch.randn(E, generator=gen) * 0.05
    tid = None
    if hash_layer:
        tid = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(vocab)])
        if dup_row is not None:
            tid[dup_row, 1] = tid[dup_row, 0]          # a repeated expert id in one row
    return MoE(gate, bias, tid, experts, sh, k, 1.5, OFFICIAL)


@pytest.fixture(autouse=True)
def _swiglu_row_tiles(monkeypatch):
    """Under the interpreter the SwiGLU + FP8 pass (``gemv.swiglu_quant``: the GEMV path's, the shared expert's,
    the pre-decoded path's unfused GEMM 1's) runs 16-row programs at every size here instead of one program a row
    below ``route.SWIGLU_TILE_MIN_ROWS`` (the interpreter's time goes with the programs): the same bits
    (test_gemv.py::test_swiglu_quant_row_tiles holds one-row programs to 16-row ones)."""
    if DEV == "cpu":
        monkeypatch.setattr(GR, "SWIGLU_TILE_MIN_ROWS", 1)


@pytest.fixture
def predecode_gpu_tile(monkeypatch):
    """``fp4_fp8.predecode`` on the GPU's tile (32 rows x 4 128-blocks a step; the interpreter's 16 x 1 runs about
    8x the programs, most of a pre-decoded MoE call's time here): the MoE tests are about the path around it;
    the tiles' own bits are test_fp4_fp8's."""
    monkeypatch.setattr(GR, "predecode_config", lambda t: {"BN": 32, "KU": 4, "num_warps": 8})


def _check_moe(y, yr):
    y, yr = y.cpu().float(), yr.float()
    assert torch.isfinite(y).all()
    rel = ((y - yr).norm() / yr.norm()).item()
    assert rel < 2e-2, rel
    assert ((y - yr).abs() <= 0.05 * yr.abs().amax(-1, keepdim=True) + 1e-6).all()


@pytest.mark.parametrize("hash_layer", [False, True])
def test_route_exact(hash_layer):
    gen = torch.Generator().manual_seed(3 + hash_layer)
    ref = _ref_moe(8, 256, 128, 3, gen, hash_layer, dup_row=5, shared=False)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = (torch.randn(13, 256, generator=gen)).bfloat16()
    ids = torch.randint(0, 64, (13,), generator=gen)
    ids[2] = 5
    i0, w0 = ref.route(x, ids)
    i1, w1 = Mo.route(x.to(DEV), ids.to(DEV), w)
    i1, w1 = i1.cpu(), w1.cpu()
    if DEV == "cpu":   # same logits: the same ids in the same slot order, weights within ulps
        assert torch.equal(i1, i0)
        torch.testing.assert_close(w1, w0, rtol=4e-7, atol=0)
    else:              # scores from another device's GEMM: compare as sets, weights to ~ulps
        assert torch.equal(i1.sort(-1).values, i0.sort(-1).values)
        o1, o0 = i1.argsort(-1), i0.argsort(-1)
        torch.testing.assert_close(w1.gather(1, o1), w0.gather(1, o0), rtol=1e-5, atol=1e-6)
    # the router's quantised x (the expert GEMMs' operand from the same launch): act_quant_fp8's bytes
    x = x * torch.logspace(-3, 1, 256).bfloat16()          # blocks of very different scales
    i2, w2, e2, xq, xs, s2 = Mo._route(x.to(DEV), ids.to(DEV), w, quant=True)
    i3, w3, e3, nq, ns, s3 = Mo._route(x.to(DEV), ids.to(DEV), w)
    q0, s0 = G8.act_quant_fp8(x.to(DEV))
    assert nq is None and ns is None and s2 is None and s3 is None
    assert torch.equal(xq, q0.view(torch.uint8)) and torch.equal(xs, s0)
    assert torch.equal(i2, i3) and torch.equal(w2, w3) and torch.equal(e2, e3)


@pytest.mark.parametrize("T", [1, 3])
def test_route_top_k_breaks_ties_to_the_lower_id_below_zero_too(T):
    """The router's top-k (one packed max-reduction a pick): the twin's rule, a stable descending sort of
    score + bias, where scores tie exactly (equal gate rows and biases) and where score + bias is below
    zero (a tie there too), one token (its sort from registers) and three (the sort after the arrivals)."""
    gen = torch.Generator().manual_seed(17)
    ref = _ref_moe(16, 256, 128, 6, gen, False, shared=False)
    ref.bias[:] = -8.0                                       # sums below zero but five: ...
    ref.bias[2] = ref.bias[7] = 1.0
    ref.gate_w[3] = ref.gate_w[9] = ref.gate_w[1]            # ... three equal scores and sums among them
    ref.bias[1] = ref.bias[3] = ref.bias[9] = 0.5
    ref.gate_w[12] = ref.gate_w[5]
    ref.bias[5] = ref.bias[12] = -3.0                        # the sixth pick: a tie below zero
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = torch.randn(T, 256, generator=gen).bfloat16()
    sc = torch.sqrt(torch.nn.functional.softplus(x.float() @ ref.gate_w.float().T)) + ref.bias
    want = sc.sort(dim=-1, descending=True, stable=True).indices[:, :6]
    assert (sc[:, [1, 3, 9]].diff(dim=1) == 0).all() and (sc[:, 5] == sc[:, 12]).all() and (sc[:, 5] < 0).all()
    assert (want[:, 5] == 5).all() and (want[:, 2:5] == torch.tensor([1, 3, 9])).all()    # the ties decide
    idx, rw, eflat, xq, xs, sort = Mo._route(x.to(DEV), None, w, quant=True, sort_bm=1)
    assert torch.equal(idx.cpu(), want)
    for a, b in zip(sort, Mo.sort_pairs(eflat, w.n_experts, 1)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T,bm", [(1, 8), (3, 1), (30, 8), (43, 1)])
def test_route_sorts_in_its_last_program(T, bm):
    """``_route(..., sort_bm=bm)``: the router's launch also sorts the pairs (its last arriving program;
    T 1: its only one, no counter; T 30 x 3 slots: two 64-pair chunks): ``sort_pairs``' perm / offs /
    tcum / inv exactly, with hash-routed repeats (the sentinel) in the keys, the counter left at 0;
    above SORT_FUSED_MAX pairs (T 43 x 3) ``sort_pairs`` runs in its own launch, the same values."""
    assert 30 * 3 <= Mo.SORT_FUSED_MAX < 43 * 3
    from dsv4.kernels.counters import arrival_counters
    gen = torch.Generator().manual_seed(40 + T)
    for hash_layer in (False, True):
        ref = _ref_moe(8, 256, 128, 3, gen, hash_layer, dup_row=5, shared=False)
        w = Mo.MoEWeights.from_reference(ref).to(DEV)
        x = torch.randn(T, 256, generator=gen).bfloat16().to(DEV)
        ids = torch.randint(0, 64, (T,), generator=gen).to(DEV)
        ids[0] = 5                                                  # the repeated hash row
        for _ in range(2):                                           # a second call: the counter was reset
            idx, rw, eflat, xq, xs, sort = Mo._route(x, ids, w, quant=True, sort_bm=bm)
            want = Mo.sort_pairs(eflat, w.n_experts, bm)
            for a, b in zip(sort, want):
                assert torch.equal(a, b)
            assert int(arrival_counters(x.device, 1)[0]) == 0
        if hash_layer:
            assert int((eflat == w.n_experts).sum()) > 0


def test_route_compile_key_is_the_same_for_every_unsorted_token_count(monkeypatch):
    """The router's constexprs depend on T only through the fused sort (T * k <= SORT_FUSED_MAX):
    above it every T launches one compiled variant, so no prefill length compiles after the
    engine's warm-up (``tests/test_warmup.py``'s GPU check)."""
    keys = {}

    class _Rec:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                keys[grid[0]] = {k: v for k, v in kw.items() if k not in ("num_warps",)}
            return launch

    monkeypatch.setattr(Mo, "_route_kernel", _Rec())
    monkeypatch.setattr(Mo, "sort_pairs", lambda *a: None)     # (its keys: the recorder wrote none)
    gen = torch.Generator().manual_seed(7)
    w = Mo.MoEWeights.from_reference(_ref_moe(8, 256, 128, 3, gen, False, shared=False)).to(DEV)
    for T in (1, 30, 50, 700, 3000):
        Mo._route(torch.randn(T, 256, generator=gen).bfloat16().to(DEV), None, w, quant=True, sort_bm=8)
    assert keys[1]["SORT"] and keys[30]["SORT"] and not keys[50]["SORT"]
    assert keys[50] == keys[700] == keys[3000]


def test_gate_bf16_only_where_exact():
    """``MoEWeights.gate_bf16``: the bf16 copy the many-row router GEMM runs on exists only when every gate
    value is bf16-exact (a checkpoint's bf16 gate upcast), and holds those values."""
    gen = torch.Generator().manual_seed(11)
    ref = _ref_moe(8, 256, 128, 3, gen, False, shared=False)
    w = Mo.MoEWeights.from_reference(ref)
    assert w.gate_bf16() is None                                # randn * 0.1 in fp32: not bf16 values
    exact = Mo.MoEWeights.from_reference(ref)
    exact.gate_w = exact.gate_w.bfloat16().float()
    g = exact.gate_bf16()
    assert g.dtype == torch.bfloat16 and torch.equal(g.float(), exact.gate_w)
    off = Mo.MoEWeights.from_reference(ref)
    off.gate_w = exact.gate_w.clone()
    off.gate_w[3, 7] *= 1.0 + 2.0 ** -12                        # one value off the bf16 grid is enough
    assert off.gate_bf16() is None
    assert exact.gate_bf16() is g                               # cached per object


@triton.jit
def _sqrt_softplus_probe(Z, Y, N, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(Y + i, Mo._sqrt_softplus(tl.load(Z + i, mask=i < N)), mask=i < N)


def test_sqrt_softplus_matches_torch():
    """The routing kernel's sqrt(softplus(z)) against torch's over the fp32 range that matters (tails,
    the 20 threshold, zero)."""
    z = torch.cat([torch.linspace(-90, 40, 4001), torch.tensor([0.0, -0.0, 20.0, 20.000002, 19.999998, -1e-8,
                                                                 1e-8, -20.0, -88.0])]).float()
    y = torch.empty_like(z).to(DEV)
    _sqrt_softplus_probe[(triton.cdiv(z.numel(), 1024),)](z.to(DEV), y, z.numel(), B=1024)
    ref = torch.sqrt(torch.nn.functional.softplus(z))
    # a few ulps (the GPU's exp / log are the approximate ex2 / lg2 forms); below z = -87.3 exp() is
    # subnormal and keeps fewer bits (19 at z = -90: the H200 measured 3.4e-6 there)
    normal = z >= -87.3
    torch.testing.assert_close(y.cpu()[normal], ref[normal], rtol=2e-6, atol=0)
    torch.testing.assert_close(y.cpu()[~normal], ref[~normal], rtol=2e-5, atol=0)


@pytest.mark.parametrize("P,E", [(1, 8), (6, 256), (100, 8), (384, 256), (1000, 64), (1500, 8)])
def test_sort_pairs_stable(P, E):
    """sort_pairs (the one-launch counting sort up to SORT_COUNTING_MAX pairs, torch.sort above) =
    a stable sort by expert id with the sentinel E last; offs / tcum / inv consistent."""
    gen = torch.Generator().manual_seed(P)
    ef = torch.randint(0, E + 1, (P,), generator=gen, dtype=torch.int32)
    ef[: P // 3] = ef[0]                          # long runs of one expert
    perm, offs, tcum, inv = Mo.sort_pairs(ef.to(DEV), E, 8)
    ref = torch.sort(ef.long(), stable=True).indices
    assert torch.equal(perm.cpu(), ref)
    assert torch.equal(inv.cpu().long()[ref], torch.arange(P))
    cnt = torch.bincount(ef.long(), minlength=E + 1)
    assert torch.equal(offs.cpu(), torch.cat([torch.zeros(1, dtype=torch.long), cnt.cumsum(0)[:E]]))
    assert torch.equal(tcum.cpu(), torch.cat([torch.zeros(1, dtype=torch.long), ((cnt[:E] + 7) // 8).cumsum(0)]))


@pytest.mark.parametrize("S", [2, 5])
@pytest.mark.parametrize("one_trip", [False, True])
def test_combine_sums_split_partials(S, one_trip, monkeypatch):
    """The MoE combine on the w2 GEMM's unsummed fp32 split partials (the decode path's one launch
    fewer) equals the combine on their ``sum_splits`` bf16 rows bit for bit, masked pairs included;
    also in its one-round-trip form (``COMBINE_ONE_TRIP``: up to four partials without the split loop)."""
    from dsv4.kernels.gemm.common import sum_splits
    monkeypatch.setattr(Mo, "COMBINE_ONE_TRIP", one_trip)
    gen = torch.Generator().manual_seed(S)
    T, k, E, d = 5, 3, 8, 320     # one-trip form: 256-column programs, the second partial
    eflat = torch.randint(0, E, (T * k,), generator=gen)
    eflat[4] = E                                   # a masked slot (sentinel expert: no row)
    perm, offs, tcum, inv = Mo.sort_pairs(eflat.int().to(DEV), E, 1)
    part = (torch.randn(S, T * k, d, generator=gen) * 3).to(DEV)
    sh = torch.randn(T, d, generator=gen).bfloat16().to(DEV)
    y_split = Mo._combine(part, inv, offs, sh, k)
    y_summed = Mo._combine(sum_splits(part), inv, offs, sh, k)
    assert y_split.dtype == torch.bfloat16
    assert torch.equal(y_split.view(torch.int16), y_summed.view(torch.int16))
    # ... and differs from a combine that skipped a split (the partials are really read)
    assert not torch.equal(Mo._combine(part[:-1].contiguous(), inv, offs, sh, k), y_summed)
    # the partial (expert-parallel) combine: the fp32 sum without the shared expert, which rounds
    # to the fused combine's bits once the shared output is added
    y32, sh_out = Mo._combine(part, inv, offs, sh, k, partial=True)
    assert y32.dtype == torch.float32 and sh_out is sh
    assert torch.equal((y32 + sh.float()).bfloat16().view(torch.int16), y_split.view(torch.int16))


@pytest.mark.parametrize("hash_layer,T,path,bm", [(False, 9, "dequant", None), (True, 7, "dequant", None),
                                                  (False, 5, "gemv", 2), (True, 7, "gemv", 4), (False, 1, "gemv", 1),
                                                  (True, 2, None, None), (False, 12, None, None),
                                                  (False, 30, "prefill", None), (True, 9, "prefill", None),
                                                  (False, 30, "fp8mma", None), (True, 30, "predec", None)])
def test_moe_forward(hash_layer, T, path, bm, request):
    """Every expert-GEMM path: the MMA kernels, the prefill kernel (fp4_prefill.py: one K=128 dot per
    block, split-K-order operands) and the decode GEMV (1/2/4-row tiles: at T 5 an expert of 3 rows
    takes a full and a partial 2-row tile, at T 7 one of 4 rows a full 4-row tile; the GEMV's programs
    go with the tiles); the shared expert on the split-K MMA partials (<= 64 tokens); the default picks
    the GEMV at <= 2 rows per expert."""
    if path == "predec":
        request.getfixturevalue("predecode_gpu_tile")
    gen = torch.Generator().manual_seed(20 + T)
    ref = _ref_moe(8, 256, 128, 2, gen, hash_layer, dup_row=4)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = (torch.randn(T, 256, generator=gen) * 1.5).bfloat16()
    ids = torch.randint(0, 64, (T,), generator=gen)
    ids[0] = 4
    # the forced GEMV runs on the 64-column tile, the forced tile kernels (dequant, prefill, fp8mma, predec) on
    # 128 columns (the GPU defaults; the interpreter's 16 / 32 run 4x the programs, its time here): the cases are
    # about the row tiles and the paths (the default-path cases keep the interpreter's tiles; the kernels' own
    # tiles: test_gemv, test_gemm, test_fp4_prefill, test_fp4_fp8)
    config = {"BM": bm, "BN": 64} if bm is not None else {"BN": 128} if path is not None else None
    y, parts = Mo.moe_forward(x.to(DEV), ids.to(DEV), w, path=path, config=config, return_parts=True)
    yr = ref(x, ids)
    _check_moe(y, yr)
    # the default takes the decode kernels up to GEMV_ROWS_PER_EXPERT rows per active expert (T x 2
    # pairs, 8 experts), MMA_GEMV_ROWS_PER_EXPERT where the tensor-core one runs (sm_89+)
    P = T * 2
    gemv_max = GR.MMA_GEMV_ROWS_PER_EXPERT if target(DEV).gluon_mma else GR.GEMV_ROWS_PER_EXPERT
    assert parts["path"] == (path or ("gemv" if P / min(8, P) <= gemv_max else GR.fp4_path("mxfp4", target(DEV))))
    # pairs sorted by expert: offsets are the cumulative counts (duplicates dropped)
    idx = parts["idx"].cpu()
    first = torch.ones_like(idx, dtype=torch.bool)
    first[:, 1] = idx[:, 1] != idx[:, 0]
    counts = torch.bincount(idx[first], minlength=8)
    assert torch.equal(parts["offs"].cpu(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))


@pytest.mark.parametrize("T", [1, 3])
def test_shared_expert_forked_before_the_router_gives_the_same_bits(monkeypatch, T):
    """``SHARED_EARLY``: the decode path's shared expert from its own quantisation of x, started before the router,
    gives the bits of the one on the router's quantised x. The fork is replaced by an inline stand-in that reports a
    side stream (a CPU step never forks), so the early branch's plumbing runs here; the GPU streams test runs it
    on a real side stream."""
    from kernel_helpers import InlineFork
    gen = torch.Generator().manual_seed(40 + T)
    ref = _ref_moe(8, 256, 128, 2, gen, False)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = (torch.randn(T, 256, generator=gen) * 1.5).bfloat16().to(DEV)
    config = {"BM": 1, "BN": 64}
    monkeypatch.setattr(Mo, "Fork", InlineFork)
    out = {}
    for early in (False, True):
        monkeypatch.setattr(Mo, "SHARED_EARLY", early)
        InlineFork.made.clear()
        out[early] = Mo.moe_forward(x, None, w, path="gemv", config=config, return_parts=True)
        assert len(InlineFork.made) == 1 and InlineFork.made[0].joined
    (y0, p0), (y1, p1) = out[False], out[True]
    assert torch.equal(p0["shared"].view(torch.int16), p1["shared"].view(torch.int16))
    assert torch.equal(y0.view(torch.int16), y1.view(torch.int16))


def test_predec_passes_over_expert_ranges_give_one_pass_s_bits(monkeypatch, predecode_gpu_tile):
    """The pre-decoded path with a scratch budget of two experts per pass (uneven ranges 2 + 2 + 1
    of the sorted rows, rebased tile counts, grids with dead tiles) gives the single pass's bits.
    Five experts: each pass decodes its experts' weights, the interpreter's time here."""
    gen = torch.Generator().manual_seed(32)
    ref = _ref_moe(5, 256, 128, 2, gen, False, dup_row=4)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = (torch.randn(24, 256, generator=gen) * 1.5).bfloat16().to(DEV)
    ids = torch.zeros(24, dtype=torch.long, device=DEV)
    one = Mo.moe_forward(x, ids, w, path="predec")
    per_expert = 256 * (256 + 4 * 2)                        # w1|w3 rows x (K bytes + fp32 factors)
    monkeypatch.setattr(GR, "PREDEC_SCRATCH_BYTES", 2 * per_expert + 100)
    assert GR.predec_experts_per_pass(5, 256, 256) == 2 and GR.predec_experts_per_pass(1, 256, 256) == 1
    assert torch.equal(Mo.moe_forward(x, ids, w, path="predec"), one)
    _check_moe(one, ref(x.cpu(), ids.cpu()))


def _predec_variants_give_the_pointer_loads_bits(cfgs):
    """The pre-decoded path in each variant of ``cfgs`` against its pointer-load form (one baseline); four
    experts (each call decodes every expert's weights, the interpreter's time here)."""
    gen = torch.Generator().manual_seed(33)
    ref = _ref_moe(4, 256, 128, 2, gen, True, dup_row=4)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = (torch.randn(24, 256, generator=gen) * 1.5).bfloat16().to(DEV)
    ids = torch.randint(0, 64, (24,), generator=gen).to(DEV)
    plain = {"ATMA": False, "WTMA": False, "UNFUSED": False, "TILE": False, "HOST_TMA": False, "PREFETCH": False}
    assert w.fp8_tile_max() is not None                   # TILE variants do take the per-tile factors
    base = Mo.moe_forward(x, ids, w, path="predec", config=plain)
    for cfg in cfgs:
        assert torch.equal(Mo.moe_forward(x, ids, w, path="predec", config=dict(plain, **cfg)), base), cfg


def test_predec_with_tma_tiles_gives_the_pointer_loads_bits(predecode_gpu_tile):
    """The pre-decoded path in the sm_90 default's form: TMA activation tiles (GEMM 1's rows, scales and routing
    weights gathered once into sorted order; GEMM 2's h as it is) and TMA weight tiles, GEMM 1 ``UNFUSED`` (its
    bf16 w1|w3 outputs, then the SwiGLU + quantisation pass), per-tile (``TILE``) weight factors, descriptors
    built on the host (``HOST_TMA``): the bits of pointer loads. (The other variants: the ``slow`` test below.)"""
    _predec_variants_give_the_pointer_loads_bits([{"ATMA": True, "WTMA": True, "UNFUSED": True, "TILE": True,
                                                   "HOST_TMA": True}])


@pytest.mark.slow
def test_predec_other_variants_give_the_pointer_loads_bits(predecode_gpu_tile):
    """Both TMA tiles with GEMM 1 fused or unfused (per-row factors), TMA activation tiles alone, TMA weight tiles
    alone (with device- or host-built descriptors), per-tile weight factors with GEMM 1 fused or unfused, the
    default with the scale operands a K block ahead."""
    _predec_variants_give_the_pointer_loads_bits([{"ATMA": True, "WTMA": True},
                                                  {"ATMA": True, "WTMA": True, "UNFUSED": True},
                                                  {"ATMA": True}, {"WTMA": True},
                                                  {"ATMA": True, "WTMA": True, "TILE": True},
                                                  {"ATMA": True, "WTMA": True, "HOST_TMA": True},
                                                  {"WTMA": True, "HOST_TMA": True},
                                                  {"ATMA": True, "WTMA": True, "UNFUSED": True, "TILE": True},
                                                  {"ATMA": True, "WTMA": True, "UNFUSED": True, "TILE": True,
                                                   "HOST_TMA": True, "PREFETCH": True}])


def test_tile_factors_only_where_the_scales_allow():
    """``MoEWeights.fp8_tile_max``: the per-tile scale maxima where every group lies within 2^12 of its
    128 x 128 tile's maximum; None where one group does not, though it does of its row's block maximum
    (the path then keeps per-row factors), and None for weights that do not fold at all."""
    from dataclasses import replace
    gen = torch.Generator().manual_seed(34)
    ref = _ref_moe(4, 256, 128, 2, gen, False, dup_row=4)
    w = Mo.MoEWeights.from_reference(ref)
    tm = w.fp8_tile_max()
    assert tm is not None and tm[0].shape == (4, 2, 2) and tm[1].shape == (4, 2, 1)
    assert torch.equal(tm[0][1, 0, 1], u8(w.w13_s)[1, :128, 4:8].max())
    s13 = u8(w.w13_s).clone()
    v = s13.view(4, 256, 2, 4)
    r = int(v[0, :128, 0].amax(-1).argmin())
    v[0, r, 0, 0] = v[0, :128, 0].max() - 12               # 2^12 below its tile's maximum
    assert v[0, r, 0].max() - v[0, r, 0, 0] < 12            # but not below its row's
    far = replace(w, w13_s=s13.view(w.w13_s.dtype))
    assert far.fp8_fold_exact() and far.fp8_tile_max() is None
    nv = Mo.MoEWeights.from_reference(ref, fmt="nvfp4", allow_lossy=True)
    assert nv.fp8_tile_max() is None


def test_shared_expert_unfused_on_the_dense_kernel(monkeypatch):
    """``router.SHARED_UNFUSED`` (on): at prefill-step sizes (``PREFILL_STEP_MIN_ROWS``, lowered here), where
    ``fp8_kernel`` picks the dense TMA kernel (sm_90; forced here), the shared expert's w1|w3 runs there into bf16 and the SwiGLU pass forms
    h: the fused epilogue's output up to the summation order inside a 128-block, and the dense kernel is
    really the one called (for w1|w3 and w2)."""
    from dsv4.kernels.gemm import fp8_prefill as FPF
    gen = torch.Generator().manual_seed(35)
    ref = _ref_moe(4, 256, 128, 2, gen, False)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = (torch.randn(80, 256, generator=gen) * 1.5).bfloat16().to(DEV)
    xq, xs = G8.act_quant_fp8(x)
    fused = Mo._shared_expert(xq, xs, w)
    calls = []
    real_kernel, real_prefill = GR.fp8_kernel, FPF.fp8_gemm_prefill
    monkeypatch.setattr(GR, "fp8_kernel", lambda M, N, K, t, prequantised=False:
                        "prefill" if prequantised and M >= 65 else real_kernel(M, N, K, t, prequantised))
    monkeypatch.setattr(FPF, "fp8_gemm_prefill", lambda xq_, *a, **kw: calls.append(xq_.shape) or
                        real_prefill(xq_, *a, **kw))
    monkeypatch.setattr(GR, "SHARED_UNFUSED", True)
    monkeypatch.setattr(GR, "PREFILL_STEP_MIN_ROWS", 81)
    calls.clear()
    assert torch.equal(Mo._shared_expert(xq, xs, w), fused) and calls == [(80, 128)]   # below a prefill step
    monkeypatch.setattr(GR, "PREFILL_STEP_MIN_ROWS", 80)
    calls.clear()
    unfused = Mo._shared_expert(xq, xs, w)
    assert calls == [(80, 256), (80, 128)]                 # w1|w3 on x, then w2 on h
    torch.testing.assert_close(unfused.float(), fused.float(), rtol=0.02, atol=0.02 * fused.float().abs().max().item())
    monkeypatch.setattr(GR, "SHARED_UNFUSED", False)
    calls.clear()
    assert torch.equal(Mo._shared_expert(xq, xs, w), fused) and calls == [(80, 128)]   # the fused epilogue, w2 dense


def test_predec_path_refuses_weights_it_cannot_fold():
    """The pre-decoded FP8 path holds only MXFP4 whose scales fold exactly into e4m3: NVFP4 is refused
    with the reason, not computed on a lossy fold."""
    gen = torch.Generator().manual_seed(31)
    ref = _ref_moe(8, 256, 128, 2, gen, False, dup_row=4)
    w = Mo.MoEWeights.from_reference(ref, fmt="nvfp4", allow_lossy=True).to(DEV)
    x = torch.randn(30, 256, generator=gen).bfloat16().to(DEV)
    with pytest.raises(ValueError, match="predec path: MXFP4 experts whose scales fold exactly"):
        Mo.moe_forward(x, torch.zeros(30, dtype=torch.long, device=DEV), w, path="predec")


def _rank_slice(w, e0, n):
    """Experts [e0, e0 + n) of ``w`` as one expert-parallel rank holds them (router whole)."""
    from dataclasses import replace
    cut = lambda t: None if t is None else t[e0:e0 + n]
    return replace(w, w13=cut(w.w13), w13_s=cut(w.w13_s), w13_s2=cut(w.w13_s2), w2=cut(w.w2), w2_s=cut(w.w2_s),
                   w2_s2=cut(w.w2_s2), expert0=e0)


@pytest.mark.parametrize("hash_layer,T,path,config", [(True, 7, "dequant", {"BN": 128}), (False, 30, "prefill", {"BN": 128}),
                                                     (False, 3, None, {"BN": 64})])
def test_moe_expert_parallel_ranks(hash_layer, T, path, config):
    """Expert parallelism: a rank holding experts [2r, 2r + 2) of 4 routes over all 4 and returns,
    bit for bit, the fp32 partial of a one-rank call whose routing keeps only its experts (the
    other ranks' picks sort to the sentinel); the ranks' partials summed plus the shared expert are
    the layer's output. (Four experts: the grouped kernels' programs under the interpreter go with
    the experts a call holds; the tile kernels and the GEMV (T 3) on their GPU column tiles for the same reason.)"""
    gen = torch.Generator().manual_seed(40 + T)
    ref = _ref_moe(4, 256, 128, 2, gen, hash_layer, dup_row=4)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    x = (torch.randn(T, 256, generator=gen) * 1.5).bfloat16().to(DEV)
    ids = torch.randint(0, 64, (T,), generator=gen).to(DEV)
    ids[0] = 4
    idx, rw = Mo.route(x, ids, w)
    total, shared = 0, None
    for r in range(2):
        wr = _rank_slice(w, 2 * r, 2)
        assert (wr.n_experts, wr.n_routed) == (2, 4)
        y, sh = Mo.moe_forward(x, ids, wr, path=path, config=config, partial=True)
        mine = torch.where((idx >= 2 * r) & (idx < 2 * r + 2), idx, torch.full_like(idx, -1))
        y1, sh1 = Mo.moe_forward(x, None, w, path=path, config=config, routing=(mine, rw), partial=True)
        assert y.dtype == torch.float32 and torch.equal(y, y1) and torch.equal(sh, sh1)
        assert (mine >= 0).any() and y.abs().sum() > 0
        total, shared = total + y, sh
    _check_moe((total + shared.float()).bfloat16(), ref(x.cpu(), ids.cpu()))


def _nv_expert(I, d, gen):
    """A ModelOpt-style expert: w1/w3 share one global scale, w2 has its own (exact dequantised values)."""
    a, b, c = (torch.randn(I, d, generator=gen) * 0.06, torch.randn(I, d, generator=gen) * 0.05,
               torch.randn(d, I, generator=gen) * 0.06)
    g = torch.maximum(a.abs().amax(), b.abs().amax()) / (6 * 448)
    deq = [dequant_nvfp4(*quant_nvfp4(a, g)), dequant_nvfp4(*quant_nvfp4(b, g)), dequant_nvfp4(*quant_nvfp4(c))]
    return Expert(Linear(deq[0], "fp4", OFFICIAL), Linear(deq[2], "fp4", OFFICIAL), Linear(deq[1], "fp4", OFFICIAL),
                  10.0, OFFICIAL)


def test_moe_weights_pick_the_checkpoint_fp4_format():
    """The fused path packs experts in the FP4 format that holds them exactly: MXFP4 for official
    checkpoints, NVFP4 for ModelOpt ones (w1/w3 sharing a global scale); neither is a named error."""
    gen = torch.Generator().manual_seed(11)
    ref = _ref_moe(4, 256, 128, 2, gen, False)
    assert Mo.MoEWeights.from_reference_exact(ref).fmt == "mxfp4"
    ref.experts = [_nv_expert(128, 256, gen) for _ in range(4)]
    w = Mo.MoEWeights.from_reference_exact(ref, layer=3)
    assert w.fmt == "nvfp4"
    for e, ex in enumerate(ref.experts):        # the twin reads the packed experts back exactly
        back = twin.stacked_expert(w.w13, w.w13_s, w.w13_s2, w.w2, w.w2_s, w.w2_s2, w.fmt, e)
        for n, b in zip(("w1", "w3", "w2"), back):
            assert torch.equal(getattr(ex, n).weight, b)
    x = (torch.randn(5, 256, generator=gen) * 1.5).bfloat16()
    _check_moe(Mo.moe_forward(x.to(DEV), None, w.to(DEV)), ref(x, None))
    ref.experts[1].w2.weight = ref.experts[1].w2.weight * 1.001          # no longer on either grid
    with pytest.raises(ValueError, match="layer 3: routed experts fit neither FP4 kernel format"):
        Mo.MoEWeights.from_reference_exact(ref, layer=3)


def test_moe_empty_experts_and_unrouted_tokens():
    gen = torch.Generator().manual_seed(5)
    ref = _ref_moe(8, 256, 128, 2, gen, False)
    w = Mo.MoEWeights.from_reference(ref).to(DEV)
    cfg = {"BN": 64}                    # the GEMV (both calls' path) on its 64-column GPU tile: test_moe_forward's
    # one token: six of the eight experts get none
    x = torch.randn(1, 256, generator=gen).bfloat16()
    _check_moe(Mo.moe_forward(x.to(DEV), None, w, config=cfg), ref(x, None))
    # explicit routing with masked slots (-1): token 1 goes to no routed expert (shared only)
    x = torch.randn(3, 256, generator=gen).bfloat16()
    idx = torch.tensor([[1, 6], [-1, -1], [3, -1]])
    rw = torch.tensor([[0.7, 0.8], [0.0, 0.0], [1.5, 0.0]])
    y = Mo.moe_forward(x.to(DEV), None, w, config=cfg, routing=(idx.to(DEV), rw.to(DEV))).cpu()
    yr = ref.shared(x).float()
    for t in range(3):
        for j in range(2):
            e = int(idx[t, j])
            if e >= 0:
                yr[t] += ref.experts[e](x[t:t + 1], rw[t, j:j + 1])[0].float()
    _check_moe(y, yr.bfloat16())
    # no tokens
    assert Mo.moe_forward(x[:0].to(DEV), None, w).shape == (0, 256)


def test_moe_nvfp4_packed():
    gen = torch.Generator().manual_seed(9)
    E, d, I, k = 4, 256, 128, 2
    pk = {n: [] for n in ("w1", "s1", "g1", "w3", "s3", "g3", "w2", "s2", "g2")}
    for _ in range(E):
        for a, (o, i) in (("1", (I, d)), ("3", (I, d)), ("2", (d, I))):
            q, s, g = quant_nvfp4(torch.randn(o, i, generator=gen) * 0.06)
            pk["w" + a].append(q)
            pk["s" + a].append(s)
            pk["g" + a].append(g)
    st = {n: torch.stack(v) for n, v in pk.items()}
    sh = tuple(quant_fp8_weight(torch.randn(o, i, generator=gen) * 0.06) for o, i in ((I, d), (I, d), (d, I)))
    w = Mo.MoEWeights.from_packed(torch.randn(E, d, generator=gen) * 0.1, torch.zeros(E), None, k, 1.5, 10.0,
                                  "nvfp4", st["w1"], st["s1"], st["w3"], st["s3"], st["w2"], st["s2"],
                                  w1_s2=st["g1"], w3_s2=st["g3"], w2_s2=st["g2"], shared=sh)
    x = torch.randn(6, d, generator=gen).bfloat16()
    _check_moe(Mo.moe_forward(x.to(DEV), None, w.to(DEV)), twin.moe_forward(x, None, w))


# ------------------------------------------------------------------------------------------------
# GPU: V4-Flash dims (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
def test_gpu_router_bf16_gate_routes_as_the_fp32_gemm():
    """A bf16-exact gate at prefill size (V4-Flash: 256 experts, d 4096, top-6, 4096 tokens) goes through
    ``dense_mm``: the chosen experts are the exact logits' wherever the k-th and (k+1)-th scores are not
    within fp32 rounding of each other, and the weights match to fp32 accuracy."""
    _need_gpu()
    gen = torch.Generator().manual_seed(5)
    E, d, T, k = 256, 4096, 4096, 6
    w = Mo.MoEWeights(gate_w=(torch.randn(E, d, generator=gen) * 0.02).bfloat16().float().cuda(),
                      bias=(torch.randn(E, generator=gen) * 0.05).cuda(), tid2eid=None, topk=k, route_scale=1.5,
                      limit=10.0, fmt="mxfp4", w13=torch.zeros(E, 2, 2, dtype=torch.uint8, device="cuda"),
                      w13_s=None, w13_s2=None, w2=torch.zeros(E, d, 1, dtype=torch.uint8, device="cuda"),
                      w2_s=None, w2_s2=None, sh13=None, sh13_s=None, sh2=None, sh2_s=None)
    x = torch.randn(T, d, generator=gen).bfloat16().cuda()
    assert w.gate_bf16() is not None and GR.dense_mm(T, target(x.device))
    idx, rw = Mo.route(x, None, w)
    s = torch.sqrt(torch.nn.functional.softplus(x.double() @ w.gate_w.double().T))
    top = (s + w.bias.double()).topk(k + 1, dim=-1)
    clear = (top.values[:, k - 1] - top.values[:, k]) > 1e-5
    assert clear.float().mean() > 0.99
    assert torch.equal(idx[clear].sort(-1).values, top.indices[clear, :k].sort(-1).values)
    ref = s.gather(1, idx)
    torch.testing.assert_close(rw.double(), ref / ref.sum(-1, keepdim=True) * 1.5, rtol=1e-5, atol=0)


@pytest.mark.gpu
def test_gpu_predec_in_kernel_decode_gives_the_passes_bits(monkeypatch):
    """``router.PREDEC_WS`` (sm_90): the pre-decoded path's GEMMs on ``fp4_fp8_ws`` (weights decoded in shared
    memory, activations in its group split order; h stored so by ``swiglu_quant`` or permuted after it,
    ``router.SWIGLU_SPLIT_STORE``) give the bits of the decode passes + grouped FP8 GEMMs, at V4-Flash dims with
    150 rows per expert (uneven: experts of 0 to 300 rows)."""
    _need_gpu()
    from dsv4.kernels.gemm import fp4_fp8_ws as WS
    if not WS.available("cuda"):
        pytest.skip("needs an sm_90 GPU with Gluon")
    gen = torch.Generator().manual_seed(41)
    ref = _ref_moe(8, 4096, 2048, 6, gen, False, vocab=256, dup_row=3)
    w = Mo.MoEWeights.from_reference(ref).to("cuda")
    assert w.fp8_tile_max() is not None
    x = torch.randn(200, 4096, generator=gen).bfloat16().cuda()
    ids = torch.randint(0, 256, (200,), generator=gen).cuda()
    calls = []
    real = WS.fp4_fp8_ws
    monkeypatch.setattr(WS, "fp4_fp8_ws", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(GR, "PREDEC_WS", True)
    y, parts = Mo.moe_forward(x, ids, w, return_parts=True)
    assert parts["path"] == "predec" and len(calls) == 2
    monkeypatch.setattr(GR, "SWIGLU_SPLIT_STORE", not GR.SWIGLU_SPLIT_STORE)    # h stored split, or permuted after
    y1 = Mo.moe_forward(x, ids, w)
    assert len(calls) == 4
    monkeypatch.setattr(GR, "PREDEC_WS", False)
    y0 = Mo.moe_forward(x, ids, w)
    assert len(calls) == 4
    assert torch.equal(y.view(torch.int16), y0.view(torch.int16))
    assert torch.equal(y1.view(torch.int16), y0.view(torch.int16))
    _check_moe(y, ref(x.cpu(), ids.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("hash_layer,T", [(False, 64), (True, 16), (False, 200), (False, 2)])
def test_gpu_moe_flash_dims(hash_layer, T):
    """V4-Flash dims (d 4096, inter 2048, top-6) with 8 experts (CPU reference time): 1.5 rows per
    expert take the decode path (tensor-core kernel and CUDA-core GEMV), 12 rows the tensor-core
    decode kernel on sm_89+ (else the MMA kernels; both run), 48 the FP8 tensor-core kernel on sm_90
    (``fp4_fp8``, where the scales fold exactly; else the prefill kernel's 64-row tiles), 150 the
    pre-decoded path on sm_90 where the scales fold (else the prefill kernel's 128-row tiles)."""
    _need_gpu()
    gen = torch.Generator().manual_seed(T)
    ref = _ref_moe(8, 4096, 2048, 6, gen, hash_layer, vocab=256, dup_row=3)
    w = Mo.MoEWeights.from_reference(ref).to("cuda")
    x = torch.randn(T, 4096, generator=gen).bfloat16()
    ids = torch.randint(0, 256, (T,), generator=gen)
    ids[0] = 3
    y, parts = Mo.moe_forward(x.cuda(), ids.cuda(), w, return_parts=True)
    _check_moe(y, ref(x, ids))
    rows = T * 6 / 8
    gemv_max = GR.MMA_GEMV_ROWS_PER_EXPERT if target("cuda").gluon_mma else GR.GEMV_ROWS_PER_EXPERT
    hopper = target("cuda").capability[0] == 9
    fp8mma = hopper and w.fp8_fold_exact() and GR.FP8MMA_ROWS_PER_EXPERT < rows <= GR.FP8MMA_MAX_ROWS_PER_EXPERT
    predec = hopper and w.fp8_fold_exact() and rows >= GR.PREDEC_ROWS_PER_EXPERT
    assert parts["path"] == ("gemv" if rows <= gemv_max else "fp8mma" if fp8mma else "predec" if predec else
                             "prefill" if rows > GR.PREFILL_ROWS_PER_EXPERT else "dequant")
    if parts["path"] == "gemv":
        assert parts["kernel"] == ("mma" if target("cuda").gluon_mma else "cuda-core")
        y2, parts2 = Mo.moe_forward(x.cuda(), ids.cuda(), w, config={"kernel": "cuda-core"}, return_parts=True)
        assert parts2["kernel"] == "cuda-core"
        _check_moe(y2, ref(x, ids))
    if GR.GEMV_ROWS_PER_EXPERT < rows <= GR.PREFILL_ROWS_PER_EXPERT:   # the MMA kernels' own range
        y3, parts3 = Mo.moe_forward(x.cuda(), ids.cuda(), w, path="dequant", return_parts=True)
        assert parts3["path"] == "dequant"
        _check_moe(y3, ref(x, ids))
