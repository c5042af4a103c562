"""The DSpark draft of the reference (dsv4/reference/dspark.py) on a tiny DSpark checkpoint with a
512-token vocabulary: target capture, ring contents and chunking, the block attention's mask,
chained stages, the Markov loop, the confidence head and partial blocks."""
from __future__ import annotations

import copy

import pytest
import torch

from checkpoint_helpers import small

from dsv4.checkpoint.tiny import build_tiny_tensors
from dsv4.formats.fp8 import fp8_qdq
from dsv4.reference import dspark as dspark_mod
from dsv4.reference.model import ReferenceModel
from dsv4.reference.norm import rms_norm

PROMPT = 150          # longer than the 128-row window: the rings wrap


@pytest.fixture(scope="module")
def cfg():
    return small()


@pytest.fixture(scope="module")
def tensors(cfg):
    return build_tiny_tensors(cfg, 5)


@pytest.fixture(scope="module")
def models(cfg, tensors):
    return {n: ReferenceModel(cfg, tensors, numerics=n) for n in ("invariant", "exact")}


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ctx(models):
    """Per numerics: (model, target features of a prompt, anchor = greedy next token); the
    invariant prompt is longer than the window."""
    out = {}
    for name, m in models.items():
        st = m.new_state()
        logits = m.forward([(_ids(PROMPT if name == "invariant" else 40), st)], capture=True)[0]
        out[name] = (m, st.last_features, int(logits.argmax()))
    return out


def _state(m, features, p0: int = 0):
    st = m.dspark.new_state()
    m.dspark.extend(st, features, p0)
    return st


def _same(a, b):
    for f in ("tokens", "logits", "confidence_logits", "confidence", "hidden"):
        torch.testing.assert_close(getattr(a, f), getattr(b, f), rtol=0, atol=0, msg=f)


def test_capture_is_the_hc_mean_after_each_target_block(models, cfg):
    """The feature is [mean_hc(output of block L) for L in dspark_target_layer_ids], in that order,
    and capturing it changes nothing the target computes."""
    m = models["invariant"]
    ids = _ids(20)
    st = m.new_state()
    m.trace = {}
    try:
        logits = m.forward([(ids, st)], all_logits=True, capture=True)[0]
        trace = m.trace
    finally:
        m.trace = None
    d = cfg.hidden_size
    feats = st.last_features
    assert feats.shape == (20, len(cfg.dspark_target_layer_ids) * d) and feats.dtype == torch.bfloat16
    for k, layer in enumerate(cfg.dspark_target_layer_ids):
        block_out = trace[f"L{layer}.hc_post"].double()                 # [n, hc, d], block L's output
        torch.testing.assert_close(feats[:, k * d:(k + 1) * d].double(), block_out.mean(1),
                                   rtol=2 ** -8, atol=0)
    plain = m.new_state()
    torch.testing.assert_close(m.forward([(ids, plain)], all_logits=True)[0], logits, rtol=0, atol=0)


def test_chunked_context_equals_one_shot(ctx):
    """Prompt in chunks plus 1-token decodes, each extended as it comes, gives the rings and the
    draft of a one-shot prompt bit for bit (invariant numerics)."""
    m, feats, anchor = ctx["invariant"]
    ids = _ids(PROMPT)
    st, pos = m.new_state(), 0
    for n in (70, 50, 27, 1, 1, 1):
        m.forward([(ids[pos:pos + n], st)], capture=True)
        m.dspark.extend(st.dspark, st.last_features, pos)
        pos += n
    one = _state(m, feats)
    for a, b in zip(st.dspark.rings, one.rings):
        torch.testing.assert_close(a.keys()[0], b.keys()[0], rtol=0, atol=0)
    _same(m.dspark.draft(st.dspark, anchor), m.dspark.draft(one, anchor))


def test_ring_holds_exactly_the_last_window_positions(ctx, cfg):
    m, feats, anchor = ctx["invariant"]
    W, n = cfg.sliding_window, feats.shape[0]
    st = _state(m, feats)
    d = m.dspark
    # slot p % W holds position p's row for the last W positions, from that stage's own wkv/kv_norm
    main_x = rms_norm(d.main_proj(feats[n - W:]), d.main_norm, cfg.rms_norm_eps, d.num)
    pos = torch.arange(n - W, n)
    for stage, ring in zip(d.stages, st.rings):
        slots, count = ring.keys()
        assert count == W
        torch.testing.assert_close(slots[pos % W], stage.context_kv(main_x, pos), rtol=0, atol=0)
        # stored like the main window KV: nope dims already FP8 (1x64 blocks), RoPE dims bf16
        nope = slots[:, :cfg.nope_head_dim]
        torch.testing.assert_close(fp8_qdq(nope, 64), nope, rtol=0, atol=0)
        assert not torch.equal(fp8_qdq(slots[:, cfg.nope_head_dim:], 64), slots[:, cfg.nope_head_dim:])
    # older context has no influence; the oldest and the newest window positions do
    base = d.draft(st, anchor)
    junk = feats.clone()
    junk[:n - W] = torch.randn(n - W, feats.shape[1], generator=torch.Generator().manual_seed(3)).to(feats.dtype)
    _same(d.draft(_state(m, junk), anchor), base)
    for p in (n - W, n - 1):
        changed = feats.clone()
        changed[p] = -changed[p]
        assert not torch.equal(d.draft(_state(m, changed), anchor).logits, base.logits), p


