"""The production model (``dsv4.model.deepseek_v4``) on a CPU: native weight storage, streaming
load, the oracle's numbers, and the same tokens from every checkpoint layout."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsv4.checkpoint.tiny import make_tiny
from dsv4.config import preset
from dsv4.engine.kv_cache import CacheConfig, KVCache, PagedSequenceState
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.reference.model import ReferenceModel
from golden_helpers import GoldenTally, margin


@pytest.fixture(scope="module")
def tiny(default_model_dir):
    """The tiny checkpoint (official layout, seed 0: the session's default model), read by the tests below and
    never written."""
    return default_model_dir


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    """128 routed experts per layer and a small vocabulary: expert weights dominate the bytes."""
    cfg = preset("tiny", n_routed_experts=128, vocab_size=2048)
    return make_tiny(str(tmp_path_factory.mktemp("e128") / "ck"), cfg=cfg, shards=3)


def _tensor_bytes(path):
    from dsv4.checkpoint.loader import open_checkpoint
    return open_checkpoint(path).total_bytes


def test_weights_are_stored_as_the_checkpoint_stores_them(many_experts):
    m = DeepseekV4.from_checkpoint(many_experts)
    disk = _tensor_bytes(many_experts)
    assert m.weight_bytes() <= 1.05 * disk, (m.weight_bytes(), disk)
    # no tensor of the model is a dequantised (fp32 / fp64) copy of an FP8 / FP4 weight
    for name, t in m.named_buffers():
        if t.dtype in (torch.float32, torch.float64):
            assert t.numel() <= m.cfg.vocab_size * m.cfg.hc_mult * m.cfg.hidden_size, name
    moe = m.layers[2].moe
    assert moe.w13.dtype == torch.uint8 and tuple(moe.w13.shape) == (128, 2 * 128, 128)


def test_peak_host_memory_while_loading_is_the_model_plus_one_tensor(many_experts):
    """RSS growth of a fresh process while it loads: the model's bytes plus at most about one
    shard, never a second (dequantised) copy."""
    code = f"""
import resource, torch
from dsv4.model.deepseek_v4 import DeepseekV4
torch.zeros(1)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
m = DeepseekV4.from_checkpoint({many_experts!r})
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base, m.weight_bytes())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    grew, weights = int(out[0]), int(out[1])
    shard = max(os.path.getsize(os.path.join(many_experts, f)) for f in os.listdir(many_experts)
                if f.endswith(".safetensors"))
    assert grew <= weights + shard + 64 * 2**20, (grew, weights, shard)


def _paged(cfg, n_seqs=2, blocks=8):
    cache = KVCache(cfg, CacheConfig(max_num_seqs=n_seqs + 1, num_blocks=blocks + 1))
    return cache


def test_prefill_and_decode_match_the_reference(tiny):
    """The model on its twins against the oracle (official numerics) on the same checkpoint: a
    300-token prefill, then teacher-forced decode steps."""
    m = DeepseekV4.from_checkpoint(tiny)
    ref = ReferenceModel.from_pretrained(tiny, numerics="official")
    cache = _paged(m.cfg)
    m.attach_cache(cache, 1024)
    st = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(2))
    ids = torch.randint(3, 128000, (300,), generator=torch.Generator().manual_seed(0))
    rst = ref.new_state()
    lr = ref.forward([(ids, rst)])[0]
    lf = m(m.prefill_context([(ids, st)]))[0]
    st.advance_to(300)
    cos = lambda a, b: float(a.double() @ b.double() / (a.double().norm() * b.double().norm()))
    for step in range(3):
        assert torch.isfinite(lf).all() and cos(lr, lf) > 0.9999 and int(lr.argmax()) == int(lf.argmax())
        tok = int(lr.argmax())
        lr = ref.forward([(torch.tensor([tok]), rst)])[0]
        bt = torch.full((1, m.max_blocks), -1, dtype=torch.long)
        bt[0, :len(st.block_table)] = torch.tensor(st.block_table)
        lf = m(m.decode_context(torch.tensor([tok]), torch.tensor([st.pos]), torch.tensor([st.slot]), bt))[0]
        st.advance_to(st.pos + 1)


