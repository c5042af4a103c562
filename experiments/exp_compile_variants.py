"""Which kernel variants a serving process compiles after start-up, per request shape (issue 30 item 4).

    PYTHONPATH=. python experiments/exp_compile_variants.py --layers 4 --experts 256 --budget 8192

Builds the engine on a synthetic V4-Flash slice, then runs a list of request mixes one after the
other and prints, for each, its wall time and the kernel variants compiled while it ran
(``engine.warmup.CompileLog``), aggregated by kernel name, with the first signatures of each.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.engine.llm import LLM  # noqa: E402
from dsv4.engine.sampling_params import SamplingParams  # noqa: E402
from dsv4.engine.warmup import CompileLog  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--show", type=int, default=3, help="signatures shown per kernel")
    ap.add_argument("--cases", default="1024x1,8192x1,1000x1,3000x4,700x8,20000x1,1024x1,37x3+513x13,5x1,257x2,"
                                       "4095x2,12000x1,300x16,1x1")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    with CompileLog() as log:
        t0 = time.perf_counter()
        llm = LLM(synthetic="flash", synthetic_layers=a.layers, synthetic_experts=a.experts,
                  max_num_batched_tokens=a.budget, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len)
        print(f"start-up {time.perf_counter() - t0:.1f} s, {len(log)} variants compiled", flush=True)
        V = llm.engine.model_config.vocab_size
        for case in a.cases.split(","):
            prompts = []
            for part in case.split("+"):
                n, k = (int(x) for x in part.split("x"))
                prompts += [{"prompt_token_ids": torch.randint(3, min(V, 128000), (n,), generator=g).tolist()}
                            for _ in range(k)]
            n0, t0 = len(log), time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            torch.cuda.synchronize()
            new = log.since(n0)
            by = collections.defaultdict(list)
            for e in new:
                by[e.name].append(e.signature)
            print(f"== {case}: {time.perf_counter() - t0:.2f} s, {len(new)} variants compiled", flush=True)
            for name, sigs in sorted(by.items(), key=lambda kv: -len(kv[1])):
                print(f"   {len(sigs):3d} {name}")
                for s in sigs[:a.show]:
                    print(f"         {s[:600]}")


if __name__ == "__main__":
    main()
