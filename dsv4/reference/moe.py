"""Mixture of experts (spec §8): sqrt-softplus gate, hash or biased top-k routing, clamped SwiGLU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import Linear
from .numerics import Numerics


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float, weight: torch.Tensor | None, num: Numerics) -> torch.Tensor:
    """The expert middle: w1 / w3 outputs (upcast), u clamped to +-limit, g to <= limit, silu(g) * u,
    times the routing weight (before w2), rounded."""
    g = g.float()
    u = u.float().clamp(-limit, limit)
    h = num.fn(F.silu, g.clamp(max=limit)) * u
    if weight is not None:
        h = weight.unsqueeze(-1) * h
    return num.round(h)


def route(x: torch.Tensor, ids: torch.Tensor | None, gate_w: torch.Tensor, bias: torch.Tensor | None,
          tid2eid: torch.Tensor | None, topk: int, route_scale: float, num: Numerics):
    """(expert ids [T, k], routing weights [T, k] fp32): sqrt-softplus scores of the fp32 gate GEMM,
    the top-k of score + bias (bias for selection only) or the hash table's row, the picked scores
    normalised to sum ``route_scale``."""
    scores = num.fn(lambda v: torch.sqrt(F.softplus(v)), num.mm(x.float(), gate_w.float().T))
    if tid2eid is not None:
        idx = tid2eid.long()[ids]                         # hash layer: ids from the table, no bias
    else:
        idx = (scores + bias.float()).topk(topk, dim=-1).indices  # bias only for selection
    w = scores.gather(1, idx)
    return idx, w / w.sum(dim=-1, keepdim=True) * route_scale


class Expert:
    """SwiGLU with the swiglu_limit clamp; the routing weight is applied before w2."""

    def __init__(self, w1: Linear, w2: Linear, w3: Linear, limit: float, num: Numerics):
        self.w1, self.w2, self.w3, self.limit, self.num = w1, w2, w3, limit, num

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit, weight, self.num))


class MoE:
    def __init__(self, gate_w: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
                 experts: list[Expert], shared: Expert, topk: int, route_scale: float, num: Numerics):
        self.gate_w = gate_w.float()
        self.bias = None if bias is None else bias.float()
        self.tid2eid = None if tid2eid is None else tid2eid.long()
        self.experts, self.shared = experts, shared
        self.topk, self.route_scale, self.num = topk, route_scale, num

    def route(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], routing weights [T, k] fp32)."""
        return route(x, ids, self.gate_w, self.bias, self.tid2eid, self.topk, self.route_scale, self.num)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        idx, w = self.route(x, ids)
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):          # increasing expert id, as the official loop
            hit = idx == e
            rows = hit.any(dim=1).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            # a repeated id in a tid2eid row contributes once, with its (equal) gathered weight
            col = hit[rows].float().argmax(dim=1)
            y[rows] += expert(x[rows], w[rows, col]).float()
        return self.num.round(y + self.shared(x).float())