def _steps(m, ids, trace: bool, decode=(5, 7)):
    """A prefill of ``ids`` and a decode step per token of ``decode`` -> their logits; ``trace``: with a trace
    recording (the blocks' per-op path) instead of ``Block.run``."""
    from dsv4.model.deepseek_v4 import Trace
    cache = _paged(m.cfg)
    m.attach_cache(cache, 1024)
    st = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(2))
    tr = lambda ctx: (setattr(ctx, "trace", Trace()), setattr(ctx.trace, "trace", {})) if trace else None
    ctx = m.prefill_context([(ids, st)])
    tr(ctx)
    out = [m(ctx)[0]]
    st.advance_to(len(ids))
    for tok in decode:
        bt = torch.full((1, m.max_blocks), -1, dtype=torch.long)
        bt[0, :len(st.block_table)] = torch.tensor(st.block_table)
        ctx = m.decode_context(torch.tensor([tok]), torch.tensor([st.pos]), torch.tensor([st.slot]), bt)
        tr(ctx)
        out.append(m(ctx)[0])
        st.advance_to(st.pos + 1)
    return out


def test_fused_mhc_sites_give_the_per_op_blocks_logits(tiny):
    """``Block.run`` (each block's last hc_post inside the next block's ``hc_post_pre``) against the
    per-op blocks (taken while a trace records): the same bits on the twins, and on the mHC and norm
    kernels under the interpreter (hc_post_pre one launch at the decode steps, the three kernels it
    replaces in the per-op blocks; on a GPU the norm's sum of squares may round in another order:
    tests/test_mhc.py)."""
    from dsv4.ops import Ops
    # 16 tokens: four complete CSA entries
    ids = torch.randint(3, 128000, (16,), generator=torch.Generator().manual_seed(3))
    m = DeepseekV4.from_checkpoint(tiny)
    for a, b in zip(_steps(m, ids, False), _steps(m, ids, True)):
        assert torch.equal(a, b)
    if "TRITON_INTERPRET" not in os.environ:
        return
    mk = DeepseekV4.from_checkpoint(tiny, ops=Ops("cpu", kernels={"hc_post_pre", "hc_pre", "hc_post", "rms_norm"}))
    # 3 Sinkhorn iterations on both paths instead of 20: the same loop, and the interpreter's time is mostly it
    sites = [mod for mod in mk.modules() if hasattr(mod, "iters")]
    assert sites
    for mod in sites:
        mod.iters = 3
    # a 4-token prefill (one complete CSA entry): above FUSED_MAX_T tokens both paths take the three kernels
    # there, whose interpreted time grows with the tokens; the decode step is the one-launch sites (one: a
    # second runs the same launches at the next position, the interpreter's time)
    got, want = _steps(mk, ids[:4], False, decode=(5,)), _steps(mk, ids[:4], True, decode=(5,))
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_prefill_from_bf16_workspaces_gives_the_pages_logits(tiny, monkeypatch):
    """``Attention.PREFILL_BF16_KV``: the prefill attention reads the window and compressed entries from bf16
    workspaces (lists remapped to their rows) instead of the FP8 pages: the same logits, bit for bit (on the
    twins, which read ``kv_bf16`` as the kernel does: tests/test_sparse_attention.py). Two sequences in two chunks
    each: the second chunk's window starts in the ring and its compressed entries include the first chunk's; the
    150-token sequence completes an HCA entry (ratio 128) in its second chunk, the 70-token one none (an empty
    list beside a full one); then a decode step."""
    import dsv4.layers.attention as A
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 128000, (n,), generator=g) for n in (150, 70)]

    def run(m):
        cache = _paged(m.cfg)
        m.attach_cache(cache, 1024)
        sts = [PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(3)) for _ in ids]
        out = []
        for lo, hi in ((0, 11), (11, None)):
            out.append(m(m.prefill_context([(x[lo:hi], st) for x, st in zip(ids, sts)])))
            for x, st in zip(ids, sts):
                st.advance_to(len(x[:hi]))
        bt = torch.full((2, m.max_blocks), -1, dtype=torch.long)
        for i, st in enumerate(sts):
            bt[i, :len(st.block_table)] = torch.tensor(st.block_table)
        out.append(m(m.decode_context(torch.tensor([5, 7]), torch.tensor([st.pos for st in sts]),
                                      torch.tensor([st.slot for st in sts]), bt)))
        return out

    m = DeepseekV4.from_checkpoint(tiny)
    monkeypatch.setattr(A.Attention, "PREFILL_BF16_KV", False)
    want = run(m)
    monkeypatch.setattr(A.Attention, "PREFILL_BF16_KV", True)
    got = run(m)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _two_sequence_steps(m, ids, verify):
    """Logits of a plain decode step of two sequences prefilled with ``ids`` (a fresh cache), and with ``verify``
    of a 3-row verify step after it."""
    cache = _paged(m.cfg)
    m.attach_cache(cache, 1024)
    sts = [PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(2)) for _ in ids]
    m(m.prefill_context([(x, st) for x, st in zip(ids, sts)]))
    for x, st in zip(ids, sts):
        st.advance_to(len(x))
    bt = torch.full((2, m.max_blocks), -1, dtype=torch.long)
    for i, st in enumerate(sts):
        bt[i, :len(st.block_table)] = torch.tensor(st.block_table)
    slots = torch.tensor([st.slot for st in sts])
    pos = torch.tensor([st.pos for st in sts])
    out = [m(m.decode_context(torch.tensor([5, 7]), pos, slots, bt))]
    if verify:
        out.append(m(m.decode_context(torch.tensor([9, 11, 13, 15, 17, 19]), pos + 1, slots, bt, rows=3)))
    return out


