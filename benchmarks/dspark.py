"""DSpark speculative decoding on the H200: the draft step and the verification step of a synthetic
V4 checkpoint with the DSpark draft of the current releases (``make-synthetic --draft dspark``
shapes, generated in device memory), beside the plain decode step, all from one run; and the TPOT
they imply at the acceptance lengths reported for V4-Flash-0731 (2.9: the low report filed as a
bug; 4.0; 5.4: SGLang on 4 x H200 at concurrency 64). Random weights accept almost nothing, so the
figure is a projection from measured step times, never a measured acceptance.

    PYTHONPATH=. python benchmarks/dspark.py --model flash --layers 43 --experts 128 --batch 1,16 --n 5 --ctx 8192

* plain decode: the engine's CUDA-graph replay of one decode step (``graph_time``, L2 flushed);
* verify: N + 1 rows per sequence through the target's multi-row decode step, as the engine's CUDA
  graph replays it (``graph_time``), beside the old eager prefill path (``do_bench`` median);
* draft: ``dspark_extend`` of the N + 1 committed rows per sequence (eager, its largest fill: all
  drafts accepted; ``do_bench``) plus the draft block as ``CudaGraphDraft`` replays it
  (``graph_time``; eager beside it);
* projected TPOT at acceptance length L = (verify + extend + draft) / L; the plain step is its own TPOT.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import eager_ms, graph_time  # noqa: E402
from benchmarks.decode_step import fill_caches  # noqa: E402
from dsv4.checkpoint.synthetic import iter_synthetic_tensors, synthetic_config  # noqa: E402
from dsv4.engine.kv_cache import CacheConfig, KVCache  # noqa: E402
from dsv4.formats.kv_entry import write_entries  # noqa: E402
from dsv4.formats.paging import BLOCK_TOKENS, WINDOW_PAGE  # noqa: E402
from dsv4.model.deepseek_v4 import DeepseekV4  # noqa: E402

ACCEPTANCE = (2.9, 4.0, 5.4)


class _Seq:
    def __init__(self, pos, slot, block_table):
        self.pos, self.slot, self.block_table = pos, slot, block_table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash", choices=["flash", "pro"])
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--n", type=int, default=5, help="draft tokens per step (num_speculative_tokens)")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--out", default=None, help="append the markdown section to this file")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    batches = [int(b) for b in a.batch.split(",")]
    Bmax, N = max(batches), a.n
    cfg = synthetic_config(a.model, a.layers, a.experts, draft="dspark")
    model = DeepseekV4(cfg, "mxfp4", "fp8", dev, draft="dspark")
    model.load(iter_synthetic_tensors(cfg, 0, dev))
    per_seq = -(-(a.ctx + 2 * N + 2) // BLOCK_TOKENS)
    cache = KVCache(cfg, CacheConfig(max_num_seqs=Bmax + 1, num_blocks=Bmax * per_seq + 1, device=str(dev),
                                     draft_layers=cfg.num_draft_stages))
    model.attach_cache(cache, per_seq * BLOCK_TOKENS)
    fill_caches(cache, dev, gen, Bmax * per_seq + 1)
    for lc in cache.draft_layers:
        n = lc.window.shape[0] * WINDOW_PAGE
        ids = torch.arange(n, device=dev)
        write_entries(lc.window, ids, torch.randn(n, 512, device=dev, generator=gen).bfloat16(), WINDOW_PAGE)
    print(model.describe(), flush=True)
    slots = [cache.allocate_slot() for _ in range(Bmax)]
    tables = [cache.allocate_blocks(per_seq) for _ in range(Bmax)]
    V = min(128000, cfg.vocab_size)
    rows = []
    for B in batches:
        seqs = [_Seq(a.ctx, slots[r], tables[r]) for r in range(B)]
        tokens = torch.randint(3, V, (B,), device=dev, generator=gen)
        pos = torch.full((B,), a.ctx, dtype=torch.long, device=dev)
        bt = torch.full((B, model.max_blocks), -1, dtype=torch.long)
        for r in range(B):
            bt[r, :per_seq] = torch.tensor(tables[r])
        bt, sl = bt.to(dev), torch.tensor(slots[:B], device=dev)
        ids = [torch.randint(3, V, (N + 1,), generator=gen, device=dev) for _ in range(B)]
        with torch.no_grad():
            plain = graph_time(lambda: model(model.decode_context(tokens, pos, sl, bt)))

            def verify_eager():
                ctx = model.prefill_context(list(zip(ids, seqs)), all_logits=True)
                ctx.keep_hidden = True
                model(ctx)
                return ctx.hidden
            hidden = verify_eager()
            # the engine's verify: N + 1 rows per sequence through the decode step (rows j-major), as
            # its CUDA graph replays it
            vt = torch.stack(ids, 0).t().reshape(-1)
            ver = graph_time(lambda: model(model.decode_context(vt, pos, sl, bt, N + 1)))
            ver_eager = eager_ms(verify_eager)
            fills = [(s.slot, a.ctx - (N + 1), hidden[r * (N + 1):(r + 1) * (N + 1)]) for r, s in enumerate(seqs)]
            ext = eager_ms(lambda: model.dspark_extend(fills))
            dr = graph_time(lambda: model.dspark_draft(sl, tokens, pos, N))
            dr_eager = eager_ms(lambda: model.dspark_draft(sl, tokens, pos, N))
        rows.append((B, plain, ver, ver_eager, ext, dr, dr_eager))
        print(f"B={B:3d} N={N}: plain decode {plain * 1e3:9.1f} us, verify graph {ver * 1e3:9.1f} us (prefill path "
              f"eager {ver_eager * 1e3:9.1f} us), "
              f"extend {ext * 1e3:8.1f} us, draft graph {dr * 1e3:8.1f} us (eager {dr_eager * 1e3:8.1f} us)",
              flush=True)
    md = [f"## DSpark speculative decoding, synthetic {a.model} ({a.layers} layers, {cfg.n_routed_experts} experts, "
          f"3 DSpark stages), {datetime.date.today()}, "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU smoke run'}", "",
          f"Command: `PYTHONPATH=. python benchmarks/dspark.py --model {a.model} --layers {a.layers} "
          f"{'' if a.experts is None else f'--experts {a.experts} '}--batch {a.batch} --n {N} --ctx {a.ctx}`. "
          "Projected TPOT = (verify + extend + draft) / acceptance length: a projection at reported acceptance "
          "lengths, not a measured acceptance (random weights accept almost nothing).", "",
          "| batch | plain decode step us | verify (N+1 rows, graph) us | verify, prefill path eager us | extend us | "
          "draft (graph) us | draft eager us | "
          + " | ".join(f"TPOT at L={L} us" for L in ACCEPTANCE) + " |",
          "|---|---|---|---|---|---|---|" + "---|" * len(ACCEPTANCE)]
    for B, plain, ver, vere, ext, dr, dre in rows:
        tot = ver + ext + dr
        md.append(f"| {B} | {plain * 1e3:.1f} | {ver * 1e3:.1f} | {vere * 1e3:.1f} | {ext * 1e3:.1f} | {dr * 1e3:.1f} | "
                  f"{dre * 1e3:.1f} | " + " | ".join(f"{tot * 1e3 / L:.1f}" for L in ACCEPTANCE) + " |")
    text = "\n".join(md) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