@pytest.mark.parametrize("numerics", ["exact", "invariant"])       # 40 context rows, then 150 (> window)
def test_block_positions_and_keys_follow_the_official_layout(ctx, cfg, numerics, monkeypatch):
    """With p context rows the block sits at positions p .. p+B-1 (the anchor at its own position)
    and every block row reads the ring slots [0, min(window, p)) and all B block rows: the official
    ``get_dspark_topk_idxs`` (slots, then the block appended after the window)."""
    m, feats, anchor = ctx[numerics]
    st = _state(m, feats)
    p, W, B = feats.shape[0], cfg.sliding_window, cfg.dspark_block_size
    seen, keys = [], []
    for stage in m.dspark.stages:
        rope = stage.attn.rope
        monkeypatch.setattr(stage.attn, "rope", lambda pos, rope=rope: seen.append(pos.clone()) or rope(pos))
    real = dspark_mod.sparse_attention
    monkeypatch.setattr(dspark_mod, "sparse_attention", lambda q, kv, idx, *a: keys.append(idx.clone()) or real(q, kv, idx, *a))
    m.dspark.draft(st, anchor)
    want = torch.cat([torch.arange(min(W, p)), W + torch.arange(B)])
    assert len(seen) == len(keys) == cfg.num_draft_stages
    for pos, idx in zip(seen, keys):
        assert pos.tolist() == list(range(p, p + B))
        assert torch.equal(idx, want.expand(B, -1))


def test_block_attention_is_bidirectional(ctx):
    """Row 0 (the anchor's) sees the later block rows: changing only the noise token changes its
    logits, whose Markov term (the anchor's) is the same."""
    m, feats, anchor = ctx["invariant"]
    st = _state(m, feats)
    other = copy.copy(m.dspark)
    other.noise_id = 7
    a, b = m.dspark.draft(st, anchor), other.draft(st, anchor)
    assert not torch.equal(a.logits[0], b.logits[0])
    assert not torch.equal(a.hidden[0], b.hidden[0])


def test_every_stage_is_in_the_chain(cfg, tensors, ctx):
    """Stage 0's MoE output only reaches the head if stage 1 consumes it (its ring comes from
    main_x, not from it)."""
    m, feats, anchor = ctx["invariant"]
    t = dict(tensors)
    t["mtp.0.ffn.shared_experts.w2.scale"] = tensors["mtp.0.ffn.shared_experts.w2.scale"].clone()
    t["mtp.0.ffn.shared_experts.w2.scale"].view(torch.uint8).add_(1)             # x2 on the e8m0 scales
    other = ReferenceModel(cfg, t, numerics="invariant")
    a = m.dspark.draft(_state(m, feats), anchor)
    b = other.dspark.draft(_state(other, feats), anchor)
    for ra, rb in zip(_state(m, feats).rings, _state(other, feats).rings):
        torch.testing.assert_close(ra.keys()[0], rb.keys()[0], rtol=0, atol=0)   # same rings
    assert not torch.equal(a.logits, b.logits)


def _without_markov(m):
    d = copy.copy(m.dspark)
    d.markov_w2 = copy.copy(d.markov_w2)
    d.markov_w2.weight = torch.zeros_like(d.markov_w2.weight)
    d.markov_w2._wt = torch.zeros_like(d.markov_w2._wt)
    return d


def test_markov_loop(ctx, tensors, cfg):
    m, feats, anchor = ctx["exact"]
    st = _state(m, feats)
    plain = _without_markov(m)
    base = plain.draft(st, anchor)
    # markov_w2 = 0: the drafts are the argmax of the base logits, row by row
    assert torch.equal(base.tokens, base.logits.argmax(-1))
    forced = plain.draft(st, anchor, sampler=lambda row: 11)
    torch.testing.assert_close(forced.logits, base.logits, rtol=0, atol=0)       # no token dependence
    # with it: row i gets markov_w2 @ markov_w1[tok_i], tok_0 = anchor, tok_i = draft i
    last = f"mtp.{cfg.num_draft_stages - 1}.markov_head."
    w1, w2 = tensors[last + "markov_w1.weight"].double(), tensors[last + "markov_w2.weight"].double()
    full = m.dspark.draft(st, anchor)
    prev = [anchor] + full.tokens[:-1].tolist()
    for i in range(len(prev)):
        torch.testing.assert_close(full.logits[i].double() - base.logits[i].double(), w2 @ w1[prev[i]],
                                   rtol=1e-5, atol=1e-5)
    assert torch.equal(full.tokens, full.logits.argmax(-1))
    assert not torch.equal(full.tokens, base.tokens)          # the Markov term changes these drafts
    # a sampler's choices feed the next row's Markov term
    picked = m.dspark.draft(st, anchor, sampler=lambda row: 11)
    assert picked.tokens.tolist() == [11] * cfg.dspark_block_size
    torch.testing.assert_close(picked.logits[1].double() - base.logits[1].double(), w2 @ w1[11],
                               rtol=1e-5, atol=1e-5)


