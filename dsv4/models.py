"""Where models come from: a checkpoint directory, a Hugging Face Hub id, or the embedded
default tiny model; and the default sampling parameters a model's ``generation_config.json``
recommends.

The default is the deterministic tiny V4 (``preset('tiny')``, seed 0) with the real V4 tokenizer,
written once into the user cache directory and reused afterwards (``DSV4_CACHE_DIR`` overrides
the location).

A model argument that is not a directory and reads ``owner/name`` is a Hub id, resolved as vLLM
does with ``huggingface_hub.snapshot_download`` into the Hub's usual cache (``HF_HUB_CACHE`` /
``HF_HOME``; ``HF_HUB_OFFLINE=1`` uses only what is cached; ``HF_TOKEN`` for gated repositories),
fetching only what dsv4 reads (``HUB_FILES``), at ``revision`` (a branch, tag or commit).
"""
from __future__ import annotations

import json
import os
import re
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
    import fcntl

    from .checkpoint.tiny import make_tiny
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # one writer at a time: processes started together on first use (servers, test workers) wait
    # for the first one's model instead of replacing it while another one loads it
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(path, "config.json")):
            print(f"dsv4: writing the default tiny model to {path} (first use)", file=sys.stderr)
            make_tiny(path, layout="official", seed=DEFAULT_SEED, overwrite=True)
    return path


#: the files of a Hub repository that dsv4 reads: weights, config, tokenizer, generation config
HUB_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json", "hf_quant_config.json",
             "generation_config.json", "tokenizer.json", "tokenizer_config.json")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(model: str) -> bool:
    """``model`` names a Hugging Face Hub repository (``owner/name``, not a local directory)."""
    return not os.path.isdir(model) and bool(_HUB_ID.fullmatch(model)) and ".." not in model


def resolve_model(model: str | None, revision: str | None = None) -> str:
    """The checkpoint directory of ``model``: the embedded default (None), a local directory, or
    the snapshot of a Hub id (module doc). Raises ``FileNotFoundError`` naming what is missing."""
    if model is None:
        if revision is not None:
            raise ValueError("--revision applies to a Hugging Face Hub id, and no model was given")
        return default_model_dir()
    if os.path.isdir(model):
        if revision is not None:
            raise ValueError(f"--revision applies to a Hugging Face Hub id; {model!r} is a local directory")
        return model
    if not is_hub_id(model):
        raise FileNotFoundError(f"model directory {model!r} does not exist, and it is not a Hugging Face Hub id "
                                f"(owner/name); omit it for the embedded default model")
    return hub_snapshot(model, revision)


def hub_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot directory of Hub repository ``repo_id`` (downloaded unless cached)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES))
    except LocalEntryNotFoundError as e:
        off = " and downloads are off (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else f" and the Hub cannot be reached ({e})"
        raise FileNotFoundError(f"model {where} is not a local directory; the Hugging Face cache "
                                f"({constants.HF_HUB_CACHE}) has no snapshot of it{off}") from None
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        raise FileNotFoundError(f"model {where}: the Hugging Face Hub refused it ({type(e).__name__}: "
                                f"{str(e).splitlines()[0]}); for a gated or private repository set HF_TOKEN") from None


#: generation_config.json fields that become default sampling parameters (vLLM's list), and their
#: SamplingParams names
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
#: transformers' GenerationConfig defaults: vLLM applies only the values that differ from them
_HF_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def generation_defaults(source: str | None, model_dir: str | None) -> dict:
    """Default sampling parameters (SamplingParams names) as vLLM's ``--generation-config``:
    ``"auto"`` (default) reads ``model_dir``'s generation_config.json (none there: no defaults),
    ``"vllm"`` ignores it, any other value is a directory whose generation_config.json is read.
    Of the file, the fields of ``GENERATION_FIELDS`` whose value differs from transformers'
    defaults count (as vLLM takes them). Requests' own values always come first."""
    source = source or "auto"
    if source == "vllm":
        return {}
    if source == "auto":
        if model_dir is None:
            return {}
        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.isfile(path):
            return {}
    else:
        path = os.path.join(source, "generation_config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--generation-config {source!r}: no generation_config.json there (give auto, "
                                    f"vllm, or a directory holding one)")
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return {GENERATION_FIELDS[k]: v for k, v in raw.items()
            if k in GENERATION_FIELDS and v is not None and v != _HF_GENERATION_DEFAULTS.get(k)}
