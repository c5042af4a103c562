"""Exact tests for dsv4.formats. Expected values come from the spec facts
(dsv4-architecture.md §3, §10.1; kernels-and-formats.md §3) and hand computation, not from the
code under test."""
import math
from fractions import Fraction

import pytest
import torch
from kernel_helpers import bits

from dsv4.formats import (
    E2M1_VALUES,
    ENTRY_BYTES,
    FP8_MAX,
    KV_DIM,
    KV_QUANT_BLOCK,
    N_SCALES,
    NOPE_DIM,
    PAGE_ALIGN,
    ROPE_DIM,
    SCALE_BYTES,
    TOKEN_DATA_BYTES,
    act_quant_fp8,
    decode_kv_entries,
    dequant_fp8_weight,
    dequant_mxfp4,
    dequant_nvfp4,
    e2m1_decode,
    e2m1_encode,
    e8m0_to_fp32,
    encode_kv_entries,
    fp4_qdq,
    fp8_qdq,
    fp32_to_e8m0,
    mxfp4_to_nvfp4,
    pack_fp4,
    page_bytes,
    pow2_ceil,
    quant_fp8_weight,
    quant_mxfp4,
    quant_nvfp4,
    read_kv_entries,
    ue8m0_scale,
    unpack_fp4,
    write_kv_entries,
)

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def exact_pow2_ceil(x: float) -> float:
    """2^ceil(log2(x)) with exact rational arithmetic (independent of the code under test)."""
    x = Fraction(x)
    k = math.floor(math.log2(x)) - 2
    while Fraction(2) ** k < x:
        k += 1
    return float(Fraction(2) ** k)


# =================================================================================== FP4 e2m1
SPEC_TABLE = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]


def test_e2m1_table_and_all_codes_round_trip():
    assert_bits_equal(E2M1_VALUES, torch.tensor(SPEC_TABLE, dtype=torch.float32))
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_decode(codes)
    assert vals.dtype == torch.float32
    assert_bits_equal(vals, torch.tensor(SPEC_TABLE, dtype=torch.float32))
    enc = e2m1_encode(vals)
    assert enc.dtype == torch.uint8
    assert torch.equal(enc, codes)


# (value, expected code) for every midpoint between neighbouring magnitudes: ties to the even code
TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]


@pytest.mark.parametrize("value,code", TIES)
def test_e2m1_ties_to_even(value, code):
    assert e2m1_encode(torch.tensor([value])).item() == code
    assert e2m1_encode(torch.tensor([-value])).item() == code | 8  # negative tie, same magnitude
    assert e2m1_decode(torch.tensor([code], dtype=torch.uint8)).item() == SPEC_TABLE[code]


def test_e2m1_nearest_off_ties():
    x = torch.tensor([0.2, 0.26, 0.74, 0.76, 1.24, 1.26, 1.74, 1.76, 2.49, 2.51, 3.49, 3.51, 4.99, 5.01])
    want = [0, 0.5, 0.5, 1, 1, 1.5, 1.5, 2, 2, 3, 3, 4, 4, 6]
    assert e2m1_decode(e2m1_encode(x)).tolist() == want
    assert e2m1_decode(e2m1_encode(-x)).tolist() == [-v for v in want]


def test_e2m1_zeros_keep_sign_bit():
    codes = e2m1_encode(torch.tensor([0.0, -0.0, 0.1, -0.1]))
    assert codes.tolist() == [0, 8, 0, 8]
    dec = e2m1_decode(codes)
    assert (dec == 0).all()


def test_e2m1_saturates():
    x = torch.tensor([6.0, 6.5, 7.0, 100.0, 3e38, float("inf")])
    assert e2m1_encode(x).tolist() == [7] * 6
    assert e2m1_encode(-x).tolist() == [15] * 6


def test_e2m1_nan_raises():
    with pytest.raises(ValueError):
        e2m1_encode(torch.tensor([1.0, float("nan")]))