def test_decode_with_the_inverse_rope_in_the_attention_gives_the_pass_logits(tiny, monkeypatch):
    """``Attention.FUSE_DECODE_ROPE``: the decode attention rotates its output back itself (the split combine's
    epilogue) instead of ``inverse_rope``'s pass: the same logits, bit for bit, for a plain step of two sequences
    and a 3-row verify step (each row group with its own rows of cos / sin) on the twins; the plain step with the
    attention kernel under the interpreter."""
    import dsv4.layers.attention as A
    from dsv4.ops import Ops
    g = torch.Generator().manual_seed(9)
    ids = [torch.randint(3, 128000, (n,), generator=g) for n in (41, 6)]

    for ops in (None, Ops("cpu", kernels={"sparse_decode"})):
        if ops is not None and "TRITON_INTERPRET" not in os.environ:
            continue
        m = DeepseekV4.from_checkpoint(tiny, **({} if ops is None else {"ops": ops}))
        monkeypatch.setattr(A.Attention, "FUSE_DECODE_ROPE", False)
        want = _two_sequence_steps(m, ids, ops is None)
        monkeypatch.setattr(A.Attention, "FUSE_DECODE_ROPE", True)
        got = _two_sequence_steps(m, ids, ops is None)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_decode_with_the_index_queries_on_the_main_stream_gives_the_same_logits(tiny, monkeypatch):
    """``Attention.INDEX_Q_MAIN``: a CSA layer's indexer queries computed before the fork's sync and handed to the
    side branch give the logits of the queries computed in the branch, bit for bit (a plain step of two sequences
    and a 3-row verify step, contexts long enough that the top-k selects). The fork is an inline stand-in that
    reports a side stream (a CPU step never forks), so the handed-over branch runs here; the GPU streams test runs
    it on a real side stream."""
    import dsv4.layers.attention as A
    from kernel_helpers import InlineFork

    g = torch.Generator().manual_seed(10)
    ids = [torch.randint(3, 128000, (n,), generator=g) for n in (150, 90)]
    m = DeepseekV4.from_checkpoint(tiny)
    # the CSA layers' top-k selects: more compressed entries than index_topk
    assert 4 in m.cfg.compress_ratios[:m.cfg.num_hidden_layers] and 90 // 4 > m.cfg.index_topk

    monkeypatch.setattr(A, "Fork", InlineFork)
    monkeypatch.setattr(A.Attention, "INDEX_Q_MAIN", False)
    want = _two_sequence_steps(m, ids, True)
    monkeypatch.setattr(A.Attention, "INDEX_Q_MAIN", True)
    got = _two_sequence_steps(m, ids, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_batched_uneven_chunks_match_the_reference(tiny, monkeypatch):
    """Two prompts prefilled together in uneven chunks (chunk ends inside compressor windows, one
    sequence's chunk beside the other's), indexer scores in row blocks of 7 rows (the bound a long
    chunk at a long context uses), then a batched decode step, against the oracle run on the same
    chunks. Tolerances, not bits: neither side is batch invariant (a CPU GEMM's rounding depends on
    the batch's row count, and the FP8 activation steps turn a moved ulp into a moved FP8 step),
    which moves the tiny model's logits to cos ~0.997; a misplaced segment offset or window row
    does far more. Tokens must agree wherever the oracle's top-1 margin is clear."""
    import dsv4.layers.attention as A
    monkeypatch.setattr(A, "SCORE_BYTES", 2 * 40 * 7)
    m = DeepseekV4.from_checkpoint(tiny)
    ref = ReferenceModel.from_pretrained(tiny, numerics="official")
    cache = _paged(m.cfg)
    m.attach_cache(cache, 1024)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128000, (n,), generator=g) for n in (170, 300)]
    sts = [PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(2)) for _ in prompts]
    rsts = [ref.new_state() for _ in prompts]
    done = [0, 0]
    cos = lambda a, b: float(a.double() @ b.double() / (a.double().norm() * b.double().norm()))
    for plan in ([(0, 101), (1, 37)], [(0, 69), (1, 200)], [(1, 63)]):
        chunks = []
        for i, n in plan:
            chunks.append((i, prompts[i][done[i]:done[i] + n]))
            done[i] += n
        lr = ref.forward([(ids, rsts[i]) for i, ids in chunks])
        lf = m(m.prefill_context([(ids, sts[i]) for i, ids in chunks]))
        for (i, ids), a, b in zip(chunks, lr, lf):
            sts[i].advance_to(sts[i].pos + ids.numel())
            assert torch.isfinite(b).all() and cos(a, b) > 0.99, (plan, i, cos(a, b))
            assert _margin(a) < 1.0 or int(a.argmax()) == int(b.argmax())
    toks = [int(a.argmax()) for a in ref.forward([(torch.tensor([5]), r) for r in rsts])]
    bt = torch.full((2, m.max_blocks), -1, dtype=torch.long)
    for r, st in enumerate(sts):
        st.advance_to(st.pos + 1)
        bt[r, :2] = torch.tensor(st.block_table)
    # decode rows at positions 170 and 300 (the token 5 was fed above to both models' states)
    lr = ref.forward([(torch.tensor([t]), r) for t, r in zip(toks, rsts)])
    lf = m(m.decode_context(torch.tensor(toks), torch.tensor([st.pos for st in sts]),
                            torch.tensor([st.slot for st in sts]), bt))
    for a, b in zip(lr, lf):
        assert cos(a, b) > 0.99 and (_margin(a) < 1.0 or int(a.argmax()) == int(b.argmax()))


