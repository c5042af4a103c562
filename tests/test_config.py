import json

import pytest

from dsv4.config import ConfigError, ModelConfig, preset, yarn_correction_range

def test_flash_and_pro_presets_match_the_published_configs():
    f, p = preset("flash"), preset("pro")
    assert (f.hidden_size, f.num_hidden_layers, f.num_attention_heads, f.q_lora_rank) == (4096, 43, 64, 1024)
    assert (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.q_lora_rank) == (7168, 61, 128, 1536)
    assert len(f.compress_ratios) == 44 and f.compress_ratios.count(4) == 21 and f.compress_ratios.count(128) == 20
    assert f.compress_ratios[:2] == (0, 0) and f.compress_ratios[-1] == 0
    assert len(p.compress_ratios) == 62 and p.compress_ratios.count(4) == 30 and p.compress_ratios.count(128) == 31
    assert p.compress_ratios[:2] == (128, 128) and p.compress_ratios[-1] == 0
    assert (f.o_groups, p.o_groups, f.index_topk, p.index_topk) == (8, 16, 512, 1024)
    assert (f.n_routed_experts, p.n_routed_experts, f.moe_intermediate_size, p.moe_intermediate_size) == (256, 384, 2048, 3072)
    assert (f.routed_scaling_factor, p.routed_scaling_factor) == (1.5, 2.5)
    assert f.hc_mix_dim == 24 and f.nope_head_dim == 448
    assert yarn_correction_range(f, f.compress_rope_theta) == (15, 25)


def test_tiny_preset_keeps_the_real_block_formats():
    t = preset("tiny")
    assert (t.head_dim, t.qk_rope_head_dim, t.sliding_window, t.hc_mult, t.vocab_size) == (512, 64, 128, 4, 129280)
    assert t.compress_ratios == (0, 0, 4, 128, 4, 128, 0)
    for name in ("hidden_size", "q_lora_rank", "o_lora_rank", "moe_intermediate_size", "index_head_dim"):
        assert getattr(t, name) % 128 == 0


def test_hf_round_trip_and_official_tool_config(tmp_path):
    t = preset("tiny")
    assert ModelConfig.from_hf(json.loads(json.dumps(t.to_hf()))) == t
    p = tmp_path / "config.json"
    p.write_text(json.dumps(preset("flash").to_hf()))
    assert ModelConfig.from_file(str(tmp_path)) == preset("flash")


@pytest.mark.parametrize("field,value,msg", [
    ("compress_ratios", [0, 0, 4], "compress_ratios"),
    ("compress_ratios", [0, 0, 4, 128, 4, 128, 2], "compress_ratios"),
    ("compress_ratios", [0, 0, 4, 128, 4, 128, 4], "the 1 draft-stage entries after num_hidden_layers=6 must be 0"),
    ("o_groups", 3, "o_groups"),
    ("head_dim", 256, "head_dim"),
    ("hidden_size", 200, "hidden_size"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("scoring_func", "softmax", "scoring_func"),
    ("expert_dtype", "int4", "expert_dtype"),
    ("rope_scaling", {"type": "linear", "factor": 2}, "rope_scaling"),
    ("quantization_config", {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "fp32",
                             "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "scale_fmt"),
    ("vocab_size", -1, "vocab_size"),
    ("bogus_field", 1, "bogus_field"),
])
def test_bad_config_values_name_the_field(field, value, msg):
    d = preset("tiny").to_hf()
    d[field] = value
    with pytest.raises(ConfigError, match=msg):
        ModelConfig.from_hf(d)


def test_missing_required_field_is_named():
    d = preset("tiny").to_hf()
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf(d)


def test_bad_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_file(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(str(tmp_path))
