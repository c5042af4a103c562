"""DeepSeek-V4 model configuration (spec §1), built from an HF ``config.json``.

One dataclass with the HF field names. ``ModelConfig.from_hf(dict)`` validates every field and
fails with a message that names the field; ``preset("flash" | "pro" | "tiny")`` gives the
published values and the project's tiny test model.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config.json value is unknown, missing or inconsistent; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    type: str = "yarn"
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class QuantizationConfig:
    quant_method: str = "fp8"
    fmt: str = "e4m3"
    scale_fmt: str = "ue8m0"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    max_position_embeddings: int = 1048576
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_shared_experts: int = 1
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    expert_dtype: str | None = "fp4"
    quantization_config: QuantizationConfig | None = field(default_factory=QuantizationConfig)
    torch_dtype: str = "bfloat16"
    model_type: str = "deepseek_v4"
    architectures: tuple[str, ...] = ("DeepseekV4ForCausalLM",)
    # ModelOpt NVFP4 exports add this (spec §11.3); None for the official release.
    moe_quant_algo: str | None = None

    # ------------------------------------------------------------------ derived facts
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_mix_dim(self) -> int:
        """Width of the mHC mixing projection: 4 pre + 4 post + 4x4 comb (= 24 for hc 4)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def num_layers_total(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def layer_ratio(self, layer: int) -> int:
        """Compress ratio of layer ``layer``; layer ids >= num_hidden_layers are MTP blocks."""
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        # Fields of HF configs that carry no model math (generation, tokenizer, bookkeeping).
        ignored = {"transformers_version", "use_cache", "initializer_range", "attention_bias",
                   "attention_dropout", "pad_token_id", "_name_or_path", "auto_map", "dtype",
                   "rope_parameters", "first_k_dense_replace", "n_group", "topk_group",
                   "ep_size", "moe_layer_freq", "kv_lora_rank", "v_head_dim", "qk_nope_head_dim",
                   "pretraining_tp", "index_head_size"}
        unknown = sorted(set(d) - known - ignored)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.name == "rope_scaling":
                v = _rope_scaling(v)
            elif f.name == "quantization_config":
                v = _quant_config(v)
            elif f.name in ("compress_ratios", "architectures"):
                if not isinstance(v, (list, tuple)):
                    raise ConfigError(f"{f.name} must be a list, got {v!r}")
                v = tuple(v)
            kw[f.name] = v
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in kw]
        if missing:
            raise ConfigError(f"config is missing required field(s): {', '.join(missing)}")
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as fh:
                d = json.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_hf(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["architectures"] = list(self.architectures)
        if self.quantization_config is not None:
            d["quantization_config"]["weight_block_size"] = list(self.quantization_config.weight_block_size)
        if self.moe_quant_algo is None:
            d.pop("moe_quant_algo")
        return d

    def replace(self, **kw) -> "ModelConfig":
        cfg = dataclasses.replace(self, **kw)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(cond: bool, fieldname: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{fieldname}: {msg} (got {getattr(self, fieldname)!r})")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
                     "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "head_dim", "qk_rope_head_dim", "sliding_window", "hc_mult",
                     "hc_sinkhorn_iters", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "must be a positive integer")
        for name in ("index_topk", "num_hash_layers", "n_shared_experts", "num_nextn_predict_layers"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, name, "must be a non-negative integer")
        need(self.model_type == "deepseek_v4", "model_type", "only 'deepseek_v4' is supported")
        need(self.num_key_value_heads == 1, "num_key_value_heads", "V4 has one shared KV head")
        need(self.head_dim == 512, "head_dim", "V4 attention uses 512-d heads (FP8 KV entry layout)")
        need(self.qk_rope_head_dim == 64, "qk_rope_head_dim", "V4 uses 64 rope dims")
        need(self.sliding_window == 128, "sliding_window", "the cache layouts assume a 128-token window")
        need(len(self.compress_ratios) == self.num_hidden_layers + self.num_nextn_predict_layers,
             "compress_ratios", f"needs num_hidden_layers + num_nextn_predict_layers = "
             f"{self.num_hidden_layers + self.num_nextn_predict_layers} entries (last = MTP layer)")
        need(all(r in (0, 4, 128) for r in self.compress_ratios), "compress_ratios",
             "every entry must be 0 (SWA), 4 (CSA) or 128 (HCA)")
        need(all(r == 0 for r in self.compress_ratios[self.num_hidden_layers:]), "compress_ratios",
             "the MTP entries (after num_hidden_layers) must be 0")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups",
             f"must divide num_attention_heads={self.num_attention_heads}")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"must be <= n_routed_experts={self.n_routed_experts}")
        need(self.num_hash_layers <= self.num_hidden_layers, "num_hash_layers",
             f"must be <= num_hidden_layers={self.num_hidden_layers}")
        need(self.index_head_dim == 128, "index_head_dim", "the indexer uses 128-d heads (Hadamard size)")
        need(self.scoring_func == "sqrtsoftplus", "scoring_func", "only 'sqrtsoftplus' is supported")
        need(self.hidden_act == "silu", "hidden_act", "only 'silu' is supported")
        need(self.expert_dtype in ("fp4", "fp8", None), "expert_dtype", "must be 'fp4', 'fp8' or null")
        need(self.moe_quant_algo in (None, "NVFP4"), "moe_quant_algo", "must be null or 'NVFP4'")
        need(self.torch_dtype == "bfloat16", "torch_dtype", "V4 runs in bfloat16")
        need(not self.tie_word_embeddings, "tie_word_embeddings", "V4 has a separate head")
        need(self.n_shared_experts == 1, "n_shared_experts", "V4 has exactly one shared expert")
        need(0 <= self.bos_token_id < self.vocab_size, "bos_token_id", "must be a token id")
        need(0 <= self.eos_token_id < self.vocab_size, "eos_token_id", "must be a token id")
        need(self.swiglu_limit > 0, "swiglu_limit", "must be > 0")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        need(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be > 0")
        # FP8 128x128 blocks and FP4 32-groups: all dims must be multiples of 128.
        for name in ("hidden_size", "q_lora_rank", "o_lora_rank", "moe_intermediate_size"):
            need(getattr(self, name) % 128 == 0, name, "must be a multiple of 128 (FP8 block size)")
        if any(r == 4 for r in self.compress_ratios):
            need(self.index_topk > 0, "index_topk", "CSA layers need index_topk > 0")
        q = self.quantization_config
        if q is not None:
            if q.quant_method != "fp8" or q.fmt != "e4m3" or tuple(q.weight_block_size) != (128, 128):
                raise ConfigError("quantization_config: only fp8 e4m3 with weight_block_size [128, 128] "
                                  f"is supported (got {q})")
            if q.scale_fmt != "ue8m0":
                raise ConfigError(f"quantization_config.scale_fmt: only 'ue8m0' is supported (got {q.scale_fmt!r})")


def _rope_scaling(v: Any) -> RopeScaling | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ConfigError(f"rope_scaling must be an object or null, got {v!r}")
    v = dict(v)
    kind = v.pop("type", v.pop("rope_type", None))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.type: only 'yarn' is supported (got {kind!r})")
    known = {f.name for f in dataclasses.fields(RopeScaling)} - {"type"}
    extra = sorted(set(v) - known - {"mscale", "mscale_all_dim"})
    if extra:
        raise ConfigError(f"rope_scaling: unknown field(s) {', '.join(extra)}")
    kw = {k: v[k] for k in known if k in v}
    return RopeScaling(type="yarn", **kw)


def _quant_config(v: Any) -> QuantizationConfig | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ConfigError(f"quantization_config must be an object or null, got {v!r}")
    known = {f.name for f in dataclasses.fields(QuantizationConfig)}
    extra = sorted(set(v) - known)
    if extra:
        raise ConfigError(f"quantization_config: unknown field(s) {', '.join(extra)}")
    kw = dict(v)
    if "weight_block_size" in kw:
        kw["weight_block_size"] = tuple(kw["weight_block_size"])
    return QuantizationConfig(**kw)


# ---------------------------------------------------------------------- presets
_FLASH = dict(
    vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
    index_n_heads=64, index_head_dim=128, index_topk=512,
    n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
    routed_scaling_factor=1.5, num_hash_layers=3,
)
_PRO = dict(
    vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
    q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
    compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0),
    index_n_heads=64, index_head_dim=128, index_topk=1024,
    n_routed_experts=384, num_experts_per_tok=6, moe_intermediate_size=3072,
    routed_scaling_factor=2.5, num_hash_layers=3,
)
# Tiny: every real code path and block format, small dims (same as shared/tools/make_tiny_official.py).
_TINY = dict(
    vocab_size=129280, hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
    q_lora_rank=128, o_groups=2, o_lora_rank=128,
    compress_ratios=(0, 0, 4, 128, 4, 128, 0),
    index_n_heads=4, index_head_dim=128, index_topk=16,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
    routed_scaling_factor=1.5, num_hash_layers=2,
)
PRESETS = {"flash": _FLASH, "pro": _PRO, "tiny": _TINY}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = ModelConfig(**{**PRESETS[name], **overrides})
    cfg.validate()
    return cfg


def yarn_correction_range(cfg: ModelConfig, base: float) -> tuple[int, int]:
    """(low, high) dims of the YaRN ramp for a rope base (spec §4.1): 15, 25 for base 160000."""
    rs = cfg.rope_scaling
    dim = cfg.qk_rope_head_dim

    def corr(rot: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(rs.beta_fast)), 0)
    high = min(math.ceil(corr(rs.beta_slow)), dim - 1)
    return low, high


def rope_frequencies(cfg: ModelConfig, ratio: int) -> torch.Tensor:
    """fp32 [rd/2] inverse frequencies of a layer with compress ratio ``ratio``."""
    import torch
    dim = cfg.qk_rope_head_dim
    base = cfg.rope_theta if ratio == 0 else cfg.compress_rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rs = cfg.rope_scaling
    if ratio != 0 and rs is not None:
        low, high = yarn_correction_range(cfg, base)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / rs.factor * (1 - smooth) + freqs * smooth
    return freqs
