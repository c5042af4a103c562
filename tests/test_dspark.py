"""The production DSpark draft (dsv4/model/dspark.py) and DSpark speculative decoding in the engine,
on a tiny DSpark checkpoint with a 512-token vocabulary (checkpoint_helpers.small).

* the production draft against the reference draft (dsv4/reference/dspark.py) on the same target
  features: ring rows, draft tokens, Markov-corrected logits and confidences;
* the target features the engine feeds the rings (prefill chunks, accepted verify rows) are those
  of the committed positions only, whatever was rejected;
* greedy with ``method: "dspark"`` (N = 1, 3, 5) gives the plain engine's tokens for batched
  prompts of 5-600 tokens under chunked prefill and preemption, and the drafts are counted;
* probabilistic drafts keep the target distribution (the engine's rejection step);
* vLLM's speculative_config for dspark: defaults, limits and refusals naming the field.
"""
from __future__ import annotations

import pytest
import torch

from checkpoint_helpers import small
from test_spec_decode import _agree

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint import make_tiny
from dsv4.checkpoint.tiny import build_tiny_tensors
from dsv4.engine.build import build_model
from dsv4.engine.kv_cache import CacheConfig, KVCache, PagedSequenceState
from dsv4.engine.spec_decode import SpeculativeConfigError, parse_speculative_config
from dsv4.formats.kv_entry import read_kv_entries
from dsv4.formats.paging import WINDOW, WINDOW_PAGE
from dsv4.reference.model import ReferenceModel

KW = dict(log=False, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="64MiB")


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(str(tmp_path_factory.mktemp("dspark") / "ck"), cfg=small("dspark"))


@pytest.fixture(scope="module")
def plain(ckpt):
    return LLM(ckpt, **KW)


# ----------------------------------------------------------------------------- the draft vs the reference
def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _same_chain(got: dict, i: int, want: dict, j: int, tol: float = 0.3) -> None:
    """Draft row ``i`` of ``got`` is row ``j`` of ``want``: the same greedy tokens, and logits within
    ``tol``, up to a step where ``want``'s top-2 logits are within ``tol`` (a near tie: after a flip
    there the chain goes on from another token). On the CPU twins a batch of two is not bit-exact with
    each alone on every MKL code path: the DSpark block's logits move by up to 0.12 on MKL's AVX path
    (2026-12-05), by 0 on its AVX2 path."""
    for k, (a, b) in enumerate(zip(got["tokens"][i].tolist(), want["tokens"][j].tolist())):
        lg, lw = got["logits"][i][k].float(), want["logits"][j][k].float()
        assert float((lg - lw).abs().max()) < tol, k
        if a != b:
            top = lw.topk(2).values
            assert float(top[0] - top[1]) < tol, (k, a, b)
            return


