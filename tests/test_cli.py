"""The main job: ``dsv4 generate`` on the embedded default model, and ``dsv4 make-tiny``."""
import os
import subprocess
import sys

import pytest

from dsv4.checkpoint.loader import load_checkpoint


def _run(args, env):
    return subprocess.run([sys.executable, "-m", "dsv4.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.slow
def test_generate_on_the_default_model(tmp_path):
    env = dict(os.environ, DSV4_CACHE_DIR=str(tmp_path / "cache"))
    r = _run(["generate", "--max-tokens", "8", "The capital of France is"], env)
    assert r.returncode == 0, r.stderr
    assert "first use" in r.stderr and "tokens in" in r.stderr      # progress/timing on stderr only
    assert "KV cache" in r.stderr or "blocks" in r.stderr           # capacity printed at start
    model_dir = tmp_path / "cache" / "tiny-official-seed0"
    assert (model_dir / "tokenizer.json").exists()
    # stdout is exactly the engine's greedy continuation (the model against the oracle: test_model.py)
    from dsv4 import LLM, SamplingParams
    c = LLM(str(model_dir), log=False, max_num_seqs=1, kv_cache_memory="64MiB").generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert c.token_ids and r.stdout == c.text + "\n"
    # second run reuses the cached model and prints the same text
    r2 = _run(["generate", "--max-tokens", "8", "The capital of France is"], env)
    assert r2.returncode == 0 and "first use" not in r2.stderr and r2.stdout == r.stdout


def test_generate_errors_are_clear(tmp_path, monkeypatch, capsys):
    """Exit code 2 and the reason on stderr (``cli.main`` in this process: no model is built on either
    path; the other tests here run the command as a process)."""
    from dsv4.cli import main
    assert main(["generate", "--model", str(tmp_path / "nope"), "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path / "c"))
    assert main(["generate", "--max-tokens", "0", "hi"]) == 2
    assert "--max-tokens must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()                       # refused before the default model is made


def test_make_tiny_layouts(tmp_path, monkeypatch):
    """The official layout through the command as a process, the transformers one through ``cli.main`` in this
    process (the same parser and writer, no second start-up of torch; its seed-3 build not kept in the session's
    build cache)."""
    import dsv4.checkpoint.tiny
    from dsv4.cli import main
    monkeypatch.setattr(dsv4.checkpoint.tiny, "BUILD_CACHE", 0)
    for layout in ("official", "hf"):
        d = tmp_path / layout
        args = ["make-tiny", str(d), "--layout", layout, "--seed", "3"]
        if layout == "official":
            r = _run(args, dict(os.environ))
            assert r.returncode == 0, r.stderr
        else:
            assert main(args) == 0
        ck = load_checkpoint(str(d), progress=False)
        assert ck.layout == layout and (d / "tokenizer.json").exists()


def test_make_tiny_into_a_non_empty_dir_names_the_flag(tmp_path):
    """A directory that holds anything (a checkpoint made before, or any file: the one rule) is refused, kept."""
    (tmp_path / "x").write_text("keep")
    r = _run(["make-tiny", str(tmp_path)], dict(os.environ))
    assert r.returncode == 2 and "exists" in r.stderr and "--overwrite" in r.stderr
    assert (tmp_path / "x").read_text() == "keep"


def test_bench_throughput_shows_progress_on_stderr(tmp_path):
    env = dict(os.environ, DSV4_CACHE_DIR=str(tmp_path / "cache"))      # a fresh cache: the build's stage shows
    r = _run(["bench", "throughput", "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
              "--kv-cache-memory", "64MiB"], env)
    assert r.returncode == 0, r.stderr
    err = r.stderr
    stages = ["building the embedded tiny model", "dsv4: loaded", "2 prompts of 8 tokens, 3 output tokens each",
              "requests: 100%", "16 prompt + 6 output tokens"]
    assert all(x in err for x in stages), err[-2000:]
    assert [err.index(x) for x in stages] == sorted(err.index(x) for x in stages)
    assert "requests      2" in r.stdout and "requests:" not in r.stdout     # the report alone on stdout
    q = _run(["bench", "throughput", "--num-prompts", "1", "--input-len", "4", "--output-len", "1",
              "--kv-cache-memory", "64MiB", "-q"], env)
    assert q.returncode == 0 and q.stderr == "", q.stderr[-2000:]


def test_validate_synthetic_shows_progress_on_stderr(tmp_path, monkeypatch, capsys):
    """Every stage of ``validate --synthetic`` reports on stderr: the weights' byte bar, the two
    models' builds, the teacher-forced steps, the engine run. The preset's real shapes cost minutes
    on a CPU, so the synthetic preset is the tiny model's config here (the stages are the same)."""
    import argparse

    from dsv4 import config
    from dsv4.checkpoint import synthetic
    from dsv4.tools import validate
    monkeypatch.setattr(synthetic, "_preset", lambda name: config.preset("tiny"))
    p = argparse.ArgumentParser()
    validate.add_parser(p.add_subparsers())
    assert validate.run(p.parse_args(["validate", "--synthetic", "flash", "--layers", "2", "--experts", "4",
                                      "--prompt-len", "16", "--steps", "2", "--engine-batch", "2"])) == 0
    cap = capsys.readouterr()
    stages = ["generating synthetic flash weights (2 layers, 4 experts)", "synthetic weights: 100%",
              "loading the weights into the production model", "building the reference model",
              "teacher-forced: a prefill of 16 tokens, then 2 decode steps", "teacher-forced steps: 100%",
              "through the engine: the prompt in a batch of 2"]
    assert all(x in cap.err for x in stages), cap.err[-2000:]
    assert [cap.err.index(x) for x in stages] == sorted(cap.err.index(x) for x in stages)
    assert "RESULT: OK" in cap.out and "synthetic weights" not in cap.out


def test_every_flag_has_help():
    import argparse
    from dsv4.cli import build_parser

    def missing(p, path):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    yield from missing(sp, path + [name])
            elif not isinstance(a, argparse._HelpAction) and not a.help:
                yield f"{' '.join(path)} {'/'.join(a.option_strings) or a.dest}"
    assert not list(missing(build_parser(), ["dsv4"]))
