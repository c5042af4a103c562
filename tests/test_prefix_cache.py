"""Automatic prefix caching (``engine.prefix_cache``): block reference counts, LRU eviction and
snapshot bookkeeping; snapshots taken inside a prefill chunk, at its end and after a decode step
hold the bytes the sequence's own slot holds, and a restored snapshot continues bit-identically on
the tiny model (SWA, CSA and HCA layers); through the engine, hits give the greedy tokens and
log-probs of caching off (bit-identical where the uncached run's chunks end at the hit too, else
within test_engine's batching tolerance): a 1,024-token shared prefix, a shared prefix ending
inside a ratio-128 group, a hit on a running sequence, hits after preemption, ``n > 1``, prompt
logprobs on a cached prompt, and a hit on a boundary passed while decoding. Every engine test
checks the pool returns to its starting count of free blocks."""
from __future__ import annotations

import pytest
import torch
from test_engine import _agree, _alone, _free, _prompt

from dsv4 import LLM, SamplingParams
from dsv4.config import preset
from dsv4.engine.kv_cache import CacheConfig, KVCache
from dsv4.engine.prefix_cache import PrefixCache
from dsv4.engine.sampling_params import SamplingParams as SP
from dsv4.engine.sequence import Sequence
from dsv4.formats.kv_entry import page_views

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)


# ============================================================================ bookkeeping (no model)
def _seq(ids):
    return Sequence("r", 0, ids, SP(), 8, 1)


