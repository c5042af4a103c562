"""``dsv4 validate``: the production model against the reference module by module, and through the
engine; a bug in any part of the production model is named by its module."""
import argparse
import os

import pytest
import torch

from dsv4.tools import validate


def _args(tmp_path, *extra, prompt_len=140, steps=2):
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path))
    p = argparse.ArgumentParser()
    validate.add_parser(p.add_subparsers())
    return p.parse_args(["validate", "--prompt-len", str(prompt_len), "--steps", str(steps), "-q", *extra])


def _flagged(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines() if "<-- diverged" in line]


def test_validate_passes_on_the_production_model(tmp_path, capsys):
    # prompt 142: decode steps at positions 142, 143 complete a CSA window (L2, L4: ratio 4)
    assert validate.run(_args(tmp_path, prompt_len=142)) == 0
    out = capsys.readouterr().out
    # at prefill the attention kernel transforms q as it loads it: no q row, sparse_attn covers it
    assert "\nprefill.L2.q " not in out and "\nprefill.L2.sparse_attn " in out
    for row in ("prefill.L2.kv", "L2.q", "prefill.L2.indexer_topk", "prefill.L2.indexer_compressor", "prefill.L3.compressor",
                "prefill.L5.moe", "prefill.logits", "L2.indexer_topk", "L2.compressor", "L3.sparse_attn",
                "L1.hc_post", "logits"):
        assert f"\n{row} " in out, row
    assert "first token EOS: False" in out and "NaN/inf logits: 0" in out
    assert "engine (batch of 4): greedy tokens = the reference's on 3/3 steps" in out
    assert "engine (alone): greedy tokens = the reference's on 3/3 steps" in out
    assert "RESULT: OK" in out and not _flagged(out)


def test_short_prompt_attention_blocks_are_the_official_ones(tmp_path, capsys):
    """A first chunk shorter than the window (101 tokens) lists min(n, 128) window entries, as the
    official prefill does: the CSA layers' attention then sums the same 64-entry softmax blocks as
    the reference, to the bit (a 128-wide list with -1 padding moves bf16 probabilities)."""
    assert validate.run(_args(tmp_path, "--no-engine", prompt_len=101, steps=1)) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("prefill.")}
    for name in ("prefill.L2.sparse_attn", "prefill.L4.sparse_attn", "prefill.L0.sparse_attn"):
        assert "max_err 0 " in rows[name], rows[name]


def _first_group_dropped(self, o, cos, sin, trace, rotated=False):
    T = o.shape[0]
    if not rotated:
        o = self.ops.inverse_rope(o, cos, sin).view(o.shape)
    z = self.wo_a(trace(f"L{self.layer_id}.sparse_attn", o).view(T, self.G, -1)).clone()
    z[:, 0] = 0
    return trace(f"L{self.layer_id}.attn", self.ops.linear(self.wo_b, z.flatten(1)))


def _inject(monkeypatch, bug):
    from dsv4.layers.attention import Attention
    from dsv4.layers.moe import MoE
    if bug == "attn":          # the output projection drops wo_a's first group
        monkeypatch.setattr(Attention, "_output", _first_group_dropped)
    elif bug == "moe":         # the shared expert is dropped
        fwd = MoE.forward

        def no_shared(self, x, ids):
            keep = self.sh2.clone()
            self.sh2.zero_()
            try:
                return fwd(self, x, ids)
            finally:
                self.sh2.copy_(keep)
        monkeypatch.setattr(MoE, "forward", no_shared)
    else:                      # an attention op that silently returns zeros (the original failure)
        from dsv4.twins import sparse_attention as sa
        zeros = lambda q, *a, **k: torch.zeros_like(q)     # noqa: E731
        monkeypatch.setattr(sa, "sparse_decode", zeros)
        monkeypatch.setattr(sa, "sparse_prefill", zeros)


@pytest.mark.parametrize("bug", ["attn", "moe", "sparse_attn"])
def test_validate_names_the_broken_module(tmp_path, capsys, monkeypatch, bug):
    """A bug injected into the production model (not the reference) is caught and only its module
    is blamed: the modules after it run on the reference's values."""
    _inject(monkeypatch, bug)
    assert validate.run(_args(tmp_path, "--no-engine", steps=1)) == 1
    out = capsys.readouterr().out
    assert "RESULT: DIVERGED" in out
    bad = _flagged(out)
    assert bad and all(name.endswith("." + bug) for name in bad), bad
    assert any(name.startswith("prefill.") for name in bad) and any(name.startswith("L") for name in bad)


def test_validate_engine_run_catches_a_batching_bug(tmp_path, capsys, monkeypatch):
    """A runner that hands a batch's logits to the wrong sequences: every module passes, the
    batched engine run fails and the alone run does not."""
    from dsv4.engine.runner import ModelRunner
    run = ModelRunner.run
    monkeypatch.setattr(ModelRunner, "run", lambda self, batch, *a, **k: run(self, batch, *a, **k)[::-1])
    assert validate.run(_args(tmp_path, steps=3)) == 1
    out = capsys.readouterr().out
    assert "engine (batch of 4): token 0 is" in out and "engine (alone): greedy tokens = the reference's" in out
    assert _flagged(out) == ["engine"] and "RESULT: DIVERGED" in out


@pytest.mark.gpu
def test_gpu_validate_synthetic_flash(tmp_path, capsys):
    """Real Flash shapes (its first 4 layers: two window-only, a CSA and an HCA layer), the kernels
    and CUDA graphs against the reference."""
    assert validate.run(_args(tmp_path, "--synthetic", "flash", "--layers", "4", "--experts", "8",
                              prompt_len=600, steps=3)) == 0
    out = capsys.readouterr().out
    assert "RESULT: OK" in out and "cuda-graphs" in out


@pytest.mark.gpu
def test_gpu_validate_names_a_broken_kernel(tmp_path, capsys, monkeypatch):
    """With the start-up check off the broken kernel runs, and validate names its module (with the
    check on it falls back to its twin first: tests/test_registry.py)."""
    from dsv4.kernels import sparse_attention as sa
    monkeypatch.setattr(sa, "sparse_decode", lambda q, *a, **k: torch.zeros_like(q))
    assert validate.run(_args(tmp_path, "--no-engine", "--kernel-check", "off", steps=1)) == 1
    bad = _flagged(capsys.readouterr().out)
    assert bad and all(name.endswith(".sparse_attn") and not name.startswith("prefill.") for name in bad), bad
