"""The MoE layer (spec §8) holding its experts as the checkpoint stores them, stacked.

Routed experts, per ``fmt``:

* ``mxfp4`` (official release): ``w13`` uint8 [E, 2I, d/2] (expert e's w1 rows, then its w3 rows;
  packed e2m1, low nibble first), ``w13_s`` uint8 e8m0 bytes [E, 2I, d/32]; ``w2`` [E, d, I/2],
  ``w2_s`` [E, d, I/32];
* ``nvfp4`` (ModelOpt): the same codes, ``w*_s`` e4m3 bytes [E, N, K/16] and the per-tensor global
  ``weight_scale_2`` as per-row fp32 ``w*_s2`` [E, N] (the kernels read a row's global scale);
  ``input_scale`` is not used (activations are FP8 1x128, as the reference runs them);
* ``fp8``: e4m3 ``w13`` [E, 2I, d], fp32 128x128 block scales ``w13_s`` [E, 2I/128, d/128], ...

The shared expert is FP8: ``sh13`` e4m3 [2I_s, d] (w1 rows, then w3), ``sh2`` [d, I_s], fp32 block
scales.

Expert parallelism (``group`` of N ranks): rank r holds routed experts [r*E/N, (r+1)*E/N) (the
other experts' tensors have the ``foreign`` loader: left unread on disk), ``expert0`` is its first; the router, the hash
table and the shared expert are replicated. Each rank sums its experts' outputs, the sums are
all-reduced (fp32), then the shared expert is added (the official MoE's order). The gate is fp32 [E, d] (bf16 on disk, widened once: the router's GEMM is fp32), its bias
fp32, hash layers' ``tid2eid`` int32. Every expert tensor is written in place as it is read, so
the layer holds one copy of the experts and nothing else of their size.
"""
from __future__ import annotations

import torch
from torch import nn

from ..parallel import SINGLE
from .linear import QBLOCK, Loader, copy_into

EXPERT_FORMATS = ("mxfp4", "nvfp4", "fp8")