def _computed(pc: PrefixCache, seq: Sequence, hit=None):
    """What the scheduler and engine do for ``seq``: admit it with ``hit``, give it blocks for
    all its tokens, 'compute' them, commit the blocks and the snapshots its boundaries take."""
    cache = pc.cache
    pc.admit(seq, hit)
    start = hit.tokens if hit else 0
    seq.block_table = (list(hit.blocks) if hit else []) + cache.allocate_blocks(
        cache.blocks_needed(seq.num_tokens) - (len(hit.blocks) if hit else 0))
    caps = pc.plan_captures(seq, start, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    pc.commit(seq, caps)
    return caps


def test_blocks_are_shared_reference_counted_and_evicted_least_recently_used_tail_first():
    cache = KVCache(preset("tiny"), CacheConfig(max_num_seqs=2, num_blocks=4, num_snapshots=3))
    pc = PrefixCache(cache)
    a = _seq(_prompt(600, 1))
    caps = _computed(pc, a)
    assert [c.pos for c in caps] == [256, 512] and pc.num_cached_blocks == 2 and pc.num_snapshots_held == 2
    b = _seq(a.prompt_ids[:512] + _prompt(100, 2))
    hit = pc.match(b)
    assert hit.tokens == 512 and hit.blocks == a.block_table[:2]
    # the whole prompt cached leaves its last token to compute: a's own 600 tokens hit 512, not 768
    assert pc.match(_seq(a.prompt_ids)).tokens == 512
    # a prompt that parts from a's at token 511 shares only the first block
    assert pc.match(_seq(a.prompt_ids[:511] + [5] * 100)).tokens == 256
    assert _computed(pc, b, hit) == []                     # 512 has a snapshot; 768 > b's 612 tokens
    assert [cache._ref[x] for x in a.block_table] == [2, 2, 1]
    assert cache.num_free_blocks == 0
    cache.free_blocks(a.block_table)                       # a ends: its third block (uncached) is free
    assert cache.num_free_blocks == 1 and cache.num_cached_free_blocks == 0
    cache.free_blocks(b.block_table)
    assert cache.num_free_blocks == 4 and cache.num_cached_free_blocks == 2 and cache.usage() == 0.0
    # pressure: the empty blocks go first, then the cached ones, the prefix's second block before
    # its first; each eviction forgets its hash and the snapshot at its end
    got = cache.allocate_blocks(3)
    assert a.block_table[1] in got and a.block_table[0] not in got
    assert pc.match(b).tokens == 256 and pc.num_snapshots_held == 1
    cache.allocate_blocks(1)
    assert pc.match(b).tokens == 0 and pc.num_cached_blocks == 0 and pc.num_snapshots_held == 0
    cache.free_blocks(got)
    with pytest.raises(ValueError, match="neither in use nor cached"):
        cache.share_blocks([got[0]])                        # a free block holds no prefix
    with pytest.raises(ValueError, match="double free"):
        cache.free_blocks([got[0]])


def test_snapshots_segmented_lru_cancel_and_duplicate_prefixes():
    """A snapshot that gave a hit is protected: a long prompt's boundaries only recycle the
    probation segment. A failed step's planned snapshots come back; a duplicate computation of a
    cached prefix keeps the cached block and takes no second snapshot."""
    cache = KVCache(preset("tiny"), CacheConfig(max_num_seqs=2, num_blocks=40, num_snapshots=4))
    pc = PrefixCache(cache)
    system = _seq(_prompt(300, 3))
    _computed(pc, system)                                  # a snapshot at 256
    turn = _seq(system.prompt_ids[:256] + [7] * 20)
    hit = pc.match(turn)
    pc.admit(turn, hit)
    assert hit.tokens == 256 and list(pc.protected) == [hit.snapshot]
    for seed in (4, 5):                                    # 8 boundaries each through the 3 others
        caps = _computed(pc, _seq(_prompt(256 * 8 + 10, seed)))
        assert len(caps) == 3 and len(pc.probation) == 3
        assert pc.match(_seq(system.prompt_ids[:256] + [8])).tokens == 256
    planned = pc.plan_captures(_seq(_prompt(600, 6)), 0, 600)
    assert len(planned) == 2 and len(pc.probation) == 1
    pc.cancel(planned)
    assert sorted(pc.free_snaps) == sorted(c.snap for c in planned) and not pc._pending
    dup = _seq(list(system.prompt_ids))
    pc.admit(dup, None)                                    # no lookup (prompt logprobs)
    dup.block_table = cache.allocate_blocks(2)
    assert pc.plan_captures(dup, 0, 300) == []
    dup.num_computed = 300
    pc.commit(dup, [])
    assert pc.block_of[system.block_hashes[0]] == system.block_table[0] and dup.block_table[0] not in pc.hash_of


# ============================================================================ snapshots on the tiny model
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    import os
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def tiny(cache_dir):
    from dsv4.model.deepseek_v4 import DeepseekV4
    from dsv4.models import resolve_model
    return DeepseekV4.from_checkpoint(resolve_model(None))


def _snap_bytes(cache: KVCache, t: int):
    return [(lc.snap_window[2 * t:2 * t + 2].clone(), None if lc.snap_comp is None else lc.snap_comp[t].clone(),
             None if lc.snap_index is None else lc.snap_index[t].clone()) for lc in cache.layers]


def test_snapshots_hold_the_slot_s_state_and_continue_bit_identically(tiny):
    """A snapshot taken at a prefill chunk's end (pending rows half from the ring, half from the
    chunk) holds the bytes of the slot copy a decode step takes (``KVCache.capture``); one taken
    inside a chunk, the rows the slot still holds after it; a second sequence sharing the first
    block with the snapshot restored gives the first's logits, bit for bit, in every layer type."""
    from dsv4.engine.kv_cache import PagedSequenceState
    m = tiny
    assert {m.cfg.layer_ratio(i) for i in range(m.cfg.num_hidden_layers)} == {0, 4, 128}
    cache = KVCache(m.cfg, CacheConfig(max_num_seqs=4, num_blocks=8, num_snapshots=4))
    m.attach_cache(cache, 1024)
    ids = torch.tensor(_prompt(300, 7))

    def new(blocks):
        return PagedSequenceState(cache, cache.allocate_slot(), blocks)

    def run(st, a, b, snaps=()):
        logits = m(m.prefill_context([(ids[a:b], st)], snaps=[list(snaps)]))
        st.advance_to(b)
        return logits

    x = new(cache.allocate_blocks(2))
    run(x, 0, 254)
    run(x, 254, 256, [(256, 0)])                           # rows 252, 253 from the ring, 254, 255 the chunk
    cache.capture(x.slot, 1, 256)
    for s0, s1 in zip(_snap_bytes(cache, 0), _snap_bytes(cache, 1)):
        for u, v in zip(s0, s1):
            assert (u is None and v is None) or torch.equal(u, v)
    want = run(x, 256, 300)
    z = new([x.block_table[0]] + cache.allocate_blocks(1))
    cache.restore(0, z.slot, 256)
    z.advance_to(256)
    assert torch.equal(run(z, 256, 300), want)
    # a boundary inside a chunk: the window rows and pending rows the slot still holds after it
    y = new(cache.allocate_blocks(2))
    run(y, 0, 258, [(256, 2)])
    cache.capture(y.slot, 3, 256)                          # ring rows of positions 130..257: 130..255 agree
    for lc in cache.layers:
        d2, s2 = page_views(lc.snap_window[4:6], 64)
        d3, s3 = page_views(lc.snap_window[6:8], 64)
        assert torch.equal(d2.reshape(128, -1)[2:], d3.reshape(128, -1)[2:])
        assert torch.equal(s2.reshape(128, -1)[2:], s3.reshape(128, -1)[2:])
        if lc.ratio == 4:                                  # pending [252, 258): 252..255 in the ring
            assert torch.equal(lc.snap_comp[2], lc.snap_comp[3]) and torch.equal(lc.snap_index[2], lc.snap_index[3])


# ============================================================================ through the engine
@pytest.fixture(scope="module")
def on(cache_dir):
    return LLM(None, max_num_seqs=4, max_num_batched_tokens=512, max_model_len=2048, kv_cache_memory="64MiB",
               log=False)


@pytest.fixture(scope="module")
def off(cache_dir):
    return LLM(None, max_num_seqs=4, max_num_batched_tokens=512, max_model_len=2048, kv_cache_memory="64MiB",
               log=False, enable_prefix_caching=False)


def _gen(llm, ids, sp=GREEDY):
    return llm.generate([{"prompt_token_ids": ids}], sp)[0]


def _same(a, b):
    """Bit-identical greedy runs: the tokens and every log-prob."""
    x, y = a.outputs[0], b.outputs[0]
    assert x.token_ids == y.token_ids
    assert [d[t].logprob for d, t in zip(x.logprobs, x.token_ids)] == \
        [d[t].logprob for d, t in zip(y.logprobs, y.token_ids)]


PREFIX = _prompt(1024, 100)


def test_a_shared_1024_token_prefix_is_reused_and_gives_caching_off_s_output(on, off):
    """The acceptance case: the second of two requests sharing 1,024 tokens reads them from the
    cache (CSA, HCA and SWA layers alike) and gives caching off's greedy tokens and log-probs,
    bit for bit (both runs' chunks end at 1,024); a prefix ending inside a ratio-128 group
    (300 tokens: the hit stops at the block boundary 256, captured inside a prefill chunk) gives
    them within the batching tolerance."""
    eng = on.engine
    start = _free(eng.cache)
    first = _gen(on, PREFIX + _prompt(40, 101))
    assert first.num_cached_tokens == 0
    q0, h0 = eng.stats["prefix_cache_queries"], eng.stats["prefix_cache_hits"]
    ids = PREFIX + _prompt(30, 102)
    second = _gen(on, ids)
    assert second.num_cached_tokens == 1024
    assert eng.stats["prefix_cache_queries"] - q0 == len(ids) and eng.stats["prefix_cache_hits"] - h0 == 1024
    _same(second, _gen(off, ids))
    inside = PREFIX[:300] + _prompt(50, 103)
    got = _gen(on, inside)
    assert got.num_cached_tokens == 256
    _agree(got.outputs[0], _gen(off, inside).outputs[0])
    assert _free(eng.cache) == start and eng.cache.num_cached_free_blocks >= 4


def test_a_hit_on_a_running_sequence_and_n_samples_share_the_prompt(on):
    """A request reuses the prefix of one still decoding (the blocks are then held twice, and an
    abort of a third sharer gives its reference back), and gives that sequence's own tokens; the
    samples of an n = 2 request wait for sample 0's prompt and reuse it: both give sample 0's
    greedy tokens, bit for bit."""
    eng = on.engine
    start = _free(eng.cache)
    ids = _prompt(300, 104)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    eng.add_request("a", {"prompt_token_ids": ids}, sp)
    while not eng.scheduler.running or eng.scheduler.running[0].num_computed < len(ids):
        eng.step()
    a = eng.scheduler.running[0]
    eng.add_request("b", {"prompt_token_ids": ids}, sp)
    eng.add_request("c", {"prompt_token_ids": ids}, sp)
    done = {o.request_id: o for o in eng.step() if o.finished}
    b = next(s for s in eng.scheduler.running if s.request_id == "b")
    assert not a.is_finished and b.num_cached_tokens == 256 and b.block_table[0] == a.block_table[0]
    assert eng.cache._ref[a.block_table[0]] == 3
    eng.abort_request("c")
    assert eng.cache._ref[a.block_table[0]] == 2
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    _same(done["a"], done["b"])
    h0 = eng.stats["prefix_cache_hits"]
    two = on.generate([{"prompt_token_ids": _prompt(300, 105)}],
                      SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))[0]
    assert eng.stats["prefix_cache_hits"] - h0 == 256 and two.num_cached_tokens == 0
    x, y = two.outputs
    assert x.token_ids == y.token_ids and [d[t].logprob for d, t in zip(x.logprobs, x.token_ids)] == \
        [d[t].logprob for d, t in zip(y.logprobs, y.token_ids)]
    assert _free(eng.cache) == start


