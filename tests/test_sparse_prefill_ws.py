"""The warp-specialized sparse prefill kernel (``kernels/sparse_prefill_ws.py``): an sm_90 compile on any
machine; on an sm_90 GPU its outputs against the product kernel (``sparse_prefill``) and the CPU twin.
The route from ``sparse_attention.sparse_prefill`` (``WS_PREFILL``) on an sm_90 GPU."""
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("triton")

from dsv4.kernels import sparse_prefill_ws as SP  # noqa: E402
from kernel_helpers import need_gpu, run_aot_script  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _aot_case(rope: bool, qnorm: bool, bf16: bool):
    """One compile for sm_90a (``tests/kernel_helpers.aot_compile``) and its checks: bf16 wgmma m64n64k16 for QK (q
    and the tile from shared memory) and m64n256k16 for PV (P from registers), the partitions' register counts within
    the file, shared memory within sm_90's 227 KB; the gathers 16-byte loads (page sizes in bytes are multiples of 16,
    the JIT's divisibility specialisation), or with bf16 workspaces each thread's 32 16-byte ``cp.async`` copies of a
    block straight into the tile and one async arrival."""
    import re
    from kernel_helpers import aot_compile
    cfg = SP.DEFAULT_CONFIG
    pool = "*bf16" if bf16 else "*u8"
    types = dict(Q="*bf16", WIDX="*i32", EIDX="*i32", WPAGES=pool, EPAGES=pool, SINK="*fp32", O="*bf16",
                 COS="*fp32", SIN="*fp32", qk_scale="fp32", q_eps="fp32")
    const = dict(STAGES=cfg["STAGES"], CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"],
                 SPLIT_QK=cfg["SPLIT_QK"], ROPE=rope, QNORM=qnorm, SX_PAD=cfg["SX_PAD"],
                 Q_CONSUMERS=cfg["Q_CONSUMERS"], BF16_KV=bf16)
    ptx, mma, smem = aot_compile(SP._sparse_prefill_ws_kernel, types, const, 90, 4,
                                 div=("stride_qt", "stride_qh", "stride_ot", "stride_oh", "w_pbytes", "e_pbytes"),
                                 maxnreg=cfg["maxnreg"], shared=True)
    if bf16:
        assert ptx.count("cp.async.cg.shared.global") == 32 and "cp.async.mbarrier.arrive.noinc" in ptx
    else:
        assert ptx.count("ld.global.v4.b32") >= 18, ptx.count("ld.global.v4.b32")   # a block: 7 x 2 e4m3 + 4 rope
    assert mma == ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"], mma
    assert re.search(r"m64n256k16\S+ \{[^}]+\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}, %rd\d+", ptx), "P not in registers"
    assert (64 + const["STAGES"] * 64) * 1024 <= smem <= 232448, smem
    assert 128 * (2 * cfg["CONSUMER_REGS"] + cfg["PRODUCER_REGS"]) <= 65536 and 384 * cfg["maxnreg"] <= 65536


_AOT_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    import test_sparse_prefill_ws as T
    if not T.SP.GLUON:
        print("skip: no Gluon"); sys.exit(0)
    # the FP8 pages; sparse_prefill's route (bf16 workspaces, the inverse RoPE in the epilogue, q by kv_insert);
    # q's transform in the consumers
    for rope, qnorm, bf16 in ((False, False, False), (True, False, True), (True, True, False)):
        T._aot_case(rope, qnorm, bf16)
