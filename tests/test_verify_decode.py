"""The speculative verify step through the decode path (``DecodeContext`` with ``rows`` = K + 1,
``layers.attention.Attention._decode``) against the same chunk through the prefill path.

Sequences stand where a verify chunk's rows cross what the per-slot rings do at a row boundary:
at 126 (an HCA and a CSA entry complete at row 1, the 128-token window wraps at row 2, the
8-row CSA rings wrap), at 255 (entries complete at row 0, the window wraps at row 1) and at 10 (a
CSA entry completes at row 1, the window is not yet full). Three sequences at these positions
verify as one decode forward, against each one's prefill-path verify:

* logits: the engine's batching tolerance (tests/test_engine.py ``_agree``: the same top-1 wherever
  the prefill's leads by ``MARGIN`` nats, its log-prob within ``LP_TOL``): the two paths round
  differently in the last bits (the attention over 1 vs R rows) and the tiny random model
  amplifies that;
* the cache: with every layer's input forced to the prefill path's (``Trace.force`` on the
  layers' outputs), the window ring, the compressor rings, the compressed entries and the indexer
  keys of each sequence are bit for bit what the prefill path leaves, and each layer's attention
  output is within ``ATTN_TOL`` of the prefill's.
"""
from __future__ import annotations

import os

import pytest
import torch

from dsv4 import LLM
from dsv4.engine.kv_cache import PagedSequenceState

MARGIN = 2.0
LP_TOL = 1.0
# relative L2 distance of a layer's attention output from the prefill path's, on the same input:
# the twins round q's head norm (bf16) by where a row sits in the batch (one group of B rows here,
# R * B rows there), and a q ulp moves the softmax by ~1 % (measured: 0 at R = 2, <= 2.5 % at R = 4)
ATTN_TOL = 0.05
POSITIONS = (126, 255, 10)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128000, (n,), generator=g).tolist()


def _agree_rows(got: torch.Tensor, want: torch.Tensor) -> None:
    """Row by row the engine's batching tolerance (module doc) on fp32 logits [n, V]."""
    lg, lw = torch.log_softmax(got.float(), -1), torch.log_softmax(want.float(), -1)
    for j in range(want.shape[0]):
        top = lw[j].topk(2)
        a, b = int(lg[j].argmax()), int(top.indices[0])
        margin = float(top.values[0] - top.values[1])
        assert a == b or margin < MARGIN, f"row {j}: top-1 {a} != {b} at a margin of {margin:.3f}"
        assert abs(float(lg[j, b] - lw[j, b])) < LP_TOL, j


def _slot_state(cache, st) -> list[torch.Tensor]:
    """Everything of the cache the sequence owns: its window pages and compressor rings, and the
    compressed entries and indexer keys of its blocks."""
    out = []
    for lc in cache.layers:
        out.append(lc.window[2 * st.slot:2 * st.slot + 2].clone())
        out += [t[st.slot].clone() for t in (lc.comp_state, lc.index_state) if t is not None]
        out += [t[st.block_table].clone() for t in (lc.entries, lc.index_keys) if t is not None]
    return out


def _put_state(cache, st, state) -> None:
    it = iter(state)
    for lc in cache.layers:
        lc.window[2 * st.slot:2 * st.slot + 2] = next(it)
        for t in (lc.comp_state, lc.index_state):
            if t is not None:
                t[st.slot] = next(it)
        for t in (lc.entries, lc.index_keys):
            if t is not None:
                t[st.block_table] = next(it)


@pytest.fixture(scope="module")
def verify_env(tmp_path_factory):
    """The tiny model (6 layers: window, window, CSA, HCA, CSA, HCA) with three sequences prefilled
    to ``POSITIONS``, their cache state, and the tokens that follow."""
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    llm = LLM(None, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, kv_cache_memory="64MiB", log=False)
    eng = llm.engine
    toks = [_prompt(p + 8, 40 + i) for i, p in enumerate(POSITIONS)]
    sts = []
    for p, t in zip(POSITIONS, toks):
        st = PagedSequenceState(eng.cache, eng.cache.allocate_slot(), eng.cache.allocate_blocks(2))
        eng.runner.forward([(torch.tensor(t[:p]), st)])
        sts.append(st)
    base = [_slot_state(eng.cache, st) for st in sts]
    yield eng, sts, toks, base
    for st in sts:
        st.release()


