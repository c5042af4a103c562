"""Load a DeepSeek-V4 checkpoint directory into the canonical in-memory form.

``load_checkpoint(path)`` returns a ``LoadedCheckpoint`` whose ``tensors`` dict uses the official
names (spec §11.1, no ``model.`` prefix) and the official formats (see ``schema.py``), whatever
the on-disk layout. Three layouts are recognised automatically:

``official``
    The released layout: official names, FP8 linears with ``.scale`` (e8m0), MXFP4 routed experts
    (int8 + e8m0 ``.scale``) or FP8 experts when config ``expert_dtype`` is 'fp8' / null;
    ``attn.wo_a`` FP8 + scale (as released) or bf16 without scale (convert.py form).

``modelopt-nvfp4``
    NVIDIA ModelOpt export (spec §11.3, dspark-and-0731 §3): official names; the main stack's routed
    experts NVFP4 (``weight`` uint8, ``weight_scale`` e4m3, ``weight_scale_2`` / ``input_scale`` fp32
    0-d). The expert format is decided per block: NVIDIA's ports keep the draft's ``mtp.*`` experts
    MXFP4. config.json's ``quantization_config`` carries ModelOpt's keys (``moe_quant_algo: NVFP4``,
    ``quantized_layers`` naming each NVFP4 block, ``ignore`` patterns); ``hf_quant_config.json`` is
    optional then, and must agree with config.json where both exist. An older export with only a
    top-level ``"moe_quant_algo": "NVFP4"`` needs ``hf_quant_config.json``; blocks neither file
    declares take the format of their tensors.

``hf``
    transformers names (spec §11.2, transformers ``conversion_mapping["deepseek_v4"]``):
    ``model.embed_tokens.weight``, ``lm_head.weight``, ``model.norm.weight``,
    ``model.hc_head.hc_{fn,base,scale}``; per layer ``model.layers.{i}.``:
    ``input_layernorm`` / ``post_attention_layernorm``, ``attn_hc.{fn,base,scale}``,
    ``ffn_hc.*``, ``self_attn.{q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj,
    o_b_proj, sinks}``, ``self_attn.compressor.{kv_proj, gate_proj, position_bias, kv_norm}``,
    ``self_attn.compressor.indexer.{q_b_proj, weights_proj, kv_proj, gate_proj, position_bias,
    kv_norm}``, ``mlp.gate.{weight, e_score_correction_bias, tid2eid}``,
    ``mlp.shared_experts.{gate_proj, up_proj, down_proj}``. FP8 block scales are named
    ``weight_scale_inv`` (same e8m0 values and shape as the official ``.scale``). On load the
    spellings ``self_attn.q_norm`` and ``compressor.indexer.scorer.weights_proj`` (other
    transformers versions) are accepted too.

    Routed experts (decision): transformers fuses and stacks them (``MergeModulelist(dim=0)`` +
    ``Concatenate(dim=1)`` onto ``mlp.experts.gate_up_proj`` / ``down_proj``) and keeps quantised
    fused experts as ``gate_up_proj`` + ``gate_up_proj_scale_inv`` (its fine-grained FP8 / MXFP4
    expert containers). The on-disk form used here is exactly that, one tensor per layer:

    * ``mlp.experts.gate_up_proj``           ``[E, 2*I, d/2]`` int8 (MXFP4) or ``[E, 2*I, d]`` e4m3
      (FP8); row block ``[e, :I]`` is expert e's ``w1``, ``[e, I:]`` its ``w3``;
    * ``mlp.experts.gate_up_proj_scale_inv`` ``[E, 2*I, d/32]`` e8m0 (MXFP4) or
      ``[E, 2*I/128, d/128]`` (FP8), split the same way;
    * ``mlp.experts.down_proj`` ``[E, d, I/2]`` / ``[E, d, I]`` = ``w2`` of every expert, and
      ``mlp.experts.down_proj_scale_inv`` its scales.

    NVFP4 experts are not stored in the hf layout (use 'modelopt-nvfp4').

    Draft (decision): transformers drops ``mtp.*``. Here the draft, when present, is kept under
    ``model.mtp.{j}.`` with the same per-block renames as a layer plus its own tensors under their
    official names: ``e_proj`` / ``h_proj`` / ``main_proj`` (FP8, ``weight_scale_inv``), ``enorm`` /
    ``hnorm`` / ``norm`` / ``main_norm``, ``hc_head.hc_{fn,base,scale}``, ``markov_head.*``,
    ``confidence_head.*``.

The draft is optional in every layout and one of three kinds, detected from the tensors and
checked against config.json (``schema.detect_draft``): none (no ``mtp.*``), the April MTP block
(``e_proj`` ...), or the DSpark draft of the current releases (``main_proj``, Markov head ...;
config.json has the ``dspark_*`` keys and ``len(dspark_target_layer_ids)`` stages). Its tensors
are validated as strictly as the main stack's. ``LoadedCheckpoint.draft`` says which (and the
tensors dict then has or lacks ``mtp.*`` keys).

Everything is validated (file integrity, index, names, shapes, dtypes against config.json) BEFORE
any tensor data is read; a bad checkpoint raises ``CheckpointError`` (a ``ValueError``) naming the
file, the tensor and what was expected versus found. Tensor data is read one tensor at a time with
``safetensors.safe_open``, so loading holds a single copy of the weights (plus, for the hf layout,
one layer's stacked expert tensor while it is split).
"""
from __future__ import annotations

