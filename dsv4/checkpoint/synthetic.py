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

from ..config import ModelConfig, preset as _preset
from ..formats.fp8 import quant_fp8_weight
from .loader import INDEX_NAME, TORCH_TO_ST, CheckpointError
from .schema import LAYOUTS, TensorSpec, disk_specs, expected_specs
from .tiny import KNOBS

DEFAULT_MAX_SHARD = "5GB"
_TINY_INTER = 128          # tiny's moe_intermediate_size: KNOBS["hot_channels"] is per this many
_DRAW_ELEMS = 1 << 24      # fp32 elements per chunk of the embedding / head draws (64 MiB)


# ------------------------------------------------------------------------------------ config
def synthetic_config(preset: str, layers: int = 4, experts: int | None = None) -> ModelConfig:
    """``preset`` ('flash' | 'pro') cut to its first ``layers`` layers and ``experts`` experts."""
    base = _preset(preset)
    if layers < 1 or layers > base.num_hidden_layers:
        raise ValueError(f"layers must be in 1..{base.num_hidden_layers}, got {layers}")
    experts = base.n_routed_experts if experts is None else experts
    if experts < 1:
        raise ValueError(f"experts must be >= 1, got {experts}")
    ratios = tuple(base.compress_ratios[:layers]) + (0,) * base.num_nextn_predict_layers
    return base.replace(num_hidden_layers=layers, compress_ratios=ratios, n_routed_experts=experts,
                        num_experts_per_tok=min(base.num_experts_per_tok, experts),
                        num_hash_layers=min(base.num_hash_layers, layers))


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


