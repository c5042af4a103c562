"""Real-shaped synthetic V4 checkpoints: random weights at Flash / Pro dimensions, streamed to disk.

No real V4 weights can be downloaded, so real scale is exercised with synthetic ones:

* ``synthetic_config(preset, layers, experts)``: the preset's real dimensions with the first
  ``layers`` layers (their compress ratios, plus the trailing 0 of the MTP block) and
  ``experts`` routed experts (default: all of them; ``num_experts_per_tok`` clipped).
* ``iter_synthetic_tensors(cfg, seed, device)``: ``(canonical name, tensor)`` pairs in schema
  order (``schema.expected_specs``) and the canonical formats of ``LoadedCheckpoint.tensors``
  (FP8 + e8m0 128x128 scales, MXFP4 routed experts or FP8 ones for ``expert_dtype`` fp8/null,
  ``attn.wo_a`` FP8), one tensor at a time, on ``device``; feeds a model in memory or the writer.
* ``make_synthetic(out_dir, cfg, layout, ...)``: writes that stream as a checkpoint in the
  official, hf or modelopt-nvfp4 layout (converted per tensor on the way), in shards of at most
  ``max_shard_size`` bytes with ``model.safetensors.index.json``, plus config / tokenizer files as
  ``writer.save_checkpoint`` writes them.

Determinism: every draw unit (a tensor, or a group drawn together such as one expert's
w1/w2/w3) has its own generator seeded from ``(seed, unit name)``, so the bytes depend on the
seed and the device kind only, not on the order of consumption or on thread counts.

Conditioning is tiny.py's (``tiny.KNOBS``, same gains and means): every linear is drawn with std
gain / sqrt(fan_in) and every norm, temperature and router knob is dimension-free, so real dims
keep the tiny model's activation scales and clear top-1 margins. The only count that scales
with size is the number of "hot" SwiGLU channels: the same fraction of the intermediate size as
tiny's (4 of 128).

Memory: the writer plans all shard headers up front from the schema and writes every tensor at
its offset as soon as it is made, so host RAM holds one tensor (plus its fp32 draw) at a time,
never a shard; the hf layout's stacked expert tensors are filled expert by expert in place.
A single tensor larger than ``max_shard_size`` gets a shard of its own.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import DSPARK_MARKOV_RANK, ModelConfig, preset as _preset, with_draft
from ..formats.fp8 import quant_fp8_weight
from .loader import INDEX_NAME, TORCH_TO_ST
from .schema import LAYOUTS, TensorSpec, base_expert_format, block_prefixes, disk_specs, expected_specs, walk
from .tiny import KNOBS

DEFAULT_MAX_SHARD = "5GB"
_TINY_INTER = 128          # tiny's moe_intermediate_size: KNOBS["hot_channels"] is per this many
_DRAW_ELEMS = 1 << 24      # fp32 elements per chunk of the embedding / head draws (64 MiB)


# ------------------------------------------------------------------------------------ config
def synthetic_config(preset: str, layers: int = 4, experts: int | None = None,
                     draft: str = "mtp") -> ModelConfig:
    """``preset`` ('flash' | 'pro') cut to its first ``layers`` layers and ``experts`` experts, with
    ``draft`` ('none' | 'mtp' | 'dspark', config.with_draft): 'dspark' at full depth is the
    V4-Flash-0731 / V4-Pro-0813 config."""
    base = _preset(preset)
    if layers < 1 or layers > base.num_hidden_layers:
        raise ValueError(f"layers must be in 1..{base.num_hidden_layers}, got {layers}")
    experts = base.n_routed_experts if experts is None else experts
    if experts < 1:
        raise ValueError(f"experts must be >= 1, got {experts}")
    ratios = tuple(base.compress_ratios[:layers]) + (0,) * base.num_nextn_predict_layers
    cfg = base.replace(num_hidden_layers=layers, compress_ratios=ratios, n_routed_experts=experts,
                       num_experts_per_tok=min(base.num_experts_per_tok, experts),
                       num_hash_layers=min(base.num_hash_layers, layers))
    return with_draft(cfg, draft, DSPARK_MARKOV_RANK[preset])


# ------------------------------------------------------------------------------------ MXFP4
def quant_mxfp4_fast(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit-identical to ``formats.fp4.quant_mxfp4`` (same codes and e8m0 bytes), ~5x faster.

    Same arithmetic: s = pow2_ceil(amax / 6) per 32-group (amax clamped at 1e-12), codes =
    e2m1(w / s) rounded to nearest, ties to the even code. The power of two is read off the fp32
    bits of amax / 6 (always a normal number here) and the rounding is seven threshold compares
    (``>`` where the tie goes down, ``>=`` where it goes up) summed as uint8.
    """
    if w.dim() != 2 or w.shape[1] % 32 != 0:
        raise ValueError(f"quant_mxfp4_fast: expected [out, in] with in % 32 == 0, got {tuple(w.shape)}")
    out_f, in_f = w.shape
    wb = w.float().reshape(out_f, in_f // 32, 32)
    amax = torch.maximum(wb.amax(dim=-1, keepdim=True), -wb.amin(dim=-1, keepdim=True)).clamp_(min=1e-12)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("quant_mxfp4_fast: input contains NaN or inf")
    bits = (amax / 6.0).view(torch.int32)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)     # biased exponent of pow2_ceil
    x = (wb / (e << 23).view(torch.float32)).reshape(out_f, in_f)
    a = x.abs()
    u8 = torch.uint8
    code = torch.signbit(x).view(u8) << 3
    for bound, tie_up in ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                          (2.5, False), (3.5, True), (5.0, False)):
        code += (a >= bound if tie_up else a > bound).view(u8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.int8), e.reshape(out_f, in_f // 32).to(u8).view(torch.float8_e8m0fnu)


# ------------------------------------------------------------------------------------ generator
def _unit_seed(seed: int, key: str) -> int:
    h = hashlib.blake2b(f"dsv4-synthetic/{int(seed)}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class _Rng:
    """The generator of one draw unit; formulas as tiny._Draw."""

    def __init__(self, seed: int, key: str, device: torch.device):
        self.device = device
        self.g = torch.Generator(device=device).manual_seed(_unit_seed(seed, key))

    def normal(self, *shape, std=1.0, mean=0.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.g, device=self.device).mul_(std)
        return x.add_(mean) if mean else x

    def linear(self, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return self.normal(out_f, in_f, std=gain / math.sqrt(in_f))

    def norm(self, dim: int, mean: float = 1.0) -> torch.Tensor:
        return self.normal(dim, std=0.05 * mean, mean=mean)

    def rows_bf16(self, n: int, d: int, std: float, row_scale: torch.Tensor | None = None) -> torch.Tensor:
        """[n, d] bf16 normal * std (* row_scale), drawn in fixed-size row chunks (bounded fp32 memory)."""
        out = torch.empty(n, d, dtype=torch.bfloat16, device=self.device)
        step = max(1, _DRAW_ELEMS // d)
        for i in range(0, n, step):
            x = self.normal(min(step, n - i), d, std=std)
            if row_scale is not None:
                x *= row_scale[i:i + step]
            out[i:i + step] = x
        return out


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def iter_synthetic_tensors(cfg: ModelConfig, seed: int = 0, device: str | torch.device | None = None,
                           draft: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(canonical name, tensor)`` for ``cfg`` in ``schema.walk`` order, on ``device``.

    Formats as ``LoadedCheckpoint.tensors`` of an official checkpoint: MXFP4 experts when
    ``cfg.expert_dtype`` is 'fp4', FP8 ones otherwise; ``attn.wo_a`` FP8; the config's draft
    (MTP blocks or DSpark stages) unless ``draft=False``. ``device`` defaults to cuda when available.
    """
    dev = torch.device(device) if device is not None else _default_device()
    k = KNOBS
    hc = cfg.hc_mult
    inter = cfg.moe_intermediate_size
    n_hot = max(1, round(k["hot_channels"] * inter / _TINY_INTER))

    def quant(name, w, fp4):
        q, s = quant_mxfp4_fast(w) if fp4 else quant_fp8_weight(w)
        yield name + ".weight", q
        yield name + ".scale", s

    for u in walk(cfg, base_expert_format(cfg), draft=draft):
        (name, sp), kind = u.specs[0], u.kind
        r = _Rng(seed, u.key, dev)
        knob = k[u.knob] if u.knob else 1.0
        if kind == "embed":
            yield name, r.rows_bf16(*sp.shape, k["embed_std"])
        elif kind == "head":
            row_scale = torch.exp(r.normal(sp.shape[0], 1, std=k["head_row_logstd"]))
            yield name, r.rows_bf16(*sp.shape, k["head_gain"] / math.sqrt(sp.shape[1]), row_scale)
            del row_scale
        elif kind == "norm":
            yield name, r.norm(sp.shape[0], knob).to(torch.bfloat16)
        elif kind == "fp8_linear":
            q, s = quant_fp8_weight(r.linear(*sp.shape, knob))
            yield name, q
            yield u.specs[1][0], s
        elif kind == "bf16_linear":
            yield name, r.linear(*sp.shape, knob).to(torch.bfloat16).contiguous()
        elif kind == "rows":
            yield name, r.rows_bf16(*sp.shape, knob)
        elif kind == "hc_mix":
            yield name, r.normal(*sp.shape, std=k["hc_fn_gain"] / math.sqrt(sp.shape[1]))
            pre = r.normal(hc, std=k["hc_base_std"])
            post = r.normal(hc, std=k["hc_base_std"])
            comb = k["hc_comb_identity"] * torch.eye(hc, device=dev) + r.normal(hc, hc, std=k["hc_base_std"])
            yield u.specs[1][0], torch.cat([pre, post, comb.flatten()])
            yield u.specs[2][0], r.normal(3, std=k["hc_scale_std"], mean=1.0)
        elif kind == "hc_head":
            yield name, r.normal(*sp.shape, std=k["hc_fn_gain"] / math.sqrt(sp.shape[1]))
            yield u.specs[1][0], r.normal(hc, std=k["hc_base_std"])
            yield u.specs[2][0], r.normal(1, std=k["hc_scale_std"], mean=1.0)
        elif kind == "ape":
            yield name, r.normal(*sp.shape, std=k["ape_std"])
        elif kind == "sink":
            yield name, r.normal(*sp.shape, std=k["sink_std"], mean=k["sink_mean"])
        elif kind == "gate_bias":
            yield name, r.normal(*sp.shape, std=k["gate_bias_std"])
        elif kind == "tid2eid":
            # K distinct experts per token: the K largest of E uniform draws per row
            u01 = torch.rand(sp.shape[0], cfg.n_routed_experts, generator=r.g, device=dev)
            yield name, u01.topk(sp.shape[1], dim=-1).indices.to(torch.int64).contiguous()
            del u01
        elif kind == "swiglu":
            spec = dict(u.specs)
            dtype = spec[u.key + "w1.weight"].dtype
            if dtype not in (torch.int8, torch.float8_e4m3fn):
                raise ValueError(f"{u.key}: the synthetic generator draws MXFP4 or FP8 experts, not {dtype}")
            fp4 = dtype == torch.int8
            d = spec[u.key + "w2.weight"].shape[0]
            w1, w3 = r.linear(inter, d), r.linear(inter, d)
            w2 = r.linear(d, inter, gain=k["w2_gain"])
            hot = torch.randperm(inter, generator=r.g, device=dev)[:n_hot]
            w1[hot] *= k["hot_gain"]
            w3[hot] *= k["hot_gain"]
            w2[:, hot] /= k["hot_gain"]
            yield from quant(u.key + "w1", w1, fp4)
            del w1
            yield from quant(u.key + "w2", w2, fp4)
            del w2
            yield from quant(u.key + "w3", w3, fp4)
            del w3
        else:
            raise AssertionError(f"unknown unit kind {kind!r}")


def synthetic_tensors(cfg: ModelConfig, seed: int = 0, device=None) -> dict[str, torch.Tensor]:
    """The whole stream as a dict (small configs only: it holds every tensor)."""
    return dict(iter_synthetic_tensors(cfg, seed, device))


# ------------------------------------------------------------------------------------ writer
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(s: str | int) -> int:
    """'5GB' -> 5 * 10**9, '512MiB' -> 512 * 2**20, 1000 / '1000' -> 1000 bytes."""
    if isinstance(s, int):
        n = s
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(s))
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"not a size: {s!r} (e.g. 5GB, 512MiB, 1000000)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise ValueError(f"size must be >= 1 byte, got {s!r}")
    return n


def human_size(n: int) -> str:
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n} B"


def _nbytes(sp: TensorSpec) -> int:
    return math.prod(sp.shape) * sp.dtype.itemsize


@dataclass
class SyntheticResult:
    path: str
    total_bytes: int
    shards: int
    tensors: int          # tensors on disk


class _ShardFiles:
    """Planned safetensors shards: headers written up front, tensor bytes written at their offsets."""

    def __init__(self, dir_: str, dspecs: dict[str, TensorSpec], max_bytes: int):
        groups: list[list[str]] = []
        acc = 0
        for n, sp in dspecs.items():
            sz = _nbytes(sp)
            if not groups or (acc + sz > max_bytes and acc > 0):
                groups.append([])
                acc = 0
            groups[-1].append(n)
            acc += sz
        self.files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        self.where: dict[str, tuple[int, int]] = {}      # disk name -> (shard, absolute offset)
        self.left = []                                    # data bytes still to write per shard
        self.paths = [os.path.join(dir_, f) for f in self.files]
        self.fds: dict[int, int] = {}
        for si, (path, names) in enumerate(zip(self.paths, groups)):
            # widest items first keeps every tensor aligned to its item size (as safetensors does)
            order = sorted(names, key=lambda n: -dspecs[n].dtype.itemsize)
            header: dict = {"__metadata__": {"format": "pt"}}
            off = 0
            for n in order:
                sz = _nbytes(dspecs[n])
                header[n] = {"dtype": TORCH_TO_ST[dspecs[n].dtype], "shape": list(dspecs[n].shape),
                             "data_offsets": [off, off + sz]}
                off += sz
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-(8 + len(raw)) % 8)
            base = 8 + len(raw)
            with open(path, "wb") as fh:
                fh.write(len(raw).to_bytes(8, "little"))
                fh.write(raw)
                fh.truncate(base + off)
            os.chmod(path, 0o644)
            for n in order:
                self.where[n] = (si, base + header[n]["data_offsets"][0])
            self.left.append(off)
        self.weight_map = {n: self.files[si] for n, (si, _) in self.where.items()}

    def write(self, disk_name: str, offset: int, t: torch.Tensor) -> int:
        si, start = self.where[disk_name]
        fd = self.fds.get(si)
        if fd is None:
            fd = self.fds[si] = os.open(self.paths[si], os.O_WRONLY)
        buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        pos, done = start + offset, 0
        while done < len(buf):
            done += os.pwrite(fd, buf[done:], pos + done)
        self.left[si] -= len(buf)
        if self.left[si] == 0:
            os.close(self.fds.pop(si))
        return len(buf)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _placements(specs: dict[str, TensorSpec], sources, cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """canonical name -> (disk name, byte offset inside that disk tensor)."""
    out: dict[str, tuple[str, int]] = {}
    for dname, src in sources.items():
        if src.kind == "same":
            out[src.name] = (dname, 0)
            continue
        p = src.name + "ffn.experts."
        suffix = "weight" if src.part in ("gate_up_proj", "down_proj") else "scale"
        for e in range(cfg.n_routed_experts):
            if src.part.startswith("gate_up"):
                nb = _nbytes(specs[f"{p}{e}.w1.{suffix}"])
                out[f"{p}{e}.w1.{suffix}"] = (dname, 2 * e * nb)
                out[f"{p}{e}.w3.{suffix}"] = (dname, 2 * e * nb + nb)
            else:
                nb = _nbytes(specs[f"{p}{e}.w2.{suffix}"])
                out[f"{p}{e}.w2.{suffix}"] = (dname, e * nb)
    return out


def _layout_stream(cfg: ModelConfig, convert: set[str], seed: int, device,
                   draft: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The canonical stream with the MXFP4 experts of the blocks ``convert`` converted to NVFP4,
    expert by expert."""
    stream = iter_synthetic_tensors(cfg, seed, device, draft=draft)
    if not convert:
        yield from stream
        return
    from .writer import _to_nvfp4
    pending: dict[str, torch.Tensor] = {}
    for name, t in stream:
        if ".ffn.experts." not in name:
            yield name, t
            continue
        pending[name] = t
        if name.endswith(".w3.scale"):         # last of the expert's six tensors (schema order)
            yield from _to_nvfp4(pending, convert).items()
            pending = {}
    assert not pending, sorted(pending)


def make_synthetic(out_dir: str, cfg: ModelConfig, *, layout: str = "official", seed: int = 0,
                   device: str | torch.device | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD,
                   overwrite: bool = False, tokenizer: bool = True, progress: bool = True,
                   draft: bool = True) -> SyntheticResult:
    """Write ``iter_synthetic_tensors(cfg, seed, device, draft)`` as a checkpoint directory in ``layout``.

    Tensors are generated on ``device`` (default cuda when available), moved to the host one at a
    time and written straight into their shard. ``out_dir`` must not exist or be empty unless
    ``overwrite``; files are written into a temporary sibling renamed at the end (as
    ``save_checkpoint``). Progress in bytes on stderr unless ``progress=False``.
    """
    from tqdm import tqdm

    from .writer import check_out_dir, layout_config, layout_formats, publish_dir, write_side_files
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    max_bytes = parse_size(max_shard_size)
    out_dir = check_out_dir(out_dir, overwrite)
    drawn = {p: base_expert_format(cfg) for p in block_prefixes(cfg, draft)}
    fmt = layout_formats(cfg, layout, drawn)
    out_cfg = layout_config(cfg, layout, fmt)
    convert = {p for p in fmt if fmt[p] != drawn[p]}
    specs = expected_specs(out_cfg, fmt, draft=draft)
    dspecs, sources = disk_specs(specs, layout, out_cfg, fmt)
    place = _placements(specs, sources, out_cfg)
    total = sum(_nbytes(sp) for sp in dspecs.values())

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if free < total:
        raise OSError(f"{parent}: {human_size(free)} free, the checkpoint needs {human_size(total)}")
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    shards = None
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               disable=not progress, desc=f"writing {os.path.basename(out_dir)}")
    try:
        os.chmod(tmp, 0o755)
        shards = _ShardFiles(tmp, dspecs, max_bytes)
        seen: set[str] = set()
        for name, t in _layout_stream(cfg, convert, seed, device, draft):
            sp = specs.get(name)
            if sp is None or name in seen:
                raise AssertionError(f"synthetic stream: unexpected or repeated tensor {name!r}")
            if t.dtype != sp.dtype or tuple(t.shape) != sp.shape:
                raise AssertionError(f"synthetic stream: {name} is {t.dtype} {tuple(t.shape)}, "
                                     f"expected {sp.dtype} {sp.shape}")
            seen.add(name)
            dname, off = place[name]
            bar.update(shards.write(dname, off, t.detach().to("cpu").contiguous()))
            del t
        missing = [n for n in specs if n not in seen]
        if missing or any(shards.left):
            raise AssertionError(f"synthetic stream: {len(missing)} tensor(s) not written, e.g. {missing[:3]}")
        shards.close()
        with open(os.path.join(tmp, INDEX_NAME), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": shards.weight_map}, fh, indent=2)
            fh.write("\n")
        write_side_files(tmp, out_cfg, layout, tokenizer)
        publish_dir(tmp, out_dir)
    except BaseException:
        if shards is not None:
            shards.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return SyntheticResult(out_dir, total, len(shards.files), len(dspecs))
