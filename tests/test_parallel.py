"""Tensor-parallel linears (``dsv4.parallel.Split``): a rank loads its slice of the checkpoint
tensor, column slices concatenate to the whole layer's output and row slices sum to it (over
gloo, two processes), and a cut off the FP8 128-blocks is refused with the tensor's name.

Tolerances, not bits, against the unsplit layer: a CPU GEMM's summation order depends on its
shape, and row-parallel sums bf16 partials (the official RowParallelLinear all-reduces its bf16
output)."""
from __future__ import annotations

import pytest
import torch

from dsv4.formats.fp8 import quant_fp8_weight
from dsv4.layers.linear import Bf16Linear, Fp8Linear
from dsv4.ops import Ops
from dsv4.parallel import SINGLE, Group, Split

OPS = Ops("cpu")


def _fp8(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return quant_fp8_weight(torch.randn(n, k, generator=g) * 0.05)


def _load(lin, tensors):
    ld = lin.loaders()
    assert sorted(ld) == sorted(tensors)
    for name, t in tensors.items():
        ld[name](t)
    return lin


def _fp8_tensors():
    (wa, sa), (wb, sb) = _fp8(256, 384, 0), _fp8(384, 384, 1)
    return {"a.weight": wa, "a.scale": sa, "b.weight": wb, "b.scale": sb}


def test_column_slices_concatenate_to_the_whole_output():
    t = _fp8_tensors()
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(2)).bfloat16()
    with pytest.raises(ValueError, match="b output rows: 384 cannot be split into 2 equal parts of a multiple of 128"):
        Fp8Linear(384, [("a", 256), ("b", 384)], OPS, split=Split("col", 0, 2))
    t2 = {"a.weight": t["a.weight"], "a.scale": t["a.scale"]}
    whole = OPS.linear(_load(Fp8Linear(384, [("a", 256)], OPS), t2), x).float()
    ranks = [_load(Fp8Linear(384, [("a", 256)], OPS, split=Split("col", r, 2)), t2) for r in range(2)]
    assert ranks[0].out_features == 128 and ranks[0].weight.shape == (128, 384) and ranks[0].scale.shape == (1, 3)
    assert torch.equal(ranks[1].weight.view(torch.uint8), t2["a.weight"][128:].view(torch.uint8))
    got = torch.cat([OPS.linear(lin, x) for lin in ranks], dim=1).float()
    assert torch.allclose(got, whole, rtol=2 ** -8, atol=0)


def test_bf16_merged_members_split_member_by_member():
    g = torch.Generator().manual_seed(3)
    t = {"p.weight": torch.randn(6, 64, generator=g).bfloat16(), "q.weight": torch.randn(4, 64, generator=g).bfloat16()}
    x = torch.randn(3, 64, generator=g)
    whole = OPS.linear(_load(Bf16Linear(64, [("p", 6), ("q", 4)], OPS, "fp32"), t), x)
    ranks = [_load(Bf16Linear(64, [("p", 6), ("q", 4)], OPS, "fp32", split=Split("col", r, 2)), t) for r in range(2)]
    outs = [OPS.linear(lin, x) for lin in ranks]
    # local layout per rank: [its p rows | its q rows]
    got = torch.cat([outs[0][:, :3], outs[1][:, :3], outs[0][:, 3:], outs[1][:, 3:]], dim=1)
    assert torch.allclose(got, whole, rtol=1e-6, atol=1e-6 * float(whole.abs().max()))


