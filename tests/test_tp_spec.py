"""Speculative decoding under tensor parallelism (CPU, gloo, two ranks): the workers mirror rank 0's
verify cut-backs and run the same draft calls (``engine.tp_workers``), so greedy outputs over two
ranks are the one-rank plain engine's, for MTP and for DSpark drafts, with drafts accepted (oracle
proposals: the target's own continuation) and rejected at chosen positions.

Oracle drafters wrap the engine's real drafter: the real ``propose`` runs first (rank 0's draft
calls must pair up with the workers' collectives, and its MTP window / DSpark rings are written as
in production); then its proposals are replaced. The workers' own drafts are never used. What
follows a rejected draft must not depend on what that draft was, bit for bit, on every rank: two
runs whose wrong drafts differ give the same log-probs. A worker that kept what a rejected draft
wrote in its window or compressor rings fails that (checked by disabling the workers' write-back).
With prefix caching, a hit gives the cold run's drafts: every rank restored the drafter's rings."""
from __future__ import annotations

import pytest
import torch

from checkpoint_helpers import small
from test_spec_decode import CLEAR, MARGIN, _agree, _prompt

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint import make_tiny

N_OUT = 12
KW = dict(max_model_len=512, kv_cache_memory="64MiB", max_num_batched_tokens=64, log=False)


class Oracle:
    """The engine's drafter with its proposals replaced by each prompt's known continuation,
    wrong (token + 1) at the output positions in ``wrong``."""

    def __init__(self, inner, continuations: dict, vocab: int, wrong=(), shift: int = 1):
        self.inner, self.cont, self.vocab, self.wrong, self.shift = inner, continuations, vocab, set(wrong), shift

    def propose(self, fills, k_of):
        self.inner.propose(fills, k_of)
        for s, k in k_of.items():
            c, n = self.cont[tuple(s.prompt_ids)], len(s.output_ids)
            s.draft_ids = [(t + self.shift) % self.vocab if n + j in self.wrong else t
                           for j, t in enumerate(c[n:n + k])]


def _greedy(llm, prompts, n=N_OUT, **kw):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2, **kw))


def _check_oracles(two, prompts, ref, vocab, wrong_at):
    """Right and wrong oracle drafts, then the real drafter, on ``two``: greedy equal to ``ref``
    wherever its top-1 margin is clear, drafts counted, all accepted only when all right; and the
    log-probs that follow the rejected drafts do not depend on what those drafts were (bit for bit:
    every rank wrote back what they overwrote)."""
    eng = two.engine
    real = eng.drafter
    cont = {tuple(p["prompt_token_ids"]): r.outputs[0].token_ids for p, r in zip(prompts, ref)}
    seen = {}
    try:
        for wrong, shift in (((), 1), (wrong_at, 1), (wrong_at, 2), (None, 1)):
            eng.drafter = real if wrong is None else Oracle(real, cont, vocab, wrong, shift)
            s0 = dict(eng.stats)
            outs = _greedy(two, prompts)
            assert all(_agree(o.outputs[0], r.outputs[0]) == N_OUT for o, r in zip(outs, ref)), wrong
            if wrong:
                lps = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
                assert seen.setdefault("lps", lps) == lps, shift
            drafted = eng.stats["spec_num_draft_tokens"] - s0["spec_num_draft_tokens"]
            accepted = eng.stats["spec_num_accepted_tokens"] - s0["spec_num_accepted_tokens"]
            assert drafted == sum(o.metrics["num_draft_tokens"] for o in outs) > 0
            assert accepted == sum(o.metrics["num_accepted_tokens"] for o in outs)
            if wrong is not None:
                assert (accepted == drafted) == (not wrong)
    finally:
        eng.drafter = real


@pytest.mark.slow
def test_mtp_over_two_ranks_keeps_the_one_rank_greedy_tokens():
    """MTP with 3 drafts on the embedded tiny model over two ranks, 64-token prefill chunks."""
    prompts = [{"prompt_token_ids": _prompt(n, seed)} for n, seed in CLEAR[:2]]
    one = LLM(None, **KW)
    ref = _greedy(one, prompts)
    # the comparison needs clear margins on the one-rank run too (CLEAR's premise: MARGIN there)
    for r in ref:
        tops = [sorted((v.logprob for v in lp.values()), reverse=True) for lp in r.outputs[0].logprobs]
        assert min(t[0] - t[1] for t in tops) >= MARGIN
    two = LLM(None, tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **KW)
    try:
        assert "tensor parallel 2" in two.engine.backend_name
        _check_oracles(two, prompts, ref, two.engine.model_config.vocab_size, wrong_at=(1, 4, 5, 9))
        # prefix caching: a 300-token prompt again hits its first block, and every rank restores
        # the drafter's part of the snapshot (the drafts are the cold run's)
        from test_spec_prefix import _run
        a = _prompt(300, 5)
        cold, hit = _run(two, a), _run(two, a)
        assert cold[0] == 0 and hit[0] == 256 and cold[3] and hit[1:] == cold[1:]
    finally:
        two.engine.close()


@pytest.fixture(scope="module")
def dspark_ckpt(tmp_path_factory):
    return make_tiny(str(tmp_path_factory.mktemp("tp_dspark") / "ck"), cfg=small("dspark"))


@pytest.mark.slow
def test_dspark_over_two_ranks_keeps_the_one_rank_greedy_tokens(dspark_ckpt):
    """DSpark with 3 drafts on a tiny DSpark checkpoint over two ranks; then probabilistic drafts
    at temperature > 0 (the workers draw theirs from their own RNG, never used) keep running."""
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(s)).tolist()}
               for n, s in ((5, 0), (130, 1))]
    ref = _greedy(LLM(dspark_ckpt, **KW), prompts)
    two = LLM(dspark_ckpt, tensor_parallel_size=2, speculative_config={
        "method": "dspark", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}, **KW)
    try:
        _check_oracles(two, prompts, ref, 500, wrong_at=(2, 3, 8))
        s0 = two.engine.stats["spec_num_draft_tokens"]
        outs = two.generate(prompts, SamplingParams(temperature=0.8, seed=3, max_tokens=N_OUT, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [N_OUT] * 2
        assert two.engine.stats["spec_num_draft_tokens"] - s0 == sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    finally:
        two.engine.close()
