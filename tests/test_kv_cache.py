"""Paged, quantised KV cache: the reference model on PagedSequenceState gives bit-identical
logits to its in-memory state; stored entries read back bit-exactly; allocation and sizing."""
from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint.tiny import build_tiny_tensors
from dsv4.config import preset
from dsv4.engine.kv_cache import CacheConfig, KVCache, KVCacheError, PagedSequenceState
from dsv4.formats.fp4 import fp4_qdq
from dsv4.formats.fp8 import fp8_qdq
from dsv4.formats.index_key import (
    decode_index_keys,
    encode_index_keys,
    index_page_bytes,
    read_index_entries,
    read_index_keys,
    write_index_entries,
    write_index_keys,
)
from dsv4.formats.kv_entry import page_bytes, read_entries, read_kv_entries, write_entries, write_kv_entries
from dsv4.formats.paging import BLOCK_TOKENS, INDEX_PAGE, block_table_tensor, blocks_needed
from dsv4.reference.model import ReferenceModel

EXACT = dict(rtol=0, atol=0)


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny")
    return ReferenceModel(cfg, build_tiny_tensors(cfg, 0), numerics="invariant")


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128000, (n,), generator=g)


def _grow(cache: KVCache, ps: PagedSequenceState, n_new: int) -> None:
    """What the engine does before a step: extend the block table to cover pos + n_new."""
    ps.block_table.extend(cache.allocate_blocks(ps.blocks_missing(n_new)))


def _step(model, cache, pairs, all_logits=False):
    """One forward of [(ids, paged_state)]: grow the block tables first."""
    for ids, ps in pairs:
        _grow(cache, ps, ids.numel())
    return model.forward(pairs, all_logits=all_logits)


def _new_paged(cache: KVCache) -> PagedSequenceState:
    return PagedSequenceState(cache, cache.allocate_slot(), [])


# ---------------------------------------------------------------------------------------------
# 1. bit-identical logits
@pytest.fixture(scope="module")
def long_run(model):
    """300 tokens (crosses the 256-token block boundary): prefill of 296, then 4 decodes, on the
    in-memory state and on a paged state (slot 1, blocks handed out out of order)."""
    cfg = model.cfg
    cache = KVCache(cfg, CacheConfig(max_num_seqs=3, num_blocks=6))
    cache.allocate_slot()                                          # slot 0 stays busy
    held = cache.allocate_blocks(3)
    cache.free_blocks([held[1]])                                   # the sequence gets blocks 1, 3
    ids = _ids(300, 1)
    st, ps = model.new_state(), _new_paged(cache)
    ref = [model.forward([(ids[:296], st)], all_logits=True)[0]]
    got = [_step(model, cache, [(ids[:296], ps)], all_logits=True)[0]]
    for i in range(296, 300):
        ref.append(model.forward([(ids[i:i + 1], st)])[0])
        got.append(_step(model, cache, [(ids[i:i + 1], ps)])[0])
    return dict(cache=cache, ids=ids, st=st, ps=ps, ref=ref, got=got, held=held)


def test_prefill_and_decode_bit_identical(long_run):
    r = long_run
    assert r["ps"].pos == r["st"].pos == 300
    assert r["ps"].block_table == [1, 3]
    assert r["ps"].slot == 1
    for a, b in zip(r["got"], r["ref"]):
        torch.testing.assert_close(a, b, **EXACT)


def test_chunked_prefill_bit_identical(model, long_run):
    cache = long_run["cache"]
    ids = long_run["ids"]
    st, ps = model.new_state(), _new_paged(cache)
    free0 = cache.num_free_blocks
    for s in range(0, 300, 37):                                    # chunk 222..258 crosses the block boundary
        a = model.forward([(ids[s:s + 37], st)], all_logits=True)[0]
        b = _step(model, cache, [(ids[s:s + 37], ps)], all_logits=True)[0]
        torch.testing.assert_close(b, a, **EXACT)
    assert len(ps.block_table) == 2 and cache.num_free_blocks == free0 - 2
    # the chunked path also equals the one-shot prefill + decodes of the first fixture
    torch.testing.assert_close(b[-1], long_run["ref"][-1], **EXACT)
    ps.release()
    assert cache.num_free_blocks == free0