def test_row_slices_sum_to_the_whole_output_and_misaligned_cuts_are_refused():
    w, s = _fp8(256, 512, 4)
    t = {"o.weight": w, "o.scale": s}
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    whole = OPS.linear(_load(Fp8Linear(512, [("o", 256)], OPS), t), x).float()
    ranks = [_load(Fp8Linear(512, [("o", 256)], OPS, split=Split("row", r, 2)), t) for r in range(2)]
    assert ranks[1].weight.shape == (256, 256) and ranks[1].scale.shape == (2, 2)
    parts = [OPS.linear(lin, x[:, 256 * r:256 * (r + 1)]).float() for r, lin in enumerate(ranks)]
    total = parts[0] + parts[1]
    # each bf16 rounding is within half an ulp (2^-9 relative) of its value
    bound = 2.0 ** -8 * (parts[0].abs() + parts[1].abs() + whole.abs())
    assert ((total - whole).abs() <= bound).all()
    with pytest.raises(ValueError, match="o input columns: 384 cannot be split into 2 equal parts of a multiple of 128"):
        Fp8Linear(384, [("o", 256)], OPS, split=Split("row", 1, 2))
    with pytest.raises(ValueError, match=r"o.weight: expected shape \(256, 512\), got \(256, 256\)"):
        ranks[0].loaders()["o.weight"](w[:, :256])


def test_split_and_group_arguments():
    assert SINGLE.world == 1 and SINGLE.split("col") is None
    x = torch.ones(3)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x
    with pytest.raises(ValueError, match="kind"):
        Split("diag", 0, 2)
    with pytest.raises(ValueError, match="rank 2"):
        Split("col", 2, 2)


def _row_worker(rank, world, port, w, s, x, q):
    import os
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        grp = Group(dist.group.WORLD)
        lin = Fp8Linear(512, [("o", 256)], Ops("cpu"), split=grp.split("row"))
        lin.loaders()["o.weight"](w)
        lin.loaders()["o.scale"](s)
        a, b = lin.cols
        y = grp.all_reduce(Ops("cpu").linear(lin, x[:, a:b]).float())
        g = grp.all_gather(y[:, :2], dim=1)
        q.put((rank, _ship((y, g))))
    finally:
        dist.destroy_process_group()


def _ship(obj) -> bytes:
    """``obj`` serialised for a queue: a tensor put as is travels as a shared-memory handle that
    dies with the worker, which may exit before the parent reads it."""
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _spawn(target, args, world=2, timeout=300, **kw):
    """Run ``target(rank, world, port, *args, queue, **kw)`` in ``world`` spawned processes; {rank:
    what each put on the queue (``_ship``ped)}."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q), kwargs=kw) for r in range(world)]
    for p in procs:
        p.start()
    import io
    got = {r: torch.load(io.BytesIO(b)) for r, b in (q.get(timeout=timeout) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def test_row_parallel_over_gloo_all_reduces_to_the_sum_of_the_slices():
    w, s = _fp8(256, 512, 6)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7)).bfloat16()
    got = _spawn(_row_worker, (w, s, x))
    t = {"o.weight": w, "o.scale": s}
    parts = [OPS.linear(_load(Fp8Linear(512, [("o", 256)], OPS, split=Split("row", r, 2)), t),
                        x[:, 256 * r:256 * (r + 1)]).float() for r in range(2)]
    assert torch.equal(got[0][0], parts[0] + parts[1]) and torch.equal(got[0][0], got[1][0])
    assert torch.equal(got[0][1], torch.cat([got[0][0][:, :2], got[1][0][:, :2]], dim=1))


# ------------------------------------------------------------------ the model over ranks
class _Rank(Group):
    """A rank of a ``world``-rank group without a process group (construction and loading only)."""

    def __init__(self, rank, world):
        self.pg, self.rank, self.world, self.active = None, rank, world, False


def _part_bytes(m):
    keys = {"experts": (".moe.w13", ".moe.w2"), "q/o": (".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b."), "head": (".head.",)}
    out = dict.fromkeys(keys, 0)
    for name, t in m.named_buffers():
        for k, pats in keys.items():
            if any(p in "." + name for p in pats):
                out[k] += t.nbytes
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny checkpoint with ``index_topk`` 64, over the <= 38 compressed entries of the runs here: the
    indexer picks every entry. Its scores move by up to ~0.4 when two ranks change the residual's last bits
    (the replicated indexer reads it through quantised queries and keys), so a 16-of-38 pick flips on most
    decode rows (CPU twins: 5 of 6 calls; the cos of the logits then drops to 0.999 on the CPU, 0.987 on an
    H100). The indexer's top-k is held elsewhere (tests/test_indexer.py, the golden tests)."""
    from dsv4.checkpoint.tiny import make_tiny
    from dsv4.config import preset
    return make_tiny(str(tmp_path_factory.mktemp("tp") / "tiny"), cfg=preset("tiny", index_topk=64))


