"""DeepSeek-V4 model configuration (spec §1), built from an HF ``config.json``.

One dataclass with the HF field names. ``ModelConfig.from_hf(dict)`` validates every field and
fails with a message that names the field; ``preset("flash" | "pro" | "tiny")`` gives the
published values and the project's tiny test model.

Release keys (spec dspark-and-0731 §1, §3), accepted here and nowhere else:

* the DSpark draft of V4-*-DSpark, V4-Flash-0731 and V4-Pro-0813: ``dspark_block_size``,
  ``dspark_markov_rank``, ``dspark_noise_token_id``, ``dspark_target_layer_ids`` (all four or
  none). With them the draft has ``len(dspark_target_layer_ids)`` stages whatever
  ``num_nextn_predict_layers`` says (the releases keep a stale 1 there);
* ``compress_ratios`` has ``num_hidden_layers`` entries for the main stack, then one 0 per draft
  stage (April: ``num_nextn_predict_layers`` MTP blocks; DSpark: its stages);
* NVIDIA ModelOpt's NVFP4 keys inside ``quantization_config`` (``quant_algo``,
  ``moe_quant_algo``, ``group_size``, ``kv_cache_quant_algo``, ``ignore``, ``quantized_layers``,
  ``config_groups``), and the older top-level ``moe_quant_algo``; both forms must agree.

Any other unknown key is an error naming it.
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
    # NVIDIA ModelOpt NVFP4 ports (spec dspark-and-0731 §3); None where the config has no such key.
    quant_algo: str | None = None                 # 'MIXED_PRECISION'
    moe_quant_algo: str | None = None             # 'NVFP4'
    group_size: int | None = None                 # 16
    kv_cache_quant_algo: str | None = None
    ignore: tuple[str, ...] | None = None         # fnmatch patterns of modules left unquantised
    quantized_layers: dict | None = None          # {'layers.N.ffn.experts': {'quant_algo': 'NVFP4', ...}}
    config_groups: dict | None = None             # compressed-tensors style description (checked, informative)

    MODELOPT_KEYS = ("quant_algo", "moe_quant_algo", "group_size", "kv_cache_quant_algo", "ignore",
                     "quantized_layers", "config_groups")


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
    # Older ModelOpt NVFP4 exports put this at the top level (spec §11.3); None for the official release.
    moe_quant_algo: str | None = None
    # DSpark draft (V4-*-DSpark, V4-Flash-0731, V4-Pro-0813); None for the April preview.
    dspark_block_size: int | None = None
    dspark_markov_rank: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ derived facts
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_mix_dim(self) -> int:
        """Width of the mHC mixing projection: 4 pre + 4 post + 4x4 comb (= 24 for hc 4)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def draft_kind(self) -> str | None:
        """'dspark' (dspark_* keys), 'mtp' (April MTP blocks) or None (num_nextn_predict_layers 0)."""
        if self.dspark_target_layer_ids is not None:
            return "dspark"
        return "mtp" if self.num_nextn_predict_layers > 0 else None

    @property
    def num_draft_stages(self) -> int:
        """Draft blocks after the main stack: DSpark stages, else num_nextn_predict_layers."""
        if self.dspark_target_layer_ids is not None:
            return len(self.dspark_target_layer_ids)
        return self.num_nextn_predict_layers

    @property
    def num_layers_total(self) -> int:
        return self.num_hidden_layers + self.num_draft_stages

    @property
    def nvfp4_experts(self) -> bool:
        """The config announces NVFP4 routed experts (ModelOpt, top-level or in quantization_config)."""
        q = self.quantization_config
        return self.moe_quant_algo == "NVFP4" or (q is not None and q.moe_quant_algo == "NVFP4")

    def layer_ratio(self, layer: int) -> int:
        """Compress ratio of layer ``layer``; layer ids >= num_hidden_layers are draft blocks (ratio 0)."""
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
            elif f.name in ("compress_ratios", "architectures", "dspark_target_layer_ids") and v is not None:
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
        for k in DSPARK_KEYS:
            if d[k] is None:
                d.pop(k)
        if self.dspark_target_layer_ids is not None:
            d["dspark_target_layer_ids"] = list(self.dspark_target_layer_ids)
        if self.quantization_config is not None:
            q = d["quantization_config"]
            # ModelOpt keys appear only in the configs that carry them; ModelOpt writes an explicit
            # null kv_cache_quant_algo beside quant_algo.
            keep_null = {"kv_cache_quant_algo"} if q["quant_algo"] is not None else set()
            for k in QuantizationConfig.MODELOPT_KEYS:
                if q[k] is None and k not in keep_null:
                    q.pop(k)
            if q.get("ignore") is not None:
                q["ignore"] = list(q["ignore"])
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
        self._validate_dspark(need)
        stages = self.num_draft_stages
        what = ("DSpark stages = len(dspark_target_layer_ids)" if self.draft_kind == "dspark"
                else "MTP blocks = num_nextn_predict_layers")
        need(len(self.compress_ratios) == self.num_hidden_layers + stages, "compress_ratios",
             f"needs num_hidden_layers + {stages} ({what}) = {self.num_hidden_layers + stages} entries: "
             f"the main stack's ratios, then one 0 per draft stage; found {len(self.compress_ratios)}")
        need(all(r in (0, 4, 128) for r in self.compress_ratios), "compress_ratios",
             "every entry must be 0 (SWA), 4 (CSA) or 128 (HCA)")
        need(all(r == 0 for r in self.compress_ratios[self.num_hidden_layers:]), "compress_ratios",
             f"the {stages} draft-stage entries after num_hidden_layers={self.num_hidden_layers} must be 0")
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
        if self.moe_quant_algo is not None and self.quantization_config is not None \
                and self.quantization_config.moe_quant_algo not in (None, self.moe_quant_algo):
            raise ConfigError(f"moe_quant_algo: the top-level value {self.moe_quant_algo!r} disagrees with "
                              f"quantization_config.moe_quant_algo {self.quantization_config.moe_quant_algo!r}")
        q = self.quantization_config
        if q is not None:
            _validate_modelopt(q)
            if q.quant_method != "fp8" or q.fmt != "e4m3" or tuple(q.weight_block_size) != (128, 128):
                raise ConfigError("quantization_config: only fp8 e4m3 with weight_block_size [128, 128] "
                                  f"is supported (got {q})")
            if q.scale_fmt != "ue8m0":
                raise ConfigError(f"quantization_config.scale_fmt: only 'ue8m0' is supported (got {q.scale_fmt!r})")


    def _validate_dspark(self, need) -> None:
        given = [k for k in DSPARK_KEYS if getattr(self, k) is not None]
        if not given:
            return
        if len(given) != len(DSPARK_KEYS):
            missing = [k for k in DSPARK_KEYS if k not in given]
            raise ConfigError(f"{missing[0]}: a DSpark config needs all of {', '.join(DSPARK_KEYS)} "
                              f"(has {', '.join(given)}; missing {', '.join(missing)})")

        def pos_int(name, lo):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, name, f"must be an integer >= {lo}")
        pos_int("dspark_block_size", 2)
        pos_int("dspark_markov_rank", 1)
        pos_int("dspark_noise_token_id", 0)
        need(self.dspark_noise_token_id < self.vocab_size, "dspark_noise_token_id",
             f"must be a token id < vocab_size={self.vocab_size}")
        ids = self.dspark_target_layer_ids
        need(len(ids) > 0 and all(isinstance(i, int) and not isinstance(i, bool) for i in ids),
             "dspark_target_layer_ids", "must be a non-empty list of layer ids")
        need(all(0 <= i < self.num_hidden_layers for i in ids), "dspark_target_layer_ids",
             f"every id must be a main layer in [0, num_hidden_layers={self.num_hidden_layers})")
        need(len(set(ids)) == len(ids), "dspark_target_layer_ids", "ids must be distinct")