def _margin(logits):
    top = logits.topk(2).values
    return float(top[0] - top[1])


def test_prefill_rejects_a_block_table_too_short(tmp_path):
    m = DeepseekV4(preset("tiny"))
    cache = _paged(m.cfg)
    m.attach_cache(cache, 1024)
    st = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(1))
    with pytest.raises(ValueError, match="block table too short for 300 tokens"):
        m.prefill_context([(torch.arange(3, 303), st)])


def test_load_names_missing_and_unexpected_tensors(tiny):
    m = DeepseekV4(preset("tiny"))
    from dsv4.checkpoint.loader import open_checkpoint
    r = open_checkpoint(tiny)
    with pytest.raises(ValueError, match="not loaded, e.g. 'layers"):
        m.load((n, t) for n, t in r.tensors() if not n.startswith(("mtp.", "layers.5.")))
    with pytest.raises(ValueError, match="unexpected checkpoint tensor 'mtp.0"):
        m.load(r.tensors())


def _layout_tokens(path, layout):
    """The engine's greedy tokens on ``path`` (a checkpoint in ``layout``) for two prompts."""
    from dsv4 import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": torch.randint(3, 128000, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
               for n in (200, 9)]
    llm = LLM(path, max_num_seqs=2, max_model_len=512, kv_cache_memory="64MiB", log=False)
    assert llm.engine.model.expert_format == ("nvfp4" if layout == "modelopt-nvfp4" else "mxfp4")
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


@pytest.fixture(scope="module")
def official_layout_tokens(tiny):
    return _layout_tokens(tiny, "official")


@pytest.mark.parametrize("layout", ["hf", "modelopt-nvfp4"])
def test_every_layout_gives_the_official_layout_s_tokens(tmp_path, monkeypatch, layout, official_layout_tokens):
    """The three layouts map onto one set of layers: the engine gives the same greedy tokens."""
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path / "cache"))
    assert _layout_tokens(make_tiny(str(tmp_path / layout), layout=layout), layout) == official_layout_tokens


# ---------------------------------------------------------------------------------------------
# the golden outputs of DeepSeek's official inference code, through the production model
@pytest.fixture(scope="module")
def official_seed1(official_seed1_dir, golden):
    return official_seed1_dir, golden


