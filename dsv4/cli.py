"""``dsv4`` command line: ``generate``, ``make-tiny``."""
from __future__ import annotations

import argparse
import sys
import time


def _cmd_generate(a: argparse.Namespace) -> int:
    import torch

    from .checkpoint.loader import load_checkpoint
    from .models import resolve_model
    from .reference.model import ReferenceModel
    from .server.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    path = resolve_model(a.model)
    ck = load_checkpoint(path, progress=not a.quiet)
    model = ReferenceModel(ck.config, ck.tensors, numerics=a.numerics)
    tok = load_tokenizer(path)
    ids = ([ck.config.bos_token_id] if not a.no_bos else []) + tok.encode(a.prompt)
    if not a.quiet:
        print(f"dsv4: loaded {path} in {time.perf_counter() - t0:.1f}s; prompt {len(ids)} tokens",
              file=sys.stderr)
    t1 = time.perf_counter()
    st = model.new_state()
    logits = model.forward([(torch.tensor(ids), st)])[0]
    detok = tok.incremental_detokenizer()
    out = []
    for _ in range(a.max_tokens):
        if not torch.isfinite(logits).all():
            print("dsv4: error: the model produced non-finite logits", file=sys.stderr)
            return 1
        nxt = int(logits.argmax())
        if nxt == ck.config.eos_token_id:
            break
        out.append(nxt)
        sys.stdout.write(detok.add(nxt))
        sys.stdout.flush()
        logits = model.forward([(torch.tensor([nxt]), st)])[0]
    sys.stdout.write(detok.flush() + "\n")
    if not a.quiet:
        dt = time.perf_counter() - t1
        print(f"dsv4: {len(out)} tokens in {dt:.2f}s ({len(out) / max(dt, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


def _cmd_make_tiny(a: argparse.Namespace) -> int:
    from .checkpoint.tiny import make_tiny
    path = make_tiny(a.dir, layout=a.layout, seed=a.seed, shards=a.shards, overwrite=a.overwrite)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 inference engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="greedy continuation of a prompt (text on stdout)")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--numerics", choices=["official", "invariant", "exact"], default="official")
    g.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress or timing on stderr")
    g.set_defaults(fn=_cmd_generate)
    t = sub.add_parser("make-tiny", help="write the deterministic tiny V4 checkpoint")
    t.add_argument("dir")
    t.add_argument("--layout", choices=["official", "hf", "modelopt-nvfp4"], default="official")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shards", type=int, default=1)
    t.add_argument("--overwrite", action="store_true")
    t.set_defaults(fn=_cmd_make_tiny)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if getattr(a, "max_tokens", 1) < 1:
        build_parser().error("--max-tokens must be >= 1")
    try:
        return a.fn(a)
    except (OSError, ValueError) as e:
        print(f"dsv4: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
