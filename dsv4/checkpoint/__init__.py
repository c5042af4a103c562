"""DeepSeek-V4 checkpoints: schema, loader (3 layouts), writer, deterministic tiny model, real-shaped
synthetic checkpoints.

Canonical in-memory form: ``{official name: tensor}`` in the official formats (see schema.py).
"""
from .loader import CheckpointConfigError, CheckpointError, LoadedCheckpoint, load_checkpoint
from .schema import (EXPERT_FORMATS, LAYOUTS, expected_specs, expected_tensors,
                     expert_format_of_config, official_to_hf)
from .synthetic import iter_synthetic_tensors, make_synthetic, synthetic_config
from .tiny import build_tiny_tensors, make_tiny
from .writer import save_checkpoint

__all__ = [
    "CheckpointConfigError", "CheckpointError", "LoadedCheckpoint", "load_checkpoint",
    "EXPERT_FORMATS", "LAYOUTS", "expected_specs", "expected_tensors", "expert_format_of_config",
    "official_to_hf", "build_tiny_tensors", "make_tiny", "save_checkpoint",
    "iter_synthetic_tensors", "make_synthetic", "synthetic_config",
]
