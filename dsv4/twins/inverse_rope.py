"""Twin of ``kernels.inverse_rope``: ``reference.rope.apply_rope(inverse=True)``, flattened, then (with
``fp8``) the official 1x128 activation quantisation."""
from __future__ import annotations

import torch

from ..formats.contracts import check_inverse_rope
from ..formats.fp8 import act_quant_fp8
from ..reference.rope import apply_rope


def inverse_rope(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp8: bool = False, **_):
    check_inverse_rope(o, cos, sin)
    y = apply_rope(o, torch.complex(cos.float(), sin.float()), inverse=True).flatten(1)
    if fp8:
        return act_quant_fp8(y, 128)
    return y


__all__ = ["inverse_rope"]