def test_model_matches_official_golden(official_seed1):
    """Official call pattern (prefill at 0, then 1-token teacher-forced decodes) on the model's
    own paged cache, held to the golden steps as test_reference holds the oracle (``GoldenTally``)."""
    path, golden = official_seed1
    m = DeepseekV4.from_checkpoint(path)
    cache = _paged(m.cfg, n_seqs=len(golden["cases"]), blocks=4 * len(golden["cases"]))
    m.attach_cache(cache, 1024)
    tally = GoldenTally()
    for case in golden["cases"]:
        st = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(4))
        tok = None
        for step in case["steps"]:
            assert st.pos == step["start_pos"]
            if step["kind"] == "prefill":
                lg = m(m.prefill_context([(torch.tensor(case["prompt_ids"]), st)]))[0]
                st.advance_to(len(case["prompt_ids"]))
            else:
                bt = torch.full((1, m.max_blocks), -1, dtype=torch.long)
                bt[0, :len(st.block_table)] = torch.tensor(st.block_table)
                lg = m(m.decode_context(torch.tensor([tok]), torch.tensor([st.pos]), torch.tensor([st.slot]), bt))[0]
                st.advance_to(st.pos + 1)
            tally.add_logits(lg, step)
            tok = step["argmax"]
    tally.check()


def test_engine_matches_official_golden(official_seed1, monkeypatch, tmp_path):
    """The golden cases served by the engine, the requests of a round in one batch: a request starts
    at each step after one whose official top-1 margin is below 0.5 (its prompt is the case's prompt
    plus the official greedy tokens so far, as the official run was teacher-forced) and decodes
    greedily up to the next such step. A token that is not the official one puts the rest of its
    request on another prefix: those steps are not judged, and the next round starts a request at the
    step after it. Every golden step is judged once, by ``GoldenTally``."""
    from dsv4 import LLM, SamplingParams
    path, golden = official_seed1
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path))
    # prefix caching off: the requests share prefixes, and a hit moves the chunk boundaries of the
    # rest of the prompt, which moves last bits (on this random-weight model up to 2 nats at a
    # step, exactly as the same boundaries do with caching off; test_prefix_cache holds a hit to the
    # uncached run bit for bit where the boundaries agree)
    llm = LLM(path, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=1024, kv_cache_memory="64MiB",
              log=False, enable_prefix_caching=False)

    def request(case, k):                  # (prompt ids, the official steps it covers, case, first step)
        steps, j = case["steps"], k
        while j < len(steps) - 1 and margin(steps[j]) >= 0.5:
            j += 1
        return case["prompt_ids"] + case["greedy_ids"][:k], steps[k:j + 1], case, k

    reqs = []
    for case in golden["cases"]:
        k = 0
        while k < len(case["steps"]):
            reqs.append(request(case, k))
            k += len(reqs[-1][1])
    tally, rounds = GoldenTally(), 0
    while reqs:
        rounds += 1
        outs = llm.generate([{"prompt_token_ids": p} for p, _, _, _ in reqs],
                            [SamplingParams(temperature=0, max_tokens=len(st), ignore_eos=True, logprobs=1)
                             for _, st, _, _ in reqs])
        done, reqs = list(zip(reqs, outs)), []
        for (prompt, steps, case, k), o in done:
            c = o.outputs[0]
            assert len(c.token_ids) == len(steps)
            for i, step in enumerate(steps):
                tally.add_token(c.token_ids[i], c.logprobs[i][c.token_ids[i]].logprob, step, f"{len(prompt)}+{i}")
                if c.token_ids[i] != step["argmax"]:
                    if i + 1 < len(steps):       # the rest of this request's steps, teacher-forced again
                        reqs.append(request(case, k + i + 1))
                    break
    assert len(tally.where) == sum(len(c["steps"]) for c in golden["cases"]) and rounds <= 6
    tally.check()


@pytest.mark.slow
def test_prompt_longer_than_8192_tokens_runs_through_chunked_prefill(tmp_path, monkeypatch):
    """An 8,300-token prompt is prefilled by the engine in 2,048-token chunks and decodes: finite
    log-probs, every block given back (nothing caps the context at 4096)."""
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path))
    from dsv4 import LLM, SamplingParams
    llm = LLM(None, max_num_seqs=2, max_num_batched_tokens=2048, max_model_len=8448, kv_cache_memory="128MiB",
              log=False)
    eng = llm.engine
    ids = torch.randint(3, 128000, (8300,), generator=torch.Generator().manual_seed(0)).tolist()
    start = (eng.cache.num_free_blocks, eng.cache.num_free_slots)
    c = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                               logprobs=2))[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 2 and eng.stats["steps"] == 6   # 5 chunks + 1
    assert all(-30 < v.logprob <= 0 for d in c.logprobs for v in d.values())
    assert (eng.cache.num_free_blocks, eng.cache.num_free_slots) == start