def test_batch_of_three_bit_identical(model):
    cfg = model.cfg
    cache = KVCache(cfg, CacheConfig(max_num_seqs=4, num_blocks=6))
    lens = [270, 150, 3]
    seqs = [_ids(n + 3, 10 + i) for i, n in enumerate(lens)]
    sts = [model.new_state() for _ in seqs]
    cache.allocate_slot()
    pss = [_new_paged(cache) for _ in seqs]
    # interleaved block tables: hand out one block per sequence in turn
    for k in range(2):
        for ids, ps, n in zip(seqs, pss, lens):
            if ps.blocks_missing(n) > 0:
                ps.block_table.extend(cache.allocate_blocks(1))
    assert pss[0].block_table == [0, 3] and pss[1].block_table == [1] and pss[2].block_table == [2]
    ref = model.forward([(s[:n], st) for s, n, st in zip(seqs, lens, sts)], all_logits=True)
    got = _step(model, cache, [(s[:n], ps) for s, n, ps in zip(seqs, lens, pss)], all_logits=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **EXACT)
    for k in range(3):                                             # seq 2 completes its first CSA entry
        ref = model.forward([(s[n + k:n + k + 1], st) for s, n, st in zip(seqs, lens, sts)])
        got = _step(model, cache, [(s[n + k:n + k + 1], ps) for s, n, ps in zip(seqs, lens, pss)])
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **EXACT)
    assert [ps.pos for ps in pss] == [273, 153, 6]
    bt = block_table_tensor([ps.block_table for ps in pss])
    assert bt.dtype == torch.int32 and bt.tolist() == [[0, 3], [1, -1], [2, -1]]


