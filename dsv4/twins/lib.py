"""Batch invariance of the twins' GEMMs.

A CPU BLAS picks its fp32 GEMM kernel by the row count M (at M = 1 a GEMV, small M their own
tails), so a row's bits would depend on how many rows share the call. Every twin GEMM whose M is
the number of tokens therefore runs on rows zero-padded to a multiple of ``ROW_PAD`` (at least
``ROW_PAD``): a token's result is then the same alone, batched, chunked or decoded (checked for this
machine's BLAS by ``tests/test_model.py``). The products and fp32 sums are still the official
fp32 GEMM's; only the order BLAS sums in is pinned.
"""
from __future__ import annotations

import functools

import torch

ROW_PAD = 8


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, ...] zero-padded along dim 0 to a multiple of ROW_PAD (at least ROW_PAD)."""
    M = x.shape[0]
    P = max(ROW_PAD, -(-M // ROW_PAD) * ROW_PAD)
    return x if P == M else torch.cat([x, x.new_zeros(P - M, *x.shape[1:])])


def row_invariant(fn):
    """``fn(x, *args)`` on x padded by ``padded_rows``; every tensor output sliced back to M rows."""
    @functools.wraps(fn)
    def run(x, *args, **kw):
        M = x.shape[0]
        out = fn(padded_rows(x), *args, **kw)
        if isinstance(out, tuple):
            return tuple(o[:M] for o in out)
        return out[:M]
    return run


__all__ = ["ROW_PAD", "padded_rows", "row_invariant"]
