"""``dsv4 validate``: the production model against the reference, module by module, then the engine.

Two models over the same weights and nothing else in common: the production model
(``model.deepseek_v4.DeepseekV4``: native weights, the op table's kernels on a GPU or twins on a
CPU, the paged cache) and the oracle (``reference.model.ReferenceModel``: fp32-dequantised
weights, DeepSeek's official math, in-memory state). Both record their module values under the
same names (``L<i>.hc_pre``, ``.q`` (decode only: at prefill the attention kernel normalises and rotates q
as it loads it, and ``.sparse_attn`` covers that), ``.kv``, ``.compressor``, ``.indexer_compressor``,
``.indexer_topk``, ``.sparse_attn`` (the attention output after its inverse RoPE), ``.attn``, ``.moe``,
``.hc_post``, ``logits``).

1. Teacher-forced, module by module: the prompt's prefill and then ``--steps`` decode steps, each
   run by the reference first; the production model then runs every module on the reference's
   inputs (each forced value is the reference's output of the module before), so each row of the
   report measures one module alone: cosine similarity and max error (min / max over the calls),
   non-finite values, the indexer's top-k overlap. The decode tokens are the reference's greedy
   choices.
2. Through the engine (``--engine-batch`` sequences; scheduler, chunked prefill, CUDA graphs on a
   GPU, the sampler; DSpark speculative decoding when the model has the DSpark draft): the validated prompt batched with others and alone, greedy. Its tokens are
   compared with the reference's greedy tokens up to the first difference, which fails unless
   the reference's top-1 margin there is below ``--margin`` (at a near-tie either answer is
   right, and the contexts part); no sequence may start with EOS or have a non-finite
   log-probability (the silent failures: empty answers, NaN sampled as token 0).

3. The DSpark draft, when the checkpoint has one (or ``--synthetic ... --draft dspark``): both drafts
   get the reference target's features of the prompt in their rings and draft one block from its
   greedy next token; the production stages run on the reference's inputs module by module like the
   main model (rows ``draft.L<i>.hc_pre`` / ``.moe`` / ``.hc_post`` of the stage layer ids,
   ``draft.dspark.hc_head``, ``draft.dspark.logits``), beside the ring rows of each stage
   (``draft.ring<s>``), the confidences and the draft tokens.

``--synthetic flash|pro --layers N`` generates real-shaped weights (``checkpoint.synthetic``) in
device memory instead of reading a checkpoint. The reference holds every weight in fp32, so a
synthetic model keeps ``--experts`` routed experts (default 16) instead of 256 / 384.

Each stage (weights, production model, reference, teacher-forced steps, engine) reports its
progress on stderr unless ``-q``; the report itself goes to stdout.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch
from tqdm import tqdm

THRESH_COS = 0.995
THRESH_TOPK = 0.98


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


def compare(ref: dict, prod: dict) -> dict:
    """Per name in both traces: {'topk_overlap'} for indexer picks, else {'cos', 'max_err',
    'nonfinite'}. A reference value with no elements (no compressor entry completed in this call)
    is skipped; the production model then records zero rows of the same width."""
    out = {}
    for k, r in ref.items():
        f = prod.get(k)
        if f is None or r.numel() == 0:
            continue
        if k.endswith("indexer_topk"):
            out[k] = {"topk_overlap": _overlap(r, f)}
            continue
        rf, ff = r.float(), f.float()
        if rf.numel() != ff.numel():
            raise RuntimeError(f"validate: {k}: the reference recorded shape {tuple(r.shape)}, the production "
                               f"model {tuple(f.shape)}")
        rf = rf.reshape(ff.shape)
        out[k] = {"cos": _cos(rf, ff), "max_err": float((rf - ff).abs().max()),
                  "nonfinite": int((~torch.isfinite(ff)).sum())}
    return out


class Forcer:
    """The production model's ``trace.force``: each traced value replaced by the reference's (its
    shape; indexer picks -1 padded or cut to the production's width)."""

    def __init__(self, ref: dict):
        self.ref = ref

    def __call__(self, name: str, t: torch.Tensor):
        r = self.ref.get(name)
        if r is None:
            return None
        if name.endswith("indexer_topk"):
            out = torch.full_like(t, -1)
            k = min(t.shape[1], r.shape[1])
            out[:, :k] = r[:, :k].to(t.device, t.dtype)
            return out
        if r.numel() != t.numel():
            return None
        return r.reshape(t.shape).to(t.device)


def _margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def _say(args, msg: str) -> None:
    if not args.quiet:
        print(f"dsv4 validate: {msg}", file=sys.stderr, flush=True)


def load_models(args, dev):
    """(config, production model, reference model, tokenizer path or None, description)."""
    from ..engine.build import build_model
    from ..reference.model import ReferenceModel
    if args.synthetic:
        from ..checkpoint.schema import expected_specs, expert_format_of_config
        from ..checkpoint.synthetic import iter_synthetic_tensors, synthetic_config
        draft = args.draft == "dspark"
        cfg = synthetic_config(args.synthetic, args.layers, args.experts, draft="dspark" if draft else "mtp")
        efmt, wfmt, path = expert_format_of_config(cfg), "fp8", None
        specs = expected_specs(cfg, efmt, draft=draft)
        total = sum(sp.dtype.itemsize * torch.Size(sp.shape).numel() for sp in specs.values())
        _say(args, f"generating synthetic {args.synthetic} weights ({args.layers} layers, {cfg.n_routed_experts} "
                   f"experts) on {dev}")
        tensors = {}
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                  disable=args.quiet, desc="synthetic weights") as bar:
            for n, t in iter_synthetic_tensors(cfg, args.seed, dev, draft=draft):
                bar.update(t.numel() * t.element_size())
                tensors[n] = t
        where = f"synthetic {args.synthetic}, {args.layers} layers, {cfg.n_routed_experts} experts"
    else:
        from ..checkpoint.loader import load_checkpoint
        from ..models import resolve_model
        path = resolve_model(args.model)
        ck = load_checkpoint(path, progress=not args.quiet)
        cfg, efmt, wfmt = ck.config, ck.expert_format, ck.wo_a_format
        draft = ck.draft == "dspark"
        tensors = {n: t.to(dev) for n, t in ck.tensors.items() if draft or not n.startswith("mtp.")}
        where = path
    _say(args, "loading the weights into the production model")
    prod = build_model(dict(tensors=(cfg, efmt, wfmt, tensors), kernels=None if args.kernels else False,
                            kernel_check=args.kernel_check, draft="dspark" if draft else None), dev,
                       log=None if args.quiet else (lambda line: _say(args, line)))
    _say(args, "building the reference model (weights dequantised to fp32)")
    ref = ReferenceModel(cfg, tensors, numerics=args.numerics)
    return cfg, prod, ref, path, where


