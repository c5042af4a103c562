"""Experiment: what a grammar-constrained row costs per decode step (the figures quoted in
``dsv4/engine/structured.py``), on the CPU, for V4's 129,280-token vocabulary.

Walks each grammar the way the random tiny model does (argmax of random logits under the mask,
until the grammar completes) and times, per step: llguidance's mask for one row
(``fill_bitmask``), applying it to the row's logits (``apply_bitmask``) and advancing the matcher
(``consume_token``). Then the whole sampler on a batch with k constrained rows against the same
batch unconstrained. One torch thread, as the server's engine thread runs.

    PYTHONPATH=. python experiments/exp_structured_mask.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.engine.sampler import Sampler  # noqa: E402
from dsv4.engine.sampling_params import SamplingParams, StructuredOutputsParams as S  # noqa: E402
from dsv4.engine.structured import GrammarCompiler, apply_bitmask, fill_bitmask  # noqa: E402
from dsv4.server.tool_grammar import tool_call_grammar  # noqa: E402
from dsv4.tokenizer import load_tokenizer  # noqa: E402

V = 129280
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "required": ["city", "days"], "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}]


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    return (f"{statistics.median(xs) * 1e3:.3f} / {xs[int(0.9 * (len(xs) - 1))] * 1e3:.3f} / "
            f"{xs[-1] * 1e3:.3f}")


def walk(compiler: GrammarCompiler, spec: S, steps: int, gen: torch.Generator):
    m = compiler.compile(spec).matcher()
    fill, apply, consume = [], [], []
    for _ in range(steps):
        logits = torch.randn(1, V, generator=gen)
        t0 = time.perf_counter()
        bm, _ = fill_bitmask([m], V)
        t1 = time.perf_counter()
        x = apply_bitmask(logits, bm)
        t2 = time.perf_counter()
        tok = int(torch.argmax(x))
        t3 = time.perf_counter()
        assert m.consume_token(tok), m.get_error()
        t4 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        consume.append(t4 - t3)
        if m.is_stopped():
            break
    return fill, apply, consume


def main():
    torch.set_num_threads(1)
    tok = load_tokenizer(None)
    compiler = GrammarCompiler(tok, V, tok.eos_id)
    t0 = time.perf_counter()
    compiler.ll_tokenizer
    print(f"llguidance tokenizer for {V} tokens: {time.perf_counter() - t0:.2f} s (once per engine)\n")
    specs = {"json_object": S(json_object=True), "json schema": S(json=SCHEMA),
             "json schema, thinking": S(json=SCHEMA, thinking=True),
             "tool call (free string)": S(grammar=tool_call_grammar(TOOLS, parallel=False)),
             "regex [a-z ]{0,200}": S(regex="[a-z ]{0,200}")}
    print("| grammar | compile ms | steps | mask ms (median / p90 / max) | apply ms | consume ms |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, spec in specs.items():
        t0 = time.perf_counter()
        compiler.compile(spec)
        comp = time.perf_counter() - t0
        fill, apply, consume = [], [], []
        for _ in range(3):
            f, a, c = walk(compiler, spec, 150, gen)
            fill += f
            apply += a
            consume += c
        print(f"| {name} | {comp * 1e3:.1f} | {len(fill)} | {_stats(fill)} | {_stats(apply)} | {_stats(consume)} |",
              flush=True)

    print("\nwhole sampler, B rows (greedy), k of them constrained (json schema, mid-string), ms per call:")
    print("| B | k | unconstrained | constrained | extra per constrained row |\n|---|---|---|---|---|")
    sampler = Sampler(tok.eos_id)
    prefix = tok.encode('{"name": "Al')
    for B, k in ((1, 1), (4, 1), (4, 4), (16, 4), (16, 16)):
        logits = torch.randn(B, V, generator=gen)
        params = [SamplingParams(temperature=0)] * B
        matchers = []
        for _ in range(k):
            m = compiler.compile(S(json=SCHEMA)).matcher()
            assert m.consume_tokens(prefix)
            matchers.append(m)
        matchers += [None] * (B - k)
        times = {}
        for label, ms in (("off", None), ("on", matchers)):
            sampler(logits, params, matchers=ms)
            t0 = time.perf_counter()
            for _ in range(10):
                sampler(logits, params, matchers=ms)
            times[label] = (time.perf_counter() - t0) / 10
        print(f"| {B} | {k} | {times['off'] * 1e3:.2f} | {times['on'] * 1e3:.2f} | "
              f"{(times['on'] - times['off']) / k * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
