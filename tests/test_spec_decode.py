"""Speculative decoding (dsv4.engine.spec_decode): vLLM's speculative_config, the MTP drafter, the
verify / accept / roll-back step, and the rejection sampler.

Random tiny weights make the real MTP block accept almost nothing, so acceptance is exercised with
an oracle drafter that proposes the target's own greedy continuation (everything accepted) or
proposes it wrong at chosen output positions. Greedy outputs are held to the plain engine's
tokens with test_engine's rule (equal wherever the plain run's top-1 leads by ``MARGIN`` nats: a
verify chunk and a decode step round differently in the last bits, which the tiny random model
amplifies)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine.kv_cache import PagedSequenceState
from dsv4.engine.spec_decode import (SpeculativeConfig, SpeculativeConfigError, accept_greedy_draft,
                                     parse_speculative_config, rejection_sample)

MARGIN = 2.0
LP_TOL = 1.0
MTP3 = {"method": "mtp", "num_speculative_tokens": 3}
# (length, seed) of prompts whose plain greedy run leads by >= MARGIN nats at each of its first 12
# steps: there no run may part, so the speculative outputs must equal the plain ones in full
CLEAR = [(120, 16), (7, 0), (7, 6)]
N_OUT = 12


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128000, (n,), generator=g).tolist()


def _agree(c, plain) -> int:
    """``c``'s tokens equal the plain run's wherever its top-1 margin is clear; the equal count."""
    for i, (a, b) in enumerate(zip(c.token_ids, plain.token_ids)):
        top = sorted((v.logprob for v in plain.logprobs[i].values()), reverse=True)
        if a != b:
            assert top[0] - top[1] < MARGIN, f"step {i}: token {a} != {b} at a top-1 margin of {top[0] - top[1]:.3f}"
            return i
        if c.logprobs is not None:
            assert abs(c.logprobs[i][a].logprob - plain.logprobs[i][b].logprob) < LP_TOL, i
    assert len(c.token_ids) == len(plain.token_ids)
    return len(c.token_ids)


class Oracle:
    """A drafter that proposes each prompt's known continuation (``continuations``: {prompt ids
    tuple: output ids}), wrong (token + 1) at the output positions in ``wrong``."""

    def __init__(self, continuations: dict, wrong=()):
        self.cont, self.wrong = continuations, set(wrong)

    def propose(self, fills, k_of):
        for s, k in k_of.items():
            c, n = self.cont[tuple(s.prompt_ids)], len(s.output_ids)
            s.draft_ids = [(t + 1) % 129280 if n + j in self.wrong else t for j, t in enumerate(c[n:n + k])]


# ----------------------------------------------------------------------------- config
def test_speculative_config_is_parsed_and_bad_ones_name_the_field():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config(MTP3) == SpeculativeConfig("mtp", 3)
    assert parse_speculative_config(json.dumps({"method": "mtp", "num_speculative_tokens": 1})).num_speculative_tokens == 1
    for bad, field in [({"method": "eagle", "num_speculative_tokens": 2}, r"speculative_config\.method: 'eagle'"),
                       ({"method": "mtp", "num_speculative_tokens": 0}, r"num_speculative_tokens: must be an integer >= 1"),
                       ({"method": "mtp", "num_speculative_tokens": "3"}, r"num_speculative_tokens"),
                       ({"method": "mtp"}, r"num_speculative_tokens"),
                       ({"method": "mtp", "num_speculative_tokens": 2, "bogus": 1}, r"speculative_config\.bogus"),
                       ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, r"speculative_config\.model"),
                       ({"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
                        r"draft_sample_method"),
                       ("{not json", r"speculative_config: not a JSON object"), ([1], r"expected a JSON object")]:
        with pytest.raises(SpeculativeConfigError, match=field):
            parse_speculative_config(bad)


def test_a_checkpoint_without_the_mtp_block_is_refused(tmp_path):
    """(On the 512-token-vocabulary tiny config, ``checkpoint_helpers.small``: the refusal reads the checkpoint's
    draft, not its size.)"""
    from checkpoint_helpers import small
    from dsv4.checkpoint import make_tiny
    for draft, what in (("none", r"no draft \(no mtp\.\* tensors\)"), ("dspark", r"a DSpark draft")):
        d = make_tiny(str(tmp_path / draft), cfg=small(draft), draft="none" if draft == "none" else None)
        with pytest.raises(SpeculativeConfigError, match=r"speculative_config\.method: 'mtp' needs the checkpoint's "
                                                          r"April MTP block, but this checkpoint has " + what):
            LLM(d, log=False, kv_cache_memory="32MiB", speculative_config=MTP3)


@pytest.mark.parametrize("layout", ["hf", "modelopt-nvfp4"])
def test_the_mtp_block_drafts_from_every_layout(tmp_path, layout):
    """The April MTP block loads from the transformers layout (``model.mtp.*``) and from NVIDIA's
    NVFP4 port layout (its experts left MXFP4) and drafts; greedy tokens are the plain engine's."""
    from dsv4.checkpoint import make_tiny
    d = make_tiny(str(tmp_path / layout), layout=layout, draft="mtp")
    prompt = [{"prompt_token_ids": _prompt(*CLEAR[1])}]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    kw = dict(log=False, max_num_seqs=2, kv_cache_memory="32MiB")
    spec = LLM(d, speculative_config=MTP3, **kw)
    assert spec.engine.model.mtp is not None
    got = spec.generate(prompt, sp)[0]
    want = LLM(d, **kw).generate(prompt, sp)[0]
    assert got.metrics["num_draft_tokens"] > 0
    _agree(got.outputs[0], want.outputs[0])