def _prompt(args, cfg, path, seed_offset=0, length=None):
    if args.prompt and not seed_offset:
        from ..tokenizer import load_tokenizer
        return [cfg.bos_token_id] + load_tokenizer(path).encode(args.prompt)
    g = torch.Generator().manual_seed(args.seed + 1000 * seed_offset)
    n = length or args.prompt_len
    return [cfg.bos_token_id] + torch.randint(3, min(cfg.vocab_size, 128000), (n - 1,), generator=g).tolist()


def teacher_forced(args, cfg, prod, ref, ids, dev, agg) -> tuple[list[int], list[float], dict]:
    """Module rows into ``agg``; returns the reference's greedy tokens after the prompt, their top-1
    margins and the production model's own checks."""
    from ..engine.kv_cache import CacheConfig, KVCache, PagedSequenceState
    max_len = len(ids) + args.steps + 1
    cache = KVCache(cfg, CacheConfig(max_num_seqs=3, num_blocks=-(-max_len // 256) + 1, device=str(dev),
                                     draft_layers=0 if prod.dspark is None else len(prod.dspark.blocks)))
    prod.attach_cache(cache, max_len)
    st = PagedSequenceState(cache, cache.allocate_slot(), cache.allocate_blocks(cache.blocks_needed(max_len)))
    rst = ref.new_state()
    force = (lambda tr: None) if args.free_running else Forcer
    checks = {"nonfinite": 0, "argmax_agree": 0, "first_eos": False}

    _say(args, f"teacher-forced: a prefill of {len(ids)} tokens, then {args.steps} decode steps")
    bar = tqdm(total=args.steps + 1, file=sys.stderr, disable=args.quiet, desc="teacher-forced steps")
    tok = torch.tensor(ids, device=dev)
    ref.trace = rtr = {}
    lr = ref.forward([(tok, rst)])[0]
    ctx = prod.prefill_context([(tok, st)])
    ptr = {}
    ctx.trace.trace, ctx.trace.force = ptr, force(rtr)
    lp = prod(ctx)[0]
    st.advance_to(len(ids))
    for k, v in compare(rtr, ptr).items():
        agg["prefill." + k].append(v)
    checks["first_eos"] = int(lp.argmax()) == cfg.eos_token_id
    greedy, margins = [int(lr.argmax())], [_margin(lr)]
    checks["argmax_agree"] += int(lp.argmax()) == greedy[0]
    checks["nonfinite"] += int((~torch.isfinite(lp)).sum())
    bar.update(1)
    for _ in range(args.steps):
        token, pos = greedy[-1], st.pos
        ref.trace = rtr = {}
        lr = ref.forward([(torch.tensor([token], device=dev), rst)])[0]
        bt = torch.full((1, prod.max_blocks), -1, dtype=torch.long)
        bt[0, :len(st.block_table)] = torch.tensor(st.block_table)
        ctx = prod.decode_context(torch.tensor([token], device=dev), torch.tensor([pos], device=dev),
                                  torch.tensor([st.slot], device=dev), bt.to(dev))
        ptr = {}
        ctx.trace.trace, ctx.trace.force = ptr, force(rtr)
        lp = prod(ctx)[0]
        st.advance_to(pos + 1)
        for k, v in compare(rtr, ptr).items():
            agg[k].append(v)
        greedy.append(int(lr.argmax()))
        margins.append(_margin(lr))
        checks["argmax_agree"] += int(lp.argmax()) == greedy[-1]
        checks["nonfinite"] += int((~torch.isfinite(lp)).sum())
        bar.update(1)
    bar.close()
    ref.trace = None
    st.release()
    return greedy, margins, checks


def through_engine(args, cfg, prod, path, ids, greedy, margins, dev) -> tuple[bool, list[str]]:
    """The validated prompt batched with ``--engine-batch - 1`` others, then alone, through the
    engine; (ok, report lines)."""
    from ..engine.llm_engine import EngineConfig, LLMEngine
    from ..engine.sampling_params import SamplingParams
    B = max(1, args.engine_batch)
    prompts = [ids] + [_prompt(args, cfg, path, i, max(2, len(ids) * (i + 1) // B + 3 * i)) for i in range(1, B)]
    n_new = args.steps + 1
    max_len = max(len(p) for p in prompts) + n_new + 1
    # no prefix caching: the alone run must compute the prompt again, not reuse the batched run's;
    # no warm-up: these few requests may compile what they need
    eng = LLMEngine(EngineConfig(model=path, max_num_seqs=B, max_num_batched_tokens=args.chunk,
                                 max_model_len=max_len, num_kv_blocks=B * -(-max_len // 256),
                                 device=str(dev), cuda_graphs=not args.enforce_eager, log=False,
                                 enable_prefix_caching=False, warmup=False,
                                 speculative_config={"method": "dspark"} if prod.dspark is not None else None),
                        prebuilt=prod)
    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, logprobs=0)

    def run(batch, tag):
        for i, p in enumerate(batch):
            eng.add_request(f"{tag}{i}", {"prompt_token_ids": p}, sp)
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0]
        return [outs[f"{tag}{i}"] for i in range(len(batch))]

    lines, ok = [], True
    _say(args, f"through the engine: the prompt in a batch of {B}, then alone, {n_new} tokens each")
    batched = run(prompts, "batch-")
    alone = run([ids], "alone-")[0]
    for name, out in ((f"batch of {B}", batched[0]), ("alone", alone)):
        toks = list(out.token_ids)
        # equal tokens keep the contexts equal; the first different one ends the comparison, and
        # is a failure unless the reference's top-1 margin there is below --margin (a near-tie)
        same, bad = 0, None
        for s, (t, g, m) in enumerate(zip(toks, greedy, margins)):
            if t != g:
                bad = s
                break
            same += 1
        if bad is not None and margins[bad] >= args.margin:
            ok = False
            lines.append(f"engine ({name}): token {bad} is {toks[bad]}, the reference's greedy token is "
                         f"{greedy[bad]} (top-1 margin {margins[bad]:.3f} >= {args.margin})  <-- diverged")
        else:
            tie = "" if bad is None else f", then a near-tie (margin {margins[bad]:.3f}) ends the comparison"
            lines.append(f"engine ({name}): greedy tokens = the reference's on {same}/{len(toks)} steps{tie}")
    for i, out in enumerate(batched + [alone]):
        lps = [next(iter(d.values())).logprob for d in (out.logprobs or [])]
        first_eos = bool(out.token_ids) and out.token_ids[0] == cfg.eos_token_id
        nonfinite = sum(1 for v in lps if not torch.isfinite(torch.tensor(v)))
        if first_eos or nonfinite or out.error:
            ok = False
            lines.append(f"engine sequence {i}: first token EOS {first_eos}, non-finite log-probs {nonfinite}, "
                         f"error {out.error!r}  <-- diverged")
    spec = "" if eng.spec is None else f"; speculative decoding: {eng.spec.describe()}, " \
        f"{eng.stats['spec_num_accepted_tokens']}/{eng.stats['spec_num_draft_tokens']} drafts accepted"
    lines.append(f"engine: {len(batched) + 1} sequences ({eng.backend_name}{spec}); first token EOS / non-finite "
                 f"log-probs: {'none' if ok else 'see above'}")
    return ok, lines


def check_dspark(args, cfg, prod, ref, ids, dev, agg) -> tuple[bool, list[str]]:
    """Part 3 of the module doc: module rows into ``agg``; (tokens and confidences agree, report lines)."""
    from ..formats.kv_entry import read_kv_entries
    from ..formats.paging import WINDOW, WINDOW_PAGE
    from ..model.deepseek_v4 import Trace
    _say(args, "DSpark draft: the reference target's features of the prompt into both drafts' rings, one block")
    rst = ref.new_state()
    anchor = int(ref.forward([(torch.tensor(ids, device=dev), rst)], capture=True)[0].argmax())
    feats, n = rst.last_features, len(ids)
    slot = prod.cache.allocate_slot()
    prod.dspark_extend([(slot, 0, feats)])
    ds = ref.dspark.new_state()
    ref.dspark.extend(ds, feats, 0)
    pos = torch.arange(max(0, n - WINDOW), n, device=dev)
    for s, (b, ring) in enumerate(zip(prod.dspark.blocks, ds.rings)):
        got = read_kv_entries(b.attn.lc.window, slot * WINDOW + pos % WINDOW, WINDOW_PAGE)
        agg[f"draft.ring{s}"].append(compare({"r": ring.keys()[0][pos % WINDOW]}, {"r": got})["r"])
    rtr = {}
    for st in ref.dspark.stages:
        st.block.attn.trace = rtr
    B = cfg.dspark_block_size
    try:
        want = ref.dspark.draft(ds, anchor)
    finally:
        for st in ref.dspark.stages:
            st.block.attn.trace = None
    rtr["dspark.hc_head"], rtr["dspark.logits"] = want.hidden, want.logits
    tr, ptr = Trace(), {}
    tr.trace, tr.force = ptr, (lambda name, t: None) if args.free_running else Forcer(rtr)
    out = prod.dspark_draft(torch.tensor([slot], device=dev), torch.tensor([anchor], device=dev),
                            torch.tensor([n], device=dev), B, confidence=True, trace=tr)
    prod.cache.free_slot(slot)
    for k, v in compare(rtr, ptr).items():
        agg["draft." + k].append(v)
    toks, wtoks = out["tokens"][0].tolist(), want.tokens.tolist()
    conf = out["confidence_logits"][0].float().cpu()
    cerr = float((conf - want.confidence_logits.float().cpu()).abs().max())
    ok = toks == wtoks and cerr < 0.05 * (1 + float(want.confidence_logits.abs().max()))
    return ok, [f"DSpark draft of one block after the prompt: production {toks}, reference {wtoks}; "
                f"confidence logits max error {cerr:.4g} -> {'OK' if ok else 'DIFFERENT'}"]


def run(args) -> int:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    cfg, prod, ref, path, where = load_models(args, dev)
    print(f"dsv4 validate: {where} on {dev}; production model: {prod.ops.describe()}; reference numerics "
          f"{args.numerics}; loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    ids = _prompt(args, cfg, path)
    agg = defaultdict(list)
    greedy, margins, checks = teacher_forced(args, cfg, prod, ref, ids, dev, agg)
    draft_ok, draft_lines = True, []
    if prod.dspark is not None:
        draft_ok, draft_lines = check_dspark(args, cfg, prod, ref, ids, dev, agg)

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
    print(f"{'module':<28} {'prefill / min over ' + str(args.steps) + ' steps':<40} flag")
    for k, txt, bad in rows:
        print(f"{k:<28} {txt:<40} {'<-- diverged' if bad else ''}")
    ok = (worst_cos >= THRESH_COS and worst_topk >= THRESH_TOPK and not checks["nonfinite"]
          and not checks["first_eos"] and not any(bad for *_x, bad in rows))
    print(f"teacher-forced: greedy agreement {checks['argmax_agree']}/{args.steps + 1}; first token EOS: "
          f"{checks['first_eos']}; NaN/inf logits: {checks['nonfinite']}")
    for line in draft_lines:
        print(line)
    ok = ok and draft_ok
    if not args.no_engine:
        eok, lines = through_engine(args, cfg, prod, path, ids, greedy, margins, dev)
        for line in lines:
            print(line)
        ok = ok and eok
    print(f"RESULT: {'OK' if ok else 'DIVERGED'} (worst module cos {worst_cos:.6f} >= {THRESH_COS}, "
          f"worst top-k overlap {worst_topk:.4f} >= {THRESH_TOPK})")
    return 0 if ok else 1


def add_parser(sub) -> None:
    v = sub.add_parser("validate", help="the production model vs the reference, per layer and module, and "
                                        "through the engine")
    v.add_argument("model", nargs="?", default=None, help="checkpoint dir (default: the embedded tiny model)")
    v.add_argument("--synthetic", choices=["flash", "pro"], default=None, help="random weights at the preset's real shapes instead of a checkpoint")
    v.add_argument("--layers", type=int, default=4, help='layers of a --synthetic model (default 4)')
    v.add_argument("--experts", type=int, default=16, help="routed experts of a synthetic model")
    v.add_argument("--draft", choices=["none", "dspark"], default="none",
                   help="a synthetic model with the DSpark draft of the current releases, validated too "
                        "(a checkpoint's DSpark draft is always validated)")
    v.add_argument("--prompt", default=None, help='prompt text (default: random token ids)')
    v.add_argument("--prompt-len", type=int, default=300, help="random prompt length when no --prompt")
    v.add_argument("--steps", type=int, default=8, help='decode steps to compare after the prefill (default 8)')
    v.add_argument("--no-kernels", dest="kernels", action="store_false",
                   help="the production model on its torch twins even on a GPU")
    v.add_argument("--kernel-check", choices=["fast", "full", "off"], default="fast",
                   help="self-check the production model's kernels against their twins first; an op that fails "
                        "falls back (default fast)")
    v.add_argument("--numerics", choices=["official", "invariant"], default="official",
                   help="the reference's numerics")
    v.add_argument("--device", default=None, help='cpu or cuda (default: cuda if available)')
    v.add_argument("--seed", type=int, default=0, help='seed of the random prompt and synthetic weights (default 0)')
    v.add_argument("--free-running", action="store_true",
                   help="let the production model carry its own values downstream (errors then accumulate)")
    v.add_argument("--no-engine", action="store_true", help="skip the run through the engine")
    v.add_argument("--engine-batch", type=int, default=4, help="sequences in the engine's batch")
    v.add_argument("--chunk", type=int, default=512, help="the engine's max_num_batched_tokens (prefill chunk)")
    v.add_argument("--margin", type=float, default=0.5,
                   help="engine tokens must equal the reference's greedy ones while its top-1 margin is >= this")
    v.add_argument("--enforce-eager", action="store_true", help="the engine without CUDA graphs")
    v.add_argument("-q", "--quiet", action="store_true", help='no progress on stderr')
    v.set_defaults(fn=run)
