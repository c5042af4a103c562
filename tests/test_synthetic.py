"""Real-shaped synthetic checkpoints (``dsv4 make-synthetic``): config, formats, determinism,
sharding, the three layouts through ``load_checkpoint``, the fast MXFP4 quantiser, conditioning.

Real dims are what make-synthetic is for, but they are too slow for CPU tests: the generator and
writer run here on a reduced ModelConfig with the Flash structure (layers 0..3: SWA, SWA, CSA,
HCA, then the MTP block)."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from dsv4 import cli
from dsv4.checkpoint import synthetic as syn
from dsv4.checkpoint.loader import load_checkpoint
from dsv4.checkpoint.schema import expected_specs
from dsv4.checkpoint.synthetic import (iter_synthetic_tensors, make_synthetic, parse_size, quant_mxfp4_fast,
                                       synthetic_config, synthetic_tensors)
from dsv4.checkpoint.writer import NVFP4_INPUT_SCALE
from dsv4.config import preset
from dsv4.formats.fp4 import dequant_mxfp4, dequant_nvfp4, quant_mxfp4, unpack_fp4
from dsv4.formats.fp8 import dequant_fp8_weight
from dsv4.reference.model import ReferenceModel


def reduced(vocab: int = 1024):
    return synthetic_config("flash", 4, 4).replace(
        vocab_size=vocab, hidden_size=256, num_attention_heads=4, q_lora_rank=128, o_groups=2, o_lora_rank=128,
        index_n_heads=4, moe_intermediate_size=128, index_topk=8)


@pytest.fixture(scope="module")
def cfg():
    return reduced()


@pytest.fixture(scope="module")
def tensors(cfg):
    return synthetic_tensors(cfg, seed=0, device="cpu")


@pytest.fixture(scope="module")
def official(cfg, tmp_path_factory):
    d = tmp_path_factory.mktemp("syn") / "official"
    return make_synthetic(d, cfg, layout="official", seed=0, device="cpu", max_shard_size="1MB", progress=False)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes-comparable view (torch.equal has no kernels for the 8-bit float dtypes)."""
    return t.reshape(-1).view(torch.uint8) if t.dtype.itemsize == 1 else t


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(raw(a[k]), raw(b[k])), k


# --------------------------------------------------------------------------------- config
def test_synthetic_config_keeps_the_real_dims():
    flash, pro = preset("flash"), preset("pro")
    c = synthetic_config("flash")
    assert c.num_hidden_layers == 4 and c.compress_ratios == (0, 0, 4, 128, 0)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.num_hash_layers) == (256, 6, 3)
    same = ("vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank", "o_groups", "o_lora_rank",
            "index_n_heads", "index_head_dim", "index_topk", "moe_intermediate_size", "routed_scaling_factor")
    assert all(getattr(c, f) == getattr(flash, f) for f in same)
    p = synthetic_config("pro", 3, 4)
    assert p.compress_ratios == (128, 128, 4, 0) and p.hidden_size == pro.hidden_size == 7168
    assert (p.n_routed_experts, p.num_experts_per_tok) == (4, 4)
    assert synthetic_config("pro").n_routed_experts == 384
    assert synthetic_config("flash", 1, 2).num_hash_layers == 1
    with pytest.raises(ValueError):
        synthetic_config("flash", 0)
    assert parse_size("5GB") == 5 * 10 ** 9 and parse_size("512MiB") == 512 * 2 ** 20 and parse_size(7) == 7
    with pytest.raises(ValueError):
        parse_size("5 parsecs")


# --------------------------------------------------------------------------------- MXFP4
def test_fast_mxfp4_is_bit_identical_to_the_helper():
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    ties = torch.cat([grid, grid.nextafter(torch.tensor(0.0)), grid.nextafter(torch.tensor(9.0))])
    ties = torch.cat([ties, -ties, torch.tensor([-0.0, 1e-30, -1e-38, 1e-45])])
    rows = torch.nn.functional.pad(ties, (0, -ties.numel() % 64)).view(-1, 64)
    rows[:, 31] = rows[:, 63] = 6.0                            # group amax 6: scale 1, the ties land exactly
    cases = [rows * 2.0 ** k for k in range(-30, 30, 7)] + [
        torch.randn(256, 4096, generator=g) / 64,               # an expert-like block
        torch.randn(64, 256, generator=g) * torch.logspace(-20, 20, 64)[:, None],
        torch.zeros(2, 64), torch.randn(8, 64, generator=g) * 1e-36]
    w = torch.randn(128, 512, generator=g)
    w[:, :32] = 0
    cases.append(w.bfloat16().float())
    for w in cases:
        q0, s0 = quant_mxfp4(w)
        q1, s1 = quant_mxfp4_fast(w)
        assert q1.dtype == torch.int8 and s1.dtype == torch.float8_e8m0fnu
        assert torch.equal(q0, q1) and torch.equal(raw(s0), raw(s1))
    with pytest.raises(ValueError):
        quant_mxfp4_fast(torch.tensor([[float("nan")] + [0.0] * 31]))


