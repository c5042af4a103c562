"""Manifold-constrained hyper-connections (spec §7): 4 residual streams mixed around each sublayer.

All fp32; only the collapsed layer input and the updated streams are rounded (bf16 in official
mode). Sinkhorn runs a fixed 1 + (iters-1) normalisation pairs, no convergence test.
"""
from __future__ import annotations

import torch

from .numerics import Numerics


def sinkhorn(c: torch.Tensor, iters: int, eps: float, num: Numerics) -> torch.Tensor:
    """Row softmax + eps, column normalise, then iters-1 (row, column) normalisation pairs."""
    c = num.fn(lambda v: v.softmax(dim=-1), c) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


class HyperConnection:
    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                 iters: int, hc_eps: float, rms_eps: float, num: Numerics):
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float()
        self.hc, self.iters, self.hc_eps, self.rms_eps, self.num = hc, iters, hc_eps, rms_eps, num

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.flatten(1).float()                                  # [T, hc*d]
        r = self.num.fn(torch.rsqrt, xf.square().mean(-1, keepdim=True) + self.rms_eps)
        return self.num.mm(xf, self.fn.T) * r

    def pre(self, x: torch.Tensor):
        """x [T, hc, d] -> (layer input [T, d], post [T, hc], comb [T, hc, hc])."""
        hc = self.hc
        mix = self._mix(x)
        pre = self.num.fn(torch.sigmoid, mix[:, :hc] * self.scale[0] + self.base[:hc]) + self.hc_eps
        post = 2 * self.num.fn(torch.sigmoid, mix[:, hc:2 * hc] * self.scale[1] + self.base[hc:2 * hc])
        comb = (mix[:, 2 * hc:] * self.scale[2] + self.base[2 * hc:]).view(-1, hc, hc)
        comb = sinkhorn(comb, self.iters, self.hc_eps, self.num)
        y = (pre.unsqueeze(-1) * x.float()).sum(dim=1)
        return self.num.round(y), post, comb

    def post(self, y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """out[k] = post[k] * y + sum_j comb[j, k] * res[j] (the transpose of comb mixes)."""
        mixed = self.num.einsum("tjk,tjd->tkd", comb, res.float())
        return self.num.round(post.unsqueeze(-1) * y.float().unsqueeze(1) + mixed)


class HyperHead:
    """Final collapse of the streams (spec §7.3): sigmoid weights, no Sinkhorn."""

    def __init__(self, fn, base, scale, hc_eps: float, rms_eps: float, num: Numerics):
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float()
        self.hc_eps, self.rms_eps, self.num = hc_eps, rms_eps, num

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.flatten(1).float()
        mix = self.num.mm(xf, self.fn.T) * self.num.fn(torch.rsqrt, xf.square().mean(-1, keepdim=True) + self.rms_eps)
        pre = self.num.fn(torch.sigmoid, mix * self.scale + self.base) + self.hc_eps
        return self.num.round((pre.unsqueeze(-1) * x.float()).sum(dim=1))
