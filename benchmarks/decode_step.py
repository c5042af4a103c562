"""One decode step of the production model (``DeepseekV4``) on a synthetic V4 checkpoint (real
layer shapes and formats, ``dsv4.checkpoint.synthetic``, generated straight into device memory) at
the given batch sizes, with the time of every layer and of the head.

    PYTHONPATH=. python benchmarks/decode_step.py --model flash --layers 4 --experts 8 --batch 1,64 --ctx 8192
    PYTHONPATH=. python benchmarks/decode_step.py --model flash --layers 4 --batch 1,16,64   # all 256 experts

The caches hold ``ctx`` positions of valid random FP8 / MXFP4 / fp32 contents for every sequence.

Tensor parallelism: run under torchrun, one process per GPU (NCCL; gloo on CPU), every rank builds
its slice and runs the same steps; rank 0 prints. Times are then fixed-count graph replays (every
rank replays the same number, so the collectives pair up), and ``--profile-step`` also reports the
share of the NCCL kernels in the step:

    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/decode_step.py --model flash --layers 4 --batch 1,64 --profile-step

Times are CUDA-graph replays (``do_bench`` medians) with the L2 flushed before every call. A layer's
time excludes the per-step index / RoPE rows (``kernels/decode_meta.py``, one launch per step, which the
full step includes). floor = bytes a step must move / measured copy bandwidth: the layer's
checkpoint-format weights (routed experts: only the experts the batch hits, expected number for
uniform routing), the KV entries attention reads (128 window + top-k CSA / all HCA entries, 584 B),
the indexer keys scored (68 B) and the compressor rings.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import graph_time, kernel_totals, roofline  # noqa: E402
from dsv4 import streams  # noqa: E402
from dsv4.checkpoint.synthetic import iter_synthetic_tensors, synthetic_config  # noqa: E402
from dsv4.engine.kv_cache import CacheConfig, KVCache  # noqa: E402
from dsv4.formats.index_key import write_index_keys  # noqa: E402
from dsv4.formats.kv_entry import write_entries  # noqa: E402
from dsv4.formats.paging import BLOCK_TOKENS, INDEX_PAGE, WINDOW, WINDOW_PAGE  # noqa: E402
from dsv4.kernels.gemm import common as gemm_common  # noqa: E402
from dsv4.kernels.gemm import fp4_mma  # noqa: E402
from dsv4.kernels.gemm import route as gemm_route  # noqa: E402
from dsv4.kernels import indexer as indexer_kernels  # noqa: E402
from dsv4.kernels import lib as kernel_lib  # noqa: E402
from dsv4.kernels import mhc as mhc_kernels  # noqa: E402
from dsv4.kernels import moe as moe_kernels  # noqa: E402
from dsv4.kernels.lib import PDL_ON  # noqa: E402
from dsv4.layers.attention import Attention  # noqa: E402
from dsv4.model import deepseek_v4 as dsv4_model  # noqa: E402
from dsv4.model.deepseek_v4 import DeepseekV4  # noqa: E402


def log(*a):
    print(*a, flush=True)


def fill_caches(cache, dev, gen, n_blocks):
    """Valid random contents everywhere a step may read."""
    for lc in cache.layers:
        n = lc.window.shape[0] * WINDOW_PAGE
        for i in range(0, n, 65536):
            ids = torch.arange(i, min(n, i + 65536), device=dev)
            write_entries(lc.window, ids, torch.randn(ids.numel(), 512, device=dev, generator=gen).bfloat16(),
                          WINDOW_PAGE)
        if lc.entries is not None:
            n = n_blocks * lc.entries_per_block
            for i in range(0, n, 65536):
                ids = torch.arange(i, min(n, i + 65536), device=dev)
                write_entries(lc.entries, ids, torch.randn(ids.numel(), 512, device=dev, generator=gen).bfloat16(),
                              lc.entries_per_block)
            lc.comp_state.normal_(generator=gen)
        if lc.index_keys is not None:
            n = n_blocks * INDEX_PAGE
            for i in range(0, n, 65536):
                ids = torch.arange(i, min(n, i + 65536), device=dev)
                write_index_keys(lc.index_keys, ids, torch.randn(ids.numel(), 128, device=dev, generator=gen))
            lc.index_state.normal_(generator=gen)


class Slice:
    """A synthetic V4 slice on ``dev`` with its caches filled for ``bmax`` sequences of ``ctx`` positions:
    ``cfg``, ``model``, ``cache``, ``per_seq`` (blocks a sequence holds), ``slots`` and ``tables`` (one each per
    sequence); ``inputs(B)`` gives a decode step's (tokens, pos, slots, block table) for the first B."""

    def __init__(self, model_name, layers, experts, dev, bmax, ctx, group=None):
        gen = torch.Generator(device=dev).manual_seed(0)
        self.cfg = cfg = synthetic_config(model_name, layers, experts)
        self.model = DeepseekV4(cfg, "mxfp4", "fp8", dev, group=group)
        self.model.load((n, t) for n, t in iter_synthetic_tensors(cfg, 0, dev) if not n.startswith("mtp."))
        self.per_seq = -(-(ctx + 1) // BLOCK_TOKENS)
        self.cache = KVCache(cfg, CacheConfig(max_num_seqs=bmax + 1, num_blocks=bmax * self.per_seq + 1,
                                              device=str(dev)))
        self.model.attach_cache(self.cache, self.per_seq * BLOCK_TOKENS)
        fill_caches(self.cache, dev, gen, bmax * self.per_seq + 1)
        self.slots = [self.cache.allocate_slot() for _ in range(bmax)]
        self.tables = [self.cache.allocate_blocks(self.per_seq) for _ in range(bmax)]
        self.dev, self.ctx, self.gen = dev, ctx, gen     # the fill's generator draws the steps' tokens too

    def inputs(self, B):
        """(tokens, pos, slots, block table) of a decode step of the first B sequences, every one at ``ctx``."""
        dev = self.dev
        tokens = torch.randint(3, 128000, (B,), device=dev, generator=self.gen)
        pos = torch.full((B,), self.ctx, dtype=torch.long, device=dev)
        sl = torch.tensor(self.slots[:B], device=dev)
        bt = torch.full((B, self.model.max_blocks), -1, dtype=torch.long)
        for r in range(B):
            bt[r, :self.per_seq] = torch.tensor(self.tables[r])
        return tokens, pos, sl, bt.to(dev)


def layer_bytes(model, cfg, i, B, ctx, ratio):
    """Bytes a decode step of layer i must read: its stored weights (routed experts: the expected
    number a batch of B hits under uniform routing) and the cache entries attention reads."""
    blk = model.layers[i]
    moe = blk.moe
    experts = sum(t.numel() * t.element_size() for t in (moe.w13, moe.w13_s, moe.w2, moe.w2_s))
    dense = sum(t.numel() * t.element_size() for t in blk.buffers()) - experts
    E, k = moe.n_experts, moe.topk
    hit = E * (1 - (1 - k / E) ** B)
    kv = B * WINDOW * 584
    if ratio == 4:
        kv += B * (min(cfg.index_topk, ctx // 4) * 584 + (ctx // 4) * 68)
    elif ratio:
        kv += B * (ctx // ratio) * 584
    return dense + hit * experts / E + kv


def fixed_graph_time(fn, reps=3, iters=20):
    """GPU ms of fn from ``iters`` replays of a graph of ``reps`` calls, the L2 flushed before
    every call (the flush timed alone and subtracted): the same count on every rank (tensor
    parallelism: ``do_bench`` picks its count per process, and collectives must pair up)."""
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def graph(body):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            body()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                flush_buf.zero_()
                body()
        return g

    def time_of(g):
        g.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / (iters * reps)

    return time_of(graph(fn)) - time_of(graph(lambda: None))


def kernel_profile(fn, reps=5, top=25):
    """[(kernel name, launches per call, GPU us per call)] of ``fn``, largest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = sorted(((k, n // reps, t / reps) for k, (n, t) in kernel_totals(prof).items()), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    comm = [r for r in rows if "nccl" in r[0].lower()]
    extra = [(f"(NCCL collectives: {sum(r[2] for r in comm) / total * 100:.1f}% of the step)",
              sum(r[1] for r in comm), sum(r[2] for r in comm))] if comm else []
    return rows[:top] + extra + [("(all kernels)", sum(r[1] for r in rows), total)]


_SINKHORN = [None]          # --sinkhorn-iters' pick, applied to every HyperConnection before a timing


def _switches() -> dict:
    """The A/B switches: flag -> (choices, the rows' tag, setter, what it switches). Each flag takes a comma list;
    the step is timed under every combination, in this process (graphs capture the setting in force)."""
    max_rows, gemv_max, fused_t = streams.MAX_ROWS, gemm_route.DENSE_GEMV_MAX_WEIGHT, mhc_kernels.FUSED_MAX_T

    def side_stream(m):
        streams.STREAMS_ON = m != "off"
        streams.MAX_ROWS = 1 << 30 if m == "on" else max_rows

    return {
        "streams": (("off", "on", "auto"), "streams", side_stream,
                    "the side stream (dsv4.streams) off, on at every batch, on up to streams.MAX_ROWS rows (the "
                    "default; default: the DSV4_STREAMS setting only)"),
        "dense-gemv": (("off", "on"), "dense gemv",
                       lambda m: setattr(gemm_route, "DENSE_GEMV_MAX_WEIGHT", 0 if m == "off" else gemv_max),
                       "the fp32-output GEMMs (compressor projection, router gate) on torch's GEMMs or on "
                       "kernels.gemm.dense_gemv up to its routed rows (default: the router's choice only)"),
        "dense-gemv-rows": (("1", "2", "4", "8", "16"), "dense gemv rows",
                            lambda m: (setattr(gemm_route, "DENSE_GEMV_MAX_ROWS", int(m)),
                                       setattr(gemm_route, "DENSE_GEMV_FP32_MAX_ROWS", int(m))),
                            "the fp32-output GEMMs (compressor projection, router gate) on kernels.gemm.dense_gemv "
                            "up to this many rows, both weight dtypes (kernels.gemm.route.DENSE_GEMV_MAX_ROWS / "
                            "DENSE_GEMV_FP32_MAX_ROWS; default 2 / 8), torch's above"),
        "mhc-sites": (("fused", "per-op"), "mhc", lambda m: setattr(dsv4_model, "FUSED_SITES", m == "fused"),
                      "the mHC sites on hc_post_pre (model.deepseek_v4.FUSED_SITES, the default) or on the per-op "
                      "blocks"),
        "prefetch": (("off", "on"), "prefetch", lambda m: setattr(kernel_lib, "PREFETCH", m == "on"),
                     "the weight kernels' L2 hints before their PDL wait (kernels.lib.PREFETCH) off or on"),
        "decode-rope": (("fused", "pass"), "rope", lambda m: setattr(Attention, "FUSE_DECODE_ROPE", m == "fused"),
                        "the attention output's inverse RoPE in the attention's combine "
                        "(layers.attention.Attention.FUSE_DECODE_ROPE, the default) or in inverse_rope's own pass"),
        "hc-loads": (("first", "after"), "hc loads", lambda m: setattr(mhc_kernels, "LOADS_FIRST", m == "first"),
                     "the fused mHC sites' last arriver issuing its stream loads before its Sinkhorn "
                     "(kernels.mhc.LOADS_FIRST, the default) or after it"),
        "moe-split": (("auto", "1", "2", "4", "8"), "moe split",
                      lambda m: setattr(gemm_common, "GROUPED_SPLIT", None if m == "auto" else int(m)),
                      "the routed experts' decode GEMMs at a fixed K split (kernels.gemm.common.GROUPED_SPLIT) or "
                      "at decode_splits' choice (auto, the default)"),
        "moe-tiles": (("search", "vec"), "moe tiles", lambda m: setattr(fp4_mma, "VEC_TILES", m == "vec"),
                      "the routed experts' decode GEMM finding its tile's expert by a binary search (dependent "
                      "loads) or by one vector load of the tile counts (kernels.gemm.fp4_mma.VEC_TILES)"),
        "moe-combine": (("loop", "one-trip"), "moe combine",
                        lambda m: setattr(moe_kernels, "COMBINE_ONE_TRIP", m == "one-trip"),
                        "the MoE combine's split loop per expert row or its one-round-trip form up to four "
                        "partials (kernels.moe.COMBINE_ONE_TRIP)"),
        "sinkhorn-iters": (("20", "10", "5", "1", "0"), "sinkhorn iters",
                           lambda m: _SINKHORN.__setitem__(0, int(m)),
                           "the mHC sites' Sinkhorn at this many iterations (timing only: any count but the "
                           "config's 20 changes the model's output; what the serial chain costs the step)"),
        "sinkhorn-rcp": (("off", "on"), "sinkhorn rcp", lambda m: setattr(mhc_kernels, "SINKHORN_RCP", m == "on"),
                         "the Sinkhorn's normalisations on the approximate reciprocal and a summation tree "
                         f"(kernels.mhc.SINKHORN_RCP; default {'on' if mhc_kernels.SINKHORN_RCP else 'off'})"),
        "shared-fork": (("route", "early"), "shared fork",
                        lambda m: setattr(moe_kernels, "SHARED_EARLY", m == "early"),
                        "the shared expert forked to the side stream after the router (on its quantised x) or before "
                        "the gate (its own quantisation; kernels.moe.SHARED_EARLY)"),
        "index-q": (("side", "main"), "index q", lambda m: setattr(Attention, "INDEX_Q_MAIN", m == "main"),
                    "a CSA layer's indexer queries on the side stream after its compressors or on the main stream "
                    "ahead of wq_b (layers.attention.Attention.INDEX_Q_MAIN; with the side stream only)"),
        "topk-single": (("select", "sort"), "topk single",
                        lambda m: setattr(indexer_kernels, "SINGLE_FULL_SORT", m == "sort"),
                        "the indexer top-k's one-program rows selecting by histograms and sorting the picks, or "
                        "sorting the whole row (kernels.indexer.SINGLE_FULL_SORT; default "
                        f"{'sort' if indexer_kernels.SINGLE_FULL_SORT else 'select'})"),
        "hc-fused-rows": (tuple(str(n) for n in (1, 2, 3, 4, 8, 16, 64)), "hc fused rows",
                          lambda m: setattr(mhc_kernels, "FUSED_MAX_T", int(m)),
                          f"the most rows an mHC site runs on the one-launch fused path, the tiled path above "
                          f"(kernels.mhc.FUSED_MAX_T; default {fused_t})"),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash", choices=["flash", "pro"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default: the preset's 256 / 384)")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--out", default=None, help="append the markdown section to this file")
    ap.add_argument("--profile-layer", type=int, default=None,
                    help="also list the GPU kernels of this layer (torch.profiler, eager calls)")
    ap.add_argument("--profile-step", action="store_true",
                    help="also list the GPU kernels of one whole step (torch.profiler, eager call)")
    switches = _switches()
    for name, (choices, _tag, _set, what) in switches.items():
        ap.add_argument(f"--{name}", default=None,
                        help=f"comma list of {' / '.join(choices)}: time the step with {what}, in this process")
    ap.add_argument("--one-rank-collectives", action="store_true",
                    help="run inside a one-rank process group (NCCL on GPUs) whose collectives run "
                         "(parallel.Group(always=True)): the cost of the tensor-parallel calls themselves")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    group = None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    timer = graph_time
    if world > 1:                                   # torchrun: one rank per process
        import torch.distributed as dist

        from dsv4.parallel import Group
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        dist.all_reduce(torch.zeros(1, device=dev))
        group = Group(dist.group.WORLD)
        timer = fixed_graph_time
        if group.rank:
            global log
            log = lambda *a: None                   # noqa: E731  (rank 0 prints)
    if args.one_rank_collectives:
        from dsv4.parallel import one_rank_group
        group = one_rank_group(dev)
    batches = [int(b) for b in args.batch.split(",")]
    sl_ = Slice(args.model, args.layers, args.experts, dev, max(batches), args.ctx, group)
    cfg, model = sl_.cfg, sl_.model
    log(f"{model.describe()}")
    log(f"programmatic dependent launch (DSV4_PDL): {'on' if PDL_ON else 'off'}; side stream (DSV4_STREAMS): "
        f"{args.streams or ('on' if streams.STREAMS_ON else 'off')}")
    copy_bw, _ = roofline(dev, dev.type != "cuda")
    log(f"roofline: copy {copy_bw / 1e12:.2f} TB/s; {args.model} {args.layers} layers, ratios "
        f"{cfg.compress_ratios[:args.layers]}, {cfg.n_routed_experts} experts, ctx {args.ctx}")
    rows, profiles = [], []
    given = {name: getattr(args, name.replace("-", "_")) for name in switches}
    lists = {}
    for name, (choices, _tag, _set, _what) in switches.items():
        lists[name] = [None] if given[name] is None else [m.strip() for m in given[name].split(",")]
        if any(m not in (None, *choices) for m in lists[name]):
            raise SystemExit(f"--{name}: expected {' / '.join(choices)}, got {given[name]!r}")
    for *picked, B in itertools.product(*lists.values(), batches):
        tag = ""
        for (name, (_c, label, setter, _w)), m in zip(switches.items(), picked):
            if m is not None:
                setter(m)
            if len(lists[name]) > 1:
                tag += f"{label} {m}: "
        if _SINKHORN[0] is not None:
            for mod in model.modules():
                if isinstance(mod, dsv4_model.HyperConnection):
                    mod.iters = _SINKHORN[0]
        tokens, pos, sl, bt = sl_.inputs(B)
        with torch.no_grad():
            h0 = torch.nn.functional.embedding(tokens, model.embed).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
            step = timer(lambda: model(model.decode_context(tokens, pos, sl, bt)))
            ctx = model.decode_context(tokens, pos, sl, bt)
            ctx.meta = model._meta(ctx)                 # the step's per-step values, computed once per step
            per_layer = [timer(lambda i=i: model.layers[i](h0, ctx)) for i in range(args.layers)]
            head = timer(lambda: model.head_logits(h0, ctx))
        if args.profile_layer is not None and dev.type == "cuda":
            profiles.append((B, f"{tag}layer {args.profile_layer}",
                             kernel_profile(lambda: model.layers[args.profile_layer](h0, ctx))))
        if args.profile_step and dev.type == "cuda":
            profiles.append((B, f"{tag}the whole step",
                             kernel_profile(lambda: model(model.decode_context(tokens, pos, sl, bt)), top=60)))
        for i, t in enumerate(per_layer):
            r = cfg.compress_ratios[i]
            nb = layer_bytes(model, cfg, i, B, args.ctx, r)
            rows.append((B, f"{tag}layer {i} ({'CSA' if r == 4 else 'HCA' if r else 'window'}"
                            f"{', hash' if i < cfg.num_hash_layers else ''})", t * 1e3, nb))
        hb = cfg.vocab_size * cfg.hidden_size * 2 // world          # this rank's vocabulary slice
        rows.append((B, f"{tag}hc_head + norm + head", head * 1e3, hb))
        rows.append((B, f"{tag}full step", step * 1e3, sum(x[3] for x in rows[-(args.layers + 1):])))
        for x in rows[-(args.layers + 2):]:
            log(f"B={x[0]:3d} {x[1]:28s} {x[2]:9.1f} us  floor {x[3] / copy_bw * 1e6:8.1f} us "
                f"({x[3] / copy_bw * 1e6 / x[2] * 100:4.0f}%)")
    md = [f"## Decode step (DeepseekV4), synthetic {args.model} ({args.layers} layers), {datetime.date.today()}, "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU smoke run'}", "",
          f"Command: `{'DSV4_PDL=1 ' if PDL_ON else ''}PYTHONPATH=. "
          f"{f'torchrun --nproc-per-node {world}' if world > 1 else 'python'} "
          f"benchmarks/decode_step.py --model {args.model} --layers {args.layers} "
          f"{'' if args.experts is None else f'--experts {args.experts} '}--batch {args.batch} --ctx {args.ctx}"
          f"{' --one-rank-collectives' if args.one_rank_collectives else ''}"
          + "".join(f" --{n} {v}" for n, v in given.items() if v)
          + f"`; torch {torch.__version__}. Copy bandwidth measured in the "
          f"run: {copy_bw / 1e12:.2f} TB/s. Every sequence at position {args.ctx}; "
          f"{cfg.n_routed_experts} routed experts (MXFP4); weights {model.weight_bytes() / 2**30:.2f} GiB"
          f"{f' per rank, tensor parallel over {world}' if world > 1 else ''}. Times: CUDA-graph replays, L2 flushed before each call"
          f"{' (fixed replay counts)' if world > 1 else ''}.", "",
          "| batch | part | us | floor us (bytes / copy BW) | % of floor |", "|---|---|---|---|---|"]
    for B, name, us, nb in rows:
        fl = nb / copy_bw * 1e6
        md.append(f"| {B} | {name} | {us:.1f} | {fl:.1f} | {fl / us * 100:.0f}% |")
    for B, what, prof in profiles:
        md += ["", f"<details><summary>{what} at batch {B}: GPU kernels (eager calls, "
                   f"torch.profiler; us per call)</summary>", "", "| kernel | calls | us |", "|---|---|---|"]
        md += [f"| `{name[:90]}` | {n} | {us:.1f} |" for name, n, us in prof]
        md += ["", "</details>"]
    text = "\n".join(md) + "\n"
    if group is not None and group.rank:
        return
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