def _prefill_verify(eng, st, ids):
    """The chunk through the prefill path alone: (logits [R, V], traces, cache state after)."""
    m = eng.model
    ctx = m.prefill_context([(ids, st)], all_logits=True)
    ctx.trace.trace = {}
    logits = m(ctx)
    return logits, ctx.trace.trace, _slot_state(eng.cache, st)


@pytest.mark.parametrize("R", [2, 4])
def test_multi_row_decode_verify_matches_the_prefill_verify(verify_env, R):
    eng, sts, toks, base = verify_env
    m = eng.model
    B = len(sts)
    ids = [torch.tensor(t[p:p + R]) for p, t in zip(POSITIONS, toks)]
    want = []
    for st, x, s in zip(sts, ids, base):
        want.append(_prefill_verify(eng, st, x))
        _put_state(eng.cache, st, s)
    bt = torch.full((B, m.max_blocks), -1, dtype=torch.long)
    for b, st in enumerate(sts):
        bt[b, :len(st.block_table)] = torch.tensor(st.block_table)
    jmajor = torch.stack(ids, 1).reshape(R * B)
    args = (jmajor, torch.tensor(POSITIONS), torch.tensor([st.slot for st in sts]), bt, R)

    ctx = m.decode_context(*args)
    ctx.keep_hidden = True
    logits = m(ctx).view(R, B, -1)
    assert ctx.hidden.shape == (R * B, m.cfg.hc_mult, m.cfg.hidden_size)
    for b in range(B):
        _agree_rows(logits[:, b], want[b][0])
        _put_state(eng.cache, sts[b], base[b])

    # every layer fed the prefill path's input: the cache writes are the prefill path's, bit for bit
    ctx = m.decode_context(*args)
    ctx.trace.trace = {}
    ctx.trace.force = {k: torch.stack([w[1][k] for w in want], 1).reshape(R * B, *v.shape[1:])
                       for k, v in want[0][1].items() if k.endswith(".hc_post")}
    m(ctx)
    for b, st in enumerate(sts):
        got = _slot_state(eng.cache, st)
        for i, (x, y) in enumerate(zip(got, want[b][2])):
            assert torch.equal(x, y), (POSITIONS[b], R, i)
        for L in range(m.cfg.num_hidden_layers):
            a = ctx.trace.trace[f"L{L}.attn"].view(R, B, -1)[:, b].float()
            w = want[b][1][f"L{L}.attn"].float().view(R, -1)
            assert float((a - w).norm() / w.norm()) < ATTN_TOL, (POSITIONS[b], R, L)
        _put_state(eng.cache, st, base[b])


def test_the_runner_verifies_as_decode_rows_grouped_by_length(verify_env, monkeypatch):
    """Batched (``per_sequence`` off, as on the kernels): verify chunks of two lengths and a plain
    decode token run as one decode forward per length, no prefill; each chunk's logits of every row
    and its final streams in its own row order, against the chunk run alone on the prefill path."""
    eng, sts, toks, base = verify_env
    run = eng.runner
    lens = (4, 2, 1)
    chunks = [(torch.tensor(t[p:p + n]), st) for p, t, st, n in zip(POSITIONS, toks, sts, lens)]
    all_rows, keep = {0, 1}, {0, 1, 2}
    want = []
    run.verify_path = "prefill"
    try:
        for i, c in enumerate(chunks):
            lg = run.forward([c], all_rows={0} if i in all_rows else set(), keep={0})[0]
            want.append((lg, run.hidden[0].float()))
            _put_state(eng.cache, sts[i], base[i])
            sts[i].advance_to(POSITIONS[i])
    finally:
        run.verify_path = "decode"
    seen = []
    m = eng.model
    forward = type(m).forward
    monkeypatch.setattr(type(m), "forward", lambda self, ctx: (seen.append((ctx.decode, getattr(ctx, "rows", 0))),
                                                              forward(self, ctx))[1])
    monkeypatch.setattr(run, "per_sequence", False)
    got = run.forward(chunks, all_rows=all_rows, keep=keep)
    assert sorted(seen) == [(True, 1), (True, 2), (True, 4)]
    pool = [(j, r, w[1][r]) for j, w in enumerate(want) for r in range(w[1].shape[0])]
    for i, ((lg, h), n) in enumerate(zip(want, lens)):
        assert sts[i].pos == POSITIONS[i] + n
        assert got[i].shape == lg.shape and run.hidden[i].shape == h.shape == (n, m.cfg.hc_mult, m.cfg.hidden_size)
        _agree_rows(got[i].view(-1, lg.shape[-1]), lg.view(-1, lg.shape[-1]))
        # each row's streams are its own (the chunk's rows in position order), not another row's
        for r in range(n):
            near = min(pool, key=lambda x: float((run.hidden[i][r].float() - x[2]).norm()))
            assert near[:2] == (i, r), (i, r, near[:2])
    for st, s, p in zip(sts, base, POSITIONS):
        _put_state(eng.cache, st, s)
        st.advance_to(p)


