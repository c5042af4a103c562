"""``dsv4 validate``: run the fast decode path and the reference side by side, module by module.

For every decode step both paths get the same cache state and the same token (the reference's
greedy choice), and the fast path runs each module on the reference's inputs; per layer and module (q/kv prologue, compressor entries, indexer top-k, sparse
attention, attention output, mHC, MoE) and for the logits it reports cosine similarity and max
error, the indexer top-k overlap, logit statistics, and whether the first token is EOS or any
logit is NaN/inf: the checks that find a silently broken kernel (empty answers, immediate EOS,
NaN sampled as token 0) in minutes.

``--synthetic flash|pro --layers N`` builds real-shaped layers (hidden size, heads, ranks, indexer,
compress ratios of the preset) with random weights in the real formats, for GPUs that cannot
hold a checkpoint. The reference holds experts dequantised in fp32, so synthetic models keep
``--experts`` routed experts (default 16) instead of 256/384; every other shape is real.
"""
from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

import torch

THRESH_COS = 0.995
THRESH_TOPK = 0.98


def synthetic_config(name: str, layers: int, experts: int):
    from ..config import preset
    base = preset(name)
    ratios = tuple(base.compress_ratios[:layers]) + (0,)
    return base.replace(num_hidden_layers=layers, compress_ratios=ratios,
                        n_routed_experts=experts, num_experts_per_tok=min(base.num_experts_per_tok, experts),
                        num_hash_layers=min(base.num_hash_layers, layers))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    na, nb = a.norm(), b.norm()
    if na == 0 and nb == 0:
        return 1.0
    return float((a @ b) / (na * nb).clamp(min=1e-300))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |A & B| / |A| for the valid (>= 0) picks of the reference A."""
    vals = []
    for ra, rb in zip(a.tolist(), b.tolist()):
        sa = {x for x in ra if x >= 0}
        if sa:
            vals.append(len(sa & {x for x in rb if x >= 0}) / len(sa))
    return sum(vals) / len(vals) if vals else 1.0


def compare(ref: dict, fast: dict) -> dict:
    out = {}
    for k, r in ref.items():
        f = fast.get(k)
        if f is None:
            continue
        if k.endswith("indexer_topk"):
            out[k] = {"topk_overlap": _overlap(r, f)}
            continue
        rf, ff = r.float(), f.float()
        out[k] = {"cos": _cos(rf, ff), "max_err": float((rf - ff).abs().max()) if rf.numel() else 0.0,
                  "nonfinite": int((~torch.isfinite(ff)).sum())}
    return out


def _compare_prefill(model, fast_dec, cache, ids, logits, agg, dev):
    """The prompt through the fused prefill twice more, into two more sequences of the cache: with
    the kernels' torch twins (same orchestration; its logits must match the reference model's:
    row ``prefill.orchestration``) and with the kernels, each module on the twin run's inputs
    (forced, as for decode), rows ``prefill.L<i>.<module>``."""
    from ..engine.kv_cache import PagedSequenceState
    from .fast_prefill import FastPrefiller
    tok = torch.tensor(ids, device=dev)
    runs = []
    for twins in (True, False):
        st = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(cache.blocks_needed(len(ids))))
        fp = FastPrefiller(fast_dec, twins=twins)
        fp.trace, fp.force = {}, (runs[0][1] if runs else None)
        lg = fp.forward([(tok, st)])[0]
        runs.append((lg, fp.trace))
        st.release()
    agg["prefill.orchestration"].append(compare({"x": logits}, {"x": runs[0][0]})["x"])
    for k, v in compare(runs[0][1], runs[1][1]).items():
        agg["prefill." + k].append(v)


def run(args) -> int:
    from ..engine.kv_cache import CacheConfig, KVCache, PagedSequenceState
    from .fast_decode import FastDecoder
    from ..reference.model import ReferenceModel

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    if args.synthetic:
        from ..checkpoint.tiny import build_tiny_tensors
        cfg = synthetic_config(args.synthetic, args.layers, args.experts)
        tensors = build_tiny_tensors(cfg, args.seed, threads=os.cpu_count() or 1)
        tok = None
        where = f"synthetic {args.synthetic}, {args.layers} layers, {cfg.n_routed_experts} experts"
    else:
        from ..checkpoint.loader import load_checkpoint
        from ..models import resolve_model
        from ..tokenizer import load_tokenizer
        path = resolve_model(args.model)
        ck = load_checkpoint(path, progress=not args.quiet)
        cfg, tensors = ck.config, ck.tensors
        tok = load_tokenizer(path)
        where = path
    tensors = {k: v.to(dev) for k, v in tensors.items()}
    model = ReferenceModel(cfg, tensors, numerics=args.numerics)
    max_len = max(256, -(-(args.prompt_len + args.steps + 1) // 256) * 256)
    # slots: the two decoders' scratch, the sequence, and (--fused) one for the fused prefill runs
    cache = KVCache(cfg, CacheConfig(max_num_seqs=4, num_blocks=max_len // 256 * 2 + 2, device=str(dev)))
    fast_attn = args.attention or ("triton" if dev.type == "cuda" else "reference")
    ref_dec = FastDecoder(model, cache, max_len, "reference")
    fast_dec = FastDecoder(model, cache, max_len, fast_attn, fused=args.fused)
    print(f"dsv4 validate: {where} on {dev}; fast path = tensorised decode with {fast_attn} attention"
          f"{' + fused mHC/compressor/indexer/MoE kernels' if args.fused else ''}; "
          f"numerics {args.numerics}; loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    if tok is not None and args.prompt:
        ids = [cfg.bos_token_id] + tok.encode(args.prompt)
    else:
        g = torch.Generator().manual_seed(args.seed)
        ids = [cfg.bos_token_id] + torch.randint(3, min(cfg.vocab_size, 128000), (args.prompt_len - 1,), generator=g).tolist()
    slot = cache.allocate_slot()
    table = cache.allocate_blocks(cache.blocks_needed(len(ids) + args.steps))
    st = PagedSequenceState(cache, slot, table)
    logits = model.forward([(torch.tensor(ids, device=dev), st)])[0]
    agg = defaultdict(list)
    if args.fused:
        _compare_prefill(model, fast_dec, cache, ids, logits, agg, dev)
    bt = torch.full((1, ref_dec.max_blocks), -1, dtype=torch.long)
    bt[0, :len(table)] = torch.tensor(table)
    bt = bt.to(dev)
    first_eos = first_nan = False
    argmax_agree = 0
    for step in range(args.steps):
        token = int(logits.argmax())
        pos = st.pos
        args_ = (torch.tensor([token], device=dev), torch.tensor([pos], device=dev),
                 torch.tensor([slot], device=dev), bt)
        # reference first; the fast path then runs every module on the reference's inputs (its
        # own values are recorded, the reference's are carried downstream), so each row of the
        # report measures one module alone. The fast path rewrites the same cache rows with the
        # forced values, i.e. the reference's.
        ref_dec.trace, ref_dec.force = {}, None
        lr = ref_dec.forward(*args_)
        fast_dec.trace, fast_dec.force = {}, (ref_dec.trace if not args.free_running else None)
        lf = fast_dec.forward(*args_)
        st.advance_to(pos + 1)
        if step == 0:
            first_eos = int(lf[0].argmax()) == cfg.eos_token_id
        first_nan |= not bool(torch.isfinite(lf).all())
        argmax_agree += int(lf[0].argmax() == lr[0].argmax())
        for k, v in compare(ref_dec.trace, fast_dec.trace).items():
            agg[k].append(v)
        logits = lr[0]
    fast_dec.trace = ref_dec.trace = fast_dec.force = None

    rows, worst_cos, worst_topk = [], 1.0, 1.0
    for k, vals in agg.items():
        if "topk_overlap" in vals[0]:
            ov = min(v["topk_overlap"] for v in vals)
            worst_topk = min(worst_topk, ov)
            rows.append((k, f"top-k overlap {ov:.4f}", ov < THRESH_TOPK))
        else:
            c = min(v["cos"] for v in vals)
            e = max(v["max_err"] for v in vals)
            nf = sum(v["nonfinite"] for v in vals)
            worst_cos = min(worst_cos, c)
            rows.append((k, f"cos {c:.6f}  max_err {e:.4g}" + (f"  NONFINITE {nf}" if nf else ""),
                         c < THRESH_COS or nf > 0))
    print(f"{'module':<24} {'min over ' + str(args.steps) + ' steps':<40} flag")
    for k, txt, bad in rows:
        print(f"{k:<24} {txt:<40} {'<-- diverged' if bad else ''}")
    lr = logits.float()
    print(f"logits: mean {lr.mean():.3f} std {lr.std():.3f} max {lr.max():.3f}; "
          f"greedy agreement {argmax_agree}/{args.steps}; first token EOS: {first_eos}; NaN/inf: {first_nan}")
    ok = worst_cos >= THRESH_COS and worst_topk >= THRESH_TOPK and not first_nan and not first_eos
    print(f"RESULT: {'OK' if ok else 'DIVERGED'} (worst module cos {worst_cos:.6f} >= {THRESH_COS}, "
          f"worst top-k overlap {worst_topk:.4f} >= {THRESH_TOPK})")
    return 0 if ok else 1


def add_parser(sub) -> None:
    v = sub.add_parser("validate", help="fast path vs reference, per layer and module")
    v.add_argument("model", nargs="?", default=None, help="checkpoint dir (default: the embedded tiny model)")
    v.add_argument("--synthetic", choices=["flash", "pro"], default=None)
    v.add_argument("--layers", type=int, default=4)
    v.add_argument("--experts", type=int, default=16, help="routed experts of a synthetic model")
    v.add_argument("--prompt", default=None)
    v.add_argument("--prompt-len", type=int, default=300, help="random prompt length when no --prompt")
    v.add_argument("--steps", type=int, default=8)
    v.add_argument("--attention", choices=["reference", "triton"], default=None)
    v.add_argument("--fused", action="store_true",
                   help="also the Triton mHC, compressor, indexer and MoE kernels (needs --attention triton)")
    v.add_argument("--numerics", choices=["official", "invariant"], default="official")
    v.add_argument("--device", default=None)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--free-running", action="store_true",
                   help="let the fast path carry its own values downstream (errors then accumulate)")
    v.add_argument("-q", "--quiet", action="store_true")
    v.set_defaults(fn=run)