""")


def test_aot_compile_sm90():
    run_aot_script(_AOT_SCRIPT, REPO, timeout=600)


def test_the_route_is_taken_only_where_it_runs(monkeypatch):
    """``sparse_attention._ws_route``: never with the switch off, without workspaces, with an explicit Triton config,
    without a window list, with H not a multiple of 64, or off an sm_90 GPU (this machine: a CPU)."""
    from dsv4.kernels import sparse_attention as sa
    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    w = torch.zeros(2, 4, dtype=torch.int32)
    ws = (torch.zeros(4, 512, dtype=torch.bfloat16), None)
    monkeypatch.setattr(sa, "WS_PREFILL", False)
    assert not sa._ws_route(q, w, ws, None)
    monkeypatch.setattr(sa, "WS_PREFILL", True)
    for args in ((q, w, None, None), (q, w, ws, {"num_stages": 1}), (q, None, ws, None), (q[:, :48], w, ws, None)):
        assert not sa._ws_route(*args)
    assert sa._ws_route(q, w, ws, None) == SP.available(q.device)


def _case(H, n, topk, all_masked_row=None, extra=True):
    import test_sparse_attention as TS
    gen = torch.Generator().manual_seed(H + n + topk)
    cache = TS.Caches(1, 2048, 64, 64, gen, device="cuda")
    widx = torch.stack([cache.window_idx(0, 1000 + i) for i in range(n)]).int()
    eidx = torch.stack([cache.extra_idx(0, 2048, topk, "csa", gen) for _ in range(n)]).int()
    if all_masked_row is not None:
        widx[all_masked_row] = -1
        eidx[all_masked_row] = -1
    q = (torch.randn(n, H, 512, generator=gen) * 0.5).bfloat16()
    sinks = torch.randn(H, generator=gen)
    return cache, q, widx, eidx if extra else None, sinks


@pytest.mark.gpu
@pytest.mark.parametrize("H,n,topk,masked,extra", [(64, 256, 512, None, True), (128, 64, 1024, 3, True),
                                                   (64, 33, 512, 0, False)])
@pytest.mark.parametrize("cfg", [None, {"STAGES": 1}, {"SPLIT_QK": False}, {"Q_CONSUMERS": False, "SX_PAD": False}])
def test_gpu_sparse_prefill_ws_matches_the_product_kernel(H, n, topk, masked, extra, cfg):
    need_gpu()
    if not SP.available("cuda"):
        pytest.skip("needs an sm_90 GPU with Gluon")
    import test_sparse_attention as TS
    from dsv4.kernels.sparse_attention import sparse_prefill
    from dsv4.twins.sparse_attention import sparse_decode as twin
    cache, q, widx, eidx, sinks = _case(H, n, topk, masked, extra)
    args = (q.cuda(), widx.cuda(), cache.wp, 64, eidx.cuda() if extra else None, cache.ep if extra else None, 64,
            sinks.cuda())
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    o = SP.sparse_prefill_ws(*args, config=cfg, out=out)
    ref = sparse_prefill(*args)
    if masked is not None:
        assert torch.equal(o[masked], torch.zeros_like(o[masked]))
    TS._compare(o, ref)
    TS._compare(o, twin(q, widx, cache.wp_cpu, 64, eidx, cache.ep_cpu, 64, sinks))
    rel = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"relative difference to the product kernel {rel:.1e}; outputs off its bits: {int((o != ref).sum())} of "
          f"{o.numel()}")


@pytest.mark.gpu
@pytest.mark.parametrize("H,n,topk", [(64, 256, 512), (128, 64, 1024)])
@pytest.mark.parametrize("cfg", [None, {"Q_PASS": False}, {"Q_CONSUMERS": False, "SX_PAD": False, "Q_PASS": False},
                                 {"SPLIT_QK": False, "Q_PASS": False}])
def test_gpu_sparse_prefill_ws_fused_q_transform_and_inverse_rope(H, n, topk, cfg):
    """The production prefill form: raw q normalised and rotated (by kv_insert's pass, the default, or in the
    kernel: the consumers, or the producer in the first form), the output's rope dims rotated back in the epilogue;
    against the product kernel's same form and the twin."""
    need_gpu()
    if not SP.available("cuda"):
        pytest.skip("needs an sm_90 GPU with Gluon")
    import test_sparse_attention as TS
    from dsv4.kernels.sparse_attention import sparse_prefill
    from dsv4.twins.sparse_attention import sparse_prefill as twin
    cache, q, widx, eidx, sinks = _case(H, n, topk)
    q = (q.float() * 5).bfloat16()
    gen = torch.Generator().manual_seed(7)
    ang = torch.rand(n, 32, generator=gen) * 6.283185307179586
    cos, sin = torch.cos(ang), torch.sin(ang)
    args = (q.cuda(), widx.cuda(), cache.wp, 64, eidx.cuda(), cache.ep, 64, sinks.cuda())
    kw = dict(rope=(cos.cuda(), sin.cuda()), q_norm_eps=1e-6)
    o = SP.sparse_prefill_ws(*args, config=cfg, **kw)
    ref = sparse_prefill(*args, **kw)
    TS._compare(o, ref)
    TS._compare(o, twin(q, widx, cache.wp_cpu, 64, eidx, cache.ep_cpu, 64, sinks, rope=(cos, sin), q_norm_eps=1e-6))
    plain = SP.sparse_prefill_ws(*args, config=cfg)
    assert (plain.float() - o.float()).norm() > 0.1 * o.float().norm()
    print(f"fused: relative difference to the product kernel "
          f"{((o.float() - ref.float()).norm() / ref.float().norm()).item():.1e}")