DSPARK_KEYS = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids")


def _validate_modelopt(q: "QuantizationConfig") -> None:
    def bad(key, msg):
        raise ConfigError(f"quantization_config.{key}: {msg} (got {getattr(q, key)!r})")
    if q.quant_algo not in (None, "MIXED_PRECISION", "NVFP4"):
        bad("quant_algo", "only 'MIXED_PRECISION' (NVFP4 routed experts) or 'NVFP4' is supported")
    if q.moe_quant_algo not in (None, "NVFP4"):
        bad("moe_quant_algo", "must be null or 'NVFP4'")
    if q.group_size not in (None, 16):
        bad("group_size", "NVFP4 uses 16-element groups")
    if q.kv_cache_quant_algo is not None:
        bad("kv_cache_quant_algo", "must be null (the KV cache format is V4's own FP8 entry)")
    if q.ignore is not None and not all(isinstance(p, str) for p in q.ignore):
        bad("ignore", "must be a list of module-name patterns")
    if q.quantized_layers is not None:
        if not isinstance(q.quantized_layers, dict):
            bad("quantized_layers", "must be an object {module: {quant_algo, group_size}}")
        for name, v in q.quantized_layers.items():
            if not isinstance(v, dict) or v.get("quant_algo") != "NVFP4" or v.get("group_size", 16) != 16:
                raise ConfigError(f"quantization_config.quantized_layers.{name}: only NVFP4 with group_size 16 "
                                  f"is supported (got {v!r})")
    if q.config_groups is not None:
        if not isinstance(q.config_groups, dict):
            bad("config_groups", "must be an object")
        for gname, g in q.config_groups.items():
            for part in ("weights", "input_activations"):
                a = g.get(part) if isinstance(g, dict) else None
                if a is not None and (not isinstance(a, dict) or a.get("num_bits") != 4
                                      or a.get("group_size") not in (None, 16) or a.get("type", "float") != "float"):
                    raise ConfigError(f"quantization_config.config_groups.{gname}.{part}: only 4-bit float "
                                      f"(NVFP4) groups of 16 are supported (got {a!r})")
    if q.quant_algo is not None and q.moe_quant_algo is None and q.quant_algo != "NVFP4":
        bad("moe_quant_algo", "a ModelOpt MIXED_PRECISION config must name moe_quant_algo 'NVFP4'")


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
    if isinstance(kw.get("ignore"), list):
        kw["ignore"] = tuple(kw["ignore"])
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