def iter_synthetic_tensors(cfg: ModelConfig, seed: int = 0,
                           device: str | torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(canonical name, tensor)`` for ``cfg`` in ``expected_specs`` order, on ``device``.

    Formats as ``LoadedCheckpoint.tensors`` of an official checkpoint: MXFP4 experts when
    ``cfg.expert_dtype`` is 'fp4', FP8 ones otherwise; ``attn.wo_a`` FP8; MTP blocks included.
    ``device`` defaults to cuda when available.
    """
    dev = torch.device(device) if device is not None else _default_device()
    k = KNOBS
    d, V = cfg.hidden_size, cfg.vocab_size
    H, D = cfg.num_attention_heads, cfg.head_dim
    dq, G, R = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    E, K, inter = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    hc, mix = cfg.hc_mult, cfg.hc_mix_dim
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    expert_fp4 = cfg.expert_dtype == "fp4"
    n_hot = max(1, round(k["hot_channels"] * inter / _TINY_INTER))

    def rng(key):
        return _Rng(seed, key, dev)

    def bf16(t):
        return t.to(torch.bfloat16).contiguous()

    def fp8(name, w):
        q, s = quant_fp8_weight(w)
        yield name + ".weight", q
        yield name + ".scale", s

    def mxfp4(name, w):
        q, s = quant_mxfp4_fast(w)
        yield name + ".weight", q
        yield name + ".scale", s

    def norm(name, dim, mean=1.0):
        yield name, bf16(rng(name).norm(dim, mean))

    def linear_fp8(name, o, i, gain=1.0):
        yield from fp8(name, rng(name).linear(o, i, gain))

    def hc_mix(p, kind):
        r = rng(f"{p}hc_{kind}")
        yield f"{p}hc_{kind}_fn", r.normal(mix, hc * d, std=k["hc_fn_gain"] / math.sqrt(hc * d))
        pre = r.normal(hc, std=k["hc_base_std"])
        post = r.normal(hc, std=k["hc_base_std"])
        comb = k["hc_comb_identity"] * torch.eye(hc, device=dev) + r.normal(hc, hc, std=k["hc_base_std"])
        yield f"{p}hc_{kind}_base", torch.cat([pre, post, comb.flatten()])
        yield f"{p}hc_{kind}_scale", r.normal(3, std=k["hc_scale_std"], mean=1.0)

    def hc_head(p):
        r = rng(f"{p}hc_head")
        yield f"{p}hc_head_fn", r.normal(hc, hc * d, std=k["hc_fn_gain"] / math.sqrt(hc * d))
        yield f"{p}hc_head_base", r.normal(hc, std=k["hc_base_std"])
        yield f"{p}hc_head_scale", r.normal(1, std=k["hc_scale_std"], mean=1.0)

    def compressor(p, head_dim, ratio, norm_mean):
        coff = 2 if ratio == 4 else 1
        yield p + "wkv.weight", bf16(rng(p + "wkv").linear(coff * head_dim, d))
        yield p + "wgate.weight", bf16(rng(p + "wgate").linear(coff * head_dim, d, gain=k["compressor_gate_gain"]))
        yield p + "ape", rng(p + "ape").normal(ratio, coff * head_dim, std=k["ape_std"])
        yield from norm(p + "norm.weight", head_dim, norm_mean)

    def swiglu(p, quant):
        r = rng(p)
        w1, w3 = r.linear(inter, d), r.linear(inter, d)
        w2 = r.linear(d, inter, gain=k["w2_gain"])
        hot = torch.randperm(inter, generator=r.g, device=dev)[:n_hot]
        w1[hot] *= k["hot_gain"]
        w3[hot] *= k["hot_gain"]
        w2[:, hot] /= k["hot_gain"]
        yield from quant(p + "w1", w1)
        del w1
        yield from quant(p + "w2", w2)
        del w2
        yield from quant(p + "w3", w3)

    def block(p, layer_id):
        ratio = cfg.layer_ratio(layer_id)
        yield from norm(p + "attn_norm.weight", d)
        yield from norm(p + "ffn_norm.weight", d)
        yield from hc_mix(p, "attn")
        yield from hc_mix(p, "ffn")
        a = p + "attn."
        yield from linear_fp8(a + "wq_a", dq, d)
        yield from norm(a + "q_norm.weight", dq)
        yield from linear_fp8(a + "wq_b", H * D, dq)
        yield from linear_fp8(a + "wkv", D, d)
        yield from norm(a + "kv_norm.weight", D, k["kv_norm"])
        yield from linear_fp8(a + "wo_a", G * R, H * D // G)
        yield from linear_fp8(a + "wo_b", d, G * R, gain=k["wo_b_gain"])
        yield a + "attn_sink", rng(a + "attn_sink").normal(H, std=k["sink_std"], mean=k["sink_mean"])
        if ratio:
            yield from compressor(a + "compressor.", D, ratio, k["compressor_norm"])
            if ratio == 4:
                yield from linear_fp8(a + "indexer.wq_b", nI * dI, dq)
                yield a + "indexer.weights_proj.weight", bf16(rng(a + "indexer.weights_proj").linear(nI, d))
                yield from compressor(a + "indexer.compressor.", dI, ratio, k["indexer_compressor_norm"])
        f = p + "ffn."
        yield f + "gate.weight", bf16(rng(f + "gate.weight").linear(E, d, gain=k["gate_gain"]))
        if layer_id < cfg.num_hidden_layers and cfg.is_hash_layer(layer_id):
            # K distinct experts per token: the K largest of E uniform draws per row
            u = torch.rand(V, E, generator=rng(f + "gate.tid2eid").g, device=dev)
            yield f + "gate.tid2eid", u.topk(K, dim=-1).indices.to(torch.int64).contiguous()
            del u
        else:
            yield f + "gate.bias", rng(f + "gate.bias").normal(E, std=k["gate_bias_std"])
        for e in range(E):
            yield from swiglu(f"{f}experts.{e}.", mxfp4 if expert_fp4 else fp8)
        yield from swiglu(f + "shared_experts.", fp8)

    yield "embed.weight", rng("embed.weight").rows_bf16(V, d, k["embed_std"])
    for i in range(cfg.num_hidden_layers):
        yield from block(f"layers.{i}.", i)
    yield from norm("norm.weight", d)
    yield from hc_head("")
    r = rng("head.weight")
    row_scale = torch.exp(r.normal(V, 1, std=k["head_row_logstd"]))
    yield "head.weight", r.rows_bf16(V, d, k["head_gain"] / math.sqrt(d), row_scale)
    del row_scale
    for j in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{j}."
        yield from linear_fp8(p + "e_proj", d, d)
        yield from linear_fp8(p + "h_proj", d, d)
        yield from norm(p + "enorm.weight", d)
        yield from norm(p + "hnorm.weight", d)
        yield from norm(p + "norm.weight", d)
        yield from hc_head(p)
        yield from block(p, cfg.num_hidden_layers + j)


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


def _layout_stream(cfg: ModelConfig, layout: str, seed: int, device) -> Iterator[tuple[str, torch.Tensor]]:
    """The canonical stream in the layout's expert format (NVFP4 for modelopt, converted per expert)."""
    stream = iter_synthetic_tensors(cfg, seed, device)
    if layout != "modelopt-nvfp4":
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
            yield from _to_nvfp4(pending, cfg).items()
            pending = {}
    assert not pending, sorted(pending)


def make_synthetic(out_dir: str, cfg: ModelConfig, *, layout: str = "official", seed: int = 0,
                   device: str | torch.device | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD,
                   overwrite: bool = False, tokenizer: bool = True, progress: bool = True) -> SyntheticResult:
    """Write ``iter_synthetic_tensors(cfg, seed, device)`` as a checkpoint directory in ``layout``.

    Tensors are generated on ``device`` (default cuda when available), moved to the host one at a
    time and written straight into their shard. ``out_dir`` must not exist or be empty unless
    ``overwrite``; files are written into a temporary sibling renamed at the end (as
    ``save_checkpoint``). Progress in bytes on stderr unless ``progress=False``.
    """
    from tqdm import tqdm

    from .writer import check_out_dir, publish_dir, write_side_files
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    max_bytes = parse_size(max_shard_size)
    out_dir = check_out_dir(out_dir, overwrite)
    fmt = "mxfp4" if cfg.expert_dtype == "fp4" else "fp8"
    if layout == "modelopt-nvfp4":
        if fmt != "mxfp4":
            raise CheckpointError(f"layout 'modelopt-nvfp4' needs config expert_dtype 'fp4', got {cfg.expert_dtype!r}")
        fmt, out_cfg = "nvfp4", cfg.replace(moe_quant_algo="NVFP4")
    else:
        out_cfg = cfg.replace(moe_quant_algo=None)
    specs = expected_specs(out_cfg, fmt)
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
        for name, t in _layout_stream(cfg, layout, seed, device):
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
        write_side_files(tmp, out_cfg, layout, True, tokenizer)
        publish_dir(tmp, out_dir)
    except BaseException:
        if shards is not None:
            shards.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return SyntheticResult(out_dir, total, len(shards.files), len(dspecs))
