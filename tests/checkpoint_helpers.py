"""Checkpoints in tests: a small config with a draft; edit checkpoint directories (copy one, rewrite
a shard, edit a JSON file)."""
import json
import os
import shutil

from safetensors.torch import load_file, save_file

from dsv4.config import ModelConfig, preset, with_draft


def small(draft: str = "dspark") -> ModelConfig:
    """Tiny with a 512-token vocabulary (fast), as a checkpoint with ``draft`` announces it."""
    return with_draft(preset("tiny", vocab_size=512), draft, markov_rank=32, noise_token_id=500)


def clone_dir(src, dst):
    """Copy a checkpoint dir; safetensors files are hard links (rewrite them, never edit in place)."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            os.link(os.path.join(src, f), os.path.join(dst, f))
        else:
            shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    return str(dst)


def rewrite_shard(path, fn):
    t = load_file(path)
    fn(t)
    os.unlink(path)
    save_file(t, path, metadata={"format": "pt"})


def edit_json(path, fn):
    with open(path) as fh:
        d = json.load(fh)
    fn(d)
    with open(path, "w") as fh:
        json.dump(d, fh)


def shard_of(ckpt, name):
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as fh:
        return os.path.join(ckpt, json.load(fh)["weight_map"][name])