# The DSpark draft of the current releases (spec dspark-and-0731 §1): V4-Flash-0731 / -DSpark
# markov rank 256, V4-Pro-0813 / -DSpark 512, both 3 stages on the last three layers, blocks of 5,
# noise token 128799. Tiny: the same structure at rank 32.
DSPARK_MARKOV_RANK = {"flash": 256, "pro": 512, "tiny": 32}
DSPARK_BLOCK_SIZE = 5
DSPARK_NOISE_TOKEN_ID = 128799
DSPARK_STAGES = 3
DRAFTS = ("none", "mtp", "dspark")


def with_draft(cfg: ModelConfig, draft: str, markov_rank: int | None = None,
               noise_token_id: int = DSPARK_NOISE_TOKEN_ID) -> ModelConfig:
    """``cfg`` as a checkpoint with ``draft`` ('none' | 'mtp' | 'dspark') announces it.

    'mtp' and 'none' give the April config (``num_nextn_predict_layers`` MTP entries; a checkpoint
    of 'none' simply has no ``mtp.*``); 'dspark' adds the release keys with ``markov_rank``, the
    last ``DSPARK_STAGES`` main layers as targets, and one trailing 0 ratio per stage, keeping
    ``num_nextn_predict_layers`` as the releases do (``noise_token_id``: the mask token, 128799 in
    the releases; a reduced-vocabulary test model needs a smaller one)."""
    if draft not in DRAFTS:
        raise ConfigError(f"draft must be one of {', '.join(DRAFTS)}, got {draft!r}")
    n = cfg.num_hidden_layers
    main = tuple(cfg.compress_ratios[:n])
    if draft != "dspark":
        return cfg.replace(compress_ratios=main + (0,) * cfg.num_nextn_predict_layers,
                           **{k: None for k in DSPARK_KEYS})
    if n < DSPARK_STAGES:
        raise ConfigError(f"num_hidden_layers: a DSpark draft reads the last {DSPARK_STAGES} main layers, the "
                          f"config has {n}")
    if markov_rank is None:
        raise ConfigError("dspark_markov_rank: give the DSpark draft's Markov rank")
    return cfg.replace(compress_ratios=main + (0,) * DSPARK_STAGES, dspark_block_size=DSPARK_BLOCK_SIZE,
                       dspark_markov_rank=markov_rank, dspark_noise_token_id=noise_token_id,
                       dspark_target_layer_ids=tuple(range(n - DSPARK_STAGES, n)))


def preset(name: str, draft: str | None = None, **overrides) -> ModelConfig:
    """A preset's config; ``draft='dspark'`` gives the current releases' form (0731 / 0813)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = ModelConfig(**{**PRESETS[name], **overrides})
    cfg.validate()
    if draft is not None:
        cfg = with_draft(cfg, draft, DSPARK_MARKOV_RANK[name])
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