def test_each_rank_holds_its_share_of_the_split_weights(tiny):
    from dsv4.model.deepseek_v4 import DeepseekV4
    twins = Ops("cpu", kernels=False)
    whole = _part_bytes(DeepseekV4.from_checkpoint(tiny, ops=twins))
    for r in range(2):
        m = DeepseekV4.from_checkpoint(tiny, ops=twins, group=_Rank(r, 2))
        assert _part_bytes(m) == {k: v // 2 for k, v in whole.items()}
        assert m.layers[2].moe.expert0 == 4 * r and m.layers[2].attn.H == 4
        # the other rank's experts are never read from disk
        seen = []
        orig = DeepseekV4.load
        DeepseekV4.load = lambda self, tensors, **kw: orig(self, (seen.append(n) or (n, t) for n, t in tensors), **kw)
        try:
            DeepseekV4.from_checkpoint(tiny, ops=twins, group=_Rank(r, 2))
        finally:
            DeepseekV4.load = orig
        experts = {int(n.split(".")[4]) for n in seen if ".ffn.experts." in n}
        assert experts == set(range(4 * r, 4 * r + 4))
    with pytest.raises(ValueError, match="tensor parallel size 4 must divide the 8 attention heads and 2 output groups"):
        DeepseekV4.from_checkpoint(tiny, ops=twins, group=_Rank(0, 4))


@pytest.mark.parametrize("layout", ["official", "hf"])
def test_a_rank_reads_only_its_slice_of_the_split_tensors(tiny, tmp_path, layout):
    """The split linears' tensors come off disk as the rank's slice (``get_slice``), in every
    layout, and load the same bytes as the whole tensor cut in memory."""
    from dsv4.checkpoint.loader import open_checkpoint
    from dsv4.checkpoint.tiny import make_tiny
    from dsv4.model.deepseek_v4 import DeepseekV4
    path = tiny if layout == "official" else make_tiny(str(tmp_path / layout), layout=layout)
    twins = Ops("cpu", kernels=False)
    whole = {n: t.clone() for n, t in open_checkpoint(path).tensors()}
    m = DeepseekV4.from_checkpoint(path, ops=twins, group=_Rank(1, 2))
    parts = m.split_parts()
    assert {n.split(".")[-2] for n in parts} >= {"wq_b", "wo_a", "wo_b", "head"}
    got = dict(open_checkpoint(path).tensors(parts=parts, skip=lambda n: n not in parts))
    assert set(got) == set(parts)
    for n, (rows, cols) in parts.items():
        t = whole[n]
        t = t if rows is None else t[rows[0]:rows[1]]
        t = t if cols is None else t[:, cols[0]:cols[1]]
        assert got[n].dtype == t.dtype and torch.equal(got[n].view(torch.uint8), t.contiguous().view(torch.uint8)), n
    # ... and the model they load equals one loaded from the whole tensors
    m2 = DeepseekV4(m.cfg, m.expert_format, m.wo_a_format, "cpu", twins, _Rank(1, 2))
    other = m2.foreign_names()
    m2.load((n, t) for n, t in whole.items() if not n.startswith("mtp.") and n not in other)
    for (n, a), (_, b) in zip(m.named_buffers(), m2.named_buffers()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n


def _run_model(path, ids, tokens, group=None, device="cpu", kernels=False):
    """Prefill ``ids`` then decode ``tokens`` (teacher-forced; an int n: n greedy steps, each fed the argmax
    of the logits before it): the logits [1 + len(tokens), V] (CPU)."""
    from dsv4.engine.kv_cache import CacheConfig, KVCache, PagedSequenceState
    from dsv4.model.deepseek_v4 import DeepseekV4
    m = DeepseekV4.from_checkpoint(path, device, ops=Ops(device, kernels=kernels), group=group)
    cache = KVCache(m.cfg, CacheConfig(max_num_seqs=2, num_blocks=4, device=device))
    m.attach_cache(cache, 1024)
    st = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(2))
    out = [m(m.prefill_context([(ids, st)]))[0]]
    st.advance_to(ids.numel())
    for i in range(tokens if isinstance(tokens, int) else len(tokens)):
        tok = int(out[-1].argmax()) if isinstance(tokens, int) else tokens[i]
        bt = torch.full((1, m.max_blocks), -1, dtype=torch.long)
        bt[0, :2] = torch.tensor(st.block_table)
        on = lambda v: torch.as_tensor(v).to(device)
        out.append(m(m.decode_context(on([tok]), on([st.pos]), on([st.slot]), on(bt)))[0])
        st.advance_to(st.pos + 1)
    return torch.stack(out).cpu()


def _tp_worker(rank, world, port, path, ids, tokens, device, kernels, q, always=False):
    import os
    import torch.distributed as dist
    if world > 1:       # the engine's rule for its ranks (llm_engine.engine_threads): the cores split over them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = Group(dist.group.WORLD, always=always)
        assert g.active == (world > 1 or always)
        q.put((rank, _ship(_run_model(path, ids, tokens, g, device, kernels))))
    finally:
        dist.destroy_process_group()


def _close_to_one_rank(one, two):
    """Per row: cos > 0.999 and the same greedy token wherever the one-rank top-1 margin is >= 1."""
    for a, b in zip(one, two):
        cos = float(a.double() @ b.double() / (a.double().norm() * b.double().norm()))
        top = a.topk(2).values
        assert torch.isfinite(b).all() and cos > 0.999, cos          # measured 0.9996-0.9999 (twins)
        assert float(top[0] - top[1]) < 1.0 or int(a.argmax()) == int(b.argmax())


def test_two_ranks_give_the_one_rank_logits_and_tokens(tiny):
    """World size 2 over gloo against world size 1: logits within tolerance (the split sums round
    in another order: bf16 partials of wo_b, fp32 expert sums across ranks), the greedy token
    wherever the top-1 margin is clear, and the same logits on both ranks."""
    ids = torch.randint(3, 128000, (150,), generator=torch.Generator().manual_seed(11))
    one = _run_model(tiny, ids, 3)                      # the one-rank greedy continuation
    tokens = [int(row.argmax()) for row in one[:-1]]
    got = _spawn(_tp_worker, (tiny, ids, tokens, "cpu", False))
    assert torch.equal(got[0], got[1])
    _close_to_one_rank(one, got[0])
    # one rank of a real group whose collectives run (``always``): every all-reduce / all-gather
    # is the identity there, so the bits are the no-group run's
    got = _spawn(_tp_worker, (tiny, ids, tokens, "cpu", False), world=1, always=True)
    assert torch.equal(got[0], one)


@pytest.mark.gpu
def test_gpu_two_ranks_on_the_kernels_give_the_one_rank_logits(tiny):
    """The kernels under tensor parallelism (local heads through the attention kernels and
    ``wo_a``, local experts through the MoE kernels with their fp32 partial sums all-reduced, the
    vocab-split head): two ranks sharing the GPU over gloo (NCCL wants one GPU per rank) against
    one rank on the kernels, as the CPU test above holds the twins."""
    ids = torch.randint(3, 128000, (150,), generator=torch.Generator().manual_seed(12))
    one = _run_model(tiny, ids, 3, device="cuda", kernels=True)      # the one-rank greedy continuation
    tokens = [int(row.argmax()) for row in one[:-1]]
    got = _spawn(_tp_worker, (tiny, ids, tokens, "cuda", True))
    assert torch.equal(got[0], got[1])
    _close_to_one_rank(one, got[0])