@pytest.mark.gpu
def test_gpu_graph_replayed_verify_equals_eager_and_the_prefill_verify(tmp_path):
    """On the kernels, an engine with MTP K = 3 (graphs of 1 and 4 rows per sequence): the verify
    chunks of the three sequences replayed from the (bucket 4, 4 rows) graph give the eager decode
    forward's logits, streams and cache writes bit for bit (the same kernels on the same shapes:
    the graph's padded layout; every split reduction has a fixed order), and the prefill-path
    verify's logits within the batching tolerance; 2-row chunks (no graph) run eagerly on the
    decode path, within the same tolerance."""
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path))
    llm = LLM(None, max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024, kv_cache_memory="2GiB",
              device="cuda", log=False, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    eng = llm.engine
    run, m, cache = eng.runner, eng.model, eng.cache
    assert m.ops.kernels and run.graphs is not None and run.graphs.rows == [1, 4]
    toks = [_prompt(p + 8, 40 + i) for i, p in enumerate(POSITIONS)]
    sts = []
    for p, t in zip(POSITIONS, toks):
        st = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(2))
        run.forward([(torch.tensor(t[:p]), st)])
        sts.append(st)
    base = [_slot_state(cache, st) for st in sts]
    every = set(range(len(sts)))

    def verify(R, path="decode"):
        """(logits per chunk, streams per chunk, cache state per sequence); the cache put back."""
        run.verify_path = path
        try:
            got = run.forward([(torch.tensor(t[p:p + R]), st) for p, t, st in zip(POSITIONS, toks, sts)],
                              all_rows=every, keep=every)
            out = ([g.clone() for g in got], [run.hidden[i].clone() for i in range(len(sts))],
                   [_slot_state(cache, st) for st in sts])
        finally:
            run.verify_path = "decode"
        for st, s, p in zip(sts, base, POSITIONS):
            _put_state(cache, st, s)
            st.advance_to(p)
        return out

    replays = []
    replay = run.graphs.replay
    run.graphs.replay = lambda b, rows, *a: (replays.append((b, rows)), replay(b, rows, *a))[1]
    lg, hid, state = verify(4)
    assert replays == [(4, 4)]
    # the same forward eagerly, on the graph's padded layout
    R, b = 4, 4
    inp = run._host(run.graphs.layout([t[p:p + R] for p, t in zip(POSITIONS, toks)], list(POSITIONS),
                                      [st.slot for st in sts], b), b * R)
    bt = run._host([st.block_table for st in sts] + [[]], m.max_blocks)
    ctx = m.decode_context(inp[0], inp[1, :b], inp[2, :b], bt, R)
    ctx.keep_hidden = True
    e_lg = m(ctx).view(R, b, -1)
    e_hid = ctx.hidden.view(R, b, *ctx.hidden.shape[1:])
    for i, st in enumerate(sts):
        assert torch.equal(e_lg[:, i], lg[i]) and torch.equal(e_hid[:, i], hid[i]), POSITIONS[i]
        assert all(torch.equal(x, y) for x, y in zip(_slot_state(cache, st), state[i])), POSITIONS[i]
        _put_state(cache, st, base[i])
    p_lg, _, _ = verify(4, "prefill")
    for i in range(len(sts)):
        _agree_rows(lg[i], p_lg[i])
    replays.clear()
    lg2, _, _ = verify(2)
    assert replays == []
    for x, y in zip(lg2, verify(2, "prefill")[0]):
        _agree_rows(x, y)
    for st in sts:
        st.release()