def test_the_production_draft_matches_the_reference():
    """Same weights, same prompt (longer than the 128-row window, prefilled in two chunks): the
    production model's DSpark features, ring rows, drafts, logits and confidences are the
    reference's (official numerics)."""
    cfg = small("dspark")
    tensors = build_tiny_tensors(cfg, 5)
    prod = build_model(dict(tensors=(cfg, "mxfp4", "fp8", tensors), kernels=False, draft="dspark",
                            kernel_check="off"), "cpu")
    ref = ReferenceModel(cfg, tensors, numerics="official")
    n = 150
    cache = KVCache(cfg, CacheConfig(max_num_seqs=3, num_blocks=3, device="cpu", draft_layers=3))
    prod.attach_cache(cache, 512)
    st = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(1))
    ids = torch.tensor(_ids(n, 1))
    feats = []
    for a, b in ((0, 90), (90, n)):
        ctx = prod.prefill_context([(ids[a:b], st)])
        ctx.keep_hidden = True
        logits = prod(ctx)
        feats.append(ctx.hidden)
        st.advance_to(b)
    feats = torch.cat(feats)
    rst = ref.new_state()
    rlogits = ref.forward([(ids, rst)], capture=True)[0]
    anchor = int(rlogits.argmax())
    assert int(logits[0].argmax()) == anchor
    assert feats.shape == rst.last_features.shape and feats.dtype == torch.bfloat16
    assert _cos(feats, rst.last_features) > 0.999
    # the rings from the reference's features (any chunking) hold the reference's ring rows
    prod.dspark_extend([(st.slot, 0, rst.last_features[:100]), (st.slot, 100, rst.last_features[100:])])
    ds = ref.dspark.new_state()
    ref.dspark.extend(ds, rst.last_features, 0)
    pos = torch.arange(n - WINDOW, n)
    for b, ring in zip(prod.dspark.blocks, ds.rings):
        got = read_kv_entries(b.attn.lc.window, st.slot * WINDOW + pos % WINDOW, WINDOW_PAGE)
        want = ring.keys()[0][pos % WINDOW]
        assert _cos(got, want) > 0.999 and float((got.float() - want.float()).abs().max()) < 0.1
    B = cfg.dspark_block_size
    out = prod.dspark_draft(torch.tensor([st.slot]), torch.tensor([anchor]), torch.tensor([n]), B, confidence=True)
    want = ref.dspark.draft(ds, anchor)
    assert out["tokens"][0].tolist() == want.tokens.tolist()
    assert _cos(out["logits"][0], want.logits) > 0.999
    assert torch.allclose(out["confidence_logits"][0], want.confidence_logits, atol=0.05, rtol=0.05)
    # a partial block is the full block's first drafts; a batch of two equals each alone
    part = prod.dspark_draft(torch.tensor([st.slot]), torch.tensor([anchor]), torch.tensor([n]), 2)
    assert part["tokens"][0].tolist() == want.tokens[:2].tolist()
    st2 = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(1))
    prod.dspark_extend([(st2.slot, 0, rst.last_features[:40])])
    two = prod.dspark_draft(torch.tensor([st.slot, st2.slot]), torch.tensor([anchor, 7]), torch.tensor([n, 40]), B)
    alone = prod.dspark_draft(torch.tensor([st2.slot]), torch.tensor([7]), torch.tensor([40]), B)
    _same_chain(two, 0, out, 0)
    _same_chain(two, 1, alone, 0)
    ref40 = ref.dspark.new_state()
    ref.dspark.extend(ref40, rst.last_features[:40], 0)
    assert _cos(alone["logits"][0], ref.dspark.draft(ref40, 7).logits) > 0.999


# ----------------------------------------------------------------------------- the engine
class OracleDSpark:
    """The engine's DSpark drafter (its rings are written as in production) whose proposals are
    replaced by the known continuation, wrong (token + 1) at the output positions in ``wrong``."""

    def __init__(self, inner, continuations: dict, wrong=()):
        self.inner, self.cont, self.wrong = inner, continuations, set(wrong)

    def propose(self, fills, k_of):
        self.inner.propose(fills, k_of)
        for s, k in k_of.items():
            c, n = self.cont[tuple(s.prompt_ids)], len(s.output_ids)
            s.draft_ids = [(t + 1) % 500 if n + j in self.wrong else t for j, t in enumerate(c[n:n + k])]


def _greedy(llm, prompts, n):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2))


PROMPTS = ((5, 0), (130, 1), (600, 2))
N_OUT = 10


@pytest.fixture(scope="module")
def plain_out(plain):
    return _greedy(plain, [{"prompt_token_ids": _ids(n, s)} for n, s in PROMPTS], N_OUT)