@pytest.mark.gpu
@pytest.mark.parametrize("H,n,topk,masked,extra", [(64, 256, 512, 5, True), (128, 64, 1024, None, True),
                                                   (64, 33, 512, None, False)])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_sparse_prefill_ws_bf16_workspace(H, n, topk, masked, extra, fused):
    """``kv_bf16``: the pools dequantised once into dense bf16 workspaces (``formats.kv_entry.read_entries``), the
    entries copied by ``cp.async``; the same attention as the product kernel on the pages (plain and production
    forms)."""
    need_gpu()
    if not SP.available("cuda"):
        pytest.skip("needs an sm_90 GPU with Gluon")
    import test_sparse_attention as TS
    from dsv4.kernels.sparse_attention import sparse_prefill
    cache, q, widx, eidx, sinks = _case(H, n, topk, masked, extra)
    if fused:
        q = (q.float() * 5).bfloat16()
    ang = torch.rand(n, 32, generator=torch.Generator().manual_seed(7)) * 6.283185307179586
    kw = dict(rope=(torch.cos(ang).cuda(), torch.sin(ang).cuda()), q_norm_eps=1e-6) if fused else {}
    args = (q.cuda(), widx.cuda(), cache.wp, 64, eidx.cuda() if extra else None, cache.ep if extra else None, 64,
            sinks.cuda())
    from dsv4.formats.kv_entry import read_entries
    every = lambda p: read_entries(p, torch.arange(p.shape[0] * 64, device=p.device), 64)
    ws = (every(cache.wp), every(cache.ep) if extra else None)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    o = SP.sparse_prefill_ws(*args, out=out, kv_bf16=ws, **kw)
    ref = sparse_prefill(*args, **kw)
    if masked is not None:
        assert torch.equal(o[masked], torch.zeros_like(o[masked]))
    TS._compare(o, ref)
    # the same tiles as the FP8 producer's (decode_kv_entries rounds the fp32 product once, as it does): same bits
    assert torch.equal(o, SP.sparse_prefill_ws(*args, **kw))
    print(f"bf16 workspace: relative difference to the product kernel "
          f"{((o.float() - ref.float()).norm() / ref.float().norm()).item():.1e}")


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_sparse_prefill_routes_to_the_ws_kernel(monkeypatch, fused):
    """``sparse_attention.WS_PREFILL`` on: ``sparse_prefill`` with workspaces gives this kernel's output (q by
    kv_insert's pass in the production form), within the Triton kernel's tolerance; off, the Triton kernel's."""
    need_gpu()
    if not SP.available("cuda"):
        pytest.skip("needs an sm_90 GPU with Gluon")
    import test_sparse_attention as TS
    from dsv4.formats.kv_entry import read_entries
    from dsv4.kernels import sparse_attention as sa
    cache, q, widx, eidx, sinks = _case(64, 96, 512, 3)
    if fused:
        q = (q.float() * 5).bfloat16()
    ang = torch.rand(q.shape[0], 32, generator=torch.Generator().manual_seed(7)) * 6.283185307179586
    kw = dict(rope=(torch.cos(ang).cuda(), torch.sin(ang).cuda()), q_norm_eps=1e-6) if fused else {}
    args = (q.cuda(), widx.cuda(), cache.wp, 64, eidx.cuda(), cache.ep, 64, sinks.cuda())
    every = lambda p: read_entries(p, torch.arange(p.shape[0] * 64, device=p.device), 64)
    ws = (every(cache.wp), every(cache.ep))
    monkeypatch.setattr(sa, "WS_PREFILL", True)
    routed = sa.sparse_prefill(*args, kv_bf16=ws, **kw)
    assert torch.equal(routed, SP.sparse_prefill_ws(*args, kv_bf16=ws, **kw))
    monkeypatch.setattr(sa, "WS_PREFILL", False)
    triton_out = sa.sparse_prefill(*args, kv_bf16=ws, **kw)
    TS._compare(routed, triton_out)