def test_head_and_confidence_formulas(ctx, tensors, cfg):
    """logits = head(norm(y)) + Markov, confidence = sigmoid(proj [y; markov_w1[tok_i]]) in fp32,
    with y the pre-norm hc_head output (exact numerics: fp32 throughout)."""
    m, feats, anchor = ctx["exact"]
    st = _state(m, feats)
    r = _without_markov(m).draft(st, anchor)
    last = f"mtp.{cfg.num_draft_stages - 1}."
    y = r.hidden.double()
    normed = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + cfg.rms_norm_eps) * tensors[last + "norm.weight"].double()
    torch.testing.assert_close(r.logits.double(), normed @ tensors["head.weight"].double().T, rtol=1e-4, atol=1e-4)
    full = m.dspark.draft(st, anchor)
    proj = tensors[last + "confidence_head.proj.weight"].double()[0]
    w1 = tensors[last + "markov_head.markov_w1.weight"].double()
    i, tok_i = 2, int(full.tokens[1])                         # row 2 conditions on draft 2
    want = proj @ torch.cat([full.hidden[i].double(), w1[tok_i]])
    torch.testing.assert_close(full.confidence_logits[i].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full.confidence.double(), torch.sigmoid(full.confidence_logits.double()),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("numerics", ["invariant", "exact"])
def test_fewer_tokens_are_the_first_of_the_full_block(ctx, cfg, numerics):
    m, feats, anchor = ctx[numerics]
    st = _state(m, feats)
    B = cfg.dspark_block_size
    full = m.dspark.draft(st, anchor)
    assert full.tokens.shape == (B,) and full.tokens.dtype == torch.long
    assert full.logits.shape == (B, cfg.vocab_size) and full.logits.dtype == torch.float32
    assert full.confidence.shape == (B,) and full.confidence.dtype == torch.float32
    assert ((full.confidence > 0) & (full.confidence < 1)).all()
    for n in range(1, B):
        part = m.dspark.draft(st, anchor, n_tokens=n)
        for f in ("tokens", "logits", "confidence_logits", "confidence", "hidden"):
            torch.testing.assert_close(getattr(part, f), getattr(full, f)[:n], rtol=0, atol=0)
    _same(m.dspark.draft(st, anchor), full)                   # deterministic, and the state is unchanged


def test_official_numerics_run_and_are_deterministic(cfg, tensors, ctx):
    m = ReferenceModel(cfg, tensors, numerics="official")
    st = m.new_state()
    logits = m.forward([(_ids(20), st)], capture=True)[0]
    m.dspark.extend(st.dspark, st.last_features, 0)
    a = m.dspark.draft(st.dspark, int(logits.argmax()))
    _same(m.dspark.draft(st.dspark, int(logits.argmax())), a)
    assert a.hidden.dtype == torch.bfloat16 and st.dspark.rings[0].keys()[0].dtype == torch.bfloat16


def test_bad_input_is_refused(ctx, cfg):
    m, feats, anchor = ctx["invariant"]
    d, B = m.dspark, cfg.dspark_block_size
    with pytest.raises(ValueError, match="extend the state"):
        d.draft(d.new_state(), anchor)
    st = _state(m, feats[:10])
    with pytest.raises(ValueError, match="continue at position 10, got position 3"):
        d.extend(st, feats[10:12], 3)
    with pytest.raises(ValueError, match=r"features must be \[n, 768\]"):
        d.extend(st, feats[10:12, :256], 10)
    for n in (0, B + 1):
        with pytest.raises(ValueError, match=f"num_speculative_tokens must be in 1..dspark_block_size={B}"):
            d.draft(st, anchor, n_tokens=n)
    with pytest.raises(ValueError, match="anchor token id 512"):
        d.draft(st, 512)
    with pytest.raises(ValueError, match="sampler returned token id -1"):
        d.draft(st, anchor, sampler=lambda row: -1)


def test_only_a_dspark_checkpoint_builds_the_draft():
    for draft in ("none", "mtp"):
        c = small(draft)
        m = ReferenceModel(c, build_tiny_tensors(c, 5, draft=draft != "none"), numerics="exact")
        assert m.dspark is None and m.new_state().dspark is None
        assert (m.mtp is not None) == (draft == "mtp")
        with pytest.raises(ValueError, match="capture needs dspark_target_layer_ids"):
            m.forward([(_ids(3), m.new_state())], capture=True)