def test_prompt_logprobs_of_a_cached_prompt_are_computed(on):
    """A request asking for prompt logprobs does not read the cache: every prompt token of a
    cached prompt is scored again, to the same values (their closeness to the oracle is
    test_engine's); its blocks are cached for the others all the same."""
    ids = _prompt(260, 106)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    first = _gen(on, ids, sp)
    again = _gen(on, ids, sp)
    assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == len(ids) and again.prompt_logprobs[0] is None
    assert [d[t].logprob for d, t in zip(again.prompt_logprobs[1:], ids[1:])] == \
        [d[t].logprob for d, t in zip(first.prompt_logprobs[1:], ids[1:])]
    assert _gen(on, ids).num_cached_tokens == 256


def test_a_boundary_passed_while_decoding_is_a_hit_for_the_next_turn(on, off):
    """Multi-turn: the next prompt extends prompt + output; the block completed by a decode step
    is snapshotted after that step and reused."""
    first = _gen(on, _prompt(250, 107), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    turn = first.prompt_token_ids + first.outputs[0].token_ids + _prompt(20, 108)
    got = _gen(on, turn)
    assert got.num_cached_tokens == 256
    _agree(got.outputs[0], _gen(off, turn).outputs[0])


def test_hits_after_preemption_and_the_pool_drains(off):
    """Three requests sharing a 256-token prefix in 6 blocks: the later ones reuse the prefix;
    crossing 512 while decoding they need 7 blocks, so one is preempted, and re-admitted it finds
    its own blocks and the snapshot its decode took at 512. The outputs of the two that read the
    cache are caching off's (each alone), and the pool returns to its starting free count."""
    small = LLM(None, max_num_seqs=3, max_num_batched_tokens=256, max_model_len=1024, num_kv_blocks=6, log=False)
    eng = small.engine
    start = _free(eng.cache)
    prompts = [PREFIX[:256] + _prompt(250, 110 + i) for i in range(3)]
    outs = small.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2))
    assert eng.scheduler.num_preemptions > 0
    assert [o.num_cached_tokens for o in outs] == [0, 256, 256]
    assert eng.stats["prefix_cache_hits"] >= 2 * 256 + 512          # and a re-admission hit 512
    assert _free(eng.cache) == start
    for p, o in zip(prompts[1:], outs[1:]):
        _agree(o.outputs[0], _alone(off, p, 10))