# ---------------------------------------------------------------------------------------------
# 2. stored values read back bit-exactly
def test_read_back_equals_reference_state(model, long_run):
    cache, st, ps = long_run["cache"], long_run["st"], long_run["ps"]
    slot, bt, p = ps.slot, ps.block_table, 300
    cfg = model.cfg
    seen = set()
    for i, (ref, pg) in enumerate(zip(st.layers, ps.layers)):
        lc = cache.layers[i]
        # window: through the interface and straight from the pool (slot*128 + q % 128)
        w_ref = ref.read_window(p)
        assert w_ref.dtype == torch.bfloat16 and w_ref.shape == (128, 512)
        torch.testing.assert_close(pg.read_window(p), w_ref, **EXACT)
        raw = read_kv_entries(lc.window, slot * 128 + torch.arange(p - 128, p) % 128, 64)
        torch.testing.assert_close(raw, w_ref, **EXACT)
        torch.testing.assert_close(w_ref[:, :448], fp8_qdq(w_ref[:, :448], 64), **EXACT)  # really QDQ'd
        r = cfg.layer_ratio(i)
        seen.add(r)
        if r == 0:
            assert pg.compressor is None and pg.indexer is None
            continue
        for kind in ("compressor", "indexer") if r == 4 else ("compressor",):
            c_ref, c_pg = getattr(ref, kind), getattr(pg, kind)
            E = p // r
            assert c_pg.num_entries == c_ref.num_entries == E
            e_ref = c_ref.entries()
            torch.testing.assert_close(c_pg.entries(), e_ref, **EXACT)
            assert e_ref.abs().amax() > 0
            # raw pages: entry j in block bt[j*r // 256] at offset j % (256 // r)
            per = BLOCK_TOKENS // r
            j = torch.arange(E)
            slots = torch.tensor(bt)[j // per] * per + j % per
            if kind == "indexer":
                torch.testing.assert_close(read_index_entries(lc.index_keys, slots, 64), e_ref, **EXACT)
                torch.testing.assert_close(fp4_qdq(e_ref, 32), e_ref, **EXACT)
            else:
                torch.testing.assert_close(read_kv_entries(lc.entries, slots, per), e_ref, **EXACT)
            # pending rows: ratio 4 keeps the last complete window (4 rows), ratio 128 the tail
            k_ref, s_ref, start_ref = c_ref.pending(p)
            k_pg, s_pg, start_pg = c_pg.pending(p)
            assert start_pg == start_ref == (296 if r == 4 else 256)
            assert k_pg.dtype == torch.float32
            torch.testing.assert_close(k_pg, k_ref, **EXACT)
            torch.testing.assert_close(s_pg, s_ref, **EXACT)
            ring = (lc.index_state if kind == "indexer" else lc.comp_state)[slot]
            rows = ring[torch.arange(start_ref, p) % ring.shape[0]]
            torch.testing.assert_close(rows, torch.cat([k_ref, s_ref], 1), **EXACT)
    assert seen == {0, 4, 128}


def test_mxfp4_index_codec():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 128, generator=g) * 3).to(torch.bfloat16)
    packed, scales = encode_index_keys(x)
    assert packed.shape == (64, 64) and scales.shape == (64, 4) and packed.dtype == scales.dtype == torch.uint8
    # the codec is fp4_qdq: lossless on already-QDQ'd values
    q = fp4_qdq(x, 32)
    torch.testing.assert_close(decode_index_keys(packed, scales), q, **EXACT)
    torch.testing.assert_close(decode_index_keys(*encode_index_keys(q)), q, **EXACT)
    # a block whose largest code is 3 (< 4) re-encodes with half the scale, same decoded values
    blk = torch.tensor([3.0, -1.5, 0.5, 0.0] * 8) * 2.0 ** -3         # codes x scale 2^-3
    y = torch.cat([blk, torch.tensor([6.0, 1.0] * 16) * 2.0 ** -3] + [blk] * 2).view(1, 128).to(torch.bfloat16)
    torch.testing.assert_close(fp4_qdq(y, 32), y, **EXACT)
    p2, s2 = encode_index_keys(y)
    assert s2[0].tolist() == [127 - 4, 127 - 3, 127 - 4, 127 - 4]
    torch.testing.assert_close(decode_index_keys(p2, s2), y, **EXACT)


def test_sync_free_page_access_matches_the_checked_form():
    """write_index_keys / read_index_keys and write_entries / read_entries (no host syncs) store the
    same bytes and read the same rows as the checked write/read_*_entries."""
    g = torch.Generator().manual_seed(1)
    n_pages = 3
    keys = (torch.randn(40, 128, generator=g) * 3).to(torch.bfloat16)
    slots = torch.randperm(n_pages * INDEX_PAGE, generator=g)[:40]
    a = torch.zeros(n_pages, index_page_bytes(INDEX_PAGE, 128), dtype=torch.uint8)
    b = torch.zeros_like(a)
    write_index_entries(a, slots, keys, INDEX_PAGE)
    write_index_keys(b, slots, keys)
    assert torch.equal(a, b)
    ids = torch.cat([slots[:7], torch.tensor([-1])]).view(2, 4)
    got = read_index_keys(b, ids)
    assert got.shape == (2, 4, 128)
    torch.testing.assert_close(got.view(8, 128)[:7], read_index_entries(a, slots[:7], INDEX_PAGE, 128), **EXACT)
    kv = (torch.randn(20, 512, generator=g) * 2).to(torch.bfloat16)
    es = torch.randperm(2 * 64, generator=g)[:20]
    pa = torch.zeros(2, page_bytes(64), dtype=torch.uint8)
    pb = torch.zeros_like(pa)
    write_kv_entries(pa, es, kv, 64)
    write_entries(pb, es, kv, 64)
    assert torch.equal(pa, pb)
    ids = torch.cat([es[:5], torch.tensor([-1])]).view(3, 2)
    rows = read_entries(pb, ids, 64)
    assert rows.shape == (3, 2, 512)
    torch.testing.assert_close(rows.view(6, 512), read_kv_entries(pa, ids.reshape(-1), 64), **EXACT)


