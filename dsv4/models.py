"""Where models come from: a checkpoint directory, or the embedded default tiny model.

The default is the deterministic tiny V4 (``preset('tiny')``, seed 0) with the real V4 tokenizer,
written once into the user cache directory and reused afterwards (``DSV4_CACHE_DIR`` overrides
the location).
"""
from __future__ import annotations

import os
import sys

DEFAULT_SEED = 0


def cache_dir() -> str:
    env = os.environ.get("DSV4_CACHE_DIR")
    if env:
        return env
    import platformdirs
    return platformdirs.user_cache_dir("dsv4")


def default_model_dir() -> str:
    """Path of the embedded default model, created on first use."""
    path = os.path.join(cache_dir(), f"tiny-official-seed{DEFAULT_SEED}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from .checkpoint.tiny import make_tiny
    os.makedirs(os.path.dirname(path), exist_ok=True)
    print(f"dsv4: writing the default tiny model to {path} (first use)", file=sys.stderr)
    try:
        make_tiny(path, layout="official", seed=DEFAULT_SEED)
    except FileExistsError:
        # another process finished it first (the writer renames a complete temp dir into place)
        if not os.path.exists(os.path.join(path, "config.json")):
            raise
    return path


def resolve_model(model: str | None) -> str:
    if model is None:
        return default_model_dir()
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model directory {model!r} does not exist (dsv4 loads local checkpoints; "
                                f"omit --model for the embedded default)")
    return model
