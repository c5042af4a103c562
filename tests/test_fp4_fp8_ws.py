"""The warp-specialized in-kernel-decode MXFP4 expert GEMM (``dsv4/kernels/gemm/fp4_fp8_ws.py``).

Gluon has no CPU interpreter: on a CPU machine these tests check the host helpers and argument errors and
compile the kernel for sm_90 (loader / decoder / consumer partitions, register reallocation, fp8 wgmma,
TMA loads, the decode's inline PTX); the ``gpu``-marked tests run it on an sm_90 GPU against the pre-decoded
path's kernel on the same experts (the same products in the same K = 32 instructions: H100, bit-equal; the
check allows one bf16 step) and the exact sum.
"""
import textwrap
from pathlib import Path

import pytest
import torch
from kernel_helpers import check_expert_sums, mx_expert_problem, need_gpu, run_aot_script

pytest.importorskip("triton")

from dsv4.kernels.gemm import fp4_fp8_ws as WS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_split_k_order_and_tile_counts():
    a = torch.arange(2 * 256, dtype=torch.int32).reshape(2, 256)
    s = WS.split_k_order(a)
    for g in range(8):          # group g: its 16 even elements, then its 16 odd ones
        b = 32 * g
        assert torch.equal(s[:, b:b + 16], a[:, b:b + 32:2]) and torch.equal(s[:, b + 16:b + 32], a[:, b + 1:b + 32:2])
    offs = torch.tensor([0, 0, 128, 129, 400])
    assert WS.tile_counts(offs, 2).tolist() == [0, 0, 1, 2, 5]


def _mag_byte(c: int, kk: int) -> int:
    """e4m3 byte of e2m1 code c times 2^(kk - 6); 0 for a zero magnitude or a flushed group (kk < 1)."""
    m = c & 7
    if m == 0 or kk < 1:
        return 0
    e = (m >> 1) + kk if m >= 2 else kk
    return (e << 3) | (((m & 1) << 2) if m >= 2 else 0) | ((c & 8) << 4)


@pytest.mark.parametrize("which", ["byte lanes", "lut"])
def test_decode_asm_on_every_code_and_shift(which):
    """The decoders' inline PTX, run instruction by instruction (``ptx_emu``): every packed byte value in every
    lane, every group shift 1..12 and a flushed group, against the e4m3 bytes of e2m1(code) * 2^(kk - 6). The
    table form needs one shift byte in all four lanes of $3 (the kernel's decoder: one group per 16 bytes)."""
    import ptx_emu
    from dsv4.kernels.gemm.fp4_fp8 import DEC_ASM
    asm = DEC_ASM.value if which == "byte lanes" else WS.DEC_LUT_ASM
    for kk in range(0, 13):
        kb = kk << 3 if kk >= 1 else 0
        for v in range(256):
            w = v | (v ^ 0x5A) << 8 | (v ^ 0xA5) << 16 | (255 - v) << 24
            lo, hi = ptx_emu.run(asm, w, kb * 0x01010101, n_out=2)
            for i in range(4):
                b = (w >> 8 * i) & 0xFF
                assert (lo >> 8 * i) & 0xFF == _mag_byte(b & 15, kk), (which, kk, hex(b))
                assert (hi >> 8 * i) & 0xFF == _mag_byte(b >> 4, kk), (which, kk, hex(b))
    assert ptx_emu.prmt(0x33221100, 0x77665544, 0x7531) == 0x77553311       # bytes 1, 3, 5, 7
    assert ptx_emu.prmt(0x0080, 0, 0x8888) == 0xFFFFFFFF                       # sign replicate of byte 0


def test_fp4_fp8_ws_argument_errors():
    a = torch.zeros(8, 256, dtype=torch.uint8)
    sa = torch.ones(8, 2)
    w = torch.zeros(2, 128, 128, dtype=torch.uint8)
    ws = torch.full((2, 128, 8), 127, dtype=torch.uint8)
    smx = torch.full((2, 1, 2), 127, dtype=torch.uint8)
    offs = torch.tensor([0, 4, 8])
    with pytest.raises(ValueError, match="unknown config keys"):
        WS.resolve_config({"BM": 64})
    with pytest.raises(ValueError, match="STAGES must be"):
        WS.resolve_config({"STAGES": 1})
    with pytest.raises(ValueError, match="CONSUMERS must be 2 or 4"):
        WS.resolve_config({"CONSUMERS": 3})
    assert WS.resolve_config({"CONSUMERS": 2})["BN"] == 128 and WS.resolve_config(None)["BN"] == 64
    assert WS.tile_counts(torch.tensor([0, 0, 256, 257, 700]), 4).tolist() == [0, 0, 1, 2, 4]
    with pytest.raises(ValueError, match="do not fit"):
        WS.fp4_fp8_ws(a[:, :128], sa, w, ws, smx, offs)
    if not WS.available("cpu"):
        with pytest.raises(ValueError, match="needs an sm_90 GPU"):
            WS.fp4_fp8_ws(a, sa, w, ws, smx, offs)