# ---------------------------------------------------------------------------------------------
# 3. allocation and sizing
TINY_BLOCK = 2 * (page_bytes(64) + 64 * 68) + 2 * page_bytes(2)            # 2 CSA + 2 HCA layers
TINY_SLOT = (6 * 2 * page_bytes(64)                                        # 6 window rings
             + 2 * (8 * 2 * 1024 * 4 + 8 * 2 * 256 * 4)                    # CSA: main + indexer state
             + 2 * (128 * 2 * 512 * 4))                                     # HCA state


def test_sizes_from_memory_budget():
    cfg = preset("tiny")
    assert (TINY_BLOCK, TINY_SLOT) == (87040, 1661696)
    cache = KVCache(cfg, CacheConfig(max_num_seqs=3, memory_bytes=3 * TINY_SLOT + 5 * TINY_BLOCK + 999))
    assert (cache.bytes_per_block, cache.bytes_per_slot) == (TINY_BLOCK, TINY_SLOT)
    assert cache.num_blocks == 5 and cache.capacity_tokens == 5 * 256
    pools = [t for lc in cache.layers for t in (lc.window, lc.entries, lc.index_keys, lc.comp_state, lc.index_state)
             if t is not None]
    assert sum(t.nbytes for t in pools) == cache.total_bytes == 3 * TINY_SLOT + 5 * TINY_BLOCK
    line = cache.describe()
    assert "\n" not in line and "5 blocks" in line and "1280 tokens" in line and "GiB" in line
    with pytest.raises(ValueError, match="memory_bytes"):
        KVCache(cfg, CacheConfig(max_num_seqs=3, memory_bytes=3 * TINY_SLOT + TINY_BLOCK - 1))
    with pytest.raises(ValueError, match="memory_bytes"):
        KVCache(cfg, CacheConfig(max_num_seqs=3, memory_bytes=TINY_SLOT))
    with pytest.raises(ValueError, match="memory_bytes"):
        KVCache(cfg, CacheConfig(max_num_seqs=1, num_blocks=10, memory_bytes=TINY_SLOT + 9 * TINY_BLOCK))
    with pytest.raises(ValueError, match="num_blocks or memory_bytes"):
        KVCache(cfg, CacheConfig(max_num_seqs=1))
    with pytest.raises(ValueError, match="max_num_seqs"):
        KVCache(cfg, CacheConfig(max_num_seqs=0, num_blocks=1))