@pytest.mark.parametrize("N", [1, 3, 5])
def test_dspark_greedy_is_the_plain_greedy(ckpt, plain_out, N):
    """Batched prompts of 5-600 tokens (the 600-token one with N = 5 only: CPU time), 64-token
    prefill chunks; the real DSpark drafts (random weights: mostly rejected, some accepted) are
    counted."""
    m = len(PROMPTS) if N == 5 else 2
    prompts = [{"prompt_token_ids": _ids(n, s)} for n, s in PROMPTS[:m]]
    spec = LLM(ckpt, speculative_config={"method": "dspark", "num_speculative_tokens": N}, **KW)
    assert spec.engine.model.dspark is not None and spec.engine.model.mtp is None
    outs = _greedy(spec, prompts, N_OUT)
    for o, r in zip(outs, plain_out[:m]):
        assert _agree(o.outputs[0], r.outputs[0]) == N_OUT
    st = spec.engine.stats
    assert st["spec_num_draft_tokens"] == sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    assert st["spec_num_accepted_tokens"] == sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert len(st["spec_accepted_per_pos"]) == N and sum(st["spec_accepted_per_pos"]) == st["spec_num_accepted_tokens"]
    assert st["spec_num_draft_tokens"] <= N * st["spec_num_drafts"]


@pytest.mark.parametrize("layout", ["hf", "modelopt-nvfp4"])
def test_the_dspark_draft_drafts_from_every_layout(tmp_path, layout):
    """The DSpark draft loads from the transformers layout (``model.mtp.*``) and from NVIDIA's NVFP4
    port layout (its experts left MXFP4) and drafts; greedy tokens are the plain engine's."""
    d = make_tiny(str(tmp_path / layout), layout=layout, cfg=small("dspark"))
    prompt = [{"prompt_token_ids": _ids(*PROMPTS[0])}]
    spec = LLM(d, speculative_config={"method": "dspark", "num_speculative_tokens": 3}, **KW)
    assert spec.engine.model.dspark is not None
    got = _greedy(spec, prompt, 6)[0]
    want = _greedy(LLM(d, **KW), prompt, 6)[0]
    assert got.metrics["num_draft_tokens"] > 0
    assert _agree(got.outputs[0], want.outputs[0]) == 6


def test_the_rings_hold_the_committed_positions_under_acceptance_and_preemption(ckpt, plain):
    """Oracle proposals (right, and wrong at chosen positions) in an engine that must preempt: the
    outputs are the plain engine's, and every DSpark ring row of a running sequence is the row of
    its committed token at that position (compared with a fresh prefill of the committed tokens:
    a row of a rejected draft or a stale position would not match). The rows are read after each
    step and compared at the end: a request's committed tokens at each step are the first ones of its
    last step's, so one prefill of those gives every step's features (causal; rounding only differs)."""
    prompts = [{"prompt_token_ids": _ids(n, 10 + i)} for i, n in enumerate((250, 251))]
    n = 12
    ref = _greedy(plain, prompts, n)
    cont = {tuple(p["prompt_token_ids"]): r.outputs[0].token_ids for p, r in zip(prompts, ref)}
    spec = LLM(ckpt, log=False, max_num_seqs=2, max_num_batched_tokens=128, max_model_len=1024, num_kv_blocks=3,
               speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    eng = spec.engine
    eng.drafter = OracleDSpark(eng.drafter, cont, wrong=(1, 5, 6))
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, sp)
    done, rows = {}, []
    model = eng.model
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        for s in [s for seqs in eng.requests.values() for s in seqs]:
            if s.is_finished or s.state is None or s.num_computed <= len(s.prompt_ids) or s.draft_ids == []:
                continue
            # committed positions 0 .. N-1 (N = num_computed): their ring rows
            N = s.num_computed
            pos = torch.arange(max(0, N - WINDOW), N)
            got = read_kv_entries(model.cache.draft_layers[0].window, s.slot * WINDOW + pos % WINDOW, WINDOW_PAGE)
            rows.append((s.request_id, s.all_ids[:N], got.clone()))
    assert len(rows) >= 3
    last = {rid: ids for rid, ids, _ in rows}               # each request's longest committed tokens
    feats = {}
    for rid, ids in last.items():
        st = PagedSequenceState(eng.cache, model.scratch_slot, [model.scratch_block] * 4)
        ctx = model.prefill_context([(torch.tensor(ids), st)])
        ctx.keep_hidden = True
        model(ctx)
        feats[rid] = ctx.hidden
    for rid, ids, got in rows:
        N = len(ids)
        assert ids == last[rid][:N]
        pos = torch.arange(max(0, N - WINDOW), N)
        model.dspark_extend([(model.scratch_slot, 0, feats[rid][:N])])
        want = read_kv_entries(model.cache.draft_layers[0].window, model.scratch_slot * WINDOW + pos % WINDOW,
                               WINDOW_PAGE)
        cos = torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1)
        # the same position's row differs by rounding only; a neighbour's row is far off (except
        # where the greedy output repeats a token)
        off = torch.nn.functional.cosine_similarity(got[1:].float(), want[:-1].float(), dim=-1)
        assert float(cos.min()) > 0.97 and float(off.median()) < 0.5, (N, float(cos.min()), float(off.median()))
    for i, r in enumerate(ref):
        assert _agree(done[str(i)].outputs[0], r.outputs[0]) == n
    assert eng.stats["spec_num_accepted_tokens"] > 0
    assert eng.cache.num_free_slots == eng.cache.max_num_seqs - 1


