"""Prefill throughput of the production model, through the engine, on a synthetic V4 slice (issue 30).

    PYTHONPATH=. python benchmarks/prefill.py --model flash --layers 4 --cases 1024x1,8192x1,16384x1,65536x1,8192x8

Each case ``NxK`` is K prompts of N random tokens, submitted together to ``LLM.generate`` with
``max_tokens=1`` (so the time is the prefill plus one sampled token per prompt), prefix caching off,
``--max-num-batched-tokens`` as the step budget (chunked prefill cuts longer prompts). A case runs
once untimed (compiles, allocator growth), then once timed on fresh prompts; tok/s = prompt tokens /
wall time of the timed run. ``43-layer tok/s`` scales that time by 43 / layers (the embedding, head
and sampler scaled too: slightly low). Then ``torch.profiler`` lists the GPU time per kernel of one
prompt of ``--budget`` tokens (one chunk), largest first, beside the wall time of that step.

``--predec-from R``: the routed experts take ``moe_forward``'s pre-decoded FP8 path (``path="predec"``)
from R rows per expert instead of the router's ``route.PREDEC_ROWS_PER_EXPERT`` (this process only; a
value above any chunk's rows, e.g. 1e9, compares with the path off).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import kernel_totals  # noqa: E402
from dsv4.engine.llm import LLM  # noqa: E402
from dsv4.engine.sampling_params import SamplingParams  # noqa: E402

FULL_DEPTH = 43


def prompts_of(case: str, V: int, g: torch.Generator) -> list[dict]:
    out = []
    for part in case.split("+"):
        n, k = (int(x) for x in part.split("x"))
        out += [{"prompt_token_ids": torch.randint(3, min(V, 128000), (n,), generator=g).tolist()} for _ in range(k)]
    return out


def timed_generate(llm, prompts) -> tuple[float, int]:
    st = llm.engine.stats
    s0 = st["steps"]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, st["steps"] - s0


def kernel_table(llm, prompt, top: int) -> tuple[list, float, float]:
    """[(kernel, launches, GPU ms)] of one generate of ``prompt``, the sum of all kernels' GPU ms
    and the wall ms."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        wall, _ = timed_generate(llm, [prompt])
    rows = sorted(((k, n, t / 1e3) for k, (n, t) in kernel_totals(prof).items()), key=lambda r: -r[2])
    return rows[:top], sum(r[2] for r in rows), wall * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash", choices=["flash", "pro"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default: the preset's)")
    ap.add_argument("--cases", default="1024x1,8192x1,16384x1,65536x1,8192x8")
    ap.add_argument("--budget", type=int, default=8192, help="--max-num-batched-tokens")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--top", type=int, default=30, help="kernels listed in the profile")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None, help="append the markdown to this file")
    ap.add_argument("--predec-from", type=float, default=None,
                    help="rows per expert from which the experts take the pre-decoded FP8 path (default: the "
                         "router's; module doc)")
    a = ap.parse_args()
    if a.predec_from is not None:
        from dsv4.kernels.gemm import route
        route.PREDEC_ROWS_PER_EXPERT = a.predec_from
    cases = a.cases.split(",")
    longest = max(sum(int(p.split("x")[0]) for p in c.split("+")) for c in cases)
    t0 = time.perf_counter()
    llm = LLM(synthetic=a.model, synthetic_layers=a.layers, synthetic_experts=a.experts,
              max_num_batched_tokens=a.budget, max_num_seqs=a.max_num_seqs, max_model_len=longest + 16,
              enable_prefix_caching=False, log=False)
    mc = llm.engine.model_config
    startup = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    md = [f"## Prefill, synthetic {a.model} ({a.layers} layers, {mc.n_routed_experts} experts), "
          f"{datetime.date.today()}, {dev}",
          "", f"Command: `PYTHONPATH=. python benchmarks/prefill.py --model {a.model} --layers {a.layers}"
          + (f" --experts {a.experts}" if a.experts else "") + f" --cases {a.cases} --budget {a.budget}"
          + (f" --predec-from {a.predec_from:g}" if a.predec_from is not None else "") + "`; "
          f"engine start-up {startup:.1f} s.", "",
          f"| case | prompt tokens | steps | untimed run s | timed run s | tok/s ({a.layers} layers) | "
          f"{FULL_DEPTH}-layer tok/s |", "|---|---|---|---|---|---|---|"]
    print("\n".join(md), flush=True)
    for case in cases:
        first, _ = timed_generate(llm, prompts_of(case, mc.vocab_size, g))
        ps = prompts_of(case, mc.vocab_size, g)
        n = sum(len(p["prompt_token_ids"]) for p in ps)
        dt, steps = timed_generate(llm, ps)
        row = (f"| {case} | {n} | {steps} | {first:.2f} | {dt:.3f} | {n / dt:,.0f} | "
               f"{n / (dt * FULL_DEPTH / a.layers):,.0f} |")
        md.append(row)
        print(row, flush=True)
    if not a.no_profile:
        rows, gpu_ms, wall_ms = kernel_table(llm, prompts_of(f"{a.budget}x1", mc.vocab_size, g)[0], a.top)
        md += ["", f"GPU time per kernel, one {a.budget}-token prompt (one chunk + one sampled token): "
               f"all kernels {gpu_ms:.1f} ms, wall {wall_ms:.1f} ms.", "",
               "| kernel | launches | GPU ms | % of kernel time |", "|---|---|---|---|"]
        md += [f"| `{k[:90]}` | {c} | {t:.2f} | {100 * t / gpu_ms:.1f}% |" for k, c, t in rows]
        print("\n".join(md[-(len(rows) + 4):]), flush=True)
    if a.out:
        with open(a.out, "a") as fh:
            fh.write("\n".join(md) + "\n\n")


if __name__ == "__main__":
    main()
