"""Speculative decoding with the MTP block: the plain decode step, the verify step (K + 1 rows per
sequence through the target) and the draft step (the MTP block over the accepted rows, then K - 1
single-row MTP steps), all from one run on a synthetic V4 slice, and the TPOT they imply at the
acceptance lengths published for V4 (SGLang's CI floors: 1.6 for K = 1, 2.8 for K = 3) -- a
projection: random synthetic weights accept almost nothing, so no measured acceptance is used.

    PYTHONPATH=. python benchmarks/spec_decode.py --model flash --layers 4 --batch 1,16,64 --k 1,3 --ctx 8192

Plain decode: CUDA-graph replays, L2 flushed (``common.graph_time``), as ``decode_step.py``. Verify, as
the engine runs it: the decode step of K + 1 rows per sequence (``DecodeContext.rows``) in a CUDA
graph -- its GPU time with ``graph_time`` like the plain step, and the engine's whole call
(``CudaGraphDecoder.replay``: the host inputs' copies and the replay) with ``triton.testing.do_bench``
(median; host time included where the GPU waits on it). Beside it the verify as the engine ran it
before, eagerly through the prefill path (do_bench). The draft is the engine's MTP drafter call (fill
and draft steps replayed from CUDA graphs, host included; do_bench), timed at its largest fill (all K
drafts accepted: K + 1 rows per sequence). The projected TPOT of one sequence at acceptance length L is (verify + draft) / L, with the engine's
verify call (and, for comparison, the prefill-path verify); plain decode's is its step.
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
from dsv4.engine.spec_decode import MTPDrafter  # noqa: E402
from dsv4.formats.paging import BLOCK_TOKENS  # noqa: E402
from dsv4.model.deepseek_v4 import CudaGraphDecoder, CudaGraphMTP, DeepseekV4  # noqa: E402

ACCEPTANCE = {1: 1.6, 3: 2.8}          # SGLang CI floors for V4 MTP (serving-anchors.md)


class _Seq:
    """What the drafter and prefill_context read of a sequence (hashable by identity)."""

    def __init__(self, pos, slot, block_table):
        self.pos, self.slot, self.block_table, self.draft_ids = pos, slot, block_table, []


def profile_table(fn, rows: int = 30) -> str:
    """torch.profiler's table of one call of ``fn`` (after a warm-up call): the ops by device time,
    then by host time, with their call counts."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    ka = prof.key_averages()
    key = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
    return ka.table(sort_by=key, row_limit=rows) + "\n" + ka.table(sort_by="self_cpu_time_total", row_limit=rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash", choices=["flash", "pro"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--k", default="1,3", help="speculative tokens per step to time")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--out", default=None, help="append the markdown section to this file")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one verify and one draft call of each batch / K (torch.profiler tables)")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    batches, ks = [int(b) for b in a.batch.split(",")], [int(k) for k in a.k.split(",")]
    Bmax, Kmax = max(batches), max(ks)
    cfg = synthetic_config(a.model, a.layers, a.experts)
    model = DeepseekV4(cfg, "mxfp4", "fp8", dev, draft="mtp")
    model.load(iter_synthetic_tensors(cfg, 0, dev))
    per_seq = -(-(a.ctx + 2 * Kmax + 2) // BLOCK_TOKENS)
    cache = KVCache(cfg, CacheConfig(max_num_seqs=Bmax + 1, num_blocks=Bmax * per_seq + 1, device=str(dev),
                                     draft_layers=1))
    model.attach_cache(cache, per_seq * BLOCK_TOKENS)
    fill_caches(cache, dev, gen, Bmax * per_seq + 1)
    print(model.describe(), flush=True)
    slots = [cache.allocate_slot() for _ in range(Bmax)]
    tables = [cache.allocate_blocks(per_seq) for _ in range(Bmax)]
    # the engine's drafter: fills of up to K + 1 rows and the draft steps replayed from CUDA graphs
    drafter = MTPDrafter(model, per_sequence=dev.type != "cuda", max_rows=Kmax + 1,
                         graphs=CudaGraphMTP(model, Bmax, Kmax + 1) if dev.type == "cuda" else None)
    rows = []
    for B in batches:
        seqs = [_Seq(a.ctx, slots[r], tables[r]) for r in range(B)]
        tokens = torch.randint(3, min(128000, cfg.vocab_size), (B,), device=dev, generator=gen)
        pos = torch.full((B,), a.ctx, dtype=torch.long, device=dev)
        bt = torch.full((B, model.max_blocks), -1, dtype=torch.long)
        for r in range(B):
            bt[r, :per_seq] = torch.tensor(tables[r])
        bt, sl = bt.to(dev), torch.tensor(slots[:B], device=dev)
        with torch.no_grad():
            plain = graph_time(lambda: model(model.decode_context(tokens, pos, sl, bt)))
            for K in ks:
                R = K + 1
                ids = [torch.randint(3, min(128000, cfg.vocab_size), (R,), generator=gen, device=dev) for _ in range(B)]
                jmajor = torch.stack(ids, 1).reshape(R * B)

                def verify():
                    ctx = model.prefill_context(list(zip(ids, seqs)), all_logits=True)
                    ctx.keep_hidden = True
                    model(ctx)
                    return ctx.hidden

                def verify_rows():
                    ctx = model.decode_context(jmajor, pos, sl, bt, R)
                    ctx.keep_hidden = True
                    model(ctx)
                    return ctx.hidden
                hidden = verify()
                fills = [(s, a.ctx, hidden[r * R:(r + 1) * R], ids[r].tolist()) for r, s in enumerate(seqs)]
                ver_graph = graph_time(verify_rows)
                if dev.type == "cuda":
                    graphs = CudaGraphDecoder(model, B, rows=(R,), buckets=(B,))
                    inp = torch.tensor(graphs.layout([x.tolist() for x in ids], [a.ctx] * B, slots[:B], B),
                                       dtype=torch.long).pin_memory()
                    bt_host = bt.cpu().pin_memory()
                    ver_call = eager_ms(lambda: graphs.replay(B, R, inp, bt_host))
                    del graphs
                else:
                    ver_call = float("nan")
                ver = eager_ms(verify)
                ver_eager = eager_ms(verify_rows)
                dr = eager_ms(lambda: drafter.propose(fills, {s: K for s in seqs}))
                rows.append((B, K, plain, ver_graph, ver_call, ver_eager, ver, dr))
                if a.profile:
                    for what, fn in (("verify (prefill path)", verify), ("verify (decode rows, eager)", verify_rows),
                                     ("draft", lambda: drafter.propose(fills, {s: K for s in seqs}))):
                        print(f"--- profile of one {what} call, B={B} K={K}", flush=True)
                        print(profile_table(fn), flush=True)
                print(f"B={B:3d} K={K}: plain decode {plain * 1e3:9.1f} us, verify graph {ver_graph * 1e3:9.1f} us "
                      f"(engine call {ver_call * 1e3:9.1f} us, eager {ver_eager * 1e3:9.1f} us), verify prefill path "
                      f"{ver * 1e3:9.1f} us, draft {dr * 1e3:9.1f} us", flush=True)
    md = [f"## Speculative decoding (MTP), synthetic {a.model} ({a.layers} layers), {datetime.date.today()}, "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU smoke run'}", "",
          f"Command: `PYTHONPATH=. python benchmarks/spec_decode.py --model {a.model} --layers {a.layers} "
          f"{'' if a.experts is None else f'--experts {a.experts} '}--batch {a.batch} --k {a.k} --ctx {a.ctx}`; "
          f"{cfg.n_routed_experts} routed experts. Plain decode and verify (K+1 decode rows per sequence): "
          "graph replays, L2 flushed (GPU time); verify engine call: the engine's CUDA-graph call with its "
          "input copies (do_bench median, host included); verify decode rows eager (the path without graphs), "
          "verify prefill path (the engine's verify before issue 31) and draft: eager (do_bench median). "
          "Projected TPOT = (verify + draft) / acceptance length, with the engine call's verify and, "
          "in the last column, the prefill-path verify (a projection at SGLang's published CI floors, not a "
          "measured acceptance).", "",
          "| batch | K | plain decode step us | verify graph us | verify engine call us | verify decode rows eager us "
          "| verify prefill path us | draft us | acceptance length | projected TPOT us "
          "| projected TPOT, prefill-path verify us |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for B, K, plain, ver_graph, ver_call, ver_eager, ver, dr in rows:
        L = ACCEPTANCE.get(K)
        proj = f"{(ver_call + dr) * 1e3 / L:.1f}" if L else "-"
        proj_p = f"{(ver + dr) * 1e3 / L:.1f}" if L else "-"
        md.append(f"| {B} | {K} | {plain * 1e3:.1f} | {ver_graph * 1e3:.1f} | {ver_call * 1e3:.1f} "
                  f"| {ver_eager * 1e3:.1f} | {ver * 1e3:.1f} | {dr * 1e3:.1f} | {L or '-'} | {proj} | {proj_p} |")
    text = "\n".join(md) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
