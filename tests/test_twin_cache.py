"""The CPU twins' fp32 weight cache (``twins.layer_ops._cached_fp32``): cached results equal uncached ones,
and a weight written in place is converted again (the cache follows the tensors' version counters)."""
import pytest
import torch

from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.twins import layer_ops


@pytest.fixture(scope="module")
def model(default_model_dir):
    return DeepseekV4.from_checkpoint(default_model_dir)          # the tiny checkpoint, official layout, seed 0


def _uncached(fn, *owners):
    saved = [o.__dict__.pop("_twin_fp32", None) for o in owners]
    budget = layer_ops.WEIGHT_CACHE_BYTES
    layer_ops.WEIGHT_CACHE_BYTES = 0                 # nothing is kept: every call converts
    try:
        return fn()
    finally:
        layer_ops.WEIGHT_CACHE_BYTES = budget
        for o, c in zip(owners, saved):
            if c is not None:
                o.__dict__["_twin_fp32"] = c


def test_moe_experts_and_shared_expert_follow_in_place_writes(model):
    layer = model.layers[2].moe
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, model.cfg.hidden_size, generator=g).bfloat16()
    ids = torch.randint(3, model.cfg.vocab_size, (5,), generator=g)
    run = lambda: layer_ops.moe(layer, x, ids)       # noqa: E731
    y0 = run()
    cache = layer.__dict__["_twin_fp32"]
    assert "shared" in cache and any(k[0] == "expert" for k in cache if isinstance(k, tuple))
    assert torch.equal(run(), y0) and torch.equal(_uncached(run, layer), y0)
    used = sorted(k[1] for k in cache if isinstance(k, tuple) and k[0] == "expert")
    e = used[0]
    w13, sh2 = layer.w13[e].clone(), layer.sh2.clone()
    try:
        layer.w13[e].copy_(layer.w13[(e + 1) % layer.n_experts])      # in place: same storage, new version
        layer.sh2.view(torch.uint8).bitwise_xor_(1)
        y1 = run()
        assert not torch.equal(y1, y0)
        assert torch.equal(y1, _uncached(run, layer))
    finally:
        layer.w13[e].copy_(w13)
        layer.sh2.copy_(sh2)
    assert torch.equal(run(), y0)


def test_wo_a_follows_in_place_writes(model):
    g_mod = model.layers[1].attn.wo_a
    lin = g_mod.lin
    gen = torch.Generator().manual_seed(1)
    o = torch.randn(3, g_mod.groups, lin.in_features, generator=gen).bfloat16()
    run = lambda: layer_ops.wo_a(g_mod, o)            # noqa: E731
    z0 = run()
    assert torch.equal(run(), z0) and torch.equal(_uncached(run, lin), z0)
    w = lin.weight.clone()
    try:
        lin.weight.view(torch.uint8)[:8].bitwise_xor_(2)
        z1 = run()
        assert not torch.equal(z1, z0) and torch.equal(z1, _uncached(run, lin))
    finally:
        lin.weight.copy_(w)


def test_an_owner_without_weak_references_is_served_uncached():
    import types
    owner, calls = types.SimpleNamespace(), []
    convert = lambda: calls.append(1) or torch.ones(2)     # noqa: E731
    for _ in range(2):
        assert torch.equal(layer_ops._cached_fp32(owner, "w", (torch.zeros(2),), convert), torch.ones(2))
    assert len(calls) == 2 and "_twin_fp32" not in owner.__dict__