# ----------------------------------------------------------------------------- rejection sampling
def test_accept_greedy_draft_is_the_matching_prefix():
    assert accept_greedy_draft([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accept_greedy_draft([5, 9, 7, 8], [5, 6, 7]) == 1
    assert accept_greedy_draft([4], []) == 0


def test_rejection_sampling_keeps_the_target_distribution():
    """Chi-square of the first emitted token (k = 2 drafts drawn from q) against p[0] on 6 tokens,
    and of the token after an accepted first draft against p[1] given d_1."""
    g = torch.Generator().manual_seed(7)
    V, N = 6, 20000
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(N):
        d = torch.stack([torch.multinomial(q[j], 1, generator=g)[0] for j in range(2)])
        a, nxt = rejection_sample(p, q, d, g)
        emitted = d[:a].tolist() + [nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    for counts, target in ((first, p[0]), (second, p[1])):
        exp = target * counts.sum()
        chi2 = float(((counts - exp) ** 2 / exp).sum())
        assert chi2 < 20.5, (chi2, counts, exp)          # 5 degrees of freedom: p = 0.001


# ----------------------------------------------------------------------------- roll-back
@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return LLM(None, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, kv_cache_memory="64MiB", log=False)


@pytest.fixture(scope="module")
def spec(plain):
    return LLM(None, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, kv_cache_memory="64MiB", log=False,
               speculative_config=MTP3)


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_a_cut_back_verify_chunk_leaves_nothing_of_its_rejected_tokens(plain, path, monkeypatch):
    """After a verify chunk cut back to its accepted positions, the logits that follow do not depend
    on what the rejected tokens were (bit for bit): the window ring, the compressor rings, entries
    and indexer keys are as if those positions were never computed. Cases: the rejected positions
    wrap the ratio-4 rings (8 rows); cross position 127 (an HCA entry and the 128-token window).
    Verify chunks on the decode path (the engine's) and on the prefill path."""
    eng = plain.engine
    monkeypatch.setattr(eng.runner, "verify_path", path)
    toks = _prompt(300, 3)

    def run(P, K, acc, junk):
        st = PagedSequenceState(eng.cache, eng.cache.allocate_slot(), eng.cache.allocate_blocks(2))
        fwd = lambda ids: eng.runner.forward([(torch.tensor(ids), st)], all_rows={0}, keep={0})[0]
        fwd(toks[:P])
        saved = eng.cache.save_positions(st.slot, P, P + K + 1)
        fwd(toks[P:P + acc + 1] + junk[:K - acc])
        eng.cache.restore_positions(st.slot, P, P + K + 1, saved, P + acc + 1)
        st.advance_to(P + acc + 1)
        q = P + acc + 1
        out = [fwd(toks[q:q + 3]).reshape(-1)] + [fwd(toks[q + 3 + i:q + 4 + i]).reshape(-1) for i in range(2)]
        st.release()
        return torch.cat(out)
    for P, K, acc in ((9, 7, 2), (125, 5, 0)):
        a, b = run(P, K, acc, [7] * 8), run(P, K, acc, _prompt(8, 99))
        assert torch.equal(a, b), (P, K, acc, float((a - b).abs().max()))


# ----------------------------------------------------------------------------- the engine
def _greedy(llm, prompts, n, **kw):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2, **kw))


def test_verified_drafts_give_the_plain_greedy_tokens(plain, spec):
    """Oracle drafts, all right and wrong at chosen positions, over a batch that mixes prompt
    lengths (chunked prefill: 64-token budget; ring wraps and position 127 inside verify chunks)."""
    prompts = [{"prompt_token_ids": _prompt(n, seed)} for n, seed in CLEAR[:2]]
    n = N_OUT
    ref = _greedy(plain, prompts, n)
    eng = spec.engine
    mtp = eng.drafter
    try:
        cont = {tuple(p["prompt_token_ids"]): r.outputs[0].token_ids for p, r in zip(prompts, ref)}
        for wrong in ((), (1, 4, 5, 9)):
            s0 = dict(eng.stats)
            eng.drafter = Oracle(cont, wrong)
            outs = _greedy(spec, prompts, n)
            assert all(_agree(o.outputs[0], r.outputs[0]) == n for o, r in zip(outs, ref))
            drafted = eng.stats["spec_num_draft_tokens"] - s0["spec_num_draft_tokens"]
            accepted = eng.stats["spec_num_accepted_tokens"] - s0["spec_num_accepted_tokens"]
            assert drafted == sum(o.metrics["num_draft_tokens"] for o in outs) > 0
            assert accepted == sum(o.metrics["num_accepted_tokens"] for o in outs)
            # the target's own tokens are all kept: each 4-token verify step emits 4 tokens
            assert (accepted == drafted) == (not wrong)
            if not wrong:
                assert eng.stats["steps"] - s0["steps"] <= 2 + 4 + -(-n // 4)
    finally:
        eng.drafter = mtp


def test_mtp_speculation_keeps_greedy_and_counts_drafts(plain, spec):
    prompts = [{"prompt_token_ids": _prompt(n, seed)} for n, seed in CLEAR[2:]]
    ref = _greedy(plain, prompts, N_OUT)
    s0 = dict(spec.engine.stats)
    outs = _greedy(spec, prompts, N_OUT)
    for o, r in zip(outs, ref):
        assert _agree(o.outputs[0], r.outputs[0]) == N_OUT
        assert o.metrics["num_draft_tokens"] > 0 and 0 <= o.metrics["num_accepted_tokens"] <= \
            o.metrics["num_draft_tokens"]
    st = spec.engine.stats
    assert st["spec_num_drafts"] > s0["spec_num_drafts"]
    assert sum(st["spec_accepted_per_pos"]) == st["spec_num_accepted_tokens"]


def test_drafts_stop_at_max_tokens_and_max_model_len(plain, spec):
    short = LLM(None, max_model_len=64, kv_cache_memory="32MiB", log=False, speculative_config=MTP3)
    out = short.generate([{"prompt_token_ids": _prompt(52, 31)}], SamplingParams(temperature=0, max_tokens=50,
                                                                              ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"   # 52 + 12 = 64
    eng = spec.engine
    out = spec.generate([{"prompt_token_ids": _prompt(30, 32)}], SamplingParams(temperature=0, max_tokens=2,
                                                                             ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 2 and out.metrics["num_draft_tokens"] <= 1
    assert eng.cache.num_free_slots == eng.cache.max_num_seqs - 1       # the model's scratch slot only


def test_spec_decode_metrics_and_bench_acceptance_length():
    """vLLM's counter names on /metrics, and bench serve's acceptance figures read back from them."""
    from dsv4.server.bench import parse_spec_counters, spec_decode_metrics
    from dsv4.server.metrics import ServerMetrics
    m = ServerMetrics("x")
    before = parse_spec_counters(m.render()[0].decode())
    m.spec_decode(4, 12, 7, [4, 2, 1])
    m.spec_decode(1, 3, 0, [0, 0, 0])
    text = m.render()[0].decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", 'vllm:spec_decode_num_accepted_tokens_per_pos_total'):
        assert name in text, name
    r = spec_decode_metrics(before, parse_spec_counters(text))
    assert (r["spec_decode_num_drafts"], r["spec_decode_draft_tokens"], r["spec_decode_accepted_tokens"]) == (5, 15, 7)
    assert r["spec_decode_acceptance_length"] == pytest.approx(1 + 7 / 5)
    assert r["spec_decode_acceptance_rate"] == pytest.approx(7 / 15)
    assert r["spec_decode_per_position_acceptance_rate"] == pytest.approx([4 / 5, 2 / 5, 1 / 5])
    assert spec_decode_metrics(before, before) == {}


def test_speculation_under_preemption_n_samples_stop_strings_and_logprobs(tmp_path, plain):
    """Oracle drafts (wrong every third position) in an engine that must preempt (2 sequences of 2
    blocks each at the end in 3 blocks), with logprobs; then n = 2 samples and a stop string: the
    outputs are the plain engine's and every block and slot comes back."""
    spec = LLM(None, max_num_seqs=2, max_num_batched_tokens=128, max_model_len=1024, num_kv_blocks=3, log=False,
               speculative_config=MTP3)
    eng = spec.engine
    prompts = [{"prompt_token_ids": _prompt(n, 10 + i)} for i, n in enumerate((254, 255))]
    clear = {"prompt_token_ids": _prompt(*CLEAR[1])}
    sp = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, logprobs=2)
    ref = plain.generate(prompts + [clear], sp)
    cont = {tuple(p["prompt_token_ids"]): r.outputs[0].token_ids for p, r in zip(prompts + [clear], ref)}
    eng.drafter = Oracle(cont, wrong=range(0, N_OUT, 3))
    start = (eng.cache.num_free_blocks, eng.cache.num_free_slots)
    outs = spec.generate(prompts, sp)
    assert eng.scheduler.num_preemptions > 0
    assert (eng.cache.num_free_blocks, eng.cache.num_free_slots) == start
    for o, r in zip(outs, ref):
        _agree(o.outputs[0], r.outputs[0])
        assert o.metrics["num_accepted_tokens"] > 0
    two = spec.generate([clear], SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, logprobs=2, n=2))[0]
    assert [_agree(c, ref[2].outputs[0]) for c in two.outputs] == [N_OUT, N_OUT]
    # a stop string inside an accepted run ends the request there; the drafts after it are dropped
    text = ref[2].outputs[0].text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text)) if text[i:i + 2].strip())
    kw = dict(temperature=0, max_tokens=N_OUT, ignore_eos=True, stop=[stop])
    want = plain.generate([clear], SamplingParams(**kw))[0].outputs[0]
    got = spec.generate([clear], SamplingParams(**kw))[0].outputs[0]
    assert (got.text, got.finish_reason) == (want.text, "stop") and len(got.text) < len(text)
    assert (eng.cache.num_free_blocks, eng.cache.num_free_slots) == start


@pytest.mark.gpu
def test_gpu_speculation_on_the_kernels_keeps_greedy(tmp_path):
    """On the GPU kernels (verify and plain decode steps replayed from CUDA graphs, MTP steps
    through the prefill path): oracle drafts, right and wrong at chosen positions, and the real MTP
    drafter give the plain greedy tokens wherever the top-1 margin is clear, and every block and
    slot comes back."""
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path))
    kw = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, kv_cache_memory="2GiB",
              device="cuda", log=False)
    prompts = [{"prompt_token_ids": _prompt(n, 50 + i)} for i, n in enumerate((300, 126, 9))]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = LLM(None, **kw).generate(prompts, sp)
    spec = LLM(None, speculative_config=MTP3, **kw)
    eng = spec.engine
    assert eng.model.ops.kernels and eng.model.mtp is not None
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.rows == [1, 4]
    replays = []
    replay = graphs.replay
    graphs.replay = lambda b, rows, *a: (replays.append(rows), replay(b, rows, *a))[1]
    start = (eng.cache.num_free_blocks, eng.cache.num_free_slots)
    mtp = eng.drafter
    cont = {tuple(p["prompt_token_ids"]): r.outputs[0].token_ids for p, r in zip(prompts, ref)}
    for drafter in (Oracle(cont), Oracle(cont, wrong=(2, 3, 8)), mtp):
        eng.drafter = drafter
        outs = spec.generate(prompts, sp)
        for o, r in zip(outs, ref):
            _agree(o.outputs[0], r.outputs[0])
            assert o.metrics["num_draft_tokens"] > 0
        assert (eng.cache.num_free_blocks, eng.cache.num_free_slots) == start
    assert 4 in replays                 # verify steps of K + 1 rows came from the graphs
