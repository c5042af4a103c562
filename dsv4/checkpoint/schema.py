"""Expected tensors of a DeepSeek-V4 checkpoint in the canonical (official) form.

Canonical form (spec §1.3, §11.1): official names without a ``model.`` prefix, official formats:

* FP8 linears: ``X.weight`` float8_e4m3fn ``[out, in]`` + ``X.scale`` float8_e8m0fnu
  ``[ceil(out/128), ceil(in/128)]``.
* routed experts (``ffn.experts.{e}.w{1,2,3}``), per ``expert_format``:
  ``'mxfp4'``  ``X.weight`` int8 ``[out, in/2]`` + ``X.scale`` e8m0 ``[out, in/32]`` (official release);
  ``'nvfp4'``  ``X.weight`` uint8 ``[out, in/2]``, ``X.weight_scale`` e4m3 ``[out, in/16]``,
  ``X.weight_scale_2`` fp32 0-d, ``X.input_scale`` fp32 0-d (NVIDIA ModelOpt, spec §11.3);
  ``'fp8'``    like any FP8 linear (config ``expert_dtype`` 'fp8' / null, convert.py --expert-dtype fp8).
* ``attn.wo_a``: ``'fp8'`` (as released: FP8 + scale) or ``'bf16'`` (convert.py form, no scale).
* norms, compressor wkv/wgate, gate weight, indexer weights_proj, embed, head: bf16;
  hc_*, attn_sink, ape, gate bias: fp32; ``ffn.gate.tid2eid``: int64 (as on disk).
* MTP blocks ``mtp.{j}.`` (layer id ``num_hidden_layers + j``; ratio 0, score-routed with bias).

``expected_tensors`` gives ``{name: (shape, dtype)}`` in a stable order (embed first, then
layers, final norm / hc_head / head, then MTP). ``expected_specs`` is the same with a description
of where every dimension comes from (used for error messages).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..config import ModelConfig

EXPERT_FORMATS = ("mxfp4", "nvfp4", "fp8")
WO_A_FORMATS = ("fp8", "bf16")

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
BF16 = torch.bfloat16
F32 = torch.float32
I64 = torch.int64


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    dims: tuple[str, ...]      # where each dim comes from, e.g. ("vocab_size", "hidden_size")
    what: str = ""             # short description of the format, e.g. "FP8 e4m3 weight"


def _ceil128(n: int) -> int:
    return -(-n // 128)


def expert_format_of_config(cfg: ModelConfig) -> str:
    """The routed-expert format a config announces: NVFP4 (ModelOpt), MXFP4 ('fp4') or FP8."""
    if cfg.moe_quant_algo == "NVFP4":
        return "nvfp4"
    if cfg.expert_dtype == "fp4":
        return "mxfp4"
    return "fp8"


def expected_specs(cfg: ModelConfig, expert_format: str, *, wo_a: str = "fp8",
                   mtp: bool = True) -> dict[str, TensorSpec]:
    """Canonical ``{name: TensorSpec}``; ``mtp=False`` leaves out the ``mtp.*`` blocks."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}")
    if wo_a not in WO_A_FORMATS:
        raise ValueError(f"wo_a must be one of {WO_A_FORMATS}, got {wo_a!r}")
    out: dict[str, TensorSpec] = {}

    d, V = cfg.hidden_size, cfg.vocab_size
    H, D = cfg.num_attention_heads, cfg.head_dim
    dq, G, R = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    E, K, inter = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    hc, mix = cfg.hc_mult, cfg.hc_mix_dim
    nI, dI = cfg.index_n_heads, cfg.index_head_dim

    def put(name, shape, dtype, dims, what=""):
        out[name] = TensorSpec(tuple(int(s) for s in shape), dtype, tuple(dims), what)

    def plain(name, shape, dtype, dims):
        put(name, shape, dtype, dims, {BF16: "bf16", F32: "fp32", I64: "int64"}.get(dtype, str(dtype)))

    def fp8_linear(name, o, i, od, idn):
        put(name + ".weight", (o, i), FP8, (od, idn), "FP8 e4m3 weight")
        put(name + ".scale", (_ceil128(o), _ceil128(i)), E8M0,
            (f"ceil({od}/128)", f"ceil({idn}/128)"), "e8m0 FP8 block scale (128x128)")

    def expert_linear(name, o, i, od, idn):
        if expert_format == "fp8":
            fp8_linear(name, o, i, od, idn)
        elif expert_format == "mxfp4":
            put(name + ".weight", (o, i // 2), torch.int8, (od, f"{idn}/2"), "MXFP4 packed e2m1 (int8)")
            put(name + ".scale", (o, i // 32), E8M0, (od, f"{idn}/32"), "MXFP4 e8m0 scale per 32")
        else:
            put(name + ".weight", (o, i // 2), torch.uint8, (od, f"{idn}/2"), "NVFP4 packed e2m1 (uint8)")
            put(name + ".weight_scale", (o, i // 16), FP8, (od, f"{idn}/16"), "NVFP4 e4m3 scale per 16")
            put(name + ".weight_scale_2", (), F32, (), "NVFP4 fp32 global scale (0-d)")
            put(name + ".input_scale", (), F32, (), "NVFP4 fp32 input scale (0-d)")

    def hc_block(p, kind):
        plain(f"{p}hc_{kind}_fn", (mix, hc * d), F32, ("(2+hc_mult)*hc_mult", "hc_mult*hidden_size"))
        plain(f"{p}hc_{kind}_base", (mix,), F32, ("(2+hc_mult)*hc_mult",))
        plain(f"{p}hc_{kind}_scale", (3,), F32, ("3",))

    def hc_head(p):
        plain(f"{p}hc_head_fn", (hc, hc * d), F32, ("hc_mult", "hc_mult*hidden_size"))
        plain(f"{p}hc_head_base", (hc,), F32, ("hc_mult",))
        plain(f"{p}hc_head_scale", (1,), F32, ("1",))

    def compressor(p, head_dim, hd_name, ratio):
        coff = 2 if ratio == 4 else 1
        cd = f"{coff}*{hd_name}" if coff == 2 else hd_name
        plain(p + "wkv.weight", (coff * head_dim, d), BF16, (cd, "hidden_size"))
        plain(p + "wgate.weight", (coff * head_dim, d), BF16, (cd, "hidden_size"))
        plain(p + "ape", (ratio, coff * head_dim), F32, (f"compress_ratio={ratio}", cd))
        plain(p + "norm.weight", (head_dim,), BF16, (hd_name,))

    def block(p, layer_id):
        ratio = cfg.layer_ratio(layer_id)
        plain(p + "attn_norm.weight", (d,), BF16, ("hidden_size",))
        plain(p + "ffn_norm.weight", (d,), BF16, ("hidden_size",))
        hc_block(p, "attn")
        hc_block(p, "ffn")
        a = p + "attn."
        fp8_linear(a + "wq_a", dq, d, "q_lora_rank", "hidden_size")
        plain(a + "q_norm.weight", (dq,), BF16, ("q_lora_rank",))
        fp8_linear(a + "wq_b", H * D, dq, "num_attention_heads*head_dim", "q_lora_rank")
        fp8_linear(a + "wkv", D, d, "head_dim", "hidden_size")
        plain(a + "kv_norm.weight", (D,), BF16, ("head_dim",))
        woa_o, woa_i = G * R, H * D // G
        woa_od, woa_id = "o_groups*o_lora_rank", "num_attention_heads*head_dim/o_groups"
        if wo_a == "fp8":
            fp8_linear(a + "wo_a", woa_o, woa_i, woa_od, woa_id)
        else:
            put(a + "wo_a.weight", (woa_o, woa_i), BF16, (woa_od, woa_id), "bf16 (convert.py form)")
        fp8_linear(a + "wo_b", d, G * R, "hidden_size", "o_groups*o_lora_rank")
        plain(a + "attn_sink", (H,), F32, ("num_attention_heads",))
        if ratio:
            compressor(a + "compressor.", D, "head_dim", ratio)
            if ratio == 4:
                fp8_linear(a + "indexer.wq_b", nI * dI, dq, "index_n_heads*index_head_dim", "q_lora_rank")
                plain(a + "indexer.weights_proj.weight", (nI, d), BF16, ("index_n_heads", "hidden_size"))
                compressor(a + "indexer.compressor.", dI, "index_head_dim", ratio)
        f = p + "ffn."
        plain(f + "gate.weight", (E, d), BF16, ("n_routed_experts", "hidden_size"))
        if layer_id < cfg.num_hidden_layers and cfg.is_hash_layer(layer_id):
            plain(f + "gate.tid2eid", (V, K), I64, ("vocab_size", "num_experts_per_tok"))
        else:
            plain(f + "gate.bias", (E,), F32, ("n_routed_experts",))
        for e in range(E):
            x = f"{f}experts.{e}."
            expert_linear(x + "w1", inter, d, "moe_intermediate_size", "hidden_size")
            expert_linear(x + "w2", d, inter, "hidden_size", "moe_intermediate_size")
            expert_linear(x + "w3", inter, d, "moe_intermediate_size", "hidden_size")
        s = f + "shared_experts."
        fp8_linear(s + "w1", inter, d, "moe_intermediate_size", "hidden_size")
        fp8_linear(s + "w2", d, inter, "hidden_size", "moe_intermediate_size")
        fp8_linear(s + "w3", inter, d, "moe_intermediate_size", "hidden_size")

    plain("embed.weight", (V, d), BF16, ("vocab_size", "hidden_size"))
    for i in range(cfg.num_hidden_layers):
        block(f"layers.{i}.", i)
    plain("norm.weight", (d,), BF16, ("hidden_size",))
    hc_head("")
    plain("head.weight", (V, d), BF16, ("vocab_size", "hidden_size"))
    if mtp:
        for j in range(cfg.num_nextn_predict_layers):
            p = f"mtp.{j}."
            fp8_linear(p + "e_proj", d, d, "hidden_size", "hidden_size")
            fp8_linear(p + "h_proj", d, d, "hidden_size", "hidden_size")
            plain(p + "enorm.weight", (d,), BF16, ("hidden_size",))
            plain(p + "hnorm.weight", (d,), BF16, ("hidden_size",))
            plain(p + "norm.weight", (d,), BF16, ("hidden_size",))
            hc_head(p)
            block(p, cfg.num_hidden_layers + j)
    return out


def expected_tensors(cfg: ModelConfig, expert_format: str, *, wo_a: str = "fp8",
                     mtp: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Canonical ``{name: (shape, dtype)}`` for ``cfg``.

    expert_format: 'mxfp4' | 'nvfp4' | 'fp8' (routed experts); wo_a: 'fp8' (released form, with
    ``.scale``) | 'bf16' (convert.py form, no scale); mtp: include the ``mtp.{j}.*`` blocks.
    """
    return {k: (v.shape, v.dtype) for k, v in expected_specs(cfg, expert_format, wo_a=wo_a, mtp=mtp).items()}


def is_routed_expert(name: str) -> bool:
    return ".ffn.experts." in name


def expert_module_names(cfg: ModelConfig, mtp: bool = True) -> list[str]:
    """``layers.{i}.ffn.experts.{e}.w{1,2,3}`` (and MTP ones) in schema order."""
    prefixes = [f"layers.{i}." for i in range(cfg.num_hidden_layers)]
    if mtp:
        prefixes += [f"mtp.{j}." for j in range(cfg.num_nextn_predict_layers)]
    return [f"{p}ffn.experts.{e}.w{k}" for p in prefixes for e in range(cfg.n_routed_experts)
            for k in (1, 2, 3)]


# ---------------------------------------------------------------------------------------------
# On-disk layouts. 'official' and 'modelopt-nvfp4' store the canonical names as they are; 'hf'
# stores transformers names (spec §11.2, see loader.py's docstring for the exact choices).
LAYOUTS = ("official", "hf", "modelopt-nvfp4")

_HF_GLOBAL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# (official block-relative regex, transformers replacement); first match wins.
_HF_BLOCK_RULES = [(re.compile(a), b) for a, b in [
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_attn_(fn|base|scale)$", r"attn_hc.\1"),
    (r"^hc_ffn_(fn|base|scale)$", r"ffn_hc.\1"),
    (r"^attn\.attn_sink$", "self_attn.sinks"),
    (r"^attn\.indexer\.compressor\.wkv\.", "self_attn.compressor.indexer.kv_proj."),
    (r"^attn\.indexer\.compressor\.wgate\.", "self_attn.compressor.indexer.gate_proj."),
    (r"^attn\.indexer\.compressor\.ape$", "self_attn.compressor.indexer.position_bias"),
    (r"^attn\.indexer\.compressor\.norm\.", "self_attn.compressor.indexer.kv_norm."),
    (r"^attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
    (r"^attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.weights_proj."),
    (r"^attn\.compressor\.wkv\.", "self_attn.compressor.kv_proj."),
    (r"^attn\.compressor\.wgate\.", "self_attn.compressor.gate_proj."),
    (r"^attn\.compressor\.ape$", "self_attn.compressor.position_bias"),
    (r"^attn\.compressor\.norm\.", "self_attn.compressor.kv_norm."),
    (r"^attn\.wq_a\.", "self_attn.q_a_proj."),
    (r"^attn\.q_norm\.", "self_attn.q_a_norm."),
    (r"^attn\.wq_b\.", "self_attn.q_b_proj."),
    (r"^attn\.wkv\.", "self_attn.kv_proj."),
    (r"^attn\.kv_norm\.", "self_attn.kv_norm."),
    (r"^attn\.wo_a\.", "self_attn.o_a_proj."),
    (r"^attn\.wo_b\.", "self_attn.o_b_proj."),
    (r"^ffn\.gate\.weight$", "mlp.gate.weight"),
    (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^ffn\.gate\.tid2eid$", "mlp.gate.tid2eid"),
    (r"^ffn\.shared_experts\.w1\.", "mlp.shared_experts.gate_proj."),
    (r"^ffn\.shared_experts\.w3\.", "mlp.shared_experts.up_proj."),
    (r"^ffn\.shared_experts\.w2\.", "mlp.shared_experts.down_proj."),
]]
# MTP-only tensors (block-relative under mtp.{j}.)
_HF_MTP_RULES = [(re.compile(a), b) for a, b in [
    (r"^(e_proj|h_proj)\.", r"\1."),
    (r"^(enorm|hnorm|norm)\.weight$", r"\1.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
]]
# Names some transformers versions use -> the names written here (spec §11.2).
_HF_ALIASES = [(re.compile(a), b) for a, b in [
    (r"\.self_attn\.q_norm\.", ".self_attn.q_a_norm."),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".compressor.indexer.weights_proj."),
]]

_BLOCK_RE = re.compile(r"^(layers|mtp)\.(\d+)\.(.*)$")
HF_EXPERT_PARTS = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")


def official_to_hf(name: str) -> str:
    """transformers name of a canonical tensor (not a routed expert: those are stacked)."""
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    m = _BLOCK_RE.match(name)
    if not m:
        raise KeyError(name)
    kind, idx, rest = m.groups()
    rules = _HF_BLOCK_RULES + (_HF_MTP_RULES if kind == "mtp" else [])
    for rx, repl in rules:
        if rx.search(rest):
            new = rx.sub(repl, rest, count=1)
            if rest.endswith(".scale"):          # FP8 linear block scale (hc_*_scale has no dot)
                new = new[: -len(".scale")] + ".weight_scale_inv"
            return f"model.{kind}.{idx}.{new}"
    raise KeyError(name)


def hf_alias(name: str) -> str:
    """Map the alternative transformers spellings onto the ones this package writes."""
    for rx, repl in _HF_ALIASES:
        name = rx.sub(repl, name)
    return name


def hf_block_prefix(official_prefix: str) -> str:
    """'layers.3.' -> 'model.layers.3.'; 'mtp.0.' -> 'model.mtp.0.'."""
    return "model." + official_prefix


@dataclass(frozen=True)
class DiskSource:
    """Where a disk tensor's data goes in the canonical dict.

    kind 'same': disk tensor == canonical tensor ``name``; kind 'experts': a stacked transformers
    expert tensor of block ``name`` (official prefix, e.g. 'layers.3.'), ``part`` one of
    HF_EXPERT_PARTS.
    """
    kind: str
    name: str
    part: str = ""


def disk_specs(specs: dict[str, TensorSpec], layout: str, cfg: ModelConfig,
               expert_format: str) -> tuple[dict[str, TensorSpec], dict[str, DiskSource]]:
    """On-disk ``{name: TensorSpec}`` of ``layout`` and where each tensor goes in canonical form."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout != "hf":
        return dict(specs), {n: DiskSource("same", n) for n in specs}
    if expert_format == "nvfp4":
        raise ValueError("the 'hf' layout stores MXFP4 or FP8 routed experts, not NVFP4 "
                         "(write NVFP4 experts as layout 'modelopt-nvfp4')")
    out: dict[str, TensorSpec] = {}
    src: dict[str, DiskSource] = {}
    E = cfg.n_routed_experts
    for name, sp in specs.items():
        if not is_routed_expert(name):
            hn = official_to_hf(name)
            out[hn] = sp
            src[hn] = DiskSource("same", name)
            continue
        if not name.endswith(".experts.0.w1.weight"):
            continue
        p = name[: name.index("ffn.experts.")]          # 'layers.3.'
        hp = hf_block_prefix(p) + "mlp.experts."
        w1, w1s = specs[p + "ffn.experts.0.w1.weight"], specs[p + "ffn.experts.0.w1.scale"]
        w2, w2s = specs[p + "ffn.experts.0.w2.weight"], specs[p + "ffn.experts.0.w2.scale"]
        for part, base in (("gate_up_proj", w1), ("gate_up_proj_scale_inv", w1s),
                           ("down_proj", w2), ("down_proj_scale_inv", w2s)):
            if part.startswith("gate_up"):
                shape = (E, 2 * base.shape[0], base.shape[1])
                dims = ("n_routed_experts", f"2*{base.dims[0]}", base.dims[1])
                what = base.what + ", stacked cat(w1, w3) per expert"
            else:
                shape = (E,) + base.shape
                dims = ("n_routed_experts",) + base.dims
                what = base.what + ", stacked w2 per expert"
            out[hp + part] = TensorSpec(shape, base.dtype, dims, what)
            src[hp + part] = DiskSource("experts", p, part)
    return out, src