import json
import os
import re
import struct
import sys
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from ..config import ConfigError, ModelConfig
from .schema import (DiskSource, TensorSpec, base_expert_format, block_prefixes, declared_expert_formats,
                     detect_draft, disk_specs, expected_specs, expert_format_of_config, hf_alias,
                     hf_block_prefix)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HF_QUANT_CONFIG = "hf_quant_config.json"


class CheckpointError(ValueError):
    """A checkpoint on disk (or a tensor dict given to the writer) is not a valid V4 checkpoint."""


class CheckpointConfigError(CheckpointError, ConfigError):
    """config.json is missing or invalid (both a CheckpointError and a ConfigError)."""


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    layout: str                      # 'official' | 'hf' | 'modelopt-nvfp4'
    expert_format: str               # the main stack's: 'mxfp4' | 'nvfp4' | 'fp8'
    wo_a_format: str = "fp8"         # 'fp8' (with scale) | 'bf16' (convert.py form)
    draft: str = "mtp"               # 'none' (no mtp.* on disk, none in `tensors`) | 'mtp' | 'dspark'
    path: str = ""
    files: list[str] = field(default_factory=list)
    expert_formats: dict[str, str] = field(default_factory=dict)   # per block: 'layers.3.' / 'mtp.0.' -> format

    @property
    def has_mtp(self) -> bool:
        """The checkpoint carries a draft (April MTP block or DSpark stages) under ``mtp.*``."""
        return self.draft != "none"


# ------------------------------------------------------------------------- dtype names
TORCH_TO_ST = {
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.float8_e5m2: "F8_E5M2",
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.bool: "BOOL",
}
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
                "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                "I64": 8, "U64": 8, "F64": 8}


_FMT_NAMES = {"mxfp4": "MXFP4 (int8 packed e2m1 + e8m0 scale)", "nvfp4": "NVFP4 (uint8 packed e2m1 + e4m3 scale)",
              "fp8": "FP8 (e4m3 + e8m0 block scale)"}


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