def test_pack_unpack_nibble_order():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0], [8, 7, 0, 0, 9, 14]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    # element 2k -> low nibble, 2k+1 -> high nibble
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x43, 0x0F], [0x78, 0x00, 0xE9]]
    assert torch.equal(unpack_fp4(packed), codes)
    # int8 checkpoints: bytes are reinterpreted (0xE9 = -23, 0x78 = 120), never sign-extended
    as_int8 = torch.tensor([[0x21, 0x43, 0x0F], [120, 0, -23]], dtype=torch.int8)
    assert torch.equal(unpack_fp4(as_int8), codes)
    assert unpack_fp4(torch.tensor([-1], dtype=torch.int8)).tolist() == [15, 15]
    rnd = torch.randint(0, 16, (3, 5, 64), generator=gen(), dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(rnd)), rnd)
    with pytest.raises(ValueError):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_fp4_qdq_hand_example():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    # block amax 3 -> s = 2^ceil(log2(3/6)) = 0.5; x/s = [6, 2, 0.6, -1.4, 4.4, 5, 1.5]
    x[0, :7] = torch.tensor([3.0, 1.0, 0.3, -0.7, 2.2, 2.5, 0.75])
    y = fp4_qdq(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # e2m1 -> [6, 2, 0.5, -1.5, 4, 4 (tie 5 -> 4), 1.5] times 0.5
    assert y[0, :7].tolist() == [3.0, 1.0, 0.25, -0.75, 2.0, 2.0, 0.75]
    assert (y[0, 7:] == 0).all() and (y[1] == 0).all()  # all-zero block stays zero (amax floor)
    # fp32 in -> fp32 out, multiple leading dims, several blocks
    z = torch.randn(2, 3, 64, generator=gen()) * 10
    w = fp4_qdq(z)
    assert w.dtype == torch.float32 and w.shape == z.shape
    # every output is an e2m1 value times its block's power-of-two scale
    s = torch.tensor([exact_pow2_ceil(a / 6) for a in z.view(-1, 32).abs().amax(-1).tolist()])
    ratio = w.view(-1, 32) / s[:, None]
    assert torch.isin(ratio, E2M1_VALUES).all()
    with pytest.raises(ValueError):
        fp4_qdq(torch.zeros(4, 48))


# =================================================================================== MXFP4
def test_mxfp4_hand_example():
    w = torch.zeros(1, 64)
    w[0, :6] = torch.tensor([10.0, 3.0, -7.0, 0.4, 1.1, 9.0])
    packed, scale = quant_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (1, 32)
    assert scale.dtype == E8M0 and scale.shape == (1, 2)
    # block 0: amax 10 -> s = 2^ceil(log2(10/6)) = 2; w/s = [5, 1.5, -3.5, .2, .55, 4.5]
    #   -> codes [6 (4, tie), 3 (1.5), 14 (-4, tie), 0, 1 (0.5), 6 (4)]
    # block 1: all zero -> amax floor 1e-12 -> s = 2^ceil(log2(1e-12/6)) = 2^-42
    assert scale.view(torch.uint8).tolist() == [[128, 127 - 42]]
    assert packed.view(torch.uint8)[0, :3].tolist() == [0x36, 0x0E, 0x61]
    assert (packed[0, 3:] == 0).all()
    dq = dequant_mxfp4(packed, scale)
    assert dq[0, :6].tolist() == [8.0, 3.0, -8.0, 0.0, 1.0, 8.0]
    assert (dq[0, 6:] == 0).all()
    # the same bytes as uint8 or as convert.py's float4_e2m1fn_x2 view
    assert torch.equal(dequant_mxfp4(packed.view(torch.uint8), scale), dq)
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert torch.equal(dequant_mxfp4(packed.view(torch.float4_e2m1fn_x2), scale), dq)


def wide_weight(out_f, in_f, seed=0, spread=3.0):
    g = gen(seed)
    w = torch.randn(out_f, in_f, generator=g) * torch.exp(torch.randn(out_f, 1, generator=g) * spread)
    w[0, :64] = 0.0  # whole zero blocks
    return w


def test_mxfp4_round_trip_idempotent():
    w = wide_weight(64, 256)
    p, s = quant_mxfp4(w)
    dq = dequant_mxfp4(p, s)
    # dequant(quant(.)) is a projection: re-quantising its output reproduces it bit-exactly
    p2, s2 = quant_mxfp4(dq)
    assert_bits_equal(dequant_mxfp4(p2, s2), dq)
    # error bound: at most half the widest grid step (1 between 4 and 6) times the scale
    err = (dq - w).abs().view(64, -1, 32)
    assert (err <= e8m0_to_fp32(s).unsqueeze(-1)).all()
    # canonical tensors (each group holds a +-6 code) are a byte-level fixed point
    codes = torch.randint(0, 16, (16, 128), generator=gen(1), dtype=torch.uint8)
    codes[:, ::32] = torch.where(torch.rand(16, 4, generator=gen(2)) < 0.5, 7, 15).to(torch.uint8)
    sc = torch.randint(100, 150, (16, 4), generator=gen(3), dtype=torch.uint8).view(E8M0)
    pk = pack_fp4(codes).view(torch.int8)
    p3, s3 = quant_mxfp4(dequant_mxfp4(pk, sc))
    assert torch.equal(p3, pk) and torch.equal(s3.view(torch.uint8), sc.view(torch.uint8))


# =================================================================================== NVFP4
def test_nvfp4_hand_example():
    w = torch.zeros(1, 48)
    w[0, :4] = torch.tensor([2688.0, 1000.0, -1344.0, 0.0])
    w[0, 16:20] = torch.tensor([13.0, 5.0, -1.0, 0.2])
    packed, ws, ws2 = quant_nvfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 24)
    assert ws.dtype == E4M3 and ws.shape == (1, 3)
    assert ws2.dtype == torch.float32 and ws2.dim() == 0
    assert ws2.item() == 1.0  # 2688 / (6 * 448)
    # block scales: 2688/6 = 448; 13/6 = 2.1667 -> e4m3 2.25 (step 0.25 in [2, 4)); zero block -> 1
    assert ws.float().tolist() == [[448.0, 2.25, 1.0]]
    codes = unpack_fp4(packed)[0]
    # block 0 / 448: [6, 2.23 -> 2, -3, 0]; block 1 / 2.25: [5.78 -> 6, 2.22 -> 2, -0.44 -> -0.5, 0.09 -> 0]
    assert codes[:4].tolist() == [7, 4, 13, 0]
    assert codes[16:20].tolist() == [7, 4, 9, 0]
    dq = dequant_nvfp4(packed, ws, ws2)
    assert dq[0, :4].tolist() == [2688.0, 896.0, -1344.0, 0.0]
    assert dq[0, 16:20].tolist() == [13.5, 4.5, -1.125, 0.0]
    assert (dq[0, 32:] == 0).all()


