"""The V4 tensor tree: every tensor of a DeepSeek-V4 checkpoint in the canonical (official) form.

``walk(cfg, expert_format, wo_a=..., draft=...)`` is the ONE description of the tree. It yields
draw units (``Unit``): a kind, the tensors the unit produces (name -> ``TensorSpec``) and a
knob name; ``expected_specs`` flattens it, the tiny builder (tiny.py) and the synthetic generator
(synthetic.py) only draw values for its units, the loader and writer check files against it.

Canonical form (spec §1.3, §11.1): official names without a ``model.`` prefix, official formats:

* FP8 linears: ``X.weight`` float8_e4m3fn ``[out, in]`` + ``X.scale`` float8_e8m0fnu
  ``[ceil(out/128), ceil(in/128)]``.
* routed experts (``ffn.experts.{e}.w{1,2,3}``), per block (``layers.{i}.`` / ``mtp.{j}.``):
  ``'mxfp4'``  ``X.weight`` int8 ``[out, in/2]`` + ``X.scale`` e8m0 ``[out, in/32]`` (official release);
  ``'nvfp4'``  ``X.weight`` uint8 ``[out, in/2]``, ``X.weight_scale`` e4m3 ``[out, in/16]``,
  ``X.weight_scale_2`` fp32 0-d, ``X.input_scale`` fp32 0-d (NVIDIA ModelOpt, spec §11.3);
  ``'fp8'``    like any FP8 linear (config ``expert_dtype`` 'fp8' / null, convert.py --expert-dtype fp8).
  ``expert_format`` is one format for every block, or ``{block prefix: format}``: NVIDIA's NVFP4
  ports keep the draft's experts MXFP4 while the main stack's are NVFP4.
* ``attn.wo_a``: ``'fp8'`` (as released: FP8 + scale) or ``'bf16'`` (convert.py form, no scale).
* norms, compressor wkv/wgate, gate weight, indexer weights_proj, embed, head, DSpark Markov and
  confidence heads: bf16; hc_*, attn_sink, ape, gate bias: fp32; ``ffn.gate.tid2eid``: int64.

The draft (``mtp.*``), one of two kinds, as ``cfg.draft_kind`` announces (spec dspark-and-0731 §2.1):

* ``'mtp'`` (April preview): ``num_nextn_predict_layers`` MTP blocks ``mtp.{j}.``: ``e_proj``,
  ``h_proj`` (FP8), ``enorm`` / ``hnorm`` / ``norm``, ``hc_head_*`` and a full block (layer id
  ``num_hidden_layers + j``; ratio 0, score-routed with bias).
* ``'dspark'`` (V4-*-DSpark, V4-Flash-0731, V4-Pro-0813): ``len(dspark_target_layer_ids)`` stages
  ``mtp.{s}.``, each a full ratio-0 score-routed block (layer id ``num_hidden_layers + s``);
  ``mtp.0.`` adds ``main_proj`` (FP8 ``[d, stages*d]``) and ``main_norm``; the last stage adds
  ``norm``, ``hc_head_*``, ``markov_head.markov_w{1,2}.weight`` (bf16 ``[vocab, markov_rank]``) and
  ``confidence_head.proj.weight`` (bf16 ``[1, d + markov_rank]``). 4,705 tensors for Flash,
  7,009 for Pro.

``draft=False`` leaves the draft out (a checkpoint without ``mtp.*``).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from ..config import ModelConfig

EXPERT_FORMATS = ("mxfp4", "nvfp4", "fp8")
WO_A_FORMATS = ("fp8", "bf16")
DRAFTS = ("none", "mtp", "dspark")

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


@dataclass(frozen=True)
class Unit:
    """One draw unit of the tree: tensors drawn together and how their values are meant.

    ``kind``: 'embed' | 'head' | 'norm' | 'fp8_linear' | 'bf16_linear' | 'rows' | 'hc_mix' |
    'hc_head' | 'ape' | 'sink' | 'gate_bias' | 'tid2eid' | 'swiglu'. ``key`` names the unit (the
    synthetic generator seeds one generator per key). ``knob``: the ``tiny.KNOBS`` entry that scales
    it (a norm's mean, a linear's gain, a row draw's std), None = 1. ``specs``: the tensors it
    yields, in order. For 'swiglu' the 'w1' / 'w2' / 'w3' tensors follow ``specs``' formats;
    'routed' tells a routed expert from the shared one.
    """
    kind: str
    key: str
    specs: tuple[tuple[str, TensorSpec], ...]
    knob: str | None = None
    routed: bool = False

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.specs]


def _ceil128(n: int) -> int:
    return -(-n // 128)


def expert_format_of_config(cfg: ModelConfig) -> str:
    """The main stack's routed-expert format a config announces: NVFP4 (ModelOpt), MXFP4 ('fp4') or FP8."""
    if cfg.nvfp4_experts:
        return "nvfp4"
    return base_expert_format(cfg)


def base_expert_format(cfg: ModelConfig) -> str:
    """The routed-expert format of the DeepSeek release a config derives from: MXFP4 or FP8."""
    return "mxfp4" if cfg.expert_dtype == "fp4" else "fp8"


def block_prefixes(cfg: ModelConfig, draft: bool = True) -> list[str]:
    """``layers.{i}.`` for the main stack, then ``mtp.{j}.`` for every draft stage."""
    out = [f"layers.{i}." for i in range(cfg.num_hidden_layers)]
    if draft:
        out += [f"mtp.{j}." for j in range(cfg.num_draft_stages)]
    return out


def _format_of(expert_format: str | Mapping[str, str], prefix: str) -> str:
    fmt = expert_format if isinstance(expert_format, str) else expert_format[prefix]
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {fmt!r} for '{prefix}'")
    return fmt


def walk(cfg: ModelConfig, expert_format: str | Mapping[str, str], *, wo_a: str = "fp8",
         draft: bool = True) -> Iterator[Unit]:
    """The draw units of ``cfg``'s checkpoint in canonical order (module doc): embed, layers, final
    norm / hc_head / head, then the draft when ``draft`` and the config announces one."""
    if wo_a not in WO_A_FORMATS:
        raise ValueError(f"wo_a must be one of {WO_A_FORMATS}, got {wo_a!r}")
    d, V = cfg.hidden_size, cfg.vocab_size
    H, D = cfg.num_attention_heads, cfg.head_dim
    dq, G, R = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    E, K, inter = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    hc, mix = cfg.hc_mult, cfg.hc_mix_dim
    nI, dI = cfg.index_n_heads, cfg.index_head_dim

    def spec(shape, dtype, dims, what=""):
        what = what or {BF16: "bf16", F32: "fp32", I64: "int64"}.get(dtype, str(dtype))
        return TensorSpec(tuple(int(s) for s in shape), dtype, tuple(dims), what)

    def one(kind, name, shape, dtype, dims, knob=None, key=None):
        return Unit(kind, key or name, ((name, spec(shape, dtype, dims)),), knob)

    def fp8_specs(name, o, i, od, idn):
        return ((name + ".weight", spec((o, i), FP8, (od, idn), "FP8 e4m3 weight")),
                (name + ".scale", spec((_ceil128(o), _ceil128(i)), E8M0, (f"ceil({od}/128)", f"ceil({idn}/128)"),
                                       "e8m0 FP8 block scale (128x128)")))

    def fp8_linear(name, o, i, od, idn, knob=None):
        return Unit("fp8_linear", name, fp8_specs(name, o, i, od, idn), knob)

    def expert_specs(name, o, i, od, idn, fmt):
        if fmt == "fp8":
            return fp8_specs(name, o, i, od, idn)
        if fmt == "mxfp4":
            return ((name + ".weight", spec((o, i // 2), torch.int8, (od, f"{idn}/2"), "MXFP4 packed e2m1 (int8)")),
                    (name + ".scale", spec((o, i // 32), E8M0, (od, f"{idn}/32"), "MXFP4 e8m0 scale per 32")))
        return ((name + ".weight", spec((o, i // 2), torch.uint8, (od, f"{idn}/2"), "NVFP4 packed e2m1 (uint8)")),
                (name + ".weight_scale", spec((o, i // 16), FP8, (od, f"{idn}/16"), "NVFP4 e4m3 scale per 16")),
                (name + ".weight_scale_2", spec((), F32, (), "NVFP4 fp32 global scale (0-d)")),
                (name + ".input_scale", spec((), F32, (), "NVFP4 fp32 input scale (0-d)")))

    def swiglu(p, fmt, routed):
        specs = (expert_specs(p + "w1", inter, d, "moe_intermediate_size", "hidden_size", fmt)
                 + expert_specs(p + "w2", d, inter, "hidden_size", "moe_intermediate_size", fmt)
                 + expert_specs(p + "w3", inter, d, "moe_intermediate_size", "hidden_size", fmt))
        return Unit("swiglu", p, specs, routed=routed)

    def hc_mix(p, kind):
        mixd = "(2+hc_mult)*hc_mult"
        return Unit("hc_mix", f"{p}hc_{kind}", (
            (f"{p}hc_{kind}_fn", spec((mix, hc * d), F32, (mixd, "hc_mult*hidden_size"))),
            (f"{p}hc_{kind}_base", spec((mix,), F32, (mixd,))),
            (f"{p}hc_{kind}_scale", spec((3,), F32, ("3",)))))

    def hc_head(p):
        return Unit("hc_head", f"{p}hc_head", (
            (f"{p}hc_head_fn", spec((hc, hc * d), F32, ("hc_mult", "hc_mult*hidden_size"))),
            (f"{p}hc_head_base", spec((hc,), F32, ("hc_mult",))),
            (f"{p}hc_head_scale", spec((1,), F32, ("1",)))))

    def norm(name, dim, dimname, knob=None):
        return one("norm", name, (dim,), BF16, (dimname,), knob)

    def compressor(p, head_dim, hd_name, ratio, norm_knob):
        coff = 2 if ratio == 4 else 1
        cd = f"{coff}*{hd_name}" if coff == 2 else hd_name
        yield one("bf16_linear", p + "wkv.weight", (coff * head_dim, d), BF16, (cd, "hidden_size"), key=p + "wkv")
        yield one("bf16_linear", p + "wgate.weight", (coff * head_dim, d), BF16, (cd, "hidden_size"),
                  "compressor_gate_gain", key=p + "wgate")
        yield one("ape", p + "ape", (ratio, coff * head_dim), F32, (f"compress_ratio={ratio}", cd))
        yield norm(p + "norm.weight", head_dim, hd_name, norm_knob)

    def block(p, layer_id):
        ratio = cfg.layer_ratio(layer_id)
        fmt = _format_of(expert_format, p)
        yield norm(p + "attn_norm.weight", d, "hidden_size")
        yield norm(p + "ffn_norm.weight", d, "hidden_size")
        yield hc_mix(p, "attn")
        yield hc_mix(p, "ffn")
        a = p + "attn."
        yield fp8_linear(a + "wq_a", dq, d, "q_lora_rank", "hidden_size")
        yield norm(a + "q_norm.weight", dq, "q_lora_rank")
        yield fp8_linear(a + "wq_b", H * D, dq, "num_attention_heads*head_dim", "q_lora_rank")
        yield fp8_linear(a + "wkv", D, d, "head_dim", "hidden_size")
        yield norm(a + "kv_norm.weight", D, "head_dim", "kv_norm")
        woa_o, woa_i = G * R, H * D // G
        woa_od, woa_id = "o_groups*o_lora_rank", "num_attention_heads*head_dim/o_groups"
        if wo_a == "fp8":
            yield fp8_linear(a + "wo_a", woa_o, woa_i, woa_od, woa_id)
        else:
            yield Unit("bf16_linear", a + "wo_a", ((a + "wo_a.weight", spec((woa_o, woa_i), BF16, (woa_od, woa_id),
                                                                              "bf16 (convert.py form)")),))
        yield fp8_linear(a + "wo_b", d, G * R, "hidden_size", "o_groups*o_lora_rank", "wo_b_gain")
        yield one("sink", a + "attn_sink", (H,), F32, ("num_attention_heads",))
        if ratio:
            yield from compressor(a + "compressor.", D, "head_dim", ratio, "compressor_norm")
            if ratio == 4:
                yield fp8_linear(a + "indexer.wq_b", nI * dI, dq, "index_n_heads*index_head_dim", "q_lora_rank")
                yield one("bf16_linear", a + "indexer.weights_proj.weight", (nI, d), BF16,
                          ("index_n_heads", "hidden_size"), key=a + "indexer.weights_proj")
                yield from compressor(a + "indexer.compressor.", dI, "index_head_dim", ratio,
                                      "indexer_compressor_norm")
        f = p + "ffn."
        yield one("bf16_linear", f + "gate.weight", (E, d), BF16, ("n_routed_experts", "hidden_size"), "gate_gain")
        if layer_id < cfg.num_hidden_layers and cfg.is_hash_layer(layer_id):
            yield one("tid2eid", f + "gate.tid2eid", (V, K), I64, ("vocab_size", "num_experts_per_tok"))
        else:
            yield one("gate_bias", f + "gate.bias", (E,), F32, ("n_routed_experts",))
        for e in range(E):
            yield swiglu(f"{f}experts.{e}.", fmt, True)
        yield swiglu(f + "shared_experts.", "fp8", False)

    yield one("embed", "embed.weight", (V, d), BF16, ("vocab_size", "hidden_size"))
    for i in range(cfg.num_hidden_layers):
        yield from block(f"layers.{i}.", i)
    yield norm("norm.weight", d, "hidden_size")
    yield hc_head("")
    yield one("head", "head.weight", (V, d), BF16, ("vocab_size", "hidden_size"))
    if not draft or cfg.draft_kind is None:
        return
    n = cfg.num_hidden_layers
    if cfg.draft_kind == "mtp":
        for j in range(cfg.num_draft_stages):
            p = f"mtp.{j}."
            yield fp8_linear(p + "e_proj", d, d, "hidden_size", "hidden_size")
            yield fp8_linear(p + "h_proj", d, d, "hidden_size", "hidden_size")
            yield norm(p + "enorm.weight", d, "hidden_size")
            yield norm(p + "hnorm.weight", d, "hidden_size")
            yield norm(p + "norm.weight", d, "hidden_size")
            yield hc_head(p)
            yield from block(p, n + j)
        return
    S, r = cfg.num_draft_stages, cfg.dspark_markov_rank
    for s in range(S):
        p = f"mtp.{s}."
        if s == 0:
            yield fp8_linear(p + "main_proj", d, S * d, "hidden_size", "len(dspark_target_layer_ids)*hidden_size")
            yield norm(p + "main_norm.weight", d, "hidden_size")
        yield from block(p, n + s)
        if s == S - 1:
            yield norm(p + "norm.weight", d, "hidden_size")
            yield hc_head(p)
            m = p + "markov_head."
            yield one("rows", m + "markov_w1.weight", (V, r), BF16, ("vocab_size", "dspark_markov_rank"),
                      "markov_std")
            yield one("bf16_linear", m + "markov_w2.weight", (V, r), BF16, ("vocab_size", "dspark_markov_rank"),
                      "markov_gain")
            yield one("bf16_linear", p + "confidence_head.proj.weight", (1, d + r), BF16,
                      ("1", "hidden_size+dspark_markov_rank"))


def expected_specs(cfg: ModelConfig, expert_format: str | Mapping[str, str], *, wo_a: str = "fp8",
                   draft: bool = True) -> dict[str, TensorSpec]:
    """Canonical ``{name: TensorSpec}`` in tree order; ``draft=False`` leaves out ``mtp.*``."""
    return {n: sp for u in walk(cfg, expert_format, wo_a=wo_a, draft=draft) for n, sp in u.specs}


def expected_tensors(cfg: ModelConfig, expert_format: str | Mapping[str, str], *, wo_a: str = "fp8",
                     draft: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Canonical ``{name: (shape, dtype)}`` for ``cfg`` (see ``expected_specs``)."""
    return {k: (v.shape, v.dtype) for k, v in expected_specs(cfg, expert_format, wo_a=wo_a, draft=draft).items()}


def is_routed_expert(name: str) -> bool:
    return ".ffn.experts." in name


def block_of(name: str) -> str:
    """'layers.3.ffn.experts.1.w2.scale' -> 'layers.3.'; '' for the global tensors."""
    m = _BLOCK_RE.match(name)
    return f"{m.group(1)}.{m.group(2)}." if m else ""


def expert_module_names(cfg: ModelConfig, draft: bool = True) -> list[str]:
    """``layers.{i}.ffn.experts.{e}.w{1,2,3}`` (and the draft's) in tree order."""
    return [f"{p}ffn.experts.{e}.w{k}" for p in block_prefixes(cfg, draft) for e in range(cfg.n_routed_experts)
            for k in (1, 2, 3)]


# Tensors only one draft kind has (block-relative, any layout's spelling).
_DRAFT_MARKERS = {"mtp": ("e_proj.", "h_proj.", "enorm.", "hnorm."),
                  "dspark": ("main_proj.", "main_norm.", "markov_head.", "confidence_head.")}


def detect_draft(names) -> tuple[str | None, str | None]:
    """(kind, a tensor that shows it) of the draft tensors among ``names`` (official or hf names):
    (None, None) without ``mtp.*``; 'mtp' / 'dspark' by the tensors only that kind has; 'mixed' when
    both kinds' tensors are there; 'unknown' when ``mtp.*`` has neither (the schema check then names
    what is missing)."""
    seen: dict[str, str] = {}
    first = None
    for n in names:
        rest = n[len("model."):] if n.startswith("model.mtp.") else n
        if not rest.startswith("mtp."):
            continue
        first = first or n
        rel = rest.split(".", 2)[2] if rest.count(".") >= 2 else ""
        for kind, marks in _DRAFT_MARKERS.items():
            if kind not in seen and rel.startswith(marks):
                seen[kind] = n
    if len(seen) == 2:
        return "mixed", f"{seen['mtp']}' and '{seen['dspark']}"
    if seen:
        return next(iter(seen.items()))
    return ("unknown", first) if first else (None, None)


# ---------------------------------------------------------------------------------------------
# Per-block routed-expert formats that a ModelOpt config declares (spec dspark-and-0731 §3).
def declared_expert_formats(cfg: ModelConfig, quantized_layers: Mapping | None = None,
                            ignore: list[str] | tuple[str, ...] | None = None,
                            draft: bool = True) -> dict[str, str] | None:
    """``{block prefix: format}`` that ``quantized_layers`` (``{'layers.N.ffn.experts': {...}}``) or
    else the ``ignore`` patterns (fnmatch on module names, as ModelOpt matches them) declare for an
    NVFP4 config; None where neither is given (the tensors on disk then decide per block).
    Raises ValueError when a pattern splits one block's experts between formats."""
    base = base_expert_format(cfg)
    prefixes = block_prefixes(cfg, draft)
    if quantized_layers is not None:
        listed = {k if k.endswith(".") else k + "." for k in quantized_layers}
        names = {p + "ffn.experts." for p in prefixes}
        unknown = sorted(k for k in listed if k not in names)
        if unknown:
            raise ValueError(f"quantized_layers names {unknown[0].rstrip('.')!r}, which is not a routed-expert "
                             f"module of this config (expected 'layers.N.ffn.experts' or 'mtp.N.ffn.experts')")
        return {p: "nvfp4" if p + "ffn.experts." in listed else base for p in prefixes}
    if ignore is None:
        return None
    out = {}
    for p in prefixes:
        hits = {any(fnmatch.fnmatchcase(f"{p}ffn.experts.{e}.w{k}", pat) for pat in ignore)
                for e in range(cfg.n_routed_experts) for k in (1, 2, 3)}
        if len(hits) > 1:
            raise ValueError(f"ignore patterns {list(ignore)} exclude some routed experts of '{p.rstrip('.')}' "
                             f"from NVFP4 but not others; one format per layer is supported")
        out[p] = base if hits.pop() else "nvfp4"
    return out


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
# Draft-only tensors (block-relative under mtp.{j}.): the April MTP block's and DSpark's extras keep
# their official names (transformers has no draft; vLLM reads these names under model.mtp).
_HF_MTP_RULES = [(re.compile(a), b) for a, b in [
    (r"^(e_proj|h_proj|main_proj)\.", r"\1."),
    (r"^(enorm|hnorm|norm|main_norm)\.weight$", r"\1.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"^(markov_head\.markov_w[12]|confidence_head\.proj)\.weight$", r"\1.weight"),
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
               expert_format: str | Mapping[str, str]) -> tuple[dict[str, TensorSpec], dict[str, DiskSource]]:
    """On-disk ``{name: TensorSpec}`` of ``layout`` and where each tensor goes in canonical form."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout != "hf":
        return dict(specs), {n: DiskSource("same", n) for n in specs}
    if "nvfp4" in ([expert_format] if isinstance(expert_format, str) else expert_format.values()):
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