def test_probabilistic_drafts_keep_the_target_distribution():
    """The engine's rejection step for probabilistic drafts (``LLMEngine._reject`` with the real
    sampler) on a 6-token vocabulary: drafts drawn from a draft distribution q far from the
    target's, over 1500 seeded trials; the first two emitted tokens follow the target's
    distributions p_0 and p_1 (chi-square, fixed seeds), and drafts are accepted."""
    from types import SimpleNamespace

    from dsv4.engine.llm_engine import LLMEngine
    from dsv4.engine.sampler import Sampler

    class Seq(SimpleNamespace):
        __hash__ = object.__hash__
    T = 0.8
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0, 2.0, 1.0, 1.5, 0.2, -0.5],
                           [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    p = torch.softmax(logits / T, dim=-1)
    q = torch.tensor([[0.05, 0.1, 0.5, 0.2, 0.1, 0.05], [0.3, 0.1, 0.1, 0.1, 0.3, 0.1]])
    params = SamplingParams(temperature=T)
    eng = SimpleNamespace(sampler=Sampler(None))
    counts, acc, n = torch.zeros(2, 6), 0, 1500
    g = torch.Generator().manual_seed(0)
    for trial in range(n):
        d = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        seq = Seq(params=params, prompt_ids=[1], generator=torch.Generator().manual_seed(trial),
                              draft_ids=d, is_finished=False)
        eng.drafter = SimpleNamespace(probs={seq: q.clone()})
        batch = [SimpleNamespace(num_draft=2, seq=seq)]
        forced = LLMEngine._reject(eng, batch, [0], {0: 0}, list(logits), [seq] * 3, [[], d[:1], d])
        assert eng.drafter.probs == {}
        counts[0, forced[0]] += 1
        acc += forced[0] == d[0]
        if forced[0] == d[0]:
            assert forced[1] is not None
            counts[1, forced[1]] += 1
    assert acc > 0.2 * n
    for j in range(2):
        m = counts[j].sum()
        exp = p[j] * m
        chi = float(((counts[j] - exp) ** 2 / exp).sum())
        assert chi < 20.5, (j, counts[j].tolist(), exp.tolist())       # 5 dof: the 0.001 quantile


def test_probabilistic_dspark_in_the_engine_is_seeded_and_counted(ckpt):
    """Probabilistic drafts through the engine: seeded requests give the same tokens twice, and
    the drafts are counted (the statistics of the step are the test above)."""
    spec = LLM(ckpt, speculative_config={"method": "dspark", "num_speculative_tokens": 3,
                                         "draft_sample_method": "probabilistic"}, **KW)
    assert spec.engine.drafter.sample_method == "probabilistic"
    prompts = [{"prompt_token_ids": _ids(9, 4)}]
    sps = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=1)]
    a = [o.outputs[0].token_ids for o in spec.generate(prompts, sps)]
    b = [o.outputs[0].token_ids for o in spec.generate(prompts, sps)]
    assert a == b and all(len(t) == 6 for t in a)
    assert spec.engine.stats["spec_num_draft_tokens"] > 0
    assert spec.engine.drafter.probs == {}