def test_nvfp4_scales_follow_modelopt_formulas():
    w = wide_weight(32, 128, spread=1.0)
    packed, ws, ws2 = quant_nvfp4(w)
    amax = w.abs().amax()
    assert torch.equal(ws2, amax / (6 * 448))
    w2 = w * 2.0 ** -7 * 2688 / amax  # global amax exactly 2688 * 2^-7 -> ws2 exactly 2^-7
    assert quant_nvfp4(w2)[2].item() == 2.0 ** -7
    block_amax = w.abs().view(32, 8, 16).amax(-1)
    want = (block_amax / (6 * ws2)).masked_fill(block_amax == 0, 1.0).to(E4M3)
    assert torch.equal(ws.view(torch.uint8), want.view(torch.uint8))
    assert ws.float().max() == 448.0  # the block holding the global amax
    # each value within half the widest grid step of its block scale
    dq = dequant_nvfp4(packed, ws, ws2).view(32, 8, 16)
    step = (ws.float() * ws2).unsqueeze(-1)
    assert ((dq - w.view(32, 8, 16)).abs() <= step * 1.0001).all()


def test_nvfp4_round_trip_idempotent():
    # exact as long as block scales stay normal e4m3 (>= 2^-6 * 448-ish of the max); subnormal
    # block scales carry too few bits for the block's max code to come back as 6
    for seed in range(4):
        w = torch.randn(32, 256, generator=gen(seed)) * torch.exp(torch.randn(32, 1, generator=gen(seed + 9)))
        p, ws, ws2 = quant_nvfp4(w)
        dq = dequant_nvfp4(p, ws, ws2)
        p2, ws_2, ws2_2 = quant_nvfp4(dq)
        assert torch.equal(p2, p)
        assert torch.equal(ws_2.view(torch.uint8), ws.view(torch.uint8))
        assert torch.equal(ws2_2, ws2)
        assert_bits_equal(dequant_nvfp4(p2, ws_2, ws2_2), dq)


