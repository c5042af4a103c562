"""``kernels/decode_meta.py``: the decode step's per-step index vectors and RoPE rows in one
launch, against its twin (PyTorch formulas) and against ``RopeTable`` itself. CPU: Triton
interpreter."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv4.config import preset  # noqa: E402
from dsv4.formats import paging  # noqa: E402
from dsv4.formats import decode_plan as dp  # noqa: E402
from dsv4.kernels import decode_meta as dm  # noqa: E402
from dsv4.twins import decode_meta as dm_twin  # noqa: E402
from dsv4.reference.rope import RopeTable  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _setup(W, B, seed, dev=DEV):
    cfg = preset("flash")
    L = W * 256
    tabs = torch.stack([dp.rope_table(RopeTable(cfg, 0, dev), L), dp.rope_table(RopeTable(cfg, 4, dev), L)])
    plan = dp.MetaPlan([(0, 0), (1, 0), (1, -3), (1, -127)], [(4, 64), (128, 2)], [(128, 2), (4, 64)], W, dev)
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, L, (B,), generator=g)
    pos[:4] = torch.tensor([0, 3, 127, L - 1])[:B]
    slots = torch.randint(0, 9, (B,), generator=g)
    bt = torch.randint(0, 300, (B, W), generator=g)
    bt[torch.rand(B, W, generator=g) < 0.2] = -1           # unallocated blocks anywhere in a row
    return cfg, tabs, plan, pos.to(dev), slots.to(dev), bt.to(dev)


def _assert_equal(a, b):
    assert len(a.rope) == len(b.rope) and len(a.write_ids) == len(b.write_ids) and len(a.visible) == len(b.visible)
    for (c1, s1), (c2, s2) in zip(a.rope, b.rope):
        assert torch.equal(c1, c2) and torch.equal(s1, s2)
    pairs = [(a.win_slot, b.win_slot), (a.widx, b.widx), (a.n_valid, b.n_valid)]
    for x, y in pairs + list(zip(a.write_ids, b.write_ids)) + list(zip(a.visible, b.visible)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("W,B", [(4, 3), (40, 5), (520, 2)])   # 520 blocks: HCA rows span 2 programs
def test_decode_meta_equals_twin(W, B):
    cfg, tabs, plan, pos, slots, bt = _setup(W, B, seed=W)
    got = dm.decode_meta(pos, slots, bt, tabs, plan, scratch_block=77)
    _assert_equal(got, dm_twin.decode_meta(pos, slots, bt, tabs, plan, scratch_block=77))
    # spot facts of the layout, independent of the twin
    assert torch.equal(got.widx[:, -1].long() >= 0, pos >= 127)
    b = int(pos.argmax())
    p = int(pos[b])
    n_vis = (p + 1) // 128
    assert (got.visible[0][b, n_vis:] == -1).all()
    if n_vis:
        last = (n_vis - 1) * 128 // 256
        want = -1 if int(bt[b, last]) < 0 else int(bt[b, last]) * 2 + (n_vis - 1) % 2
        assert int(got.visible[0][b, n_vis - 1]) == want


def test_rope_rows_are_rope_table_values():
    """A table row is ``rope(p)`` bitwise, negative compressor positions included, in both trig modes."""
    cfg = preset("flash")
    for ratio, fp64 in ((0, False), (4, False), (4, True)):
        rope = RopeTable(cfg, ratio, DEV, fp64)
        tab = dp.rope_table(rope, 4096)[None]
        plan = dp.MetaPlan([(0, 0), (0, 1 - 128)], [], [], 16, DEV)
        pos = torch.tensor([0, 1, 126, 127, 4095, 3000], device=DEV)
        bt = torch.zeros(pos.shape[0], 16, dtype=torch.long, device=DEV)
        m = dm.decode_meta(pos, torch.zeros_like(pos), bt, tab, plan, 0)
        for (cos, sin), off in zip(m.rope, (0, -127)):
            f = rope(pos + off)
            assert torch.equal(cos, f.real) and torch.equal(sin, f.imag)


def test_decode_meta_rejects_bad_input():
    cfg, tabs, plan, pos, slots, bt = _setup(4, 3, seed=1)
    with pytest.raises(ValueError, match="int64"):
        dm.decode_meta(pos.int(), slots, bt, tabs, plan, 0)
    with pytest.raises(ValueError, match="columns"):
        dm.decode_meta(pos, slots, bt[:, :3], tabs, plan, 0)
    with pytest.raises(ValueError, match="expected pos, slots"):
        dm.decode_meta(pos, slots[:2], bt, tabs, plan, 0)
    with pytest.raises(ValueError, match="table 1 of 1"):
        dm.decode_meta(pos, slots, bt, tabs[:1], plan, 0)
    with pytest.raises(ValueError, match="not a cache layout"):
        dp.MetaPlan([], [(4, 32)], [], 4, DEV)
    with pytest.raises(ValueError, match="at most 2"):
        dp.MetaPlan([], [], [(128, 2)] * 3, 4, DEV)


@pytest.mark.gpu
def test_gpu_decode_meta_equals_twin():
    for W, B in ((4096, 64), (40, 1), (4, 128)):
        cfg, tabs, plan, pos, slots, bt = _setup(W, B, seed=B)
        _assert_equal(dm.decode_meta(pos, slots, bt, tabs, plan, 5),
                      dm_twin.decode_meta(pos, slots, bt, tabs, plan, 5))