_AOT_SCRIPT = textwrap.dedent("""
    import json, os, re, sys
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    from kernel_helpers import aot_compile, ptxas_report
    from dsv4.kernels.gemm import fp4_fp8_ws as WS
    if not WS.GLUON:
        print("no Gluon Hopper ops in this triton"); sys.exit(0)
    from triton.experimental.gluon import language as gl
    from triton.runtime.jit import mangle_type
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    import torch

    def desc(dtype, gdt, block):   # the JIT's signature string of a host descriptor of this block
        t = torch.empty(256, 256, dtype=dtype)
        return mangle_type(TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt)))

    # the default, the per-byte scale loads and the two-consumer form (CI time: one compile each)
    for consumers, group_scales, lut in ((4, True, True), (4, False, True), (2, True, False)):
        cfg = WS.resolve_config({"CONSUMERS": consumers})
        bn = cfg["BN"]
        types = dict(a_desc=desc(torch.float8_e4m3fn, gl.float8e4nv, [64, 128]),
                     w_desc=desc(torch.uint8, gl.uint8, [bn, 64]),
                     OUT="*bf16", SA="*fp32", WS="*u8", SMAX="*u8", TCUM="*i64", OFFS="*i64")
        const = dict(STAGES=cfg["STAGES"], LOG2G=9, CONSUMER_REGS=cfg["CONSUMER_REGS"], DECODER_REGS=cfg["DECODER_REGS"],
                     LOADER_REGS=cfg["LOADER_REGS"], GROUP_SCALES=group_scales, PROBE=0, NC=consumers, LUT=lut,
                     LIVE_LOADS=True)
        # Triton JSON-serialises the constexpr arguments when a jit_post_compile_hook is installed (the
        # engine's warm-up log): a layout object passed as one fails the launch there
        json.dumps(const)
        ptx, mma, smem = aot_compile(WS._fp4_fp8_ws_kernel, types, const, 90, 4, div=("P", "N", "K"),
                                     maxnreg=cfg["maxnreg"], shared=True)
        # STAGES x (consumers activation boxes of 8 KB + the packed and the decoded weight tiles) + barriers,
        # within sm_90's 227 KB per block
        assert cfg["STAGES"] * (consumers * 8192 + bn * 64 + bn * 128) <= smem <= 232448, smem
        # ptxas at the launch's register count: no local memory
        info = ptxas_report(ptx)
        assert " 0 bytes spill stores, 0 bytes spill loads" in info, info
        # the driver launches at most 65,536 / maxnreg threads per block: the launch must fit the warps it needs,
        # and the partitions' register counts must fit the register file
        threads = int(re.search(r"\\.reqntid\\s+(\\d+)", ptx).group(1))
        assert threads == 128 * (consumers + 2), threads
        assert threads * cfg["maxnreg"] <= 65536, (threads, cfg["maxnreg"])
        assert 128 * (consumers * cfg["CONSUMER_REGS"] + cfg["DECODER_REGS"] + cfg["LOADER_REGS"]) <= 65536
        assert mma == ["wgmma.mma_async.sync.aligned.m64n%dk32.f32.e4m3.e4m3" % bn], mma
        # the group split store is a register-level join: no shuffles beyond the prologue's one warp broadcast
        assert ptx.count("shfl.sync") <= 1, ptx.count("shfl.sync")
        assert re.search(r"cp\\.async\\.bulk\\.tensor\\.2d\\.shared::(cluster|cta)\\.global", ptx), "expected TMA loads"
        assert ("prmt.b32 lo, tl, th, sl" in ptx) == lut and "prmt.b32" in ptx, "expected the inline decode"
        for regs in (cfg["LOADER_REGS"], cfg["DECODER_REGS"], cfg["CONSUMER_REGS"]):
            assert re.search(r"setmaxnreg\\.(inc|dec)\\.sync\\.aligned\\.u32\\s+%d\\b" % regs, ptx), regs
        # the decoder's scale loads per K block: one byte per (row, group) a thread holds (BN / 32 rows, one
        # group), against one per packed byte (BN / 2) without GROUP_SCALES
        loads = len(re.findall(r"ld\\.global(\\.\\w+)*\\.[bu]8\\b", ptx))
        print("consumers", consumers, "group scales", group_scales, "byte loads", loads)
        assert (loads <= 8) if group_scales else (loads >= bn // 2), loads
    print("ok", len(ptx))
""")