class MoE(nn.Module):
    def __init__(self, cfg, layer_id: int, fmt: str, hash_layer: bool, ops, device=None, group=None):
        super().__init__()
        if fmt not in EXPERT_FORMATS:
            raise ValueError(f"expert format must be one of {EXPERT_FORMATS}, got {fmt!r}")
        self.group = group or SINGLE
        E, I, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if E % self.group.world:
            raise ValueError(f"expert parallel size {self.group.world} must divide the {E} routed experts")
        self.n_total = E
        E //= self.group.world                        # local experts
        self.expert0 = self.group.rank * E
        self.fmt, self.ops, self.layer_id = fmt, ops, layer_id
        self.topk, self.route_scale, self.limit = cfg.num_experts_per_tok, float(cfg.routed_scaling_factor), \
            float(cfg.swiglu_limit)
        self.n_experts, self.inter, self.dim = E, I, d
        u8, f32 = torch.uint8, torch.float32
        buf = lambda n, *shape, dtype=u8: self.register_buffer(n, torch.empty(*shape, dtype=dtype, device=device))
        buf("gate_w", self.n_total, d, dtype=f32)
        if hash_layer:
            buf("tid2eid", cfg.vocab_size, self.topk, dtype=torch.int32)
            self.register_buffer("bias", None)
        else:
            buf("bias", self.n_total, dtype=f32)
            self.register_buffer("tid2eid", None)
        if fmt == "fp8":
            e4 = torch.float8_e4m3fn
            buf("w13", E, 2 * I, d, dtype=e4)
            buf("w13_s", E, 2 * I // QBLOCK, d // QBLOCK, dtype=f32)
            buf("w2", E, d, I, dtype=e4)
            buf("w2_s", E, d // QBLOCK, I // QBLOCK, dtype=f32)
            self.w13_s2 = self.w2_s2 = None
        else:
            g = 32 if fmt == "mxfp4" else 16
            buf("w13", E, 2 * I, d // 2)
            buf("w13_s", E, 2 * I, d // g)
            buf("w2", E, d, I // 2)
            buf("w2_s", E, d, I // g)
            if fmt == "nvfp4":
                buf("w13_s2", E, 2 * I, dtype=f32)
                buf("w2_s2", E, d, dtype=f32)
            else:
                self.w13_s2 = self.w2_s2 = None
        e4 = torch.float8_e4m3fn
        buf("sh13", 2 * I, d, dtype=e4)
        buf("sh13_s", 2 * I // QBLOCK, d // QBLOCK, dtype=f32)
        buf("sh2", d, I, dtype=e4)
        buf("sh2_s", d // QBLOCK, I // QBLOCK, dtype=f32)

    # ------------------------------------------------------------------ loading
    def loaders(self, prefix: str) -> dict[str, Loader]:
        """Canonical names under ``prefix`` ('layers.{i}.ffn.') -> loader into this layer's storage."""
        I = self.inter
        out: dict[str, Loader] = {prefix + "gate.weight": copy_into(self.gate_w, prefix + "gate.weight")}
        if self.tid2eid is not None:
            out[prefix + "gate.tid2eid"] = copy_into(self.tid2eid, prefix + "gate.tid2eid")
        else:
            out[prefix + "gate.bias"] = copy_into(self.bias, prefix + "gate.bias")
        fp8 = self.fmt == "fp8"
        rows13 = lambda w: slice(0, I) if w == "w1" else slice(I, 2 * I)
        for e in range(self.n_total):
            if not self.expert0 <= e < self.expert0 + self.n_experts:       # another rank's expert
                for w in ("w1", "w3", "w2"):
                    for part in (("weight", "weight_scale", "weight_scale_2", "input_scale")
                                 if self.fmt == "nvfp4" else ("weight", "scale")):
                        out[f"{prefix}experts.{e}.{w}.{part}"] = foreign
                continue
            le = e - self.expert0
            for w in ("w1", "w3", "w2"):
                n = f"{prefix}experts.{e}.{w}."
                if w == "w2":
                    codes, sc, s2 = self.w2[le], self.w2_s[le], None if self.w2_s2 is None else self.w2_s2[le]
                else:
                    r = rows13(w)
                    codes, s2 = self.w13[le, r], None if self.w13_s2 is None else self.w13_s2[le, r]
                    sc = self.w13_s[le, r.start // QBLOCK:r.stop // QBLOCK] if fp8 else self.w13_s[le, r]
                out[n + "weight"] = copy_into(codes, n + "weight")
                if self.fmt == "nvfp4":
                    out[n + "weight_scale"] = _raw(sc, n + "weight_scale")
                    out[n + "weight_scale_2"] = _fill(s2, n + "weight_scale_2")
                    out[n + "input_scale"] = _unused
                elif fp8:
                    out[n + "scale"] = copy_into(sc, n + "scale")
                else:
                    out[n + "scale"] = _raw(sc, n + "scale")
        s = prefix + "shared_experts."
        out[s + "w1.weight"] = copy_into(self.sh13[:I], s + "w1.weight")
        out[s + "w3.weight"] = copy_into(self.sh13[I:], s + "w3.weight")
        out[s + "w2.weight"] = copy_into(self.sh2, s + "w2.weight")
        out[s + "w1.scale"] = copy_into(self.sh13_s[:I // QBLOCK], s + "w1.scale")
        out[s + "w3.scale"] = copy_into(self.sh13_s[I // QBLOCK:], s + "w3.scale")
        out[s + "w2.scale"] = copy_into(self.sh2_s, s + "w2.scale")
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.moe(self, x, ids)


def _raw(dst: torch.Tensor, what: str) -> Loader:
    """Scale bytes kept as they are (uint8 view of e8m0 / e4m3)."""
    def load(t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(t.shape)}")
        dst.copy_(t.contiguous().view(torch.uint8))
    return load


def _fill(dst: torch.Tensor, what: str) -> Loader:
    """A 0-d global scale spread over the rows it applies to."""
    def load(t: torch.Tensor) -> None:
        if t.numel() != 1:
            raise ValueError(f"{what}: expected a scalar, got shape {tuple(t.shape)}")
        dst.fill_(float(t.float()))
    return load


def foreign(t: torch.Tensor) -> None:
    """Another rank's tensor (expert parallelism): not read from disk when the reader can skip it
    (``DeepseekV4.from_checkpoint``), dropped when it comes anyway."""


def _unused(t: torch.Tensor) -> None:
    """ModelOpt's ``input_scale`` (a W4A4 activation scale): the activations here are FP8 1x128."""
