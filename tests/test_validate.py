"""``dsv4 validate``: module-by-module comparison of the fast decode path with the reference."""
import argparse
import os

import pytest
import torch

from dsv4.tools import validate


def _args(tmp_path, *extra, prompt_len=140):
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path))
    p = argparse.ArgumentParser()
    validate.add_parser(p.add_subparsers())
    return p.parse_args(["validate", "--prompt-len", str(prompt_len), "--steps", "2", "-q", *extra])


def test_validate_passes_on_a_correct_fast_path(tmp_path, capsys):
    assert validate.run(_args(tmp_path, "--attention", "reference")) == 0
    out = capsys.readouterr().out
    assert "RESULT: OK" in out and "L2.indexer_topk" in out and "L3.compressor" in out
    assert "first token EOS: False" in out


def test_validate_names_the_broken_module(tmp_path, capsys, monkeypatch):
    """A kernel that silently returns garbage (the original bug) is caught and named."""
    pytest.importorskip("triton")
    from dsv4.kernels import sparse_attention as sa

    def broken(q, *a, **k):
        return torch.zeros_like(q)
    monkeypatch.setattr(sa, "sparse_decode", broken)
    assert validate.run(_args(tmp_path, "--attention", "triton", "--steps", "1")) == 1
    out = capsys.readouterr().out
    assert "RESULT: DIVERGED" in out
    bad = [line.split()[0] for line in out.splitlines() if "<-- diverged" in line]
    assert bad and all(name.endswith(".sparse_attn") for name in bad)   # nothing else is blamed


def test_validate_fused_hot_path_kernels(tmp_path, capsys):
    """The Triton mHC, compressor, indexer and MoE kernels inside the decode step, module by module
    against the reference, and the fused prefill's logits and cache contents (interpreter on CPU:
    a short prompt; the GPU run uses long ones)."""
    pytest.importorskip("triton")
    assert validate.run(_args(tmp_path, "--attention", "triton", "--fused", "--steps", "1", prompt_len=27)) == 0
    out = capsys.readouterr().out
    assert "RESULT: OK" in out and "L2.indexer_topk          top-k overlap 1.0000" in out
    for row in ("prefill.orchestration", "prefill.logits", "prefill.L2.sparse_attn", "prefill.L2.compressor",
                "prefill.L2.indexer_compressor", "prefill.L2.indexer_topk", "prefill.L3.moe"):
        assert row in out
