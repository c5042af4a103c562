"""dsv4.checkpoint: schema, writer / loader round trips in 3 layouts, tiny model, bad checkpoints."""
import filecmp
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from checkpoint_helpers import clone_dir, edit_json, rewrite_shard, shard_of
from conftest import skip_or_fail_without_shared
import torch
from safetensors.torch import load_file, save_file

from dsv4.checkpoint import (CheckpointConfigError, CheckpointError, build_tiny_tensors,
                             expected_tensors, load_checkpoint, make_tiny, official_to_hf,
                             save_checkpoint)
from dsv4.checkpoint.writer import NVFP4_INPUT_SCALE, tokenizer_dir
from dsv4.config import ConfigError, preset
from dsv4.formats.fp4 import dequant_mxfp4, dequant_nvfp4
from dsv4.formats.fp8 import dequant_fp8_weight

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFICIAL_TOOL = os.path.join(REPO, "..", "shared", "tools", "make_tiny_official.py")


# ----------------------------------------------------------------------------- helpers
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def assert_same_dict(a: dict, b: dict):
    assert list(a) == list(b) or set(a) == set(b)
    bad = [k for k in a if not same_bits(a[k], b[k])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:5]}"


def dequant_expert(t: dict, mod: str) -> torch.Tensor:
    if mod + ".weight_scale_2" in t:
        return dequant_nvfp4(t[mod + ".weight"], t[mod + ".weight_scale"], t[mod + ".weight_scale_2"])
    if t[mod + ".weight"].dtype == torch.int8:
        return dequant_mxfp4(t[mod + ".weight"], t[mod + ".scale"])
    return dequant_fp8_weight(t[mod + ".weight"], t[mod + ".scale"])


