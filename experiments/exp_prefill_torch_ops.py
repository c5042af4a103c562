"""Which torch (aten) ops a prefill chunk and a decode step launch besides the package's kernels, and from
where: the production model on the tiny preset with every op on its kernel (Triton's CPU interpreter),
under a TorchDispatchMode that records each aten call made outside the interpreter's own work, keyed by
the innermost ``dsv4`` frame that made it. On a GPU each such call is a torch kernel launch (a dtype or
layout copy, an elementwise op, a cuBLAS GEMM, an index op) beside the Triton / Gluon kernels; the call
sites are the same at real shapes.

    TRITON_INTERPRET=1 PYTHONPATH=. python experiments/exp_prefill_torch_ops.py [--tokens 300] [--decode]

Prints one table per pass: aten op, dsv4 call site, calls. Views, metadata queries and allocations
(``empty``, ``view``, ``as_strided``, ...) launch nothing and are left out.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from dsv4.checkpoint.tiny import make_tiny  # noqa: E402
from dsv4.engine.kv_cache import CacheConfig, KVCache, PagedSequenceState  # noqa: E402
from dsv4.model.deepseek_v4 import DeepseekV4  # noqa: E402
from dsv4.ops import Ops  # noqa: E402

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dsv4")
# no device work: views, shape / metadata queries, allocations, scalar reads of host tensors
NO_LAUNCH = ("view", "_unsafe_view", "as_strided", "empty", "empty_strided", "empty_like", "detach", "alias",
             "slice", "select", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze", "split",
             "split_with_sizes", "unbind", "reshape", "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride",
             "is_same_size", "unfold", "chunk", "narrow", "diagonal", "_reshape_alias", "view_as_real",
             "view_as_complex", "real", "imag", "_conj", "conj", "resolve_conj", "resolve_neg")


class Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH:
            stack = traceback.extract_stack()
            if not any("triton" in f.filename and "interpreter" in f.filename for f in stack):
                site = next((f"{os.path.relpath(f.filename, PKG)}:{f.lineno} {f.name}" for f in reversed(stack)
                             if f.filename.startswith(PKG)), "?")
                self.calls[(name, site)] += 1
        return func(*args, **(kwargs or {}))


def table(title, rec):
    print(f"\n## {title}: {sum(rec.calls.values())} aten calls outside the kernels\n")
    print("| aten op | dsv4 call site | calls |\n|---|---|---|")
    for (name, site), n in sorted(rec.calls.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| `{name}` | `{site}` | {n} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--decode", action="store_true", help="also one decode step after the prefill")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        m = DeepseekV4.from_checkpoint(make_tiny(os.path.join(d, "ck")), ops=Ops("cpu", kernels=True))
    print(m.ops.describe())
    cache = KVCache(m.cfg, CacheConfig(max_num_seqs=2, num_blocks=9))
    m.attach_cache(cache, 1024)
    st = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(4))
    ids = torch.randint(3, m.cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ctx = m.prefill_context([(ids, st)])
        rec = Record()
        with rec:
            logits = m(ctx)
        table(f"prefill chunk of {args.tokens} tokens", rec)
        if args.decode:
            tok = logits[0].argmax().view(1)
            pos = torch.tensor([args.tokens])
            bt = torch.full((1, m.max_blocks), -1, dtype=torch.long)
            bt[0, :len(st.block_table)] = torch.tensor(st.block_table)
            ctx = m.decode_context(tok, pos, torch.tensor([st.slot]), bt)
            rec = Record()
            with rec:
                m(ctx)
            table("decode step", rec)


if __name__ == "__main__":
    main()