# --------------------------------------------------------------------------------- generator
def test_generator_formats_follow_the_schema(cfg, tensors):
    specs = expected_specs(cfg, "mxfp4")
    assert list(tensors) == list(specs)                         # schema order, every tensor once
    for n, sp in specs.items():
        assert tensors[n].dtype == sp.dtype and tuple(tensors[n].shape) == sp.shape, n
        assert tensors[n].is_contiguous()
    for n, t in tensors.items():
        if n.endswith(".scale"):
            assert t.dtype == torch.float8_e8m0fnu and int(t.view(torch.uint8).max()) < 255, n   # no NaN byte
        if ".ffn.experts." in n and n.endswith(".weight"):
            w = dequant_mxfp4(t, tensors[n[: -len("weight")] + "scale"])
            assert torch.isfinite(w).all() and (unpack_fp4(t) & 7).any(), n
        elif n.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            w = dequant_fp8_weight(t, tensors[n[: -len("weight")] + "scale"])
            assert torch.isfinite(w).all(), n
            fan_in = w.shape[1]
            assert 0.1 / fan_in ** 0.5 < float(w.std()) < 3.0 / fan_in ** 0.5, n      # fan-in scaled draws
        elif t.is_floating_point():
            assert torch.isfinite(t.float()).all(), n
    tid = tensors["layers.0.ffn.gate.tid2eid"]
    assert tid.min() >= 0 and tid.max() < cfg.n_routed_experts
    assert (tid.sort(-1).values.diff(dim=-1) > 0).all()         # distinct experts per token
    assert "layers.3.ffn.gate.bias" in tensors and "mtp.0.ffn.gate.bias" in tensors
    assert float(tensors["layers.0.attn.kv_norm.weight"].float().mean()) == pytest.approx(1.5, rel=0.05)


def test_generator_is_deterministic(cfg, tensors):
    assert_same(synthetic_tensors(cfg, seed=0, device="cpu"), tensors)
    other = {}
    for n, t in iter_synthetic_tensors(cfg, seed=1, device="cpu"):     # the start of the stream suffices
        other[n] = t
        if n == "layers.0.ffn.experts.0.w1.weight":
            break
    for n in ("embed.weight", "layers.0.attn.wq_b.weight", "layers.0.ffn.experts.0.w1.weight"):
        assert not torch.equal(raw(other[n]), raw(tensors[n])), n


# --------------------------------------------------------------------------------- writer
def _header(path):
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        h = json.loads(fh.read(n))
    h.pop("__metadata__", None)
    return n, h


def test_shards_and_index(cfg, official):
    d = official.path
    limit = parse_size("1MB")
    with open(os.path.join(d, "model.safetensors.index.json")) as fh:
        index = json.load(fh)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == official.shards > 2 and files == sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    stored = []
    for f in files:
        n, h = _header(os.path.join(d, f))
        data = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in h.values())
        assert os.path.getsize(os.path.join(d, f)) == 8 + n + data and (8 + n) % 8 == 0
        assert data <= limit or len(h) == 1, f                 # only a lone oversize tensor may exceed it
        stored += h
        assert all(index["weight_map"][k] == f for k in h)
    assert sorted(stored) == sorted(index["weight_map"]) == sorted(expected_specs(cfg, "mxfp4"))
    assert len(stored) == len(set(stored)) == official.tensors
    assert index["metadata"]["total_size"] == official.total_bytes
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.exists(os.path.join(d, f)), f


def test_official_layout_loads_and_is_deterministic(cfg, tensors, official, tmp_path):
    ck = load_checkpoint(official.path, progress=False)
    assert (ck.layout, ck.expert_format, ck.has_mtp) == ("official", "mxfp4", True)
    assert ck.config == cfg
    assert_same(ck.tensors, tensors)
    again = make_synthetic(tmp_path / "again", cfg, seed=0, device="cpu", max_shard_size="1MB", progress=False)
    for f in sorted(os.listdir(official.path)):
        with open(os.path.join(official.path, f), "rb") as a, open(os.path.join(again.path, f), "rb") as b:
            assert a.read() == b.read(), f
    with pytest.raises(FileExistsError):
        make_synthetic(again.path, cfg, device="cpu", progress=False)


def test_hf_layout_loads_to_the_same_tensors(cfg, tensors, tmp_path):
    r = make_synthetic(tmp_path / "hf", cfg, layout="hf", seed=0, device="cpu", max_shard_size="2MB",
                       progress=False, tokenizer=False)
    _, h = _header(os.path.join(r.path, "model-00001-of-%05d.safetensors" % r.shards))
    assert all(k.startswith(("model.", "lm_head.")) for k in h)
    ck = load_checkpoint(r.path, progress=False)
    assert (ck.layout, ck.expert_format) == ("hf", "mxfp4") and ck.config == cfg
    assert_same(ck.tensors, tensors)