def test_nvfp4_all_zero_tensor():
    p, ws, ws2 = quant_nvfp4(torch.zeros(2, 32))
    assert (p == 0).all() and (ws.float() == 1.0).all() and ws2.item() == 0.0
    assert (dequant_nvfp4(p, ws, ws2) == 0).all()


# =================================================================================== MXFP4 -> NVFP4
def random_mxfp4(out_f, in_f, e_lo, e_hi, seed=0):
    g = gen(seed)
    packed = torch.randint(0, 256, (out_f, in_f // 2), generator=g, dtype=torch.uint8).view(torch.int8)
    e = torch.randint(e_lo, e_hi + 1, (out_f, in_f // 32), generator=g)
    e[0, 0], e[-1, -1] = e_lo, e_hi  # hit both ends of the range
    return packed, (e + 127).to(torch.uint8).view(E8M0)


@pytest.mark.parametrize("e_lo,e_hi", [(-20, -3), (-127, -110), (110, 127), (0, 0)])
def test_mxfp4_to_nvfp4_is_exact(e_lo, e_hi):
    packed, scale = random_mxfp4(32, 256, e_lo, e_hi)
    p, ws, ws2 = mxfp4_to_nvfp4(packed, scale)
    assert p.dtype == torch.uint8 and ws.dtype == E4M3 and ws2.dtype == torch.float32 and ws2.dim() == 0
    assert ws.shape == (32, 16) and torch.equal(p.view(torch.int8), packed)
    # ws2 is a power of two, block scales are powers of two in e4m3's exact range 2^-9 .. 2^8
    assert ws2.item() == 2.0 ** round(math.log2(ws2.item()))
    f = ws.float()
    assert ((f >= 2.0 ** -9) & (f <= 2.0 ** 8)).all() and torch.equal(torch.frexp(f)[0], torch.full_like(f, 0.5))
    assert torch.equal(ws[:, 0::2].view(torch.uint8), ws[:, 1::2].view(torch.uint8))  # one 32-group = 2 x 16
    assert_bits_equal(dequant_nvfp4(p, ws, ws2), dequant_mxfp4(packed, scale))


def test_mxfp4_to_nvfp4_from_quantised_weights_with_zero_groups():
    w = wide_weight(64, 256, spread=1.0)  # zero groups get scale 2^-42, far outside the range
    packed, scale = quant_mxfp4(w)
    p, ws, ws2 = mxfp4_to_nvfp4(packed, scale)
    assert_bits_equal(dequant_nvfp4(p, ws, ws2), dequant_mxfp4(packed, scale))


def test_mxfp4_to_nvfp4_rejects_wide_scale_range():
    packed, scale = random_mxfp4(4, 64, -30, -12)  # 18 octaves
    packed = packed.view(torch.uint8) | 0x11  # every group non-zero
    with pytest.raises(ValueError, match="span"):
        mxfp4_to_nvfp4(packed.view(torch.int8), scale)
    bad = scale.view(torch.uint8).clone()
    bad[0, 0] = 255  # e8m0 NaN
    with pytest.raises(ValueError, match="NaN"):
        mxfp4_to_nvfp4(packed.view(torch.int8), bad.view(E8M0))


# =================================================================================== FP8
def test_fp8_max_and_saturation():
    assert FP8_MAX == 448.0 == torch.finfo(E4M3).max
    # block amax exactly 448 * 2^-5 -> s = 2^-5, q reaches exactly +-448
    x = torch.linspace(-1, 1, 128).to(torch.bfloat16).float() * 448 * 2.0 ** -5
    x[0] = -448 * 2.0 ** -5
    q, s = act_quant_fp8(x.to(torch.bfloat16))
    assert s.item() == 2.0 ** -5 and q.float().min().item() == -448.0
    # wide-range data never leaves the e4m3 range, never produces NaN
    y = (torch.randn(8, 512, generator=gen()) * torch.exp(torch.randn(8, 512, generator=gen(1)) * 8))
    q, s = act_quant_fp8(y.to(torch.bfloat16))
    assert torch.isfinite(q.float()).all() and (q.float().abs() <= 448).all()
    assert (q.float().abs().view(8, 4, 128).amax(-1) >= 224).all()  # scale is tight (pow2 ceil)


def test_pow2_ceil_exact():
    x = torch.tensor([1.0, 2.0 ** -140, 2.0 ** 127, 3.0, 0.75, 1.0000001, 3 * 2.0 ** -140, 448.0, 449.0])
    want = [1.0, 2.0 ** -140, 2.0 ** 127, 4.0, 1.0, 2.0, 2.0 ** -138, 512.0, 512.0]
    assert pow2_ceil(x).tolist() == want
    assert pow2_ceil(x).dtype == torch.float32


def test_ue8m0_scale_matches_exact_formula():
    # bf16-representable amax values (the official input is bf16): exact powers of two times 448,
    # their neighbours, and random magnitudes
    base = [448 * 2.0 ** k for k in range(-20, 20, 3)] + [1e-4, 1.0, 3.0, 0.3, 1e6]
    vals = torch.tensor(base)
    vals = torch.cat([vals, vals.to(torch.bfloat16).float().nextafter(torch.tensor(0.0)),
                      torch.exp(torch.randn(200, generator=gen()) * 10)]).to(torch.bfloat16).float()
    got = ue8m0_scale(vals, 448.0)
    want = torch.tensor([exact_pow2_ceil(Fraction(v) / 448) for v in vals.tolist()])
    assert torch.equal(got, want)
    assert ue8m0_scale(torch.tensor([448.0 * 4]), 448.0).item() == 4.0  # powers of two stay


def test_act_quant_fp8_hand_example_and_floor():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    # block amax 1 -> s = 2^ceil(log2(1/448)) = 2^-8; x*256 = [256, 76.8, 76, 68, 72]
    # e4m3 in [64, 128) has step 8: 76.8 -> 80, ties 76 -> 80 and 68 -> 64 (even mantissa), 72 exact
    x[0, :5] = torch.tensor([1.0, 0.3, 76 / 256, 68 / 256, 72 / 256])
    q, s = act_quant_fp8(x)
    assert q.dtype == E4M3 and q.shape == x.shape and s.dtype == torch.float32 and s.shape == (2, 2)
    assert q[0, :5].float().tolist() == [256.0, 80.0, 80.0, 64.0, 72.0]
    # all-zero blocks: amax floor 1e-4 -> s = 2^ceil(log2(1e-4/448)) = 2^-22
    assert s.tolist() == [[2.0 ** -8, 2.0 ** -22], [2.0 ** -22, 2.0 ** -22]]
    assert (q[1].float() == 0).all()
    y = fp8_qdq(x, 128)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert y[0, :5].tolist() == [1.0, 0.3125, 0.3125, 0.25, 0.28125]
    with pytest.raises(ValueError, match=r"\(2, 200\)"):
        act_quant_fp8(torch.zeros(2, 200))


def test_act_quant_rows_independent():
    x = (torch.randn(16, 512, generator=gen()) * torch.exp(torch.randn(16, 1, generator=gen(1)) * 4)).to(torch.bfloat16)
    q, s = act_quant_fp8(x)
    for i in [0, 5, 15]:
        qi, si = act_quant_fp8(x[i:i + 1])
        assert torch.equal(qi.view(torch.uint8), q[i:i + 1].view(torch.uint8)) and torch.equal(si, s[i:i + 1])
    perm = torch.randperm(16, generator=gen(2))
    qp, sp = act_quant_fp8(x[perm])
    assert torch.equal(qp.view(torch.uint8), q[perm].view(torch.uint8)) and torch.equal(sp, s[perm])
    # 3-D input = the same rows
    q3, s3 = act_quant_fp8(x.view(4, 4, 512))
    assert torch.equal(q3.view(16, 512).view(torch.uint8), q.view(torch.uint8))


def test_fp8_qdq_matches_definition():
    x = (torch.randn(4, 3, 256, generator=gen()) * 100).to(torch.bfloat16)
    for block in (64, 128):
        q, s = act_quant_fp8(x, block)
        want = (q.float().view(4, 3, -1, block) * s.unsqueeze(-1)).view(x.shape).to(torch.bfloat16)
        assert_bits_equal(fp8_qdq(x, block), want)
    assert fp8_qdq(x.float(), 64).dtype == torch.float32


def test_fp8_weight_dequant_hand_example():
    w = torch.zeros(256, 256)
    w[0, 0], w[0, 200], w[200, 0], w[200, 200] = 1.5, -3.0, 448.0, 0.5
    q = w.to(E4M3)
    scale = fp32_to_e8m0(torch.tensor([[1.0, 2.0], [0.5, 4.0]]))
    dq = dequant_fp8_weight(q, scale)
    assert dq.dtype == torch.float32 and dq.shape == (256, 256)
    assert [dq[0, 0].item(), dq[0, 200].item(), dq[200, 0].item(), dq[200, 200].item()] == [1.5, -6.0, 224.0, 2.0]
    assert torch.equal(dequant_fp8_weight(q, scale.float()), dq)  # fp32 scales accepted
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        dequant_fp8_weight(q, torch.ones(2, 3))


def test_fp8_weight_quant_ragged_and_round_trip():
    w = wide_weight(130, 200, spread=1.0)
    q, s = quant_fp8_weight(w)
    assert q.dtype == E4M3 and q.shape == (130, 200) and s.dtype == E8M0 and s.shape == (2, 2)
    for bi, bj in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        amax = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].abs().max().item()
        assert e8m0_to_fp32(s)[bi, bj].item() == exact_pow2_ceil(Fraction(amax) / 448)
    dq = dequant_fp8_weight(q, s)
    q2, s2 = quant_fp8_weight(dq)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))


def test_e8m0_conversions():
    b = torch.arange(255, dtype=torch.uint8)
    f = e8m0_to_fp32(b.view(E8M0))
    assert f.tolist() == [2.0 ** (i - 127) for i in range(255)]
    assert torch.equal(fp32_to_e8m0(f).view(torch.uint8), b)
    assert torch.isnan(e8m0_to_fp32(torch.tensor([255], dtype=torch.uint8))).all()
    for bad in [3.0, 0.0, -1.0, 0.75, 2.0 ** -128, 2.0 ** 128, float("nan"), float("inf")]:
        with pytest.raises(ValueError):
            fp32_to_e8m0(torch.tensor([1.0, bad]))


# =================================================================================== KV entries
def test_kv_constants():
    assert (NOPE_DIM, ROPE_DIM, KV_DIM, KV_QUANT_BLOCK, N_SCALES) == (448, 64, 512, 64, 7)
    assert (TOKEN_DATA_BYTES, SCALE_BYTES, ENTRY_BYTES, PAGE_ALIGN) == (576, 8, 584, 576)
    assert page_bytes(64) == 37440 and page_bytes(1) == 1152 and page_bytes(2) == 1728
    assert page_bytes(4) == 2880  # 4 * 584 = 2336 -> 5 * 576


def wide_kv(n, seed=0):
    """bf16 kv rows over a wide range of magnitudes, with zero blocks and exact block maxima."""
    g = gen(seed)
    m = max(n, 8)
    mag = torch.exp(torch.randn(m, 8, 1, generator=g) * 6).expand(m, 8, 64)
    kv = (torch.randn(m, 8, 64, generator=g) * mag).reshape(m, 512)
    kv[1, 64:128] = 0  # zero nope block
    kv[2, :448] = 0  # all nope zero
    kv[3, :64] = 448 * 2.0 ** -3  # block exactly at a power-of-two max
    kv[3, 64] = -448 * 2.0 ** 7
    kv[4, 128:192] = torch.linspace(-1, 1, 64) * 2.0 ** 100
    kv[5, :448] = 3e38  # near bf16 max
    kv[6, 448:] = -0.0
    return kv[:n].to(torch.bfloat16)


def test_kv_encode_decode_bit_exact():
    kv = wide_kv(64)
    data, scales = encode_kv_entries(kv)
    assert data.dtype == torch.uint8 and data.shape == (64, 576)
    assert scales.dtype == torch.uint8 and scales.shape == (64, 8)
    out = decode_kv_entries(data, scales)
    want = torch.cat([fp8_qdq(kv[:, :448], 64), kv[:, 448:]], dim=1)
    assert_bits_equal(out, want)
    # rope stored as raw bf16 bytes
    assert torch.equal(data[:, 448:].contiguous().view(torch.int16), kv[:, 448:].contiguous().view(torch.int16))
    # scale bytes = 127 + log2(s), s = 2^ceil(log2(max(amax, 1e-4) / 448)); pad byte 0
    amax = kv[:, :448].float().abs().view(64, 7, 64).amax(-1).clamp(min=1e-4)
    want_bytes = [[127 + int(math.log2(exact_pow2_ceil(Fraction(a) / 448))) for a in row] + [0]
                  for row in amax.tolist()]
    assert scales.tolist() == want_bytes


def test_kv_entry_hand_example():
    kv = torch.zeros(1, 512, dtype=torch.bfloat16)
    kv[0, :64] = 1.0  # s = 2^-8 -> byte 119; q = 256 = 2^8 -> e4m3 0 1111 000 = 0x78
    kv[0, 448] = 1.0  # bf16 0x3F80, little-endian bytes 80 3F
    data, scales = encode_kv_entries(kv)
    assert data[0, :64].tolist() == [0x78] * 64 and (data[0, 64:448] == 0).all()
    assert data[0, 448:450].tolist() == [0x80, 0x3F] and (data[0, 450:] == 0).all()
    assert scales[0].tolist() == [119] + [127 - 22] * 6 + [0]


def test_kv_pages_write_read_scattered():
    B, num_pages = 4, 3
    pages = torch.randint(0, 256, (num_pages, page_bytes(B)), generator=gen(), dtype=torch.uint8)
    before = pages.clone()
    slots = torch.tensor([5, -1, 0, 11, 7], dtype=torch.int64)
    kv = wide_kv(5, seed=3)
    write_kv_entries(pages, slots, kv, B)
    # expected bytes from the spec layout: token data at t*576, scales at B*576 + t*8
    data, scales = encode_kv_entries(kv)
    expect = before.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        p, t = divmod(slot, B)
        expect[p, t * 576:(t + 1) * 576] = data[i]
        expect[p, B * 576 + t * 8:B * 576 + (t + 1) * 8] = scales[i]
    assert torch.equal(pages, expect)  # other slots and page padding untouched
    out = read_kv_entries(pages, slots, B)
    want = torch.cat([fp8_qdq(kv[:, :448], 64), kv[:, 448:]], dim=1)
    want[1] = 0
    assert_bits_equal(out, want)
    assert_bits_equal(read_kv_entries(pages, torch.tensor([7, 7, 5]), B), out[[4, 4, 0]])


def test_kv_page_of_64_layout():
    B = 64
    pages = torch.zeros(2, page_bytes(B), dtype=torch.uint8)
    kv = wide_kv(1, seed=5)
    write_kv_entries(pages, torch.tensor([B + 63]), kv, B)
    data, scales = encode_kv_entries(kv)
    assert (pages[0] == 0).all()
    assert torch.equal(pages[1, 63 * 576:64 * 576], data[0])
    assert torch.equal(pages[1, 36864 + 504:36864 + 512], scales[0])
    assert (pages[1, 37376:] == 0).all()  # alignment padding


def test_kv_validation_errors():
    B = 4
    pages = torch.zeros(2, page_bytes(B), dtype=torch.uint8)
    kv = torch.zeros(2, 512, dtype=torch.bfloat16)
    ok = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="bfloat16"):
        encode_kv_entries(kv.float())
    with pytest.raises(ValueError):
        encode_kv_entries(torch.zeros(2, 511, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        decode_kv_entries(torch.zeros(2, 576, dtype=torch.uint8), torch.zeros(3, 8, dtype=torch.uint8))
    with pytest.raises(ValueError):
        decode_kv_entries(torch.zeros(2, 584, dtype=torch.uint8), torch.zeros(2, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pages"):
        write_kv_entries(torch.zeros(2, page_bytes(B) - 1, dtype=torch.uint8), ok, kv, B)
    with pytest.raises(ValueError, match="pages"):
        write_kv_entries(pages.view(torch.int8), ok, kv, B)
    with pytest.raises(ValueError, match="slots"):
        write_kv_entries(pages, ok.int(), kv, B)
    with pytest.raises(ValueError, match="range"):
        write_kv_entries(pages, torch.tensor([0, 8]), kv, B)
    with pytest.raises(ValueError, match="range"):
        read_kv_entries(pages, torch.tensor([-2]), B)
    with pytest.raises(ValueError, match="rows"):
        write_kv_entries(pages, torch.tensor([0, 1, 2]), kv, B)
    with pytest.raises(ValueError):
        write_kv_entries(pages, ok, kv.float(), B)
    with pytest.raises(ValueError):
        page_bytes(0)
    assert (pages == 0).all()  # failed calls wrote nothing


def test_requantising_a_qdq_block_keeps_or_halves_its_scale():
    """The cache writers re-derive a QDQ'd block's ue8m0 scale (encode_kv_entries / the MXFP4 index
    keys); the compressor kernels take the new codes from the first encoding instead of quantising
    twice. That rests on these facts, checked over every fp32 block maximum of three binades: the
    re-derived scale is the QDQ scale or half of it, and at half the scale every value the block can
    hold (|v| <= half the format's range) re-encodes as its code doubled exactly
    (e4m3 magnitude m -> 2m below 8, else m + 8; e2m1 c -> 2c up to 2, else c + 2)."""
    from dsv4.formats.fp4 import magnitude_codes
    mant = torch.arange(1 << 23, dtype=torch.int32) | (127 << 23)
    one_binade = mant.view(torch.float32)                               # every fp32 in [1, 2)
    for qmax, floor in ((FP8_MAX, 1e-4), (6.0, 6.0 * 2.0 ** -126)):
        for e in (-12, 0, 9):
            amax = one_binade * 2.0 ** e
            s = ue8m0_scale(amax.clamp(min=floor), qmax)
            v = (amax / s).clamp(max=qmax)
            if qmax == FP8_MAX:
                q = v.to(torch.float8_e4m3fn).float()
            else:
                q = E2M1_VALUES[magnitude_codes(v)]
            s2 = ue8m0_scale((q * s).clamp(min=floor), qmax)
            assert bool(((s2 == s) | (s2 == s / 2)).all()), (qmax, e)
            assert bool((s2 == s / 2).any())                            # both cases occur
    codes = torch.arange(128, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    half = vals <= FP8_MAX / 2
    doubled = (vals[half] * 2).to(torch.float8_e4m3fn).view(torch.uint8).long()
    m = codes[half].long()
    assert torch.equal(doubled, torch.where(m < 8, 2 * m, m + 8))
    c = torch.arange(8)
    fits = E2M1_VALUES[c] <= 3.0
    assert torch.equal(magnitude_codes(E2M1_VALUES[c[fits]] * 2), torch.where(c[fits] <= 2, 2 * c[fits],
                                                                                  c[fits] + 2))