def test_window_only_model_sizes_blocks_without_dividing_by_zero():
    """Only sliding-window layers (the first two of Flash): a block holds no bytes, so the budget
    pays for slots alone and every slot can reach the full model length."""
    cfg = preset("tiny", num_hidden_layers=2, compress_ratios=(0, 0, 0))
    slot = KVCache(cfg, CacheConfig(max_num_seqs=1, num_blocks=1)).bytes_per_slot
    cache = KVCache(cfg, CacheConfig(max_num_seqs=2, memory_bytes=2 * slot))
    assert cache.bytes_per_block == 0
    assert cache.num_blocks == 2 * -(-cfg.max_position_embeddings // BLOCK_TOKENS)
    with pytest.raises(ValueError, match="memory_bytes"):
        KVCache(cfg, CacheConfig(max_num_seqs=2, memory_bytes=2 * slot - 1))


def test_allocation_accounting():
    cache = KVCache(preset("tiny"), CacheConfig(max_num_seqs=2, num_blocks=4))
    assert blocks_needed(0) == 0 and blocks_needed(1) == 1 and blocks_needed(256) == 1 and blocks_needed(257) == 2
    assert cache.blocks_needed(513) == 3
    assert (cache.num_free_blocks, cache.num_free_slots, cache.usage()) == (4, 2, 0.0)
    a = cache.allocate_blocks(3)
    assert sorted(a) == [0, 1, 2] and cache.num_free_blocks == 1 and cache.usage() == 0.75
    assert cache.can_allocate(1) and not cache.can_allocate(2)
    with pytest.raises(KVCacheError, match="out of KV blocks"):
        cache.allocate_blocks(2)
    assert cache.num_free_blocks == 1                                   # a failed allocation takes nothing
    s0, s1 = cache.allocate_slot(), cache.allocate_slot()
    assert {s0, s1} == {0, 1} and cache.num_free_slots == 0
    with pytest.raises(KVCacheError, match="slot"):
        cache.allocate_slot()
    cache.free_blocks(a[:2])
    with pytest.raises(ValueError, match="double free"):
        cache.free_blocks([a[2], a[0]])                                 # nothing freed on error
    assert cache.num_free_blocks == 3
    with pytest.raises(ValueError, match="repeated"):
        cache.free_blocks([a[2], a[2]])
    cache.free_blocks([a[2]])
    cache.free_slot(s0)
    with pytest.raises(ValueError, match="double free"):
        cache.free_slot(s0)
    cache.free_slot(s1)
    assert (cache.num_free_blocks, cache.num_free_slots, cache.usage()) == (4, 2, 0.0)


def test_block_table_must_cover_the_step(model):
    cache = KVCache(model.cfg, CacheConfig(max_num_seqs=1, num_blocks=2))
    ps = _new_paged(cache)
    assert ps.mtp is None and ps.blocks_missing(5) == 1
    with pytest.raises(KVCacheError, match="block table"):
        model.forward([(_ids(5, 3), ps)])
    ps2 = PagedSequenceState(cache, ps.slot, [1])                       # block 1 is not allocated
    with pytest.raises(KVCacheError, match="not an allocated block"):
        model.forward([(_ids(8, 3), ps2)])


# ---------------------------------------------------------------------------------------------
# 4. slot reuse leaks no state
def test_slot_reuse_no_stale_state(model):
    cfg = model.cfg
    cache = KVCache(cfg, CacheConfig(max_num_seqs=1, num_blocks=2))    # forces slot 0 and block reuse
    first = _new_paged(cache)
    long_ids = _ids(300, 5)
    _step(model, cache, [(long_ids[:298], first)])
    for i in (298, 299):
        _step(model, cache, [(long_ids[i:i + 1], first)])
    first.release()
    assert cache.num_free_blocks == 2 and cache.num_free_slots == 1

    def run(make_state, ids, pre):
        st = make_state()
        out = [model.forward([(ids[:pre], st)], all_logits=True)[0]]
        for i in range(pre, ids.numel()):
            out.append(model.forward([(ids[i:i + 1], st)])[0])
        return st, out

    for ids, pre in ((_ids(6, 6), 3), (_ids(140, 7), 130)):            # < 4 prompt tokens; < 128 + decodes
        def reused():
            ps = _new_paged(cache)
            ps.block_table.extend(cache.allocate_blocks(blocks_needed(ids.numel())))
            return ps
        fresh_cache = KVCache(cfg, CacheConfig(max_num_seqs=1, num_blocks=2))

        def fresh():
            ps = _new_paged(fresh_cache)
            ps.block_table.extend(fresh_cache.allocate_blocks(blocks_needed(ids.numel())))
            return ps
        ps, got = run(reused, ids, pre)
        assert ps.slot == 0 and ps.block_table[0] in (0, 1)
        _, want = run(fresh, ids, pre)
        _, mem = run(model.new_state, ids, pre)
        for a, b, c in zip(got, want, mem):
            torch.testing.assert_close(a, b, **EXACT)
            torch.testing.assert_close(a, c, **EXACT)
        ps.release()