def test_a_seeded_request_drafts_from_its_own_generator_on_the_draft_device():
    """A seeded request whose sampler generator lives elsewhere than the draft (the GPU) gets a draft
    generator on the draft's device from its own seed, made once and kept: equal seeds draw equal
    streams, other seeds other ones, and that stream is not the sampler's. Unseeded: the global one."""
    from types import SimpleNamespace

    from dsv4.engine.spec_decode import _device_generator

    def seq(seed):    # a generator that reports another device than the draft's (here the CPU)
        g = torch.Generator().manual_seed(seed)
        return SimpleNamespace(generator=SimpleNamespace(device=torch.device("cuda"), initial_seed=g.initial_seed),
                               draft_generator=None)
    a, b, c = seq(5), seq(5), seq(6)
    ga = _device_generator(a, "cpu")
    assert ga.device.type == "cpu" and _device_generator(a, "cpu") is ga and a.draft_generator is ga
    draw = lambda g: torch.rand(8, generator=g)
    assert torch.equal(draw(ga), draw(_device_generator(b, "cpu")))
    assert not torch.equal(draw(torch.Generator().manual_seed(5)), draw(_device_generator(seq(5), "cpu")))
    assert not torch.equal(draw(_device_generator(seq(5), "cpu")), draw(_device_generator(c, "cpu")))
    own = SimpleNamespace(generator=torch.Generator().manual_seed(5), draft_generator=None)
    assert _device_generator(own, "cpu") is own.generator                   # already on the draft's device
    assert _device_generator(SimpleNamespace(generator=None, draft_generator=None), "cpu") is None


