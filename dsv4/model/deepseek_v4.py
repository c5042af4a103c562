"""The production DeepSeek-V4 model: native checkpoint weights, one forward for prefill and decode.

``DeepseekV4(cfg, ...)`` allocates every weight once in the checkpoint's own format on its device
(FP8 codes + scales, packed FP4 + scales, bf16 / fp32 where the checkpoint has them; see
``dsv4.layers``) and ``load(reader)`` streams the checkpoint into it tensor by tensor through
per-parameter loaders. ``forward(ctx)`` runs one step over a per-step context built by the engine's
runner: a ``DecodeContext`` (a fixed number of new tokens per sequence: 1, or K + 1 for a
speculative verify step; fixed shapes, CUDA-graph capturable) or a ``PrefillContext`` (chunks of any
length of any sequences). Both go through the same layer body
(mHC pre -> RMSNorm -> attention -> mHC post -> mHC pre -> RMSNorm -> MoE -> mHC post) and the same
attention orchestration; every op is called through the op table (``dsv4.ops``): kernels on a GPU,
torch twins on a CPU.

The model holds no reference objects: ``dsv4.reference`` is the oracle it is tested against.
The checkpoint's draft is loaded when speculative decoding asks for it: the April MTP block
(``mtp.0.*``, ``draft='mtp'``, ``mtp_forward``) or the DSpark stages (``mtp.0-2.*``, ``draft='dspark'``,
``model.dspark``: ``dspark_extend`` / ``dspark_draft``); otherwise no draft weight is read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, rope_frequencies
from ..formats.decode_plan import TABLE_NEG, MetaPlan, rope_table
from ..formats.paging import BLOCK_TOKENS, INDEX_PAGE, WINDOW
from ..layers.attention import Attention, Rope
from ..layers.linear import Bf16Linear, Fp8Linear, copy_into, weight_bytes
from ..layers.moe import MoE
from ..ops import Ops
from ..parallel import Group, default_group


class HyperConnection(nn.Module):
    """mHC parameters of one site (spec §7): fn [(2+hc)*hc, hc*d], base, scale (fp32 as stored)."""

    def __init__(self, cfg, n_mix: int, device=None):
        super().__init__()
        hc, d = cfg.hc_mult, cfg.hidden_size
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("fn", torch.empty(n_mix, hc * d, **f32))
        self.register_buffer("base", torch.empty(n_mix, **f32))
        self.register_buffer("scale", torch.empty(3 if n_mix > hc else 1, **f32))
        self.iters, self.hc_eps, self.rms_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps

    def loaders(self, p: str):
        return {p + "fn": copy_into(self.fn, p + "fn"), p + "base": copy_into(self.base, p + "base"),
                p + "scale": copy_into(self.scale, p + "scale")}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ops, ropes, expert_fmt: str, wo_a_fmt: str, device=None,
                 group=None, prefix: str | None = None, attn_cls=Attention):
        """``prefix``: checkpoint prefix of the block (default ``layers.{layer_id}.``); ``attn_cls``: the
        attention (a DSpark stage's reads its ring and draft block, ``model.dspark``)."""
        super().__init__()
        self.layer_id, self.ops, self.eps = layer_id, ops, cfg.rms_norm_eps
        self.prefix = prefix or f"layers.{layer_id}."
        hc = cfg.hc_mult
        self.hc_attn = HyperConnection(cfg, (2 + hc) * hc, device)
        self.hc_ffn = HyperConnection(cfg, (2 + hc) * hc, device)
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("attn_norm", torch.empty(cfg.hidden_size, **f32))
        self.register_buffer("ffn_norm", torch.empty(cfg.hidden_size, **f32))
        self.attn = attn_cls(cfg, layer_id, ops, ropes, wo_a_fmt, device, group, self.prefix)
        hash_layer = layer_id < cfg.num_hidden_layers and cfg.is_hash_layer(layer_id)
        self.moe = MoE(cfg, layer_id, expert_fmt, hash_layer, ops, device, group)

    def loaders(self):
        p = self.prefix
        out = {p + "attn_norm.weight": copy_into(self.attn_norm, p + "attn_norm.weight"),
               p + "ffn_norm.weight": copy_into(self.ffn_norm, p + "ffn_norm.weight")}
        out.update(self.hc_attn.loaders(p + "hc_attn_"))
        out.update(self.hc_ffn.loaders(p + "hc_ffn_"))
        out.update(self.attn.loaders())
        out.update(self.moe.loaders(p + "ffn."))
        return out

    def _pre(self, hc, h):
        return self.ops.hc_pre(h, hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps, hc.rms_eps)

    def _boundary(self, hc, norm, h, pending):
        """One mHC site: the pending hc_post (y, post, comb) of the site before (None: none) applied to
        the streams h, this site's hc_pre and its RMSNorm -> (streams, normed input, post, comb)."""
        y, post, comb = pending if pending is not None else (None, None, None)
        return self.ops.hc_post_pre(y, h, post, comb, hc.fn, hc.base, hc.scale, norm, hc.iters, hc.hc_eps,
                                    hc.rms_eps, self.eps)

    def run(self, h, ctx, pending=None):
        """The block with its hc_posts moved into the next site's ``hc_post_pre`` (one launch per site at
        decode): streams h [T, hc, d] and the block before's pending hc_post (y, post, comb) ->
        (streams, this block's own pending hc_post). ``forward`` is ``run`` + that hc_post; no trace
        points (``fused(ctx)``)."""
        h, a, post, comb = self._boundary(self.hc_attn, self.attn_norm, h, pending)
        a = self.attn(a, ctx)
        h, f, post, comb = self._boundary(self.hc_ffn, self.ffn_norm, h, (a, post, comb))
        return h, (self.moe(f, ctx.ids), post, comb)

    def forward(self, h, ctx):
        """Residual streams h [T, hc, d] -> [T, hc, d]."""
        if fused(ctx):
            h, (f, post, comb) = self.run(h, ctx)
            return self.ops.hc_post(f, h, post, comb)
        ops, i, t = self.ops, self.layer_id, ctx.trace
        a, post, comb = self._pre(self.hc_attn, h)
        a = t(f"L{i}.hc_pre", a)
        a = self.attn(ops.rms_norm(a, self.attn_norm, self.eps), ctx)
        h = ops.hc_post(a, h, post, comb)
        f, post, comb = self._pre(self.hc_ffn, h)
        f = t(f"L{i}.moe", self.moe(ops.rms_norm(f, self.ffn_norm, self.eps), ctx.ids))
        return t(f"L{i}.hc_post", ops.hc_post(f, h, post, comb))


FUSED_SITES = True     # False: every forward on the per-op blocks (benchmarks/decode_step.py --mhc-sites A/B)


def fused(ctx) -> bool:
    """Whether a forward may run its blocks through ``Block.run`` (the hc_post / hc_pre / RMSNorm sites
    fused): not while ``dsv4 validate`` records or forces the blocks' trace points."""
    return FUSED_SITES and ctx.trace.trace is None and ctx.trace.force is None


class MTPLayer(nn.Module):
    """The April MTP block (spec §9, checkpoint ``mtp.0.*``): ``e_proj`` / ``h_proj`` (FP8),
    ``enorm`` / ``hnorm`` / ``norm``, its own ``hc_head`` and a full block (layer id
    ``num_hidden_layers``: sliding window only, score-routed), the target's embedding and head.
    Its window lives in the KV cache's draft layer (``KVCache.draft_layers[0]``)."""

    def __init__(self, cfg: ModelConfig, ops, ropes, expert_fmt: str, wo_a_fmt: str, device=None, group=None):
        super().__init__()
        d, p = cfg.hidden_size, "mtp.0."
        self.ops, self.eps, self.hc, self.d = ops, cfg.rms_norm_eps, cfg.hc_mult, d
        self.e_proj = Fp8Linear(d, [(p + "e_proj", d)], ops, device)
        self.h_proj = Fp8Linear(d, [(p + "h_proj", d)], ops, device)
        f32 = dict(dtype=torch.float32, device=device)
        for n in ("enorm", "hnorm", "norm"):
            self.register_buffer(n, torch.empty(d, **f32))
        self.hc_head = HyperConnection(cfg, cfg.hc_mult, device)
        self.block = Block(cfg, cfg.num_hidden_layers, ops, ropes, expert_fmt, wo_a_fmt, device, group, prefix=p)

    def loaders(self):
        p = "mtp.0."
        out = {p + n + ".weight": copy_into(getattr(self, n), p + n + ".weight") for n in ("enorm", "hnorm", "norm")}
        out.update(self.e_proj.loaders())
        out.update(self.h_proj.loaders())
        out.update(self.hc_head.loaders(p + "hc_head_"))
        out.update(self.block.loaders())
        return out

    def forward(self, emb: torch.Tensor, h_main: torch.Tensor, ctx) -> torch.Tensor:
        """Token embeddings ``emb`` [T, d] and the residual streams ``h_main`` [T, hc, d] they follow
        -> the block's output streams [T, hc, d]: e = enorm(emb), h = hnorm(h_main) per stream,
        x = e_proj(e) broadcast to the streams + h_proj(h) (a bf16 sum), then the block."""
        ops, T = self.ops, emb.shape[0]
        e = ops.rms_norm(emb, self.enorm, self.eps)
        h = ops.rms_norm(h_main.reshape(T * self.hc, self.d), self.hnorm, self.eps)
        x = ops.linear(self.e_proj, e).unsqueeze(1) + ops.linear(self.h_proj, h).view(T, self.hc, self.d)
        return self.block(x, ctx)


# ---------------------------------------------------------------------------------------------
# per-step contexts (built by the engine's runner)

class Trace:
    """Trace points for ``dsv4 validate``: record each named value; continue with a forced one
    where given (module-by-module comparison on identical inputs). ``force`` is a dict
    {name: value} or a callable ``(name, own value) -> value or None`` (None: keep the own)."""
    trace: dict | None = None
    force: object = None

    @property
    def trace_on(self) -> bool:
        return self.trace is not None

    def __call__(self, name, t):
        if self.trace is not None:
            self.trace[name] = t.detach().clone()
        if self.force is not None:
            f = self.force(name, t) if callable(self.force) else self.force.get(name)
            if f is not None:
                return f.to(t.dtype)
        return t


@dataclass
class Segment:
    """One prefill chunk: rows [r0, r1) of the batch, positions p0 .. end-1 of the sequence in
    ``slot`` whose block table is ``bt`` [1, max_blocks] (int64, -1 padded). ``snaps``
    [(block boundary b, snapshot)], p0 < b <= end: prefix-cache snapshots of the sequence's state
    at b to take from the chunk (``engine.kv_cache``)."""
    r0: int
    n: int
    p0: int
    slot: int
    bt: torch.Tensor
    snaps: list = field(default_factory=list)

    @property
    def r1(self) -> int:
        return self.r0 + self.n

    @property
    def end(self) -> int:
        return self.p0 + self.n

    @property
    def w_prev(self) -> int:
        return min(self.p0, WINDOW)


@dataclass
class PrefillContext:
    ids: torch.Tensor                  # int64 [T]
    pos: torch.Tensor                  # int64 [T]
    segs: list[Segment]
    max_blocks: int
    scratch_block: int
    logit_rows: torch.Tensor           # rows whose logits are returned
    trace: Trace = field(default_factory=Trace)
    decode = False
    _rope: dict = field(default_factory=dict)
    # prompt scoring (prompt logprobs): [(rows, next-token ids, k)]; the forward fills ``scored``
    # with (logprob of the next token [n], its rank [n], top-k logprobs [n, k], their ids [n, k])
    score: list = field(default_factory=list)
    scored: list = field(default_factory=list)

    tables: object = None              # DeepseekV4.rope_rows
    keep_hidden: bool = False          # set: the forward leaves the final residual streams [T, hc, d] in ``hidden``
    hidden: torch.Tensor | None = None

    def rope_rows(self, rope: Rope):
        """(cos, sin) fp32 [T, 32] of every row's position (once per rope and step)."""
        key = id(rope)
        if key not in self._rope:
            self._rope[key] = self.tables(rope, self.pos)
        return self._rope[key]


@dataclass
class DecodeContext:
    """``rows`` tokens per sequence at consecutive positions (1: a plain decode step; K+1: a
    speculative verify step), T = rows * B rows laid out j-major: row j of sequence b is row j*B + b,
    at position pos_b + j, with the sequence's slot and block table. Every per-row field has T rows."""
    ids: torch.Tensor                  # int64 [T]: the new tokens
    pos: torch.Tensor                  # int64 [T]
    slots: torch.Tensor                # int64 [T]
    bt: torch.Tensor                   # int64 [T, max_blocks], -1 padded
    max_blocks: int
    rows: int = 1
    meta: dict | None = None           # the step's index vectors and RoPE rows (``DeepseekV4._meta``)
    trace: Trace = field(default_factory=Trace)
    keep_hidden: bool = False
    hidden: torch.Tensor | None = None
    decode = True


def prefill_context(chunks, max_blocks: int, scratch_block: int, device, tables, all_logits=False,
                    snaps: list | None = None) -> PrefillContext:
    """chunks: [(token ids [n], state with .pos, .slot, .block_table)] -> the step's context.
    ``all_logits``: True for the logits of every row, or per chunk (a speculative verify chunk
    needs every row's, a prefill chunk its last row's); ``snaps``: each chunk's ``Segment.snaps``."""
    ids, segs, r0 = [], [], 0
    for k, (tok, st) in enumerate(chunks):
        n = tok.numel()
        if n == 0:
            raise ValueError("every chunk needs at least one token")
        if -(-(st.pos + n) // BLOCK_TOKENS) > len(st.block_table):
            raise ValueError(f"sequence in slot {st.slot}: block table too short for {st.pos + n} tokens")
        bt = torch.full((1, max_blocks), -1, dtype=torch.long)
        bt[0, :len(st.block_table)] = torch.tensor(st.block_table, dtype=torch.long)
        sn = list(snaps[k]) if snaps else []
        for b, _t in sn:
            if not (st.pos < b <= st.pos + n and b % BLOCK_TOKENS == 0):
                raise ValueError(f"sequence in slot {st.slot}: a snapshot at {b} is not a block boundary in "
                                 f"({st.pos}, {st.pos + n}]")
        segs.append(Segment(r0, n, st.pos, st.slot, bt.to(device), sn))
        ids.append(tok.reshape(-1))
        r0 += n
    ids = torch.cat(ids).to(device=device, dtype=torch.long)
    pos = torch.cat([torch.arange(s.p0, s.end) for s in segs]).to(device)
    every = [all_logits] * len(segs) if isinstance(all_logits, bool) else list(all_logits)
    rows = torch.tensor([r for s, e in zip(segs, every) for r in (range(s.r0, s.r1) if e else [s.r1 - 1])])
    return PrefillContext(ids, pos, segs, max_blocks, scratch_block, rows.to(device), tables=tables)


# ---------------------------------------------------------------------------------------------
SCORE_ROWS = 256          # prompt scoring: head rows per block ([256, 129280] fp32 = 132 MB)


class DeepseekV4(nn.Module):
    """``group`` (``dsv4.parallel.Group``, default ``parallel.default_group()``): tensor parallelism over its ranks, the
    official layout (``layers.attention.Attention``, ``layers.moe.MoE``): q heads and routed experts
    split, the head column-parallel over the vocabulary with its logits all-gathered; the embedding,
    mHC, norms, KV head, compressors, indexer and caches replicated. Every rank runs the same
    forward on the same inputs, on the kernels or on the twins (``ops``)."""

    def __init__(self, cfg: ModelConfig, expert_format: str = "mxfp4", wo_a_format: str = "fp8",
                 device="cpu", ops: Ops | None = None, group: Group | None = None, draft: str | None = None,
                 draft_expert_format: str | None = None):
        """``draft``: None (the draft's weights are not loaded), 'mtp' (the April MTP block, ``self.mtp``)
        or 'dspark' (the DSpark stages, ``self.dspark``); the draft's routed experts are in
        ``draft_expert_format`` (NVIDIA's NVFP4 ports keep them MXFP4)."""
        super().__init__()
        self.cfg, self.device = cfg, torch.device(device)
        self.ops = ops or Ops(self.device)
        self.group = group or default_group()
        self.expert_format, self.wo_a_format = expert_format, wo_a_format
        self.ropes = {r: Rope(rope_frequencies(cfg, r).to(self.device)) for r in sorted(set(cfg.compress_ratios))}
        self.register_buffer("embed", torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16,
                                                  device=self.device))
        self.layers = nn.ModuleList(Block(cfg, i, self.ops, self.ropes, expert_format, wo_a_format, self.device,
                                          self.group) for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperConnection(cfg, cfg.hc_mult, self.device)
        self.register_buffer("norm", torch.empty(cfg.hidden_size, dtype=torch.float32, device=self.device))
        self.head = Bf16Linear(cfg.hidden_size, [("head", cfg.vocab_size)], self.ops, "fp32", self.device,
                               self.group.split("col"))
        if draft not in (None, "mtp", "dspark"):
            raise ValueError(f"draft must be None, 'mtp' or 'dspark', got {draft!r}")
        self.mtp = self.dspark = None
        if draft == "mtp":
            self.mtp = MTPLayer(cfg, self.ops, self.ropes, draft_expert_format or expert_format, wo_a_format,
                                self.device, self.group)
        elif draft == "dspark":
            from .dspark import DSparkDraft
            self.dspark = DSparkDraft(cfg, self.ops, self.ropes, draft_expert_format or expert_format, wo_a_format,
                                      self.device, self.group)
        self.draft = draft
        self.cache = None

    @property
    def graph_safe(self) -> bool:
        """The decode step can be captured in a CUDA graph: every op on a kernel (the twins synchronise
        with the host; FP8 routed experts have no kernel and run their twin)."""
        return self.ops.graph_safe and self.expert_format != "fp8"

    # ------------------------------------------------------------------ weights
    def loaders(self):
        out = {"embed.weight": copy_into(self.embed, "embed.weight"), "norm.weight": copy_into(self.norm, "norm.weight")}
        for b in self.layers:
            out.update(b.loaders())
        out.update(self.hc_head.loaders("hc_head_"))
        out.update(self.head.loaders())
        for d in (self.mtp, self.dspark):
            if d is not None:
                out.update(d.loaders())
        return out

    @classmethod
    def from_checkpoint(cls, path_or_reader, device="cpu", ops: Ops | None = None, progress: bool = False,
                        group: Group | None = None, draft: str | None = None):
        """Validate a checkpoint directory, allocate the model on ``device`` and stream the weights
        in (host memory: one checkpoint tensor at a time on top of the model itself on CPU).
        ``draft`` ('mtp' | 'dspark', the checkpoint's) loads its draft too; otherwise ``mtp.*`` is left
        unread."""
        from ..checkpoint.loader import open_checkpoint
        r = open_checkpoint(path_or_reader) if isinstance(path_or_reader, str) else path_or_reader
        if draft is not None and draft != r.draft:
            raise ValueError(f"{r.path}: the checkpoint's draft is {r.describe_draft()}, not {draft!r}")
        model = cls(r.config, r.expert_format, r.wo_a_format, device, ops, group, draft,
                    r.expert_formats.get("mtp.0.") if draft else None)
        other = model.foreign_names()               # other ranks' experts: never read
        parts = model.split_parts()                 # split linears: only this rank's slice is read
        skip = (lambda n: n in other) if draft else (lambda n: n.startswith("mtp.") or n in other)
        model.load(r.tensors(progress=progress, skip=skip, parts=parts), presliced=set(parts))
        return model

    def split_parts(self) -> dict:
        """{checkpoint tensor: (rows, cols)} of the tensors this rank holds a slice of (tensor
        parallelism); empty on one rank."""
        if self.group.world == 1:
            return {}
        return {n: fn.part for n, fn in self.loaders().items()
                if getattr(fn, "part", None) is not None and fn.part != (None, None)}

    def foreign_names(self) -> set[str]:
        """Checkpoint tensors that belong to other ranks (expert parallelism); empty on one rank."""
        from ..layers.moe import foreign
        return {n for n, fn in self.loaders().items() if fn is foreign}

    @torch.no_grad()
    def load(self, tensors, presliced=()) -> None:
        """Copy ``(canonical name, tensor)`` pairs into the model; every weight must come exactly
        once (a missing, unexpected or repeated name is an error naming it). Names in
        ``presliced`` come as this rank's slice only (``split_parts``), the others whole."""
        loaders = self.loaders()
        seen = set()
        for name, t in tensors:
            fn = loaders.get(name)
            if fn is None:
                raise ValueError(f"unexpected checkpoint tensor '{name}' for this model")
            if name in seen:
                raise ValueError(f"checkpoint tensor '{name}' given twice")
            (fn.presliced if name in presliced else fn)(t)
            seen.add(name)
        from ..layers.moe import foreign
        missing = [n for n, fn in loaders.items() if n not in seen and fn is not foreign]
        if missing:
            raise ValueError(f"{len(missing)} model tensor(s) were not loaded, e.g. '{missing[0]}'")

    def weight_bytes(self) -> int:
        return weight_bytes(self)

    # ------------------------------------------------------------------ cache
    def attach_cache(self, cache, max_model_len: int) -> None:
        """Bind the paged KV cache (``engine.kv_cache.KVCache``): its layer pools, a private scratch
        slot and block (writes of padding / non-completing rows land there) and the decode step's
        index / RoPE plan for positions below ``max_model_len``."""
        self.cache = cache
        for b, lc in zip(self.layers, cache.layers):
            b.attn.lc = lc
        if self.mtp is not None:
            if not cache.draft_layers:
                raise ValueError("the model has an MTP block but the KV cache has no draft layer "
                                 "(CacheConfig.draft_layers=1)")
            self.mtp.block.attn.lc = cache.draft_layers[0]
        if self.dspark is not None:
            if len(cache.draft_layers) != len(self.dspark.blocks):
                raise ValueError(f"the model's DSpark draft has {len(self.dspark.blocks)} stages but the KV cache has "
                                 f"{len(cache.draft_layers)} draft layers (CacheConfig.draft_layers)")
            for b, lc in zip(self.dspark.blocks, cache.draft_layers):
                b.attn.lc = lc
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // BLOCK_TOKENS)
        self.scratch_slot = cache.allocate_slot()
        self.scratch_block = cache.reserve_block()
        self._plan_meta(max_model_len)

    def _plan_meta(self, max_model_len):
        """The decode step's per-step values from one ``decode_meta`` call: RoPE rows of every
        layer's and compressor's rope (tables computed once: row p equals ``rope(p)``) and the index
        vectors of the window, compressed-cache writes and HCA reads."""
        uniq, rope_keys, rope_reqs = {}, [], []
        drafts = [self.mtp.block] if self.mtp is not None else list(self.dspark.blocks) if self.dspark is not None else []
        for blk in list(self.layers) + drafts:
            at = blk.attn
            reqs = [("attn", at.rope, 0)] + [(("comp", c.ratio), c.rope, 1 - c.ratio)
                                             for c in (at.compressor, at.index_comp) if c is not None]
            for key, rope, off in reqs:
                if (key, id(rope)) in rope_keys:
                    continue
                uniq.setdefault(id(rope), (len(uniq), rope))
                rope_keys.append((key, id(rope)))
                rope_reqs.append((uniq[id(rope)][0], off))
        self._table_of = {k: i for k, (i, _r) in uniq.items()}
        # a DSpark block always has B rows: the last anchor (position max_model_len - 1) reaches B - 1 past it
        n = max_model_len + (self.dspark.block_size if self.dspark is not None else 0)
        self._rope_tables = torch.empty(len(uniq), TABLE_NEG + n, 64, device=self.device)
        for i, rope in uniq.values():
            self._rope_tables[i] = rope_table(rope, n)
        write_keys, write_reqs, vis_keys, vis_reqs = [], [], [], []
        for blk, lc in zip(self.layers, self.cache.layers):
            r, epb = blk.attn.ratio, lc.entries_per_block
            if r and ("wid", r, epb) not in write_keys:
                write_keys.append(("wid", r, epb))
                write_reqs.append((r, epb))
            if r and r != 4 and ("visible", r, epb) not in vis_keys:
                vis_keys.append(("visible", r, epb))
                vis_reqs.append((r, epb))
            if r == 4 and "index_wid" not in write_keys:
                write_keys.append("index_wid")
                write_reqs.append((4, INDEX_PAGE))
        self._meta_keys = (rope_keys, write_keys, vis_keys)
        self._meta_plan = MetaPlan(rope_reqs, write_reqs, vis_reqs, self.max_blocks, self.device)

    def _meta(self, ctx: DecodeContext) -> dict:
        m = self.ops.decode_meta(ctx.pos, ctx.slots, ctx.bt, self._rope_tables, self._meta_plan, self.scratch_block)
        rope_keys, write_keys, vis_keys = self._meta_keys
        memo = {k: (None, c, s) for k, (c, s) in zip(rope_keys, m.rope)}
        memo.update(zip(write_keys, m.write_ids))
        memo.update(zip(vis_keys, m.visible))
        memo.update(win_slot=m.win_slot, widx32=m.widx, index_nvalid=m.n_valid)
        return memo

    def decode_context(self, tokens, pos, slots, bt, rows: int = 1) -> DecodeContext:
        """``tokens`` [rows * B] j-major (``DecodeContext``); ``pos`` (each sequence's first row),
        ``slots`` [B] and ``bt`` [B, max_blocks] per sequence, spread over its rows on the device
        (no host synchronisation: capturable)."""
        if rows > 1:
            B = pos.shape[0]
            pos = (pos[None, :] + torch.arange(rows, device=pos.device)[:, None]).reshape(rows * B)
            slots, bt = slots.repeat(rows), bt.repeat(rows, 1)
        return DecodeContext(tokens, pos, slots, bt, self.max_blocks, rows)

    def prefill_context(self, chunks, all_logits=False, snaps: list | None = None) -> PrefillContext:
        return prefill_context(chunks, self.max_blocks, self.scratch_block, self.device, self.rope_rows, all_logits,
                               snaps)

    def rope_rows(self, rope: Rope, positions: torch.Tensor):
        """(cos, sin) fp32 [n, 32] of ``rope`` at ``positions`` from the tables the decode step reads:
        prefill and decode rotate a position by the same bits (computing them per call would not
        be: vectorised and scalar sin / cos differ in the last ulp)."""
        rows = self._rope_tables[self._table_of[id(rope)], TABLE_NEG + positions]
        return rows[:, :32].contiguous(), rows[:, 32:].contiguous()

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, ctx) -> torch.Tensor:
        """fp32 logits [rows, V]: every decode row, or a prefill's ``logit_rows``."""
        if ctx.decode:
            ctx.meta = self._meta(ctx)
        h = F.embedding(ctx.ids, self.embed).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        feats = {}
        capture = ctx.keep_hidden and self.dspark is not None
        run, pending = fused(ctx), None
        for blk in self.layers:
            target = capture and blk.layer_id in self.dspark.targets
            if run:
                # a block's last hc_post runs inside the next block's first site; applied here only
                # where the streams themselves are read (a DSpark target, after the last block)
                h, pending = blk.run(h, ctx, pending)
                if target:
                    h, pending = self.ops.hc_post(pending[0], h, pending[1], pending[2]), None
            else:
                h = blk(h, ctx)
            if target:
                # the DSpark target feature: block L's output averaged over its hc streams (model.dspark)
                feats[blk.layer_id] = h.float().mean(dim=1).to(torch.bfloat16)
        if pending is not None:
            h = self.ops.hc_post(pending[0], h, pending[1], pending[2])
        if ctx.keep_hidden:
            # what the drafter reads: the final residual streams [T, hc, d] (MTP), or the DSpark
            # feature [T, S*d] in dspark_target_layer_ids order
            ctx.hidden = torch.cat([feats[i] for i in self.dspark.targets], dim=-1) if capture else h
        if not ctx.decode:
            ctx.scored = [self._score(h, rows, nxt, k, ctx) for rows, nxt, k in ctx.score]
            h = h[ctx.logit_rows].contiguous()
        return self.head_logits(h, ctx)

    @torch.no_grad()
    def mtp_forward(self, ctx: "PrefillContext", h_main: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block over ``ctx``'s rows: ``ctx.ids`` are the tokens that follow the rows of
        ``h_main`` [T, hc, d] (the target's pre-hc_head residual streams, or a previous MTP step's
        output), at ``ctx``'s positions in the MTP block's window. Returns (fp32 logits of
        ``ctx.logit_rows`` [rows, V], the block's output streams [T, hc, d])."""
        if self.mtp is None:
            raise RuntimeError("the model was built without its MTP block (draft='mtp')")
        x = self.mtp(F.embedding(ctx.ids, self.embed), h_main, ctx)
        return self._mtp_logits(x[ctx.logit_rows].contiguous()), x

    def _mtp_logits(self, xs: torch.Tensor) -> torch.Tensor:
        """The MTP block's head over its output streams ``xs`` [rows, hc, d]: its own hc_head and norm,
        then the target's head -> fp32 logits [rows, V]."""
        ops, m = self.ops, self.mtp
        hh = m.hc_head
        y = ops.rms_norm(ops.hc_head(xs, hh.fn, hh.base, hh.scale, hh.hc_eps, hh.rms_eps), m.norm, self.cfg.rms_norm_eps)
        return self.head_fp32(y)

    @torch.no_grad()
    def mtp_decode(self, tokens, pos, slots, bt, rows: int, h_main: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block over ``rows`` rows per sequence through the decode step (``decode_context``:
        ``tokens`` and ``h_main`` [rows * B, hc, d] j-major, ``pos`` the first row's position per
        sequence in the MTP window). Returns (fp32 logits [B, V] of each sequence's last row, the
        block's output streams [rows * B, hc, d], j-major). No host synchronisation: capturable."""
        if self.mtp is None:
            raise RuntimeError("the model was built without its MTP block (draft='mtp')")
        ctx = self.decode_context(tokens, pos, slots, bt, rows)
        ctx.meta = self._meta(ctx)
        x = self.mtp(F.embedding(ctx.ids, self.embed), h_main, ctx)
        return self._mtp_logits(x[(rows - 1) * pos.shape[0]:].contiguous()), x

    @torch.no_grad()
    def dspark_extend(self, rows: list) -> None:
        """DSpark context rows into the stages' rings: ``rows`` [(slot, p0, features [n, S*d])], the
        target's features (``forward`` with ``keep_hidden``) of positions p0 .. p0+n-1 of the sequence
        in ``slot``; only each sequence's last 128 rows are computed (the ring keeps no more)."""
        if self.dspark is None:
            raise RuntimeError("the model was built without its DSpark draft (draft='dspark')")
        feats, slots, pos = [], [], []
        for slot, p0, f in rows:
            n = f.shape[0]
            keep = min(n, WINDOW)
            feats.append(f[n - keep:])
            pos.append(torch.arange(p0 + n - keep, p0 + n))
            slots.append(torch.full((keep,), slot, dtype=torch.long))
        if feats:
            self.dspark.extend(torch.cat(feats), torch.cat(slots).to(self.device), torch.cat(pos).to(self.device),
                               self.rope_rows)

    @torch.no_grad()
    def dspark_draft(self, slots: torch.Tensor, anchors: torch.Tensor, anchor_pos: torch.Tensor, n_tokens: int,
                     temperature: torch.Tensor | None = None, generator=None, confidence: bool = False,
                     trace=None) -> dict:
        """One DSpark draft call (``model.dspark``) for the sequences in ``slots`` [n] (device int64)
        with anchor tokens ``anchors`` [n] at positions ``anchor_pos`` [n]: their rings must hold every
        context position before the anchor (``dspark_extend``)."""
        if self.dspark is None:
            raise RuntimeError("the model was built without its DSpark draft (draft='dspark')")
        ctx = self.dspark.context(slots, anchors, anchor_pos, self.rope_rows, trace)
        return self.dspark(ctx, self.embed, self.head_fp32, n_tokens, temperature, generator, confidence)

    def head_fp32(self, y: torch.Tensor) -> torch.Tensor:
        """The head over normed rows ``y`` [rows, d] -> fp32 logits [rows, V] (all ranks' columns)."""
        return self.group.all_gather(self.ops.linear(self.head, y).float(), dim=-1)

    def _score(self, h, rows, nxt, k, ctx, block: int = SCORE_ROWS):
        """Log-probabilities of ``nxt`` after ``rows`` of a prefill and the top ``k``: the head in
        blocks of ``block`` rows, so a long chunk never holds its [T, vocab] fp32 logits."""
        parts = []
        for i in range(0, rows.numel(), block):
            lp = torch.log_softmax(self.head_logits(h[rows[i:i + block]].contiguous(), ctx), dim=-1)
            t = nxt[i:i + block].to(lp.device)
            tl = lp.gather(1, t[:, None]).squeeze(1)
            rank = (lp > tl[:, None]).sum(1) + 1
            top = lp.topk(k, dim=-1) if k else None
            parts.append((tl, rank, top.values if top else lp[:, :0], top.indices if top else t[:, None][:, :0]))
        return tuple(torch.cat([p[j] for p in parts]).cpu() for j in range(4))

    def head_logits(self, h, ctx) -> torch.Tensor:
        ops, hh = self.ops, self.hc_head
        y = ops.rms_norm(ops.hc_head(h, hh.fn, hh.base, hh.scale, hh.hc_eps, hh.rms_eps), self.norm,
                         self.cfg.rms_norm_eps)
        return ctx.trace("logits", self.head_fp32(y))

    def describe(self) -> str:
        gib = 2.0 ** 30
        return (f"model: {self.cfg.num_hidden_layers} layers, {self.cfg.n_routed_experts} experts "
                f"({self.expert_format}), weights {self.weight_bytes() / gib:.2f} GiB on {self.device}; "
                f"{self.ops.describe()}; decode CUDA graphs {'possible' if self.graph_safe else 'off'}"
                + (f"; rank {self.group.rank} of {self.group.world}"
                   f"{'' if self.group.active else ' (collectives skipped)'}" if self.group.pg is not None else ""))


class CudaGraphDecoder:
    """Captures the model's decode step once per (batch-size bucket, rows per sequence) and replays
    it (as vLLM and nano-vllm do): ``rows`` 1 for the plain step, K + 1 for a speculative verify
    step (``DecodeContext``). Each graph has its own static inputs, filled by one host-to-device copy
    each from the caller's (pinned) tensors:

    * ``inp`` int64 [3, bucket * rows]: row 0 the tokens, j-major over the bucket (token j of
      sequence b at j * bucket + b); rows 1 and 2 in their first ``bucket`` entries each sequence's
      first position and slot;
    * ``bt`` int64 [bucket, max_blocks]: the block tables, -1 padded.

    Padding sequences have the model's scratch slot, position 0, token 0 and an all -1 block table
    (``layout``). A replay returns views of the graph's static outputs: the fp32 logits of every row
    [bucket * rows, V] and the final residual streams [bucket * rows, hc, d], valid until the same
    graph is replayed again."""

    def __init__(self, model: DeepseekV4, max_num_seqs: int, rows=(1,), buckets=(1, 2, 4, 8, 16, 32, 64, 128)):
        self.model = model
        self.buckets = [b for b in buckets if b <= max_num_seqs] or [1]
        self.rows = sorted(set(rows))
        self.graphs = {}                 # (bucket, rows) -> (graph, inp, bt, logits, hidden)
        self.pool = None
        for r in reversed(self.rows):
            for b in reversed(self.buckets):
                self._capture(b, r)

    def bucket(self, n: int, rows: int = 1) -> int | None:
        """The captured bucket that takes ``n`` sequences of ``rows`` rows, or None (run eagerly)."""
        if rows not in self.rows:
            return None
        return next((b for b in self.buckets if b >= n), None)

    def layout(self, tokens: list[list[int]], pos: list[int], slots: list[int], bucket: int) -> list[list[int]]:
        """The three rows of ``inp`` (class doc), ``bucket * rows`` long each, for sequences with
        ``tokens`` (each ``rows`` long), first positions ``pos`` and ``slots``, padded to ``bucket``."""
        n, rows = len(tokens), len(tokens[0])
        pad, tail = bucket - n, [0] * (bucket * (rows - 1))
        ids = [t[j] for j in range(rows) for t in tokens + [[0] * rows] * pad]
        return [ids, list(pos) + [0] * pad + tail, list(slots) + [self.model.scratch_slot] * pad + tail]

    def _capture(self, b, rows):
        dev, m = self.model.device, self.model
        inp = torch.zeros(3, b * rows, dtype=torch.long, device=dev)
        inp[2].fill_(m.scratch_slot)
        bt = torch.full((b, m.max_blocks), -1, dtype=torch.long, device=dev)

        def run():
            ctx = m.decode_context(inp[0], inp[1, :b], inp[2, :b], bt, rows)
            ctx.keep_hidden = True
            return m(ctx), ctx

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):                       # warm up (Triton compiles, allocator settles)
                run()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out, ctx = run()
        self.pool = g.pool()
        self.graphs[(b, rows)] = (g, inp, bt, out, ctx.hidden)

    def replay(self, bucket: int, rows: int, inp: torch.Tensor, bt: torch.Tensor):
        """Run graph (bucket, rows) on ``inp`` [3, bucket * rows] and ``bt`` [bucket, max_blocks]
        (class doc; pinned host tensors are copied without blocking) -> (logits, streams)."""
        g, s_inp, s_bt, out, hidden = self.graphs[(bucket, rows)]
        s_inp.copy_(inp, non_blocking=True)
        s_bt.copy_(bt, non_blocking=True)
        g.replay()
        return out, hidden


class CudaGraphMTP:
    """The MTP block's decode-path calls (``DeepseekV4.mtp_decode``) replayed from CUDA graphs, one
    per (batch bucket, rows): ``rows`` 1 .. K + 1 (a fill of the accepted rows, then single draft
    rows). Padding rows use the scratch slot, position 0, an all -1 block table and zero streams;
    their outputs are dropped."""

    def __init__(self, model: DeepseekV4, max_num_seqs: int, max_rows: int, buckets=(1, 2, 4, 8, 16, 32, 64, 128)):
        self.model = model
        self.buckets = [b for b in buckets if b <= max_num_seqs] or [1]
        self.graphs, self.pool = {}, None
        for r in range(max_rows, 0, -1):
            for b in reversed(self.buckets):
                self._capture(b, r)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _capture(self, b: int, rows: int):
        m, dev = self.model, self.model.device
        cfg = m.cfg
        tok = torch.zeros(b * rows, dtype=torch.long, device=dev)
        pos = torch.zeros(b, dtype=torch.long, device=dev)
        slots = torch.full((b,), m.scratch_slot, dtype=torch.long, device=dev)
        bt = torch.full((b, m.max_blocks), -1, dtype=torch.long, device=dev)
        h = torch.zeros(b * rows, cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
        run = lambda: m.mtp_decode(tok, pos, slots, bt, rows, h)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):                       # warm up (Triton compiles, allocator settles)
                run()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = run()
        self.pool = g.pool()
        self.graphs[(b, rows)] = (g, (tok, pos, slots, bt, h), out)

    def __call__(self, tokens, pos, slots, bt, rows: int, h_main):
        """As ``mtp_decode`` for n <= the largest bucket sequences (else eager); outputs are views of
        the graph's static buffers, valid until its next replay."""
        n = pos.shape[0]
        b = self.bucket(n)
        if b is None or (b, rows) not in self.graphs:
            return self.model.mtp_decode(tokens, pos, slots, bt, rows, h_main)
        g, (tok, p, sl, btab, h), (logits, x) = self.graphs[(b, rows)]
        m = self.model
        tok.view(rows, b)[:, :n].copy_(tokens.view(rows, n))
        tok.view(rows, b)[:, n:].zero_()
        p[:n].copy_(pos)
        p[n:].zero_()
        sl[:n].copy_(slots)
        sl[n:].fill_(m.scratch_slot)
        btab[:n].copy_(bt)
        btab[n:].fill_(-1)
        h.view(rows, b, *h.shape[1:])[:, :n].copy_(h_main.view(rows, n, *h_main.shape[1:]))
        h.view(rows, b, *h.shape[1:])[:, n:].zero_()
        g.replay()
        return logits[:n], x.view(rows, b, *x.shape[1:])[:, :n].reshape(rows * n, *x.shape[1:])

