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


def _mix(x: torch.Tensor, fn: torch.Tensor, rms_eps: float, num: Numerics) -> torch.Tensor:
    xf = x.flatten(1).float()                                      # [T, hc*d]
    r = num.fn(torch.rsqrt, xf.square().mean(-1, keepdim=True) + rms_eps)
    return num.mm(xf, fn.float().T) * r


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
           hc_eps: float, rms_eps: float, num: Numerics):
    """x [T, hc, d] -> (layer input [T, d], post [T, hc], comb [T, hc, hc])."""
    base, scale = base.float(), scale.float()
    mix = _mix(x, fn, rms_eps, num)
    pre = num.fn(torch.sigmoid, mix[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * num.fn(torch.sigmoid, mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mix[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    comb = sinkhorn(comb, iters, hc_eps, num)
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=1)
    return num.round(y), post, comb


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, num: Numerics) -> torch.Tensor:
    """out[k] = post[k] * y + sum_j comb[j, k] * res[j] (the transpose of comb mixes)."""
    mixed = num.einsum("tjk,tjd->tkd", comb, res.float())
    return num.round(post.unsqueeze(-1) * y.float().unsqueeze(1) + mixed)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            rms_eps: float, num: Numerics) -> torch.Tensor:
    """Final collapse of the streams (spec §7.3): sigmoid weights, no Sinkhorn."""
    mix = _mix(x, fn, rms_eps, num)
    pre = num.fn(torch.sigmoid, mix * scale.float() + base.float()) + hc_eps
    return num.round((pre.unsqueeze(-1) * x.float()).sum(dim=1))


class HyperConnection:
    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                 iters: int, hc_eps: float, rms_eps: float, num: Numerics):
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float()
        self.hc, self.iters, self.hc_eps, self.rms_eps, self.num = hc, iters, hc_eps, rms_eps, num

    def pre(self, x: torch.Tensor):
        """x [T, hc, d] -> (layer input [T, d], post [T, hc], comb [T, hc, hc])."""
        return hc_pre(x, self.fn, self.base, self.scale, self.hc, self.iters, self.hc_eps, self.rms_eps, self.num)

    def post(self, y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return hc_post(y, res, post, comb, self.num)


class HyperHead:
    """Final collapse of the streams (spec §7.3): sigmoid weights, no Sinkhorn."""

    def __init__(self, fn, base, scale, hc_eps: float, rms_eps: float, num: Numerics):
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float()
        self.hc_eps, self.rms_eps, self.num = hc_eps, rms_eps, num

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return hc_head(x, self.fn, self.base, self.scale, self.hc_eps, self.rms_eps, self.num)
