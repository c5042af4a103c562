"""Mixture of experts (spec §8): sqrt-softplus gate, hash or biased top-k routing, clamped SwiGLU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import Linear
from .numerics import Numerics


class Expert:
    """SwiGLU with the swiglu_limit clamp; the routing weight is applied before w2."""

    def __init__(self, w1: Linear, w2: Linear, w3: Linear, limit: float, num: Numerics):
        self.w1, self.w2, self.w3, self.limit, self.num = w1, w2, w3, limit, num

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        g = self.w1(x).float()
        u = self.w3(x).float().clamp(-self.limit, self.limit)
        h = self.num.fn(F.silu, g.clamp(max=self.limit)) * u
        if weight is not None:
            h = weight.unsqueeze(-1) * h
        return self.w2(self.num.round(h))


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
        scores = self.num.fn(lambda v: torch.sqrt(F.softplus(v)), self.num.mm(x.float(), self.gate_w.T))
        if self.tid2eid is not None:
            idx = self.tid2eid[ids]                       # hash layer: ids from the table, no bias
        else:
            idx = (scores + self.bias).topk(self.topk, dim=-1).indices  # bias only for selection
        w = scores.gather(1, idx)
        w = w / w.sum(dim=-1, keepdim=True) * self.route_scale
        return idx, w

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
