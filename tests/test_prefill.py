"""Fused prefill (``dsv4.tools.fast_prefill.FastPrefiller``) against the reference model on the same
paged cache layout: logits and every cache structure it writes (window ring, compressed entries,
indexer keys, compressor rings). CPU: Triton interpreter at the tiny model."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv4.checkpoint.tiny import build_tiny_tensors  # noqa: E402
from dsv4.config import preset  # noqa: E402
from dsv4.engine.kv_cache import CacheConfig, KVCache, PagedSequenceState  # noqa: E402
from dsv4.tools.fast_decode import FastDecoder  # noqa: E402
from dsv4.tools.fast_prefill import FastPrefiller  # noqa: E402
from dsv4.reference.model import ReferenceModel  # noqa: E402

MAX_LEN = 512


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny")
    return ReferenceModel(cfg, build_tiny_tensors(cfg, 0))


def _seqs(cache, lens):
    out = []
    for n in lens:
        slot = cache.allocate_slot()
        out.append(PagedSequenceState(cache, slot, cache.allocate_blocks(cache.blocks_needed(n))))
    return out


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300))


def _compare_prefill(model, lens, plan, twins, seed):
    """Prefill ``lens``-token prompts by ``plan`` (per step: (sequence, chunk length) pairs run as
    one batch) with the reference and with the fused prefill, on two caches; check logits and
    every cache structure."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128000, (n,), generator=g) for n in lens]
    caches = [KVCache(cfg, CacheConfig(max_num_seqs=len(lens) + 1, num_blocks=8)) for _ in range(2)]
    ref_seqs, fast_seqs = _seqs(caches[0], lens), _seqs(caches[1], lens)
    fast = FastPrefiller(FastDecoder(model, caches[1], MAX_LEN, "triton", fused=True), twins=twins)
    done = [0, 0]
    for step in plan:
        chunks_r, chunks_f = [], []
        for i, n in step:
            ids = prompts[i][done[i]:done[i] + n]
            done[i] += n
            chunks_r.append((ids, ref_seqs[i]))
            chunks_f.append((ids, fast_seqs[i]))
        lr = model.forward(chunks_r)
        lf = fast.forward(chunks_f)
        for a, b in zip(lr, lf):
            assert torch.isfinite(b).all()
            assert _cos(a, b) > 0.999, _cos(a, b)
    for sr, sf in zip(ref_seqs, fast_seqs):
        assert sf.pos == sr.pos
        for li in range(cfg.num_hidden_layers):
            lr_, lf_ = sr.layers[li], sf.layers[li]
            wr, wf = lr_.read_window(sr.pos), lf_.read_window(sf.pos)
            assert wr.shape == wf.shape and _cos(wr, wf) > 0.999
            for name in ("compressor", "indexer"):
                cr, cf = getattr(lr_, name), getattr(lf_, name)
                if cr is None:
                    continue
                assert cf.num_entries == cr.num_entries
                er, ef = cr.entries(), cf.entries()
                assert er.shape == ef.shape and (er.numel() == 0 or _cos(er, ef) > 0.995), (li, name)
                # pending rows in the ring (fp32 K / scores) of the same positions
                kr, sr_, p_r = cr.pending(sr.pos)
                kf, sf_, p_f = cf.pending(sf.pos)
                assert p_r == p_f and kr.shape == kf.shape
                if kr.numel():
                    assert _cos(kr, kf) > 0.999 and _cos(sr_, sf_) > 0.999, (li, name)


def test_fused_prefill_orchestration_matches_reference(model):
    """Two sequences prefilled in mixed chunks (chunks crossing the 128-token window and CSA / HCA
    window boundaries, starting mid-window, batched together): with the kernels' torch twins the
    fused prefill's index lists, scratch window, rings and pages give the reference's logits and
    cache contents."""
    _compare_prefill(model, (300, 150), [[(0, 37), (1, 150)], [(0, 200)], [(0, 63)]], twins=True, seed=3)


def test_fused_prefill_triton_kernels(model):
    """The same with the Triton kernels (interpreter: short chunks; the GPU test runs long ones)."""
    _compare_prefill(model, (21, 9), [[(0, 13), (1, 9)], [(0, 8)]], twins=False, seed=5)


def test_fused_prefill_then_decode_continues(model):
    """After a fused prefill the fused decode step reads the cache the prefill wrote: its next-token
    logits equal the reference's on its own prefilled cache (cos), argmax included."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 128000, (260,), generator=g)
    caches = [KVCache(cfg, CacheConfig(max_num_seqs=3, num_blocks=4)) for _ in range(2)]
    (sr,), (sf,) = _seqs(caches[0], (264,)), _seqs(caches[1], (264,))
    dec = FastDecoder(model, caches[1], MAX_LEN, "triton", fused=True)
    lr = model.forward([(ids, sr)])[0]
    lf = FastPrefiller(dec, twins=True).forward([(ids, sf)])[0]
    tok = int(lr.argmax())
    assert int(lf.argmax()) == tok
    lr2 = model.forward([(torch.tensor([tok]), sr)])[0]
    bt = torch.full((1, dec.max_blocks), -1, dtype=torch.long)
    bt[0, :len(sf.block_table)] = torch.tensor(sf.block_table)
    lf2 = dec.forward(torch.tensor([tok]), torch.tensor([sf.pos]), torch.tensor([sf.slot]), bt)[0]
    assert _cos(lr2, lf2) > 0.999
    assert int(lr2.argmax()) == int(lf2.argmax())


def test_fused_prefill_rejects_short_block_table(model):
    cache = KVCache(model.cfg, CacheConfig(max_num_seqs=3, num_blocks=4))
    (st,) = _seqs(cache, (10,))
    fast = FastPrefiller(FastDecoder(model, cache, MAX_LEN, "triton", fused=True), twins=True)
    with pytest.raises(ValueError, match="block table too short"):
        fast.forward([(torch.arange(3, 303), st)])


def test_fused_prefill_scores_in_row_blocks(model, monkeypatch):
    """Indexer scores of a long chunk are computed in row blocks (bounded memory): same picks,
    logits and caches as one block."""
    import dsv4.tools.fast_prefill as P
    monkeypatch.setattr(P, "SCORE_BYTES", 2 * 40 * 7)          # blocks of 7 rows at 40 entries
    _compare_prefill(model, (170,), [[(0, 170)]], twins=True, seed=9)