# ------------------------------------------------------------------------- safetensors headers
@dataclass(frozen=True)
class HeaderEntry:
    file: str          # absolute path
    dtype: str         # safetensors dtype string
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: str) -> dict[str, HeaderEntry]:
    """Parse and check a safetensors header without reading tensor data.

    Detects truncated / corrupt files and names the first tensor whose bytes are missing.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: corrupt safetensors file: {size} bytes, too short for the "
                                      f"8-byte header length (expected a safetensors file)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file: the header claims "
                                      f"{n} bytes but only {size - 8} bytes follow the length field "
                                      f"(no tensor can be read)")
            raw = fh.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read file ({e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    data_len = size - 8 - n
    out: dict[str, HeaderEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(int(s) for s in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor '{name}': {info!r}") from None
        numel = 1
        for s in shape:
            numel *= s
        item = _ST_ITEMSIZE.get(dtype)
        if item is not None and end - start != numel * item:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor '{name}' ({dtype} "
                                  f"{_shape_str(shape)}) needs {numel * item} bytes but its data_offsets "
                                  f"[{start}, {end}) span {end - start}")
        out[name] = HeaderEntry(path, dtype, shape, start, end)
    # truncation: name the first tensor (by offset) whose data runs past the end of the file
    beyond = sorted((e for e in out.values() if e.end > data_len), key=lambda e: e.start)
    if beyond:
        first = beyond[0]
        fname = next(k for k, v in out.items() if v is first)
        need = 8 + n + max(e.end for e in out.values())
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensor '{fname}' ({first.dtype} {_shape_str(first.shape)}) "
            f"needs data bytes [{first.start}, {first.end}) but the data section holds only {data_len} bytes "
            f"(expected file size {need} bytes, found {size}; {len(beyond)} tensor(s) affected)")
    max_end = max((e.end for e in out.values()), default=0)
    if max_end != data_len:
        raise CheckpointError(f"{path}: corrupt safetensors file: the tensors cover {max_end} data bytes "
                              f"but the file holds {data_len} ({data_len - max_end} unexplained trailing bytes)")
    return out


# ------------------------------------------------------------------------- inventory
def _config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    try:
        return ModelConfig.from_file(cfg_path)
    except ConfigError as e:
        raise CheckpointConfigError(str(e)) from None


def _inventory(path: str) -> tuple[dict[str, HeaderEntry], list[str], str]:
    """name -> HeaderEntry over all shards; the shard list; a short description of where to look."""
    index_path = os.path.join(path, INDEX_NAME)
    inv: dict[str, HeaderEntry] = {}
    if os.path.exists(index_path):
        try:
            with open(index_path) as fh:
                index = json.load(fh)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{index_path}: not a valid index file ({e})") from None
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{index_path}: expected an object with a 'weight_map' of "
                                  f"tensor name -> file name, found {type(wmap).__name__}")
        files = sorted(set(wmap.values()))
        headers: dict[str, dict[str, HeaderEntry]] = {}
        for f in files:
            fp = os.path.join(path, f)
            if not os.path.isfile(fp):
                tensor = next(k for k, v in wmap.items() if v == f)
                n = sum(1 for v in wmap.values() if v == f)
                others = f" (and {n - 1} other tensor(s))" if n > 1 else ""
                raise CheckpointError(f"{index_path}: tensor '{tensor}'{others} is mapped to file '{f}', "
                                      f"which does not exist in {path}")
            headers[f] = read_safetensors_header(fp)
        for name, f in wmap.items():
            if name not in headers[f]:
                raise CheckpointError(f"{index_path}: tensor '{name}' is mapped to file '{f}', but "
                                      f"{os.path.join(path, f)} has no tensor of that name")
            inv[name] = headers[f][name]
        for f, hdr in headers.items():
            for name in hdr:
                if wmap.get(name) != f:
                    listed = (f"the index maps it to '{wmap[name]}'" if name in wmap
                              else "the index does not list it")
                    raise CheckpointError(f"{os.path.join(path, f)}: tensor '{name}' is stored in this file but "
                                          f"{index_path} does not map it here ({listed})")
        return inv, [os.path.join(path, f) for f in files], INDEX_NAME
    single = os.path.join(path, SINGLE_NAME)
    if os.path.isfile(single):
        files = [single]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no {INDEX_NAME}, no {SINGLE_NAME} and no *.safetensors file")
    for fp in files:
        for name, e in read_safetensors_header(fp).items():
            if name in inv:
                raise CheckpointError(f"{fp}: tensor '{name}' is also stored in {inv[name].file} "
                                      f"(each tensor must be stored once)")
            inv[name] = e
    where = os.path.basename(files[0]) if len(files) == 1 else f"{len(files)} *.safetensors files"
    return inv, files, where


def _detect_layout(inv: dict[str, HeaderEntry]) -> str:
    names = list(inv)
    n_model = sum(1 for n in names if n.startswith("model.") or n == "lm_head.weight")
    if n_model * 2 > len(names):
        return "hf"
    if any(".ffn.experts." in n and (n.endswith(".weight_scale_2") or n.endswith(".weight_scale"))
           for n in names):
        return "modelopt-nvfp4"
    return "official"


def _config_fields_note(cfg: ModelConfig, labels) -> str:
    fields = []
    for lab in labels:
        for ident in re.findall(r"[a-z_][a-z0-9_]*", lab):
            if hasattr(cfg, ident) and ident not in fields and not callable(getattr(cfg, ident)):
                fields.append(ident)
    return ", ".join(f"{f}={getattr(cfg, f)!r}" for f in fields)


def check_tensors(specs: dict[str, TensorSpec], found: dict[str, tuple[str, tuple[int, ...], str]],
                  cfg: ModelConfig, *, missing_where: str, context: str = "",
                  aliases=None) -> list[str]:
    """Compare found ``{name: (st dtype, shape, file)}`` with ``specs``; return problem messages.

    Order: missing / wrong shape / wrong dtype in schema order, then unexpected tensors.
    ``aliases`` maps a found name to the name it stands for in ``specs``.
    """
    aliases = aliases or {}
    by_spec: dict[str, str] = {}
    problems: list[str] = []
    unexpected: list[str] = []
    for name in found:
        key = aliases.get(name, name)
        if key in specs and key not in by_spec:
            by_spec[key] = name
        else:
            unexpected.append(name)
    for key, sp in specs.items():
        exp_dt = TORCH_TO_ST.get(sp.dtype, str(sp.dtype))
        if key not in by_spec:
            problems.append(f"{missing_where}: tensor '{key}' is missing (expected {exp_dt} "
                            f"{_shape_str(sp.shape)}, {sp.what}){context}")
            continue
        disk = by_spec[key]
        dt, shape, file = found[disk]
        shown = disk if disk == key else f"{disk}' (read as '{key}"
        if tuple(shape) != sp.shape:
            detail = ""
            if len(shape) == len(sp.shape):
                bad = [i for i in range(len(shape)) if shape[i] != sp.shape[i]]
                parts = []
                for i in bad:
                    note = _config_fields_note(cfg, [sp.dims[i]])
                    src = f" = {sp.dims[i]}" + (f" (config.json {note})" if note else "")
                    parts.append(f"dim {i} is {shape[i]}, expected {sp.shape[i]}{src}")
                detail = "; " + "; ".join(parts)
                fields = _config_fields_note(cfg, [sp.dims[i] for i in bad])
                if fields:
                    detail += f" -- config.json ({fields}) disagrees with this tensor"
            if dt != exp_dt:
                detail += f"; also dtype {dt}, expected {exp_dt} ({sp.what})"
            problems.append(f"{file}: tensor '{shown}' has shape {_shape_str(shape)}, expected "
                            f"{_shape_str(sp.shape)} = [{', '.join(sp.dims)}] from config.json{detail}")
        elif dt != exp_dt:
            problems.append(f"{file}: tensor '{shown}' has dtype {dt}, expected {exp_dt} ({sp.what}){context}")
    for name in unexpected:
        dt, shape, file = found[name]
        key = aliases.get(name, name)
        why = ("it duplicates another spelling of the same tensor" if key in by_spec and by_spec[key] != name
               else "not a tensor of this DeepSeek-V4 config")
        problems.append(f"{file}: unexpected tensor '{name}' ({dt} {_shape_str(shape)}): {why}{context}")
    return problems


def raise_problems(problems: list[str], header: str = "") -> None:
    if not problems:
        return
    msg = header + problems[0]
    if len(problems) > 1:
        more = "\n  ".join(problems[1:6])
        msg += f"\n({len(problems) - 1} more problem(s)):\n  {more}"
        if len(problems) > 6:
            msg += "\n  ..."
    raise CheckpointError(msg)


def describe_formats(formats: dict[str, str]) -> str:
    """'mxfp4' when every block agrees, else 'nvfp4 (layers.*) / mxfp4 (mtp.*)'-style."""
    kinds = sorted(set(formats.values()))
    if len(kinds) <= 1:
        return kinds[0] if kinds else "?"
    main = sorted({f for p, f in formats.items() if p.startswith("layers.")})
    draft = sorted({f for p, f in formats.items() if p.startswith("mtp.")})
    return f"{'/'.join(main)} (layers.*) + {'/'.join(draft)} (mtp.*)"


def check_draft_kind(cfg: ModelConfig, detected: tuple[str, str], file: str, cfg_path: str = "config.json") -> None:
    """The draft tensors found (``schema.detect_draft``) must be the kind config.json announces."""
    kind, witness = detected
    if kind == "mixed":
        raise CheckpointError(f"{file}: the mtp.* tensors mix an April MTP block and a DSpark draft ('{witness}'); "
                              f"a checkpoint carries one draft")
    want = cfg.draft_kind
    if kind == "unknown" or kind == want:
        return
    if want is None:
        raise CheckpointError(f"{file}: tensor '{witness}' is a draft tensor, but {cfg_path} announces no draft "
                              f"(num_nextn_predict_layers=0 and no dspark_* keys)")
    if kind == "dspark":
        raise CheckpointError(f"{file}: tensor '{witness}' belongs to a DSpark draft (V4-*-DSpark / 0731 / 0813 "
                              f"layout), but {cfg_path} has no dspark_* keys (dspark_block_size, "
                              f"dspark_markov_rank, dspark_noise_token_id, dspark_target_layer_ids), so it "
                              f"announces an April MTP block")
    raise CheckpointError(f"{file}: tensor '{witness}' belongs to an April MTP block, but {cfg_path} announces a "
                          f"DSpark draft (dspark_* keys, {cfg.num_draft_stages} stages)")


def _announced_formats(cfg: ModelConfig, path: str, prefixes: list[str], nv: list[str],
                       inv: dict[str, HeaderEntry]) -> tuple[dict[str, str], str]:
    """({block prefix: format} the config files announce, where that was said). A block left out
    is decided by its tensors (an older ModelOpt config: top-level moe_quant_algo only)."""
    cfg_path = os.path.join(path, "config.json")
    base = base_expert_format(cfg)
    if not cfg.nvfp4_experts:
        return {p: base for p in prefixes}, f"{cfg_path} (expert_dtype={cfg.expert_dtype!r}, no NVFP4)"
    q = cfg.quantization_config
    in_config = q is not None and (q.quant_algo is not None or q.moe_quant_algo is not None)
    draft = any(p.startswith("mtp.") for p in prefixes)
    try:
        declared = None if q is None else declared_expert_formats(cfg, q.quantized_layers, q.ignore, draft)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: quantization_config: {e}") from None
    src = f"{cfg_path} (quantization_config.{'quantized_layers' if q and q.quantized_layers else 'ignore'})"
    qpath = os.path.join(path, HF_QUANT_CONFIG)
    hq = _read_hf_quant_config(qpath, required=not in_config, witness=(nv[0], inv[nv[0]].file) if nv else None)
    if hq is not None:
        quant = hq.get("quantization") if isinstance(hq.get("quantization"), dict) else {}
        algo = quant.get("quant_algo")
        if q is not None and q.quant_algo is not None and algo is not None and algo != q.quant_algo:
            raise CheckpointError(f"{qpath}: quant_algo {algo!r} disagrees with {cfg_path} "
                                  f"quantization_config.quant_algo {q.quant_algo!r}")
        try:
            hdecl = declared_expert_formats(cfg, quant.get("quantized_layers"), quant.get("exclude_modules"), draft)
        except ValueError as e:
            raise CheckpointError(f"{qpath}: {e}") from None
        if declared is not None and hdecl is not None and hdecl != declared:
            p = next(p for p in prefixes if hdecl[p] != declared[p])
            raise CheckpointError(f"{qpath}: declares '{p}ffn.experts' {hdecl[p]}, but {src} declares it "
                                  f"{declared[p]}; the two files must agree")
        if declared is None and hdecl is not None:
            declared, src = hdecl, f"{qpath} (quantized_layers / exclude_modules)"
    if declared is None:
        top = {p: "nvfp4" for p in prefixes if p.startswith("layers.")}
        return top, f"{cfg_path} (moe_quant_algo='NVFP4')"
    return declared, src


def _read_hf_quant_config(qpath: str, required: bool, witness) -> dict | None:
    try:
        with open(qpath) as fh:
            q = json.load(fh)
        if not isinstance(q, dict):
            raise ValueError("not a JSON object")
        return q
    except FileNotFoundError:
        if not required:
            return None
        what = f" (tensor '{witness[0]}' in {witness[1]})" if witness else ""
        raise CheckpointError(f"{qpath}: missing; a ModelOpt NVFP4 checkpoint{what} whose config.json has "
                              f"only the top-level moe_quant_algo must ship hf_quant_config.json") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{qpath}: invalid ({e})") from None


# ------------------------------------------------------------------------- main entry
@dataclass
class CheckpointReader:
    """A validated checkpoint directory whose tensor data has not been read yet.

    ``open_checkpoint`` checks everything the headers can show; ``tensors()`` then streams the
    canonical tensors shard by shard (one disk tensor in host memory at a time, plus for the hf
    layout one layer's stacked expert tensor while its per-expert views are consumed)."""
    config: ModelConfig
    layout: str
    expert_format: str                    # the main stack's
    wo_a_format: str
    draft: str                            # 'none' | 'mtp' | 'dspark'
    path: str
    files: list[str]
    names: list[str]                      # canonical names in schema order
    inventory: dict[str, HeaderEntry]     # disk name -> header entry
    aliases: dict[str, str]
    sources: dict[str, DiskSource]
    expert_formats: dict[str, str] = field(default_factory=dict)   # per block prefix

    @property
    def has_mtp(self) -> bool:
        return self.draft != "none"

    def describe_draft(self) -> str:
        """One line for start-up logs: which draft the checkpoint carries."""
        cfg = self.config
        if self.draft == "none":
            return "no draft (no mtp.* tensors)"
        if self.draft == "mtp":
            return f"April MTP draft ({cfg.num_draft_stages} block(s), mtp.*)"
        fmts = sorted({f for p, f in self.expert_formats.items() if p.startswith("mtp.")})
        return (f"DSpark draft ({cfg.num_draft_stages} stages on layers {list(cfg.dspark_target_layer_ids)}, block "
                f"{cfg.dspark_block_size}, markov rank {cfg.dspark_markov_rank}, {'/'.join(fmts)} experts)")

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data on disk."""
        return sum(e.end - e.start for e in self.inventory.values())

    def tensors(self, progress: bool = False, skip=None, parts: dict | None = None):
        """Yield ``(canonical name, tensor)`` for every tensor, file by file in on-disk order.
        ``skip(canonical_name) -> bool`` leaves tensors unread (an hf stacked expert tensor is read
        unless all of its experts are skipped). ``parts``: {canonical name: (rows, cols)}, each
        [start, stop) or None = all: those tensors are read as that slice only (safetensors
        ``get_slice``: tensor parallelism, a rank's part of a split linear) and yielded as it; their
        full shapes were checked against the schema when the checkpoint was opened. Tensor values are checked as they are read
        (``gate.tid2eid`` ids in range). The tensors are CPU tensors backed by their own memory;
        a consumer that keeps one should copy it into its own storage."""
        from tqdm import tqdm
        inv, cfg = self.inventory, self.config
        by_file: dict[str, list[str]] = {}
        for n, e in inv.items():
            by_file.setdefault(e.file, []).append(n)
        bar = tqdm(total=self.total_bytes, desc=f"loading {os.path.basename(os.path.abspath(self.path))}",
                   unit="B", unit_scale=True, unit_divisor=1000, disable=not progress, file=sys.stderr,
                   leave=False, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B "
                                           "[{elapsed}<{remaining}, {rate_fmt}]")
        try:
            for fp in self.files:
                names = sorted(by_file.get(fp, []), key=lambda n: inv[n].start)
                try:
                    fh_ctx = safe_open(fp, framework="pt", device="cpu")
                except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                    raise CheckpointError(f"{fp}: cannot open safetensors file ({e})") from None
                with fh_ctx as fh:
                    for n in names:
                        src = self.sources[self.aliases.get(n, n)]
                        outs = list(_canonical_names(src, cfg))
                        if skip is not None and all(skip(c) for c in outs):
                            bar.update(inv[n].end - inv[n].start)
                            continue
                        part = None if parts is None else parts.get(outs[0]) if src.kind == "same" else None
                        if part is None and parts is not None and any(c in parts for c in outs):
                            raise CheckpointError(f"{fp}: tensor '{n}' holds several model tensors and "
                                                  f"cannot be read as a slice")
                        try:
                            t = fh.get_tensor(n) if part is None else _read_part(fh.get_slice(n), *part)
                        except Exception as e:  # noqa: BLE001
                            raise CheckpointError(f"{fp}: cannot read tensor '{n}' ({e})") from None
                        for name, part in _split(src, t, cfg):
                            if skip is not None and skip(name):
                                continue
                            if name.endswith("gate.tid2eid"):
                                self._check_tid2eid(name, n, part)
                            yield name, part
                        del t
                        bar.update(inv[n].end - inv[n].start)
        finally:
            bar.close()

    def _check_tid2eid(self, name: str, disk: str, t: torch.Tensor) -> None:
        cfg = self.config
        bad = (t < 0) | (t >= cfg.n_routed_experts)
        if bool(bad.any()):
            row = int(bad.any(dim=1).nonzero()[0, 0])
            raise CheckpointError(
                f"{self.inventory[disk].file}: tensor '{disk}' holds expert ids outside [0, n_routed_experts="
                f"{cfg.n_routed_experts}) (row {row}: {t[row].tolist()})")


def open_checkpoint(path: str) -> CheckpointReader:
    """Validate a V4 checkpoint directory (module doc) without reading tensor data."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    cfg = _config(path)
    inv, files, where = _inventory(path)
    layout = _detect_layout(inv)
    where_path = os.path.join(path, where) if where in (INDEX_NAME, SINGLE_NAME) else path
    cfg_path = os.path.join(path, "config.json")
    # ---- the draft under mtp.*: detected from the tensors, checked against config.json
    kind, witness = detect_draft(inv)
    if kind is not None:
        check_draft_kind(cfg, (kind, witness), inv[witness.split("' and '")[0]].file, cfg_path)
    has_draft = kind is not None
    draft = cfg.draft_kind if has_draft else "none"
    prefixes = block_prefixes(cfg, has_draft)

    # ---- routed-expert formats: per block, config.json / hf_quant_config.json vs the tensors
    nv = sorted(n for n in inv if ".experts." in n and n.endswith((".weight_scale_2", ".weight_scale")))
    if nv and not cfg.nvfp4_experts:
        raise CheckpointError(
            f"{cfg_path}: moe_quant_algo is None, expected \"NVFP4\": tensor '{nv[0]}' in "
            f"{inv[nv[0]].file} is an NVFP4 expert tensor (ModelOpt layout); NVIDIA's ports say "
            f"quantization_config.moe_quant_algo \"NVFP4\"")
    if cfg.nvfp4_experts and layout == "hf":
        raise CheckpointError(f"{cfg_path}: moe_quant_algo \"NVFP4\" but the tensors use transformers names "
                              f"(layout 'hf'), which carries MXFP4/FP8 experts only")
    if cfg.nvfp4_experts:
        layout = "modelopt-nvfp4"   # also when no NVFP4 tensor is there: the schema check names them
    announced, source = _announced_formats(cfg, path, prefixes, nv, inv)
    expert_formats = {}
    for p in prefixes:
        probe = (hf_block_prefix(p) + "mlp.experts.gate_up_proj") if layout == "hf" else f"{p}ffn.experts.0.w1.weight"
        disk_fmt = None
        if probe in inv:
            disk_fmt = {"I8": "mxfp4", "U8": "nvfp4", "F8_E4M3": "fp8"}.get(inv[probe].dtype)
        want = announced.get(p)
        if disk_fmt is not None and want is not None and disk_fmt != want:
            raise CheckpointError(
                f"{inv[probe].file}: tensor '{probe}' is {inv[probe].dtype} {_shape_str(inv[probe].shape)} "
                f"({_FMT_NAMES[disk_fmt]} routed experts), but {source} announces {_FMT_NAMES[want]} experts "
                f"for '{p}ffn.experts'")
        expert_formats[p] = want or disk_fmt
    main = expert_formats["layers.0."] or expert_format_of_config(cfg)
    expert_formats = {p: f or main for p, f in expert_formats.items()}
    mixed = sorted({expert_formats[p] for p in prefixes if p.startswith("layers.")})
    if len(mixed) > 1:
        odd = next(p for p in prefixes if expert_formats[p] != main)
        raise CheckpointError(f"{path}: the main stack mixes routed-expert formats ({', '.join(mixed)}: "
                              f"'{odd}ffn.experts' is {expert_formats[odd]}, 'layers.0.ffn.experts' {main}); "
                              f"one format for every main layer is supported")

    # ---- wo_a form (decided from the files, validated by the schema)
    woa_name = "model.layers.0.self_attn.o_a_proj.weight" if layout == "hf" else "layers.0.attn.wo_a.weight"
    wo_a = "bf16" if woa_name in inv and inv[woa_name].dtype == "BF16" else "fp8"

    specs = expected_specs(cfg, expert_formats, wo_a=wo_a, draft=has_draft)
    dspecs, sources = disk_specs(specs, layout, cfg, expert_formats)
    found = {n: (e.dtype, e.shape, e.file) for n, e in inv.items()}
    aliases = {}
    if layout == "hf":
        aliases = {n: hf_alias(n) for n in inv if hf_alias(n) != n}
    context = (f" [layout {layout}, config.json expert_dtype={cfg.expert_dtype!r} "
               f"{'NVFP4 ' if cfg.nvfp4_experts else ''}-> {describe_formats(expert_formats)} experts, wo_a {wo_a}, "
               f"draft {draft}]")
    problems = check_tensors(dspecs, found, cfg, missing_where=where_path, context=context, aliases=aliases)
    raise_problems(problems)

    return CheckpointReader(config=cfg, layout=layout, expert_format=main, wo_a_format=wo_a,
                            draft=draft, path=path, files=files, names=list(specs), inventory=inv,
                            aliases=aliases, sources=sources, expert_formats=expert_formats)


def load_checkpoint(path: str, progress: bool = True) -> LoadedCheckpoint:
    """Load, validate and convert a V4 checkpoint directory to the canonical form (module doc)."""
    r = open_checkpoint(path)
    tensors = {}
    for name, t in r.tensors(progress=progress):
        tensors[name] = t.clone() if t._base is not None else t   # hf expert parts: own their memory
    tensors = {k: tensors[k] for k in r.names}          # schema order
    return LoadedCheckpoint(config=r.config, tensors=tensors, layout=r.layout, expert_format=r.expert_format,
                            wo_a_format=r.wo_a_format, draft=r.draft, path=r.path, files=r.files,
                            expert_formats=r.expert_formats)


def _read_part(sl, rows, cols) -> torch.Tensor:
    """The [rows] x [cols] slice of a safetensors slice handle (None = the whole dimension)."""
    r = slice(None) if rows is None else slice(rows[0], rows[1])
    if cols is None:
        return sl[r]
    return sl[r, cols[0]:cols[1]]


def _canonical_names(src: DiskSource, cfg: ModelConfig):
    """The canonical tensor names one disk tensor supplies."""
    if src.kind == "same":
        yield src.name
        return
    p = src.name + "ffn.experts."
    suffix = "weight" if src.part in ("gate_up_proj", "down_proj") else "scale"
    ws = ("w1", "w3") if src.part.startswith("gate_up") else ("w2",)
    for e in range(cfg.n_routed_experts):
        for w in ws:
            yield f"{p}{e}.{w}.{suffix}"


def _split(src: DiskSource, t: torch.Tensor, cfg: ModelConfig):
    """(canonical name, tensor) of one disk tensor (hf stacked experts: per-expert views)."""
    if src.kind == "same":
        yield src.name, t
        return
    p = src.name + "ffn.experts."
    E = cfg.n_routed_experts
    suffix = "weight" if src.part in ("gate_up_proj", "down_proj") else "scale"
    if src.part.startswith("gate_up"):
        half = t.shape[1] // 2
        for e in range(E):
            yield f"{p}{e}.w1.{suffix}", t[e, :half]
            yield f"{p}{e}.w3.{suffix}", t[e, half:]
    else:
        for e in range(E):
            yield f"{p}{e}.w2.{suffix}", t[e]
