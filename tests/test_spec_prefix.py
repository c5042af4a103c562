"""Prefix caching together with speculative decoding (MTP and DSpark drafts), on CPU.

A snapshot then also holds the drafter's rings, and for MTP the target's streams before the
boundary (MTP's row there reads the next token, which a sequence hitting the snapshot may not
share: it recomputes that row). Held to an engine with caching off, on prompts whose uncached
prefill chunks also end at the hit (64-token chunks, 256-token blocks), so the main model's bits
are the same: a hit gives the same tokens and log-probs, and the drafter proposes the same drafts
(a snapshot without its draft part, or a stale MTP row, changes them). With caching on, no verify
chunk puts a draft on the last position before a block boundary, so snapshots taken during decoding
hold committed tokens only and a later prompt that extends the output hits them (then within the
batching tolerance: verify chunks computed that snapshot, prefill chunks the uncached run)."""
from __future__ import annotations

import pytest
import torch

from checkpoint_helpers import small
from test_spec_decode import _prompt

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint import make_tiny
from dsv4.formats.paging import BLOCK_TOKENS

KW = dict(max_model_len=1024, kv_cache_memory="64MiB", max_num_batched_tokens=64, log=False)
MTP3 = {"method": "mtp", "num_speculative_tokens": 3}


class Logged:
    """The engine's drafter, its drafts logged per call: (position of the pending token, drafts)."""

    def __init__(self, inner, continuations: dict | None = None):
        self.inner, self.cont, self.log = inner, continuations, []

    def propose(self, fills, k_of):
        self.inner.propose(fills, k_of)
        for s, k in k_of.items():
            if self.cont is not None:           # the target's own continuation: all accepted
                c, n = self.cont[tuple(s.prompt_ids)], len(s.output_ids)
                s.draft_ids = c[n:n + k]
            self.log.append((s.num_computed, list(s.draft_ids)))


def _run(llm, prompt, n=12, cont=None):
    eng = llm.engine
    real = eng.drafter
    eng.drafter = Logged(real, cont)
    try:
        o = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                                        logprobs=2))[0]
    finally:
        log, eng.drafter = eng.drafter.log, real
    c = o.outputs[0]
    return o.num_cached_tokens, c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], log


def _check_hit_like_uncached(ckpt, spec, a, b, exact=True, n_hit=12, **kw):
    """Prompt ``a``, then ``b`` (``a``'s first block, another tail): ``b`` hits the block and runs
    as on an engine with caching off, drafts included, over ``n_hit`` output tokens (``a``'s 12
    leave rows past the boundary in the draft rings of the slot ``b`` reuses, which a snapshot
    restored without its draft part would leave there). ``exact=False`` (GPU kernels, whose MTP rows
    may round by the fill they are computed in): the same tokens, log-probs within 1e-3, and at
    least 80 % of the steps drafting the same tokens (a drafter without its snapshot state drafts
    next to none alike)."""
    kw = dict(KW, **kw)
    on = LLM(ckpt, speculative_config=spec, **kw)
    off = LLM(ckpt, speculative_config=spec, enable_prefix_caching=False, **kw)
    assert "prefix caching on" in on.engine.describe_prefix_caching()
    assert on.engine.cache.num_snapshots > 0 and on.engine.cache.draft_layers[0].snap_window is not None
    first, cold = _run(on, a), _run(off, a)
    assert first[0] == 0 and first[3] and first[1] == cold[1] and (not exact or first[2:] == cold[2:])
    hit, ref = _run(on, b, n_hit), _run(off, b, n_hit)
    assert hit[0] == BLOCK_TOKENS and ref[0] == 0 and hit[1] == ref[1]
    if exact:
        assert hit[2:] == ref[2:]
    else:
        assert max(abs(x - y) for x, y in zip(hit[2], ref[2])) < 1e-3
        assert len(hit[3]) == len(ref[3]) and sum(x == y for x, y in zip(hit[3], ref[3])) >= 0.8 * len(ref[3])


def test_an_mtp_prefix_hit_drafts_as_without_the_cache():
    """Its next token differs from the snapshotted prompt's: MTP's row before the boundary is
    recomputed from the kept streams. The hit runs for six output tokens (five draft steps): a snapshot
    restored without its draft rings, or a stale MTP row, changes the first two steps' drafts."""
    a = _prompt(300, 5)
    _check_hit_like_uncached(None, MTP3, a, a[:BLOCK_TOKENS] + _prompt(44, 6), n_hit=6)


@pytest.fixture(scope="module")
def dspark_ckpt(tmp_path_factory):
    return make_tiny(str(tmp_path_factory.mktemp("spec_prefix") / "ck"), cfg=small("dspark"))


def test_a_dspark_prefix_hit_drafts_as_without_the_cache(dspark_ckpt):
    ids = lambda n, s: torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(s)).tolist()
    a = ids(300, 5)
    _check_hit_like_uncached(dspark_ckpt, {"method": "dspark", "num_speculative_tokens": 3}, a,
                             a[:BLOCK_TOKENS] + ids(44, 6))


@pytest.mark.slow
def test_a_boundary_passed_while_speculating_is_snapshotted_and_hit():
    """All drafts accepted (the target's continuation) from position 250 on: no verify chunk puts a
    draft on position 255, and the snapshot at 256 taken while decoding serves the prompt that
    continues the output, which then runs as without the cache."""
    p = _prompt(250, 7)
    off = LLM(None, speculative_config=MTP3, enable_prefix_caching=False, **KW)
    out = _run(off, p, n=20)[1]
    on = LLM(None, speculative_config=MTP3, **KW)
    _, toks, _, log = _run(on, p, n=20, cont={tuple(p): out})
    assert toks == out
    for pos, drafts in log:                # the verify chunk covers positions pos .. pos + len(drafts)
        b = (pos // BLOCK_TOKENS + 1) * BLOCK_TOKENS
        assert pos == b - 1 or pos + len(drafts) < b - 1, (pos, drafts)
    # the pending token (output i sits at position 250 + i) reached 255 itself, then drafted
    q = BLOCK_TOKENS - 1 - len(p)
    assert (BLOCK_TOKENS - 1, out[q + 1:q + 4]) in log
    # the snapshot's state was computed by verify chunks, the uncached run's by prefill chunks: the
    # same tokens, log-probs within the batching tolerance (tests/test_prefix_cache.py's rule)
    nxt = p + out[:12]
    hit, ref = _run(on, nxt), _run(off, nxt)
    assert hit[0] == BLOCK_TOKENS and hit[1] == ref[1]
    assert max(abs(x - y) for x, y in zip(hit[2], ref[2])) < 0.3


@pytest.mark.gpu
def test_gpu_prefix_hits_under_mtp_on_the_kernels(tmp_path, monkeypatch):
    """The same on the GPU kernels, decode, verify and MTP steps replayed from CUDA graphs."""
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path))
    a = _prompt(300, 5)
    _check_hit_like_uncached(None, MTP3, a, a[:BLOCK_TOKENS] + _prompt(44, 6), exact=False, device="cuda",
                             kv_cache_memory="2GiB")