# ----------------------------------------------------------------------------- config
def test_dspark_speculative_config_defaults_limits_and_refusals(tmp_path, ckpt):
    s = parse_speculative_config('{"method": "dspark"}')
    assert (s.method, s.num_speculative_tokens, s.draft_sample_method) == ("dspark", None, "greedy")
    with pytest.raises(SpeculativeConfigError, match=r"speculative_config\.draft_sample_method: method 'dspark' "
                                                      r"supports 'greedy' or 'probabilistic', got 'beam'"):
        parse_speculative_config({"method": "dspark", "draft_sample_method": "beam"})
    with pytest.raises(SpeculativeConfigError, match=r"speculative_config\.draft_sample_method: method 'mtp'"):
        parse_speculative_config({"method": "mtp", "num_speculative_tokens": 1, "draft_sample_method": "probabilistic"})
    with pytest.raises(SpeculativeConfigError, match=r"speculative_config\.num_speculative_tokens: must be an "
                                                      r"integer >= 1, got 0"):
        parse_speculative_config({"method": "dspark", "num_speculative_tokens": 0})
    llm = LLM(ckpt, speculative_config={"method": "dspark"}, **KW)
    assert llm.engine.spec.num_speculative_tokens == 5            # dspark_block_size
    assert len(llm.engine.cache.draft_layers) == 3
    with pytest.raises(SpeculativeConfigError, match=r"speculative_config\.num_speculative_tokens: 6 exceeds the "
                                                      r"DSpark draft's block size \(dspark_block_size=5\)"):
        LLM(ckpt, speculative_config={"method": "dspark", "num_speculative_tokens": 6}, **KW)
    with pytest.raises(SpeculativeConfigError, match=r"speculative_config\.method: 'mtp' needs the checkpoint's April "
                                                      r"MTP block, but this checkpoint has a DSpark draft .*use method "
                                                      r"'dspark'"):
        LLM(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **KW)
    for draft, what in (("mtp", r"the April MTP block .*use method 'mtp'"), ("none", r"no draft \(no mtp\.\* tensors\)")):
        d = make_tiny(str(tmp_path / draft), cfg=small(draft), draft=draft)
        with pytest.raises(SpeculativeConfigError, match=r"speculative_config\.method: 'dspark' needs the checkpoint's "
                                                          r"DSpark draft, but this checkpoint has " + what):
            LLM(d, speculative_config={"method": "dspark"}, **KW)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_seeded_probabilistic_drafts_are_reproducible(ckpt):
    """Probabilistic DSpark drafts on the GPU: a batch of seeded requests gives the same tokens on every
    run (their drafts come from their own generators on the GPU, not from the global one, whose state
    moves on between runs)."""
    kw = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, kv_cache_memory="2GiB",
              device="cuda", log=False)
    spec = LLM(ckpt, speculative_config={"method": "dspark", "num_speculative_tokens": 3,
                                         "draft_sample_method": "probabilistic"}, **kw)
    prompts = [{"prompt_token_ids": _ids(40, 7)}, {"prompt_token_ids": _ids(30, 8)}]
    sps = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=s) for s in (11, 12)]
    runs = [[o.outputs[0].token_ids for o in spec.generate(prompts, sps)] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert spec.engine.stats["spec_num_draft_tokens"] > 0


@pytest.mark.gpu
def test_gpu_dspark_on_the_kernels(ckpt):
    """On the GPU kernels: the production draft (its block attention and stages on the kernels,
    replayed from its CUDA graph) drafts the twins' tokens from the same rings; and the engine with
    DSpark speculation (oracle proposals right and wrong at chosen positions, then the real drafts)
    gives the plain greedy tokens, returning every block and slot."""
    kw = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, kv_cache_memory="2GiB",
              device="cuda", log=False)
    prompts = [{"prompt_token_ids": _ids(n, 50 + i)} for i, n in enumerate((300, 126, 9))]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = LLM(ckpt, **kw).generate(prompts, sp)
    spec = LLM(ckpt, speculative_config={"method": "dspark"}, **kw)
    eng = spec.engine
    assert eng.model.ops.kernels and eng.drafter.graphs is not None
    start = (eng.cache.num_free_blocks, eng.cache.num_free_slots)
    real = eng.drafter
    cont = {tuple(p["prompt_token_ids"]): r.outputs[0].token_ids for p, r in zip(prompts, ref)}
    for drafter in (OracleDSpark(real, cont), OracleDSpark(real, cont, wrong=(2, 3, 8)), real):
        eng.drafter = drafter
        outs = spec.generate(prompts, sp)
        for o, r in zip(outs, ref):
            _agree(o.outputs[0], r.outputs[0])
            assert o.metrics["num_draft_tokens"] > 0
        assert (eng.cache.num_free_blocks, eng.cache.num_free_slots) == start
    # kernels vs twins on the same weights and rings: the draft tokens and logits
    m = eng.model
    slot = eng.cache.allocate_slot()
    feats = torch.randn(200, m.dspark.feature_dim, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    m.dspark_extend([(slot, 0, feats.bfloat16())])
    args = (torch.tensor([slot], device="cuda"), torch.tensor([17], device="cuda"), torch.tensor([200], device="cuda"))
    graph = real.graphs(*args)
    kern = m.dspark_draft(*args, 5)
    saved = dict(m.ops.__dict__)           # every module holds this op table: switch it to the twins
    try:
        m.ops.__init__(m.device, False)
        tw = m.dspark_draft(*args, 5)
    finally:
        m.ops.__dict__.clear()
        m.ops.__dict__.update(saved)
    eng.cache.free_slot(slot)
    assert graph.tolist() == kern["tokens"].tolist()
    assert _cos(kern["logits"], tw["logits"]) > 0.999
    assert kern["tokens"].tolist() == tw["tokens"].tolist()