def test_aot_compile_sm90():
    run_aot_script(_AOT_SCRIPT, REPO, timeout=600)


# ------------------------------------------------------------------------------------------------
# GPU (sm_90)

@pytest.mark.gpu
@pytest.mark.parametrize("E,N,K,rows", [(4, 256, 512, [0, 64, 130, 200]), (8, 4096, 2048, [192] * 8),
                                        (16, 128, 4096, [1, 300, 0, 5] * 4)])
@pytest.mark.parametrize("cfg", [None, {"STAGES": 2, "GRID": 3}, {"GROUP_SCALES": False}, {"LUT": False},
                                 {"CONSUMERS": 2, "LUT": False}, {"CONSUMERS": 2, "STAGES": 2, "GRID": 3},
                                 {"LIVE_LOADS": False}])
def test_gpu_fp4_fp8_ws_matches_predecoded(E, N, K, rows, cfg):
    """Empty experts, an expert of one row, tiles whose second half has no rows, more tiles than programs:
    the pre-decoded path's kernel (the same products) within one bf16 step, and the exact sum."""
    need_gpu()
    if not WS.available("cuda"):
        pytest.skip("needs an sm_90 GPU with Gluon")
    from dsv4.kernels.gemm import fp4_fp8 as F
    args, extra = mx_expert_problem(E, N, K, rows)
    _, xs, w, ws, smx, offs = args
    xq, Wd = extra
    offs = offs.cpu()
    P = sum(rows)
    y = WS.fp4_fp8_ws(*args, config=cfg)
    y2 = WS.fp4_fp8_ws(*args, config=cfg)
    assert torch.equal(y, y2), f"two identical calls differ at {int((y != y2).sum())} outputs"
    w8, f8 = F.predecode(w, ws, tile=True, tile_smax=smx)
    bm = 64
    n = (offs[1:] - offs[:-1] + bm - 1) // bm
    tcum = torch.cat([n.new_zeros(1), n.cumsum(0)]).cuda()
    ref = torch.empty(P, N, dtype=torch.bfloat16, device="cuda")
    from dsv4.kernels.gemm import route as R
    from dsv4.kernels.lib import target
    cfg_ref = dict(R.fp8_predec_config(float(max(rows)), target("cuda")), UNFUSED=False)
    F.fp4_fp8_launch(xq.view(torch.uint8), xs, w8, f8, None, ref, None, P, N, K, 0, fmt="mxfp4", config=cfg_ref,
                     predecoded=True, offs=offs.cuda(), tcum=tcum, n_groups=E,
                     n_tiles=min(P, -(-P // bm) + min(E, P)))
    check_expert_sums(y, args, extra)
    # one bf16 step of the larger value, plus the fp32 rounding of a K-term sum in another order (where the
    # output cancels, a few fp32 ulps of the partials exceed its own bf16 step)
    yf, rf = y.float(), ref.float()
    bad = (yf - rf).abs() > 2.0 ** -7 * torch.maximum(yf.abs(), rf.abs()) + 2.0 ** -16 * rf.abs().max()
    if bad.any():
        nz = bad.nonzero()
        i = nz[0].tolist()
        ex = (xq[i[0]].double().cpu() * xs[i[0]].double().cpu().repeat_interleave(128)
              @ Wd[int(torch.searchsorted(offs, i[0], right=True)) - 1, i[1]].double()).item()
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} outputs differ from the pre-decoded kernel's by "
                             f"more than one bf16 step, first at {i}: {yf[i[0], i[1]].item()} vs "
                             f"{rf[i[0], i[1]].item()} (exact {ex}); rows {nz[:, 0].unique().tolist()[:12]}, "
                             f"columns {nz[:, 1].unique().tolist()[:12]}")