@pytest.mark.gpu
@pytest.mark.parametrize("synthetic", [None, "flash"])
def test_hits_on_the_kernels_give_caching_off_s_greedy_tokens(tmp_path, monkeypatch, synthetic):
    """The same cases on the GPU kernels (decode in CUDA graphs, the decode step's snapshot taken
    after the graph replay), on the tiny model and on 4 layers of synthetic V4-Flash (real shapes,
    random weights: SWA, CSA and HCA layers): a 1,024-token hit gives caching off's tokens and
    log-probs (both runs' last chunk is the same); a hit at 768 captured inside a prefill chunk and
    a hit on a boundary passed while decoding give its greedy tokens wherever its top-1 margin is
    clear, within test_engine's batching tolerance (the chunk boundaries differ from caching off's:
    last bits move)."""
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path))
    kw = dict(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=2048, kv_cache_memory="2GiB", device="cuda",
              log=False, synthetic=synthetic, synthetic_layers=4, synthetic_experts=16)
    on, off = LLM(None, **kw), LLM(None, enable_prefix_caching=False, **kw)
    assert on.engine.model.ops.kernels and on.engine.runner.graphs is not None
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    first = _gen(on, _prompt(250, 1), sp)                          # crosses 256 while decoding
    cases = [PREFIX + _prompt(30, 2), PREFIX[:1000] + _prompt(40, 3),
             first.prompt_token_ids + first.outputs[0].token_ids + _prompt(20, 4)]
    _gen(on, PREFIX + _prompt(40, 5), sp)
    got = [_gen(on, ids, sp) for ids in cases]
    assert [g.num_cached_tokens for g in got] == [1024, 768, 256]
    want = [_gen(off, ids, sp) for ids in cases]
    x, y = got[0].outputs[0], want[0].outputs[0]
    assert x.token_ids == y.token_ids
    assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for a, b, t in zip(x.logprobs, y.logprobs, x.token_ids))
    for g, w in zip(got[1:], want[1:]):
        _agree(g.outputs[0], w.outputs[0])
    assert _free(on.engine.cache) == (on.engine.seq_blocks, on.engine.cfg.max_num_seqs)