def test_modelopt_layout_dequantises_to_the_same_experts(cfg, tensors, tmp_path):
    r = make_synthetic(tmp_path / "mo", cfg, layout="modelopt-nvfp4", seed=0, device="cpu",
                       max_shard_size="2MB", progress=False, tokenizer=False)
    assert os.path.exists(os.path.join(r.path, "hf_quant_config.json"))
    ck = load_checkpoint(r.path, progress=False)
    assert (ck.layout, ck.expert_format) == ("modelopt-nvfp4", "nvfp4")
    assert ck.config.nvfp4_experts and ck.config.replace(quantization_config=cfg.quantization_config) == cfg
    t = ck.tensors
    non_expert = {k: v for k, v in tensors.items() if ".ffn.experts." not in k}
    assert_same({k: v for k, v in t.items() if ".ffn.experts." not in k}, non_expert)
    mods = sorted({k.rsplit(".", 1)[0] for k in tensors if ".ffn.experts." in k})
    assert sorted({k.rsplit(".", 1)[0] for k in t if ".ffn.experts." in k}) == mods
    draft = [m for m in mods if m.startswith("mtp.")]
    assert draft and all(t[m + ".weight"].dtype == torch.int8 for m in draft)     # left MXFP4, as the ports do
    for m in (m for m in mods if not m.startswith("mtp.")):
        assert t[m + ".weight"].dtype == torch.uint8 and m + ".scale" not in t
        got = dequant_nvfp4(t[m + ".weight"], t[m + ".weight_scale"], t[m + ".weight_scale_2"])
        assert torch.equal(got, dequant_mxfp4(tensors[m + ".weight"], tensors[m + ".scale"])), m   # lossless
        assert t[m + ".input_scale"].item() == NVFP4_INPUT_SCALE
        if m.endswith("w1"):
            assert torch.equal(t[m + ".weight_scale_2"], t[m[:-1] + "3.weight_scale_2"])


def test_cli_make_synthetic(cfg, tensors, tmp_path, monkeypatch, capsys):
    seen = {}

    def small(preset, layers, experts, draft="mtp"):
        seen["args"] = (preset, layers, experts, draft)
        return cfg
    monkeypatch.setattr(syn, "synthetic_config", small)
    d = tmp_path / "cli"
    rc = cli.main(["make-synthetic", str(d), "--preset", "pro", "--layers", "2", "--experts", "4",
                   "--device", "cpu", "--max-shard-size", "4MB", "--seed", "0"])
    out = capsys.readouterr()
    assert rc == 0 and seen["args"] == ("pro", 2, 4, "mtp")
    assert out.out.strip().endswith(str(d)) and "MB" in out.out and "B/s" in out.err   # bytes progress bar
    assert_same(load_checkpoint(str(d), progress=False).tensors, tensors)
    assert cli.main(["make-synthetic", str(d), "--device", "cpu"]) == 2          # exists: clear error
    assert "exists" in capsys.readouterr().err


# --------------------------------------------------------------------------------- conditioning
def test_reference_model_has_clear_greedy_margins():
    """Finite logits and clear top-1 margins through all layer kinds (real vocab, reduced widths)."""
    c = reduced(vocab=129280)
    m = ReferenceModel(c, synthetic_tensors(c, seed=0, device="cpu"), numerics="invariant")
    ids = torch.randint(3, 128000, (24,), generator=torch.Generator().manual_seed(0))
    st = m.new_state()
    lg = m.forward([(ids, st)])[0]
    margins = []
    for _ in range(8):
        assert torch.isfinite(lg).all()
        top = lg.float().topk(2).values
        margins.append(float(top[0] - top[1]))
        lg = m.forward([(lg.argmax().view(1), st)])[0]
    margins = torch.tensor(margins)
    assert margins.median() >= 1.0, margins
    assert (margins >= 0.5).float().mean() >= 0.75, margins


# --------------------------------------------------------------------------------- serving
def test_engine_serves_the_generator_in_memory_as_from_disk(cfg, official, monkeypatch, capsys):
    """``--synthetic``: the generator's tensors go straight into the model; the engine then gives
    the greedy tokens of the same checkpoint written by make-synthetic and served from disk."""
    from dsv4.engine.llm_engine import LLMEngine
    from dsv4.engine.sampling_params import SamplingParams
    monkeypatch.setattr(syn, "synthetic_config", lambda preset, layers, experts: cfg)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def greedy(**kw):
        eng = LLMEngine(kv_cache_memory="32MiB", max_model_len=512, **kw)
        eng.add_request("r", {"prompt_token_ids": [0] + list(range(100, 140))}, sp)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    return eng, list(o.outputs[0].token_ids)
    eng, mem = greedy(synthetic="flash", synthetic_layers=4, synthetic_experts=4)
    assert "loaded synthetic flash (4 layers, 4 experts, seed 0)" in capsys.readouterr().err
    assert eng.model.weight_bytes() <= 1.05 * official.total_bytes
    _, disk = greedy(model=official.path)
    assert mem == disk and len(mem) == 6
    with pytest.raises(ValueError, match="not both"):
        LLMEngine(model=official.path, synthetic="flash")
    rc = cli.main(["generate", "1 2 3", "--synthetic", "flash", "--layers", "4", "--max-tokens", "3", "-q",
                   "--kv-cache-memory", "32MiB", "--max-model-len", "256"])
    assert rc == 0 and capsys.readouterr().out.strip()
