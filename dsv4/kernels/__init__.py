"""Triton / Gluon kernels of the hot path, one file per kernel family (``gemm/`` the GEMMs and their
router), their torch twins in ``dsv4.twins`` (one file each, the same names and signatures), and the
op table that picks between them in ``dsv4.ops`` (the only importer of both).

``lib.py``: the device helpers the kernel files share (public names; no kernel file imports another's
private name) and the one device probe, ``lib.target(device)``. The names below are re-exported for
callers that only ask whether kernels can run here.
"""
from __future__ import annotations

from .lib import cuda_ok, interpreting, target, triton_available

__all__ = ["cuda_ok", "interpreting", "target", "triton_available"]