def expert_modules(t: dict) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in t if ".ffn.experts." in k})


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="module")
def tiny(cfg):
    return build_tiny_tensors(cfg, 0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def official_dir(tiny, cfg, root):
    return save_checkpoint(tiny, cfg, root / "official", layout="official")


@pytest.fixture(scope="module")
def hf_dir(tiny, cfg, root):
    return save_checkpoint(tiny, cfg, root / "hf", layout="hf", tokenizer=False)


@pytest.fixture(scope="module")
def modelopt_dir(tiny, cfg, root):
    return save_checkpoint(tiny, cfg, root / "modelopt", layout="modelopt-nvfp4", tokenizer=False)


@pytest.fixture(scope="module")
def small_cfg():
    return preset("tiny", vocab_size=512)


@pytest.fixture(scope="module")
def small_tensors(small_cfg):
    return build_tiny_tensors(small_cfg, 3)


@pytest.fixture(scope="module")
def small_dir(small_tensors, small_cfg, root):
    """Small-vocab official checkpoint in 3 shards: the template for the bad-checkpoint cases."""
    return save_checkpoint(small_tensors, small_cfg, root / "small", shards=3, tokenizer=False)


@pytest.fixture
def bad(small_dir, tmp_path):
    return clone_dir(small_dir, tmp_path / "bad")


# ----------------------------------------------------------------------------- schema / tiny
def test_schema_matches_tiny(tiny, cfg):
    exp = expected_tensors(cfg, "mxfp4")
    assert list(exp) == list(tiny)
    for k, (shape, dtype) in exp.items():
        assert (tuple(tiny[k].shape), tiny[k].dtype) == (shape, dtype), k


def test_schema_structure(cfg):
    exp = expected_tensors(cfg, "mxfp4")
    L = cfg.num_hidden_layers
    for i, ratio in enumerate(cfg.compress_ratios[:L]):
        p = f"layers.{i}.attn."
        assert (p + "indexer.wq_b.weight" in exp) == (ratio == 4)
        assert (p + "compressor.wkv.weight" in exp) == (ratio > 0)
        if ratio:
            coff = 2 if ratio == 4 else 1
            assert exp[p + "compressor.ape"][0] == (ratio, coff * cfg.head_dim)
            assert exp[p + "compressor.wkv.weight"][0] == (coff * cfg.head_dim, cfg.hidden_size)
        assert (f"layers.{i}.ffn.gate.tid2eid" in exp) == (i < cfg.num_hash_layers)
        assert (f"layers.{i}.ffn.gate.bias" in exp) == (i >= cfg.num_hash_layers)
    assert exp["layers.0.ffn.gate.tid2eid"] == ((cfg.vocab_size, cfg.num_experts_per_tok), torch.int64)
    # MTP: ratio 0 (no compressor), score-routed with bias, own hc_head and norms
    assert "mtp.0.ffn.gate.bias" in exp and "mtp.0.ffn.gate.tid2eid" not in exp
    assert "mtp.0.attn.compressor.wkv.weight" not in exp
    for k in ("mtp.0.e_proj.scale", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hc_head_fn",
              "mtp.0.ffn.experts.7.w2.scale"):
        assert k in exp
    assert not any(k.startswith("mtp.") for k in expected_tensors(cfg, "mxfp4", draft=False))
    # formats
    assert exp["layers.0.ffn.experts.0.w1.weight"] == ((128, 128), torch.int8)
    assert exp["layers.0.ffn.experts.0.w2.scale"] == ((256, 4), torch.float8_e8m0fnu)
    assert exp["layers.0.attn.wo_a.scale"] == ((2, 16), torch.float8_e8m0fnu)
    bf = expected_tensors(cfg, "mxfp4", wo_a="bf16")
    assert "layers.0.attn.wo_a.scale" not in bf and bf["layers.0.attn.wo_a.weight"][1] == torch.bfloat16
    nv = expected_tensors(cfg, "nvfp4")
    m = "layers.3.ffn.experts.1.w2"
    assert nv[m + ".weight"] == ((256, 64), torch.uint8)
    assert nv[m + ".weight_scale"] == ((256, 8), torch.float8_e4m3fn)
    assert nv[m + ".weight_scale_2"] == ((), torch.float32) and nv[m + ".input_scale"] == ((), torch.float32)
    assert m + ".scale" not in nv
    f8 = expected_tensors(cfg, "fp8")
    assert f8[m + ".weight"] == ((256, 128), torch.float8_e4m3fn) and f8[m + ".scale"][0] == (2, 1)
    # the Flash preset reproduces spec §1.3 shapes
    fl = expected_tensors(preset("flash"), "mxfp4")
    assert fl["layers.0.attn.wo_a.weight"][0] == (8192, 4096) and fl["layers.0.attn.wo_a.scale"][0] == (64, 32)
    assert fl["layers.2.attn.compressor.ape"][0] == (4, 1024) and fl["layers.3.attn.compressor.ape"][0] == (128, 512)
    assert fl["layers.0.ffn.experts.0.w1.scale"][0] == (2048, 128)
    assert fl["layers.2.attn.indexer.compressor.ape"][0] == (4, 256)
    assert fl["mtp.0.e_proj.scale"][0] == (32, 32)


def test_tiny_weights_are_sane(tiny, cfg):
    for k, t in tiny.items():
        if t.is_floating_point() and t.element_size() > 1:
            assert torch.isfinite(t.float()).all(), k
    tab = tiny["layers.0.ffn.gate.tid2eid"]
    assert tab.min() >= 0 and tab.max() < cfg.n_routed_experts
    assert (tab[:, 0] != tab[:, 1]).all()                      # distinct experts per token
    assert 4.6 < tiny["embed.weight"].float().std() < 5.4
    assert 1.3 < tiny["layers.0.attn.kv_norm.weight"].float().mean() < 1.7
    assert 1.8 < tiny["layers.2.attn.compressor.norm.weight"].float().mean() < 2.2
    comb = tiny["layers.0.hc_attn_base"][8:].view(4, 4)
    assert (comb.diagonal() > comb.sum(1) - comb.diagonal() - 1.5).all()   # identity-biased
    assert 0.0 < tiny["layers.0.attn.attn_sink"].mean() < 2.5
    norms = tiny["head.weight"].float().norm(dim=1)
    assert norms.max() / norms.median() > 3                                 # log-normal spread
    # hot SwiGLU channels: some w1 rows with |w| ~ 8/sqrt(d) -> pre-activations beyond the clamp
    w1 = dequant_mxfp4(tiny["layers.3.ffn.experts.0.w1.weight"], tiny["layers.3.ffn.experts.0.w1.scale"])
    row = w1.norm(dim=1)
    assert (row > 4 * row.median()).sum() == 4
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    assert ((x @ w1.T).abs() > cfg.swiglu_limit).any()


def test_determinism(tiny, cfg, official_dir, tmp_path, monkeypatch):
    import dsv4.checkpoint.tiny
    monkeypatch.setattr(dsv4.checkpoint.tiny, "BUILD_CACHE", 0)           # a second build, not the kept one
    again = build_tiny_tensors(cfg, 0)
    assert_same_dict(again, tiny)
    other = build_tiny_tensors(preset("tiny", vocab_size=512), 1)
    assert not same_bits(other["layers.0.attn.wq_a.weight"], tiny["layers.0.attn.wq_a.weight"])
    assert not torch.equal(other["norm.weight"], tiny["norm.weight"])
    out = make_tiny(tmp_path / "again", seed=0)
    for f in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert filecmp.cmp(os.path.join(out, f), os.path.join(official_dir, f), shallow=False), f


# ----------------------------------------------------------------------------- round trips
def test_official_round_trip_bit_exact(tiny, cfg, official_dir):
    ck = load_checkpoint(official_dir, progress=False)
    assert (ck.layout, ck.expert_format, ck.wo_a_format, ck.has_mtp) == ("official", "mxfp4", "fp8", True)
    assert ck.config == cfg
    assert list(ck.tensors) == list(tiny)
    assert_same_dict(ck.tensors, tiny)
    files = set(os.listdir(official_dir))
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert "model.safetensors.index.json" not in files and "hf_quant_config.json" not in files
    assert not [f for f in os.listdir(os.path.dirname(official_dir)) if ".tmp-" in f]
    assert filecmp.cmp(os.path.join(official_dir, "tokenizer.json"),
                       os.path.join(tokenizer_dir(), "tokenizer.json"), shallow=False)
    with open(os.path.join(official_dir, "config.json")) as fh:
        assert "moe_quant_algo" not in json.load(fh)
    with open(os.path.join(official_dir, "generation_config.json")) as fh:
        g = json.load(fh)
    assert (g["bos_token_id"], g["eos_token_id"], g["temperature"], g["top_p"]) == (0, 1, 1.0, 1.0)


def test_progress_bar_goes_to_stderr(official_dir, capsys):
    load_checkpoint(official_dir, progress=True)
    out, err = capsys.readouterr()
    # counted in bytes: "<done>MB/<total>MB [.., <rate>MB/s]"
    assert out == "" and re.search(r"[0-9.]+[kMG]?B/[0-9.]+[kMG]?B", err) and "B/s" in err, err


def test_hf_layout(tiny, cfg, hf_dir):
    names = set(load_file(os.path.join(hf_dir, "model.safetensors")))
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.hc_head.hc_fn",
              "model.layers.0.self_attn.q_a_proj.weight_scale_inv", "model.layers.0.self_attn.sinks",
              "model.layers.0.attn_hc.scale", "model.layers.0.mlp.gate.tid2eid",
              "model.layers.3.mlp.gate.e_score_correction_bias",
              "model.layers.2.self_attn.compressor.indexer.position_bias",
              "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight",
              "model.layers.3.self_attn.compressor.kv_norm.weight",
              "model.layers.0.mlp.shared_experts.up_proj.weight",
              "model.mtp.0.e_proj.weight_scale_inv", "model.mtp.0.hc_head.hc_scale",
              "model.mtp.0.mlp.experts.gate_up_proj"):
        assert n in names, n
    assert not any(n.startswith("layers.") or ".experts.0." in n for n in names)
    assert official_to_hf("layers.0.attn.wo_a.scale") == "model.layers.0.self_attn.o_a_proj.weight_scale_inv"
    t = load_file(os.path.join(hf_dir, "model.safetensors"))
    gu = t["model.layers.3.mlp.experts.gate_up_proj"]
    E, inter, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert gu.shape == (E, 2 * inter, d // 2) and gu.dtype == torch.int8
    assert t["model.layers.3.mlp.experts.gate_up_proj_scale_inv"].shape == (E, 2 * inter, d // 32)
    assert t["model.layers.3.mlp.experts.down_proj"].shape == (E, d, inter // 2)
    assert same_bits(gu[5, inter:], tiny["layers.3.ffn.experts.5.w3.weight"])
    ck = load_checkpoint(hf_dir, progress=False)
    assert (ck.layout, ck.expert_format, ck.has_mtp) == ("hf", "mxfp4", True)
    assert ck.config == cfg
    assert list(ck.tensors) == list(tiny)
    assert_same_dict(ck.tensors, tiny)


def test_hf_layout_fp8_experts_without_mtp_and_aliases(cfg, tmp_path):
    """FP8 experts (expert_dtype null) stack too; MTP-less hf checkpoints load with has_mtp False."""
    c = preset("tiny", vocab_size=512, expert_dtype=None)
    t = {k: v for k, v in build_tiny_tensors(c, 5).items() if not k.startswith("mtp.")}
    assert t["layers.0.ffn.experts.0.w1.weight"].dtype == torch.float8_e4m3fn
    d = save_checkpoint(t, c, tmp_path / "hf8", layout="hf", tokenizer=False)
    st = os.path.join(d, "model.safetensors")
    sh = load_file(st)["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape
    assert sh == (c.n_routed_experts, 2, 2)
    # the alternative transformers spelling q_norm (instead of q_a_norm) is accepted
    rewrite_shard(st, lambda x: x.update({"model.layers.0.self_attn.q_norm.weight":
                                           x.pop("model.layers.0.self_attn.q_a_norm.weight")}))
    ck = load_checkpoint(d, progress=False)
    assert (ck.layout, ck.expert_format, ck.has_mtp) == ("hf", "fp8", False)
    assert not any(k.startswith("mtp.") for k in ck.tensors)
    assert_same_dict(ck.tensors, t)


def test_modelopt_nvfp4_layout(tiny, cfg, official_dir, modelopt_dir, tmp_path):
    """NVIDIA's port form: ModelOpt keys inside quantization_config, the main stack's experts NVFP4,
    the draft's (mtp.*) left MXFP4 and listed under ignore; hf_quant_config.json says the same."""
    main = [f"layers.{i}.ffn.experts" for i in range(cfg.num_hidden_layers)]
    with open(os.path.join(modelopt_dir, "config.json")) as fh:
        c = json.load(fh)
    assert "moe_quant_algo" not in c
    qc = c["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["moe_quant_algo"], qc["group_size"]) == \
        ("fp8", "MIXED_PRECISION", "NVFP4", 16)
    assert qc["kv_cache_quant_algo"] is None and "mtp.*" in qc["ignore"]
    assert sorted(qc["quantized_layers"]) == sorted(main)
    assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    with open(os.path.join(modelopt_dir, "hf_quant_config.json")) as fh:
        q = json.load(fh)["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION" and q["kv_cache_quant_algo"] is None
    assert sorted(q["quantized_layers"]) == sorted(main)
    assert q["quantized_layers"]["layers.0.ffn.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
    ck = load_checkpoint(modelopt_dir, progress=False)
    assert (ck.layout, ck.expert_format, ck.draft) == ("modelopt-nvfp4", "nvfp4", "mtp")
    assert ck.expert_formats == {**{m[:-len("ffn.experts")]: "nvfp4" for m in main}, "mtp.0.": "mxfp4"}
    assert ck.config.nvfp4_experts and ck.config.replace(quantization_config=cfg.quantization_config) == cfg
    t = ck.tensors
    non_expert = [k for k in tiny if ".ffn.experts." not in k]
    assert [k for k in t if ".ffn.experts." not in k] == non_expert
    assert_same_dict({k: t[k] for k in non_expert}, {k: tiny[k] for k in non_expert})
    mods = expert_modules(tiny)
    assert expert_modules(t) == mods
    for m in mods:
        if m.startswith("mtp."):              # the draft's experts are stored as released
            assert same_bits(t[m + ".weight"], tiny[m + ".weight"]) and m + ".weight_scale" not in t
            continue
        assert t[m + ".weight"].dtype == torch.uint8 and m + ".scale" not in t
        assert torch.equal(dequant_expert(t, m), dequant_expert(tiny, m)), m
        assert t[m + ".input_scale"].item() == NVFP4_INPUT_SCALE
    for m in mods[::3]:                       # w1 / w3 share weight_scale_2 (fused GEMM1)
        base = m[:-1]
        if not m.startswith("mtp."):
            assert torch.equal(t[base + "1.weight_scale_2"], t[base + "3.weight_scale_2"])
    # NVFP4 tensors write back unchanged; they cannot be written in the official / hf layouts
    again = save_checkpoint(t, ck.config, tmp_path / "mo2", layout="modelopt-nvfp4", tokenizer=False)
    assert_same_dict(load_checkpoint(again, progress=False).tensors, t)
    with pytest.raises(CheckpointError, match="NVFP4"):
        save_checkpoint(t, ck.config, tmp_path / "no", layout="official")
    with pytest.raises(CheckpointError, match="NVFP4"):
        save_checkpoint(t, ck.config, tmp_path / "no2", layout="hf")


def test_sharded_with_index(tiny, cfg, tmp_path):
    d = save_checkpoint(tiny, cfg, tmp_path / "sh", shards=3, tokenizer=False)
    shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    with open(os.path.join(d, "model.safetensors.index.json")) as fh:
        idx = json.load(fh)
    assert set(idx["weight_map"]) == set(tiny) and set(idx["weight_map"].values()) == set(shards)
    assert idx["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in tiny.values())
    ck = load_checkpoint(d, progress=False)
    assert_same_dict(ck.tensors, tiny)
    # no index: the *.safetensors files of the directory are read
    os.unlink(os.path.join(d, "model.safetensors.index.json"))
    assert_same_dict(load_checkpoint(d, progress=False).tensors, tiny)


def test_wo_a_bf16_and_no_mtp(small_tensors, small_cfg, tmp_path):
    """convert.py form of wo_a (bf16, no scale) and a checkpoint without MTP both load."""
    t = {k: v for k, v in small_tensors.items() if not k.startswith("mtp.")}
    for i in range(small_cfg.num_hidden_layers):
        p = f"layers.{i}.attn.wo_a."
        t[p + "weight"] = dequant_fp8_weight(t[p + "weight"], t.pop(p + "scale")).to(torch.bfloat16)
    d = save_checkpoint(t, small_cfg, tmp_path / "conv", tokenizer=False)
    ck = load_checkpoint(d, progress=False)
    assert (ck.layout, ck.wo_a_format, ck.has_mtp) == ("official", "bf16", False)
    assert_same_dict(ck.tensors, t)
    exact = dequant_fp8_weight(small_tensors["layers.2.attn.wo_a.weight"], small_tensors["layers.2.attn.wo_a.scale"])
    assert torch.equal(ck.tensors["layers.2.attn.wo_a.weight"].float(), exact)


def test_layout_auto_detection(official_dir, hf_dir, modelopt_dir):
    for d, lay in ((official_dir, "official"), (hf_dir, "hf"), (modelopt_dir, "modelopt-nvfp4")):
        assert load_checkpoint(d, progress=False).layout == lay


def test_official_tiny_writer_reproduces_the_golden_checkpoint(official_seed1_dir, golden):
    """dsv4's own writer (``checkpoint.official_tiny``) writes the checkpoint the golden outputs were
    computed on: every file the golden file lists has the sha256 it records; the loader reads it
    as the official layout of ``preset('tiny')``."""
    import hashlib
    sums = golden["checkpoint"]["sha256"]
    assert len(sums) == 3
    for name, want in sums.items():
        with open(os.path.join(official_seed1_dir, name), "rb") as fh:
            assert hashlib.sha256(fh.read()).hexdigest() == want, name
    ck = load_checkpoint(official_seed1_dir, progress=False)
    assert (ck.layout, ck.expert_format, ck.wo_a_format, ck.has_mtp) == ("official", "mxfp4", "fp8", True)
    assert ck.tensors["layers.0.attn.wo_a.weight"].dtype == torch.float8_e4m3fn
    assert ck.tensors["layers.0.attn.wo_a.scale"].dtype == torch.float8_e8m0fnu
    assert ck.config == preset("tiny")
    assert set(ck.tensors) == set(expected_tensors(preset("tiny"), "mxfp4"))


def test_official_tiny_writer_equals_the_shared_tool(official_seed1_dir, tmp_path):
    """Where ``../shared`` is there, the tool that wrote the golden run's checkpoint and dsv4's
    writer give identical files (all of them: shards, index, config, generation config)."""
    tool = os.path.normpath(OFFICIAL_TOOL)
    if not os.path.isfile(tool):
        skip_or_fail_without_shared(f"external tool {tool} (<repo>/../shared/tools/make_tiny_official.py)")
    out = tmp_path / "official_tool"
    # on MKL's COMPATIBLE path, as the fixture's checkpoint is written (conftest.official_seed1_dir)
    subprocess.run([sys.executable, tool, str(out), "--seed", "1"], check=True, capture_output=True,
                   timeout=300, env=dict(os.environ, MKL_CBWR="COMPATIBLE"))
    names = sorted(os.listdir(out))
    assert names == sorted(os.listdir(official_seed1_dir)) and len(names) == 5
    _, diff, errors = filecmp.cmpfiles(out, official_seed1_dir, names, shallow=False)
    assert not diff and not errors, (diff, errors)


# ----------------------------------------------------------------------------- writer errors
def test_writer_rejects_bad_input_and_is_atomic(small_tensors, small_cfg, tmp_path, monkeypatch):
    t = dict(small_tensors)
    del t["layers.1.attn.q_norm.weight"]
    with pytest.raises(CheckpointError, match=r"<tensors>.*layers\.1\.attn\.q_norm\.weight.*missing"):
        save_checkpoint(t, small_cfg, tmp_path / "x")
    assert not os.path.exists(tmp_path / "x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    with pytest.raises(FileExistsError):
        save_checkpoint(small_tensors, small_cfg, tmp_path / "full")
    import dsv4.checkpoint.writer as w

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(w, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(small_tensors, small_cfg, tmp_path / "y")
    assert sorted(os.listdir(tmp_path)) == ["full"]           # no out_dir, no temp dir left


# ----------------------------------------------------------------------------- bad checkpoints
def test_bad_missing_tensor(bad):
    name = "layers.4.attn.indexer.weights_proj.weight"
    rewrite_shard(shard_of(bad, name), lambda t: t.pop(name))
    edit_json(os.path.join(bad, "model.safetensors.index.json"), lambda d: d["weight_map"].pop(name))
    with pytest.raises(CheckpointError, match=re.escape("model.safetensors.index.json") + ".*" +
                       re.escape(f"'{name}' is missing") + r".*BF16 \[4, 256\]"):
        load_checkpoint(bad, progress=False)


def test_bad_unexpected_tensor(bad):
    f = shard_of(bad, "norm.weight")
    rewrite_shard(f, lambda t: t.update({"layers.0.attn.bogus.weight": torch.zeros(3)}))
    edit_json(os.path.join(bad, "model.safetensors.index.json"),
              lambda d: d["weight_map"].update({"layers.0.attn.bogus.weight": os.path.basename(f)}))
    with pytest.raises(CheckpointError,
                       match=re.escape(f) + r": unexpected tensor 'layers\.0\.attn\.bogus\.weight' \(F32 \[3\]\)"):
        load_checkpoint(bad, progress=False)


def test_bad_wrong_shape(bad):
    name = "layers.1.attn.q_norm.weight"
    f = shard_of(bad, name)
    rewrite_shard(f, lambda t: t.update({name: torch.ones(64, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=re.escape(f) + r".*'layers\.1\.attn\.q_norm\.weight' has shape \[64\], "
                       r"expected \[128\].*q_lora_rank=128"):
        load_checkpoint(bad, progress=False)


def test_bad_wrong_dtype(bad):
    name = "layers.0.attn_norm.weight"
    f = shard_of(bad, name)
    rewrite_shard(f, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(CheckpointError,
                       match=re.escape(f) + r": tensor 'layers\.0\.attn_norm\.weight' has dtype F32, expected BF16"):
        load_checkpoint(bad, progress=False)


def test_bad_expert_dtype_vs_config(bad):
    edit_json(os.path.join(bad, "config.json"), lambda d: d.update({"expert_dtype": None}))
    name = "layers.0.ffn.experts.0.w1.weight"
    with pytest.raises(CheckpointError, match=re.escape(shard_of(bad, name)) + ": tensor '" + re.escape(name) +
                       r"' is I8 \[128, 128\] \(MXFP4 .*config\.json \(expert_dtype=None.* announces FP8"):
        load_checkpoint(bad, progress=False)


def test_bad_truncated_shard(bad):
    f = os.path.join(bad, "model-00003-of-00003.safetensors")
    with open(f, "rb") as fh:
        data = fh.read()
    os.unlink(f)                                   # hard link: write a new file
    with open(f, "wb") as fh:
        fh.write(data[:-1000])
    with pytest.raises(CheckpointError, match=re.escape(f) + r": truncated safetensors file: tensor '[^']+' .*"
                       r"expected file size \d+ bytes, found \d+"):
        load_checkpoint(bad, progress=False)


def test_bad_corrupt_header(bad):
    f = os.path.join(bad, "model-00002-of-00003.safetensors")
    with open(f, "rb") as fh:
        data = bytearray(fh.read())
    data[8:20] = b"\x00garbage!!\xff\xfe"
    os.unlink(f)
    with open(f, "wb") as fh:
        fh.write(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f) + ": corrupt safetensors header"):
        load_checkpoint(bad, progress=False)


def test_bad_index_points_at_missing_file(bad):
    idx = os.path.join(bad, "model.safetensors.index.json")
    edit_json(idx, lambda d: d["weight_map"].update({"head.weight": "model-00009-of-00009.safetensors"}))
    with pytest.raises(CheckpointError, match=re.escape(idx) + r": tensor 'head\.weight' .*"
                       r"'model-00009-of-00009\.safetensors', which does not exist"):
        load_checkpoint(bad, progress=False)


def test_bad_index_points_at_missing_tensor(bad):
    idx = os.path.join(bad, "model.safetensors.index.json")
    edit_json(idx, lambda d: d["weight_map"].update({"layers.0.attn.ghost": "model-00001-of-00003.safetensors"}))
    with pytest.raises(CheckpointError, match=re.escape(idx) + r": tensor 'layers\.0\.attn\.ghost' is mapped to "
                       r"file 'model-00001-of-00003\.safetensors', but .* has no tensor of that name"):
        load_checkpoint(bad, progress=False)


def test_bad_tensor_not_in_index(bad):
    idx = os.path.join(bad, "model.safetensors.index.json")
    f = shard_of(bad, "norm.weight")
    edit_json(idx, lambda d: d["weight_map"].pop("norm.weight"))
    with pytest.raises(CheckpointError, match=re.escape(f) + r": tensor 'norm\.weight' is stored in this file but "
                       + re.escape(idx) + r" does not map it here \(the index does not list it\)"):
        load_checkpoint(bad, progress=False)


def test_bad_config_hidden_size_vs_embedding(bad):
    edit_json(os.path.join(bad, "config.json"), lambda d: d.update({"hidden_size": 384}))
    f = shard_of(bad, "embed.weight")
    with pytest.raises(CheckpointError, match=re.escape(f) + r": tensor 'embed\.weight' has shape \[512, 256\], "
                       r"expected \[512, 384\].*dim 1 is 256, expected 384 = hidden_size.*"
                       r"config\.json \(hidden_size=384\) disagrees with this tensor"):
        load_checkpoint(bad, progress=False)


def test_bad_missing_config(bad):
    os.unlink(os.path.join(bad, "config.json"))
    cfg_path = os.path.join(bad, "config.json")
    with pytest.raises(CheckpointError, match=re.escape(cfg_path) + ": config.json not found") as ei:
        load_checkpoint(bad, progress=False)
    assert isinstance(ei.value, ConfigError) and isinstance(ei.value, CheckpointConfigError)


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"),
    (None, "num_attention_heads"),
])
def test_bad_invalid_config(bad, text, match):
    p = os.path.join(bad, "config.json")
    if text is None:
        edit_json(p, lambda d: d.update({"num_attention_heads": -8}))
    else:
        with open(p, "w") as fh:
            fh.write(text)
    with pytest.raises(CheckpointConfigError, match=re.escape(p) + ".*" + match):
        load_checkpoint(bad, progress=False)


def test_bad_tid2eid_values(bad):
    name = "layers.1.ffn.gate.tid2eid"
    f = shard_of(bad, name)

    def poke(t):
        t[name] = t[name].clone()
        t[name][7, 1] = 99
    rewrite_shard(f, poke)
    with pytest.raises(CheckpointError, match=re.escape(f) + r": tensor 'layers\.1\.ffn\.gate\.tid2eid' "
                       r"holds expert ids outside \[0, n_routed_experts=8\) \(row 7"):
        load_checkpoint(bad, progress=False)


def test_bad_duplicate_tensor_without_index(bad):
    os.unlink(os.path.join(bad, "model.safetensors.index.json"))
    f1 = os.path.join(bad, "model-00001-of-00003.safetensors")
    rewrite_shard(os.path.join(bad, "model-00003-of-00003.safetensors"),
                  lambda t: t.update({"embed.weight": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=r"tensor 'embed\.weight' is also stored in " + re.escape(f1)):
        load_checkpoint(bad, progress=False)


def test_bad_modelopt(small_tensors, small_cfg, tmp_path):
    good = save_checkpoint(small_tensors, small_cfg, tmp_path / "mo", layout="modelopt-nvfp4", tokenizer=False)
    ref = load_checkpoint(good, progress=False)
    # config.json carries ModelOpt's keys: hf_quant_config.json is optional
    d1 = clone_dir(good, tmp_path / "noq")
    os.unlink(os.path.join(d1, "hf_quant_config.json"))
    assert load_checkpoint(d1, progress=False).expert_formats == ref.expert_formats
    # an older export with only the top-level moe_quant_algo needs hf_quant_config.json ...
    d1b = clone_dir(d1, tmp_path / "legacy")

    def legacy(d):
        for k in ("quant_algo", "moe_quant_algo", "group_size", "kv_cache_quant_algo", "ignore",
                  "quantized_layers", "config_groups"):
            d["quantization_config"].pop(k)
        d["moe_quant_algo"] = "NVFP4"
    edit_json(os.path.join(d1b, "config.json"), legacy)
    with pytest.raises(CheckpointError, match=re.escape(os.path.join(d1b, "hf_quant_config.json")) +
                       r": missing.*tensor 'layers\.0\.ffn\.experts\.0\.w1\.weight_scale'"):
        load_checkpoint(d1b, progress=False)
    shutil.copyfile(os.path.join(good, "hf_quant_config.json"), os.path.join(d1b, "hf_quant_config.json"))
    assert load_checkpoint(d1b, progress=False).expert_formats == ref.expert_formats
    # ... and the two files must agree
    d1c = clone_dir(good, tmp_path / "disagree")
    edit_json(os.path.join(d1c, "hf_quant_config.json"),
              lambda d: d["quantization"]["quantized_layers"].update({"mtp.0.ffn.experts": {"quant_algo": "NVFP4"}}))
    with pytest.raises(CheckpointError, match=re.escape(os.path.join(d1c, "hf_quant_config.json")) +
                       r": declares 'mtp\.0\.ffn\.experts' nvfp4, but .*config\.json.*mxfp4; the two files must agree"):
        load_checkpoint(d1c, progress=False)
    # config.json declares a block NVFP4 whose tensors are MXFP4
    d1d = clone_dir(d1, tmp_path / "declared")
    edit_json(os.path.join(d1d, "config.json"),
              lambda d: d["quantization_config"]["quantized_layers"].update({"mtp.0.ffn.experts": {"quant_algo": "NVFP4"}}))
    with pytest.raises(CheckpointError, match=r"tensor 'mtp\.0\.ffn\.experts\.0\.w1\.weight' is I8 .*MXFP4.*"
                       r"quantization_config\.quantized_layers\) announces NVFP4 .* for 'mtp\.0\.ffn\.experts'"):
        load_checkpoint(d1d, progress=False)
    d2 = clone_dir(good, tmp_path / "noalgo")
    edit_json(os.path.join(d2, "config.json"), lambda d: [d["quantization_config"].pop(k) for k in
                                                         ("moe_quant_algo", "quant_algo")])
    with pytest.raises(CheckpointError, match=re.escape(os.path.join(d2, "config.json")) +
                       r": moe_quant_algo is None, expected \"NVFP4\": tensor 'layers\.\d+\.ffn\.experts"):
        load_checkpoint(d2, progress=False)
    d3 = clone_dir(good, tmp_path / "nvmissing")
    st = os.path.join(d3, "model.safetensors")
    name = "layers.4.ffn.experts.3.w2.weight_scale_2"
    rewrite_shard(st, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(f"'{name}' is missing") + r".*NVFP4 fp32 global scale"):
        load_checkpoint(d3, progress=False)


def test_bad_hf_stacked_experts(small_tensors, small_cfg, tmp_path):
    d = save_checkpoint(small_tensors, small_cfg, tmp_path / "hfbad", layout="hf", tokenizer=False)
    st = os.path.join(d, "model.safetensors")
    name = "model.layers.2.mlp.experts.gate_up_proj"
    rewrite_shard(st, lambda t: t.update({name: t[name][:, :200].contiguous()}))
    with pytest.raises(CheckpointError, match=re.escape(st) + ".*" + re.escape(f"'{name}' has shape [8, 200, 128], "
                       "expected [8, 256, 128]") + ".*2\\*moe_intermediate_size"):
        load_checkpoint(d, progress=False)


def test_bad_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "nope", progress=False)
    (tmp_path / "empty").mkdir()
    shutil.copyfile(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), tmp_path / "empty" / "x")
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_checkpoint(tmp_path / "empty", progress=False)
