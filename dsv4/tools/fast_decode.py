"""Tensorised decode step over the paged quantised KV cache (one new token per sequence).

Same weights, same row-wise ops and the same cache contents as the reference model on a
``PagedSequenceState``, but every per-sequence Python loop is replaced by fixed-shape tensor ops
(index lists padded with -1, masks instead of branches, no host synchronisation), so one step of
a given batch size can be captured in a CUDA graph and replayed. Attention runs either through
the reference twin (gather + dequant + the reference's ``sparse_attention``: with invariant
numerics the step is bit-identical to the reference) or the Triton kernels (``kv_insert`` +
``sparse_decode``).

Padding rows (a CUDA graph is captured for a bucket of batch sizes) and non-completing
compressor rows write into a private scratch slot / block, never into a live sequence's cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engine.kv_cache import KVCache
from ..formats.fp8 import fp8_qdq
from ..formats.index_key import read_index_keys, write_index_keys
from ..formats.kv_entry import read_entries, write_entries
from ..formats.paging import BLOCK_TOKENS, INDEX_PAGE, WINDOW, WINDOW_PAGE
from ..reference.attention import sparse_attention
from ..reference.model import Block, ReferenceModel
from ..kernels.paging import block_entry_ids, entry_ids, entry_ids_torch
from ..reference.norm import head_rms_norm, rms_norm
from ..reference.rope import apply_rope


class FastDecoder:
    """``forward(tokens, pos, slots, block_tables)`` -> fp32 logits [B, V] for one decode step.

    tokens/pos/slots: int64 [B]; block_tables: int64 [B, W] (W = max_model_len / 256, -1 pad).
    """

    def __init__(self, model: ReferenceModel, cache: KVCache, max_model_len: int, attention: str = "reference",
                 fused: bool = False):
        if attention not in ("reference", "triton"):
            raise ValueError(f"attention backend must be 'reference' or 'triton', got {attention!r}")
        if fused and attention != "triton":
            raise ValueError("the fused hot path (Triton mHC / compressor / indexer / MoE kernels) needs "
                             "attention='triton'")
        self.model, self.cache, self.cfg, self.num = model, cache, model.cfg, model.num
        self.attention = attention
        # fused: every remaining hot op in a Triton kernel (issue "GPU hot path II"); the kernels
        # pass their twin tests and `dsv4 validate --fused` compares them module by module
        self.fused = fused
        if fused:
            from ..kernels.gemm import fp8_weight_exact
            from ..kernels.moe import MoEWeights
            self.moe_weights = [MoEWeights.from_reference_exact(b.moe, i) for i, b in enumerate(model.layers)]
            self._fp8 = {}
            for b in model.layers:
                lins = [b.attn.wq_a, b.attn.wq_b, b.attn.wkv, b.attn.wo_b]
                if b.attn.indexer is not None:
                    lins.append(b.attn.indexer.wq_b)
                for lin in lins:
                    if lin.kind == "fp8":
                        self._fp8[id(lin)] = fp8_weight_exact(lin.weight, f"layer {b.layer_id} linear")
            # fp32 GEMMs of bf16 values (head, compressor wkv/wgate: bf16 weights upcast, inputs
            # bf16-rounded): on CUDA one bf16 tensor-core GEMM with fp32 output (exact products,
            # fp32 sums: the official result up to summation order) at half the weight bytes
            self._bf16 = {}
            if cache.device.type == "cuda":
                comps = [model.head]
                for b in model.layers:
                    for c in (b.attn.compressor, b.attn.indexer.compressor if b.attn.indexer else None):
                        if c is not None:
                            comps += [c.wkv, c.wgate]
                    if b.attn.indexer is not None:
                        comps.append(b.attn.indexer.weights_proj)
                for lin in comps:
                    if lin.kind in ("fp32", "bf16") and torch.equal(lin.weight.bfloat16().float(), lin.weight):
                        self._bf16[id(lin)] = lin.weight.bfloat16()
            # linears that read the same input, as one GEMM each (fewer launches per layer): wq_a|wkv
            # (FP8, one act quant) and the compressors' wkv/wgate + the indexer's weights_proj (bf16);
            # the members' weights become views of the concatenation
            self._group, self._group_w, self._gx = {}, {}, None
            for b in model.layers:
                self._make_group(("fp8", b.layer_id), [b.attn.wq_a, b.attn.wkv])
                ix = b.attn.indexer
                members = [l for c in (b.attn.compressor, ix.compressor if ix else None) if c is not None
                           for l in (c.wkv, c.wgate)] + ([ix.weights_proj] if ix else [])
                self._make_group(("bf16", b.layer_id), members)
            # wo_a: the official bf16 einsum (bf16 operands, fp32 accumulation, bf16 out) as one
            # batched tensor-core GEMM over the G groups
            self._wo_a = [b.attn.wo_a.weight.to(torch.bfloat16).view(b.attn.G, -1, b.attn.wo_a.weight.shape[1])
                          for b in model.layers]
            # ... and, where the weight is FP8-representable (checkpoints: it is FP8 dequantised), its
            # FP8 form for the decode-size kernel (``fp8_mma`` act="bf16": half the weight bytes)
            self._wo_a_fp8 = [self._fp8_or_none(b.attn.wo_a.weight) if cache.device.type == "cuda" else None
                              for b in model.layers]
        self.max_blocks = -(-max_model_len // BLOCK_TOKENS)
        # private scratch slot and block: writes of padding / non-completing rows land there
        self.scratch_slot = cache.allocate_slot()
        self.scratch_block = cache.allocate_blocks(1)[0]
        dev = cache.device
        if fused:
            self._plan_meta(max_model_len)
        self._win_off = torch.arange(WINDOW, device=dev)
        self._memo: dict | None = None      # per-step values shared by the layers (see _once)
        self.trace: dict | None = None      # name -> tensor, filled when set (``dsv4 validate``)
        self.force: dict | None = None      # name -> tensor that replaces this path's value downstream

    @staticmethod
    def _fp8_or_none(w):
        from ..kernels.gemm import fp8_weight_exact
        if w.shape[0] % 128 or w.shape[1] % 128:
            return None
        try:
            return fp8_weight_exact(w)
        except ValueError:
            return None

    def _t(self, name, t):
        """Trace point: record this path's value; continue with a forced one if given (module-by-
        module comparison with identical inputs)."""
        if self.trace is not None:
            self.trace[name] = t.detach().clone()
        if self.force is not None and name in self.force:
            return self.force[name].to(t.dtype)
        return t

    # ------------------------------------------------------------------ helpers
    def _plan_meta(self, max_model_len):
        """The fused step's per-step values (``_once`` keys) from one ``decode_meta`` launch: RoPE
        tables of every layer's and compressor's rope (computed once, the rows ``rope(p)`` gives) and
        the index vectors of the window, compressed-cache writes and HCA reads."""
        from ..kernels.decode_meta import TABLE_NEG, MetaPlan, rope_table
        ropes = []
        for blk in self.model.layers:
            ropes.append(("attn", blk.attn.rope, 0))
            for c in (blk.attn.compressor, blk.attn.indexer.compressor if blk.attn.indexer else None):
                if c is not None:
                    ropes.append((("comp", c.ratio), c.rope, 1 - c.ratio))
        uniq, rope_keys, rope_reqs = {}, [], []       # equal ropes (freqs, trig mode) share a table
        for key, rope, off in ropes:
            if (key, id(rope)) in rope_keys:
                continue
            sig = (rope.freqs.cpu().numpy().tobytes(), rope.fp64_trig)
            uniq.setdefault(sig, (len(uniq), rope))
            rope_keys.append((key, id(rope)))
            rope_reqs.append((uniq[sig][0], off))
        self._rope_tables = torch.empty(len(uniq), TABLE_NEG + max_model_len, 64, device=self.cache.device)
        for i, rope in uniq.values():
            self._rope_tables[i] = rope_table(rope, max_model_len)
        write_keys, write_reqs, vis_keys, vis_reqs = [], [], [], []
        for blk, lc in zip(self.model.layers, self.cache.layers):
            if blk.ratio and ("wid", blk.ratio, lc.entries_per_block) not in write_keys:
                write_keys.append(("wid", blk.ratio, lc.entries_per_block))
                write_reqs.append((blk.ratio, lc.entries_per_block))
            if blk.ratio and blk.ratio != 4 and ("visible", blk.ratio, lc.entries_per_block) not in vis_keys:
                vis_keys.append(("visible", blk.ratio, lc.entries_per_block))
                vis_reqs.append((blk.ratio, lc.entries_per_block))
            if blk.attn.indexer is not None and "index_wid" not in write_keys:
                write_keys.append("index_wid")
                write_reqs.append((4, INDEX_PAGE))
        self._meta_keys = (rope_keys, write_keys, vis_keys)
        self._meta_plan = MetaPlan(rope_reqs, write_reqs, vis_reqs, self.max_blocks, self.cache.device)

    def _step_memo(self, pos, slots, bt) -> dict:
        """The ``_once`` values of a fused step, from one ``decode_meta`` launch."""
        from ..kernels.decode_meta import decode_meta
        m = decode_meta(pos, slots, bt, self._rope_tables, self._meta_plan, self.scratch_block)
        rope_keys, write_keys, vis_keys = self._meta_keys
        memo = {k: (None, c, s) for k, (c, s) in zip(rope_keys, m.rope)}
        memo.update(zip(write_keys, m.write_ids))
        memo.update(zip(vis_keys, m.visible))
        memo.update(win_slot=m.win_slot, widx32=m.widx, index_nvalid=m.n_valid)
        return memo

    def _once(self, key, fn):
        """A value every layer of the step needs (RoPE rows, window lists, entry ids): computed by
        the first layer, reused by the others (fewer small launches per step)."""
        if self._memo is None:
            return fn()
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def _rope(self, rope, p, key, offset: int = 0):
        """(complex freqs, fp32 cos, fp32 sin) of positions p + offset from a RoPE table."""
        def make():
            f = rope(p + offset if offset else p)
            return f, f.real.float().contiguous(), f.imag.float().contiguous()
        return self._once((key, id(rope)), make)

    def _entry_ids(self, bt, e, per_block, m, write_mask=None):
        """Global page-entry ids of entries e [B, ...] of ratio-m layers; -1 where e is invalid
        (e < 0) — or, for writes (``write_mask``), the scratch block where the mask is False."""
        if write_mask is None:
            return entry_ids_torch(bt, e, per_block, m)
        ids, blk = block_entry_ids(bt, e, per_block, m)
        return torch.where(write_mask & (blk >= 0), ids, self.scratch_block * per_block)

    def _compress_fused(self, comp, ring, slots, x, pos, pages, page_ids, page_size):
        """Compressor decode update of the fused step: the kv / gate projections, then one kernel
        (``compress_decode``, which also adds the gate's ape: ``project``'s sum, same rounding)."""
        from ..kernels.compressor import compress_decode
        _f, cos, sin = self._rope(comp.rope, pos, ("comp", comp.ratio), offset=1 - comp.ratio)
        k, s = self._lin(comp.wkv, x), self._lin(comp.wgate, x)
        new, complete = compress_decode(ring, slots, pos, k, s, comp.norm_w, cos, sin,
                                        ratio=comp.ratio, indexer=comp.is_indexer, ape=comp.ape,
                                        eps=comp.eps, pages=pages, page_slots=page_ids, page_size=page_size)
        return new, complete

    def _compress(self, comp, ring, slots, k, s, pos):
        """Decode update of one compressor: write this token's row into the slot's ring, pool
        the window it completes (masked for rows that complete none). -> (entries [B, c],
        complete [B])."""
        m = comp.ratio
        R = ring.shape[1]
        ring[slots, pos % R] = torch.cat([k, s], dim=1)
        complete = (pos + 1) % m == 0
        start = pos + 1 - m                                      # first token of the completed window
        cur = start[:, None] + torch.arange(m, device=pos.device)
        rows = ring[slots[:, None], cur.clamp(min=0) % R]        # [B, m, 2*coff*c]
        w = rows.shape[-1] // 2
        prows = ring[slots[:, None], (cur - m).clamp(min=0) % R] if comp.overlap else rows
        pooled = comp.pool(rows[..., :w], rows[..., w:], prows[..., :w], prows[..., w:], (cur - m >= 0)[..., None])
        return comp.postprocess(pooled, start.clamp(min=0)), complete

    def _norm(self, x, w, eps):
        """RMSNorm: one Triton launch on the fused path (the reference's eight torch ops otherwise)."""
        if self.fused:
            from ..kernels.norm import rms_norm as rms_norm_kernel
            return rms_norm_kernel(x, w, eps)
        return rms_norm(x, w, eps, self.num)

    def _make_group(self, key, lins):
        """Concatenate the fused path's weights of ``lins`` (all FP8 or all bf16-exact) along N."""
        table = self._fp8 if key[0] == "fp8" else self._bf16
        lins = [l for l in lins if id(l) in table]
        if len(lins) < 2:
            return
        parts = [table[id(l)] for l in lins]
        if key[0] == "fp8":
            if any(w.shape[0] % 128 for w, _s in parts):
                return
            w, ws = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            self._group_w[key] = (w, ws)
        else:
            w = torch.cat(parts)
            self._group_w[key] = w
        start = 0
        for l, p in zip(lins, parts):
            n = (p[0] if key[0] == "fp8" else p).shape[0]
            self._group[id(l)] = (key, start, start + n)
            table[id(l)] = (w[start:start + n], ws[start // 128:(start + n) // 128]) if key[0] == "fp8" \
                else w[start:start + n]
            start += n

    def _lin_group(self, lin, x):
        """The group's GEMM (computed for the first member asked with this x, kept for the others)
        and this member's columns (a strided view); None when ``lin`` is in no group."""
        g = self._group.get(id(lin)) if self.fused and x.dim() == 2 else None
        if g is None or (g[0][0] == "bf16" and x.dtype != torch.bfloat16):
            return None
        key, a, b = g
        if self._gx is None or self._gx[0] != key or self._gx[1] is not x:
            if key[0] == "fp8":
                from ..kernels.gemm import fp8_linear
                y = fp8_linear(x, *self._group_w[key])
            else:
                y = torch.mm(x, self._group_w[key].t(), out_dtype=torch.float32)
            self._gx = (key, x, y)
        return self._gx[2][:, a:b]

    def _lin(self, lin, x):
        """A checkpoint linear: the block-scaled FP8 Triton GEMM on the fused path, else the
        reference's (dequantised-weight GEMM with the same quantised operands)."""
        y = self._lin_group(lin, x)
        if y is not None:
            return y
        if self.fused and lin.kind == "fp8":
            from ..kernels.gemm import fp8_linear
            return fp8_linear(x, *self._fp8[id(lin)])
        w = self._bf16.get(id(lin)) if self.fused else None
        if w is not None and x.dtype == torch.bfloat16:
            return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
        return lin(x)

    def project(self, comp, x, pos):
        """``Compressor.project`` (fp32 K rows and scores + ape) through ``_lin``."""
        return self._lin(comp.wkv, x), self._lin(comp.wgate, x) + comp.ape[pos % comp.ratio]

    # ------------------------------------------------------------------ attention of one layer
    def _attention(self, blk: Block, lc, x, pos, slots, bt, freqs):
        at, num = blk.attn, self.num
        B, L = x.shape[0], f"L{blk.layer_id}."
        qr = self._norm(self._lin(at.wq_a, x), at.q_norm, at.eps)
        q = self._lin(at.wq_b, qr).view(B, at.H, at.D)
        kv = self._norm(self._lin(at.wkv, x), at.kv_norm, at.eps)
        win_slot = self._once("win_slot", lambda: slots * WINDOW + pos % WINDOW)
        freqs, cos, sin = freqs
        if self.attention == "triton":
            from ..kernels.kv_insert import kv_insert
            q, kv = kv_insert(q, kv, cos, sin, lc.window, win_slot, WINDOW_PAGE, at.eps)
        else:
            q = apply_rope(head_rms_norm(q, at.eps, num), freqs)
            kv = apply_rope(kv, freqs)
            kv = torch.cat([fp8_qdq(kv[:, :at.nope], 64), kv[:, at.nope:]], dim=-1)
            write_entries(lc.window, win_slot, kv, WINDOW_PAGE)
        q = self._t(L + "q", q)
        kv = self._t(L + "kv", kv)
        # window index list: positions max(0, p-127) .. in order, -1 beyond p (reference layout)
        def window_list():
            wpos = (pos - (WINDOW - 1)).clamp(min=0)[:, None] + self._win_off
            return torch.where(wpos <= pos[:, None], slots[:, None] * WINDOW + wpos % WINDOW, -1)
        extra_idx = None
        if blk.ratio:
            epb = lc.entries_per_block
            if at.indexer is not None:
                picks = self._indexer(at.indexer, lc, x, qr, pos, slots, bt, (freqs, cos, sin))
                picks = self._t(L + "indexer_topk", picks)
            if self.fused:
                ids = self._once(("wid", blk.ratio, epb),
                                 lambda: self._entry_ids(bt, pos // blk.ratio, epb, blk.ratio, pos >= 0))
                new, complete = self._compress_fused(at.compressor, lc.comp_state, slots, x, pos,
                                                     lc.entries, ids, epb)
                if self.trace is not None:
                    self._t(L + "compressor", torch.where(complete[:, None], new, 0))
            else:
                ck, cs = self.project(at.compressor, x, pos)
                new, complete = self._compress(at.compressor, lc.comp_state, slots, ck, cs, pos)
                new = self._t(L + "compressor", torch.where(complete[:, None], new, 0))
                write_entries(lc.entries, self._entry_ids(bt, pos // blk.ratio, epb, blk.ratio, complete), new, epb)
            if blk.ratio == 4:      # the picks' global ids: one kernel on the Triton path
                extra_idx = entry_ids(bt, picks, epb, 4) if self.attention == "triton" else \
                    self._entry_ids(bt, picks, epb, 4)
            else:
                def visible_entries():
                    j = torch.arange(self.max_blocks * epb, device=x.device)[None, :].expand(B, -1)
                    vis = j < ((pos + 1) // blk.ratio)[:, None]
                    return self._entry_ids(bt, torch.where(vis, j, -1), epb, blk.ratio)
                extra_idx = self._once(("visible", blk.ratio, epb), visible_entries)
        if self.attention == "triton":
            from ..kernels.sparse_attention import sparse_decode
            o = sparse_decode(q, self._once("widx32", lambda: window_list().to(torch.int32)), lc.window, WINDOW_PAGE,
                              None if extra_idx is None else extra_idx.to(torch.int32),
                              lc.entries, lc.entries_per_block or 64, sinks=at.sink, scale=at.scale)
        else:
            widx = self._once("widx", window_list)
            rows = read_entries(lc.window, widx, WINDOW_PAGE)
            valid = widx >= 0
            if extra_idx is not None:
                rows = torch.cat([rows, read_entries(lc.entries, extra_idx, lc.entries_per_block)], dim=1)
                valid = torch.cat([valid, extra_idx >= 0], dim=1)
            K = rows.shape[1]
            loc = torch.where(valid, torch.arange(B * K, device=x.device).view(B, K), -1)
            o = sparse_attention(q, rows.reshape(B * K, -1), loc, at.sink, at.scale, num)
        o = self._t(L + "sparse_attn", o)
        if self.attention == "triton":
            from ..kernels.inverse_rope import inverse_rope
            og = inverse_rope(o, cos, sin).view(B, at.G, -1)        # bf16 (the einsums widen it)
        else:
            og = apply_rope(o, freqs, inverse=True).view(B, at.G, -1).float()
        if self.fused:
            from ..kernels import fp8_mma
            wq = self._wo_a_fp8[blk.layer_id]
            if wq is not None and B <= fp8_mma.WO_A_MAX_ROWS and fp8_mma.available(og.device):
                z = fp8_mma.fp8_mma(*wq, x_bf16=og.reshape(B, -1).to(torch.bfloat16), act="bf16", groups=at.G)
                z = z.view(B, at.G, -1)
            else:
                z = torch.einsum("tgd,grd->tgr", og.to(torch.bfloat16), self._wo_a[blk.layer_id])
        else:
            z = num.round(num.einsum("tgd,grd->tgr", og, at.wo_a.weight.view(at.G, -1, og.shape[-1])))
        out = self._lin(at.wo_b, z.flatten(1))
        return self._t(L + "attn", out)

    def _indexer(self, ix, lc, x, qr, pos, slots, bt, freqs):
        """Indexer keys update + top-k over this sequence's keys; -1 for non-causal picks."""
        if self.fused:
            return self._indexer_fused(ix, lc, x, qr, pos, slots, bt, freqs)
        iq, iw = ix.queries(qr, x, freqs[0])
        ck, cs = ix.compressor.project(x, pos)
        new, complete = self._compress(ix.compressor, lc.index_state, slots, ck, cs, pos)
        write_index_keys(lc.index_keys, self._entry_ids(bt, pos // 4, INDEX_PAGE, 4, complete), new)
        B = x.shape[0]
        n_max = self.max_blocks * INDEX_PAGE
        j = torch.arange(n_max, device=x.device)[None, :].expand(B, -1)
        keys = read_index_keys(lc.index_keys, self._entry_ids(bt, j, INDEX_PAGE, 4))   # [B, E, 128]
        r = self.num.round
        sc = r(self.num.einsum("bhd,btd->bht", iq.float(), keys.float()))
        sc = r(sc.relu() * iw.unsqueeze(-1))
        sc = r(sc.float().sum(dim=1))
        visible = ((pos + 1) // 4)[:, None]
        sc = sc.masked_fill(j >= visible, float("-inf"))
        k = min(ix.topk, n_max)
        idx = sc.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        return idx.masked_fill(idx >= visible, -1)

    def _indexer_fused(self, ix, lc, x, qr, pos, slots, bt, freqs):
        from ..kernels.indexer import index_q_prologue, index_scores, index_topk
        B = x.shape[0]
        q = self._lin(ix.wq_b, qr).view(B, ix.n_heads, ix.head_dim)
        q = index_q_prologue(q, freqs[1], freqs[2])
        r = self.num.round     # the bf16 linear's rounding, then the scaled weights' (reference order)
        w = r(r(self._lin(ix.weights_proj, x)) * (ix.head_dim ** -0.5 * ix.n_heads ** -0.5))
        ids = self._once("index_wid", lambda: self._entry_ids(bt, pos // 4, INDEX_PAGE, 4, pos >= 0))
        self._compress_fused(ix.compressor, lc.index_state, slots, x, pos, lc.index_keys, ids, INDEX_PAGE)
        n_max = self.max_blocks * INDEX_PAGE
        scores = index_scores(q, w, lc.index_keys, bt, pos, n=n_max)
        n_valid = self._once("index_nvalid", lambda: ((pos + 1) // 4).to(torch.int32))
        return index_topk(scores, min(ix.topk, n_max), n_valid=n_valid)      # int32

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def forward(self, tokens, pos, slots, bt):
        self._memo = self._step_memo(pos, slots, bt) if self.fused else {}
        try:
            return self._forward(tokens, pos, slots, bt)
        finally:
            self._memo = None
            self._gx = None

    def _forward(self, tokens, pos, slots, bt):
        m, num = self.model, self.num
        h = num.round(F.embedding(tokens, m.embed)).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        if self.fused:
            return self._forward_fused(tokens, pos, slots, bt, h)
        for i, blk in enumerate(m.layers):
            lc = self.cache.layers[i]
            freqs = self._rope(blk.attn.rope, pos, "attn")
            a, post, comb = blk.hc_attn.pre(h)
            a = self._t(f"L{i}.hc_pre", a)
            a = self._attention(blk, lc, rms_norm(a, blk.attn_norm, self.cfg.rms_norm_eps, num), pos, slots, bt, freqs)
            h = blk.hc_attn.post(a, h, post, comb)
            f, post, comb = blk.hc_ffn.pre(h)
            f = self._moe(blk.moe, rms_norm(f, blk.ffn_norm, self.cfg.rms_norm_eps, num), tokens)
            f = self._t(f"L{i}.moe", f)
            h = blk.hc_ffn.post(f, h, post, comb)
            h = self._t(f"L{i}.hc_post", h)
        y = rms_norm(m.hc_head(h), m.norm, self.cfg.rms_norm_eps, num)
        logits = m.head(y).float()
        return self._t("logits", logits)

    def _forward_fused(self, tokens, pos, slots, bt, h):
        for i in range(len(self.model.layers)):
            h = self.fused_layer(i, h, tokens, pos, slots, bt)
        return self.fused_head(h)

    def fused_layer(self, i, h, tokens, pos, slots, bt):
        """Layer i of the fused step: residual streams h [B, hc, d] -> [B, hc, d] (separate so a
        benchmark can capture and time one layer)."""
        from ..kernels.mhc import hc_post, hc_pre
        from ..kernels.moe import moe_forward
        blk, lc, cfg = self.model.layers[i], self.cache.layers[i], self.cfg

        def pre(hc, x):
            return hc_pre(x, hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps, hc.rms_eps)
        freqs = self._rope(blk.attn.rope, pos, "attn")
        a, post, comb = pre(blk.hc_attn, h)
        a = self._t(f"L{i}.hc_pre", a)
        a = self._attention(blk, lc, self._norm(a, blk.attn_norm, cfg.rms_norm_eps), pos, slots, bt, freqs)
        self._gx = None                    # the grouped linears' output for this layer's x
        h = hc_post(a, h, post, comb)
        f, post, comb = pre(blk.hc_ffn, h)
        f = moe_forward(self._norm(f, blk.ffn_norm, cfg.rms_norm_eps), tokens, self.moe_weights[i])
        f = self._t(f"L{i}.moe", f)
        return self._t(f"L{i}.hc_post", hc_post(f, h, post, comb))

    def fused_head(self, h):
        from ..kernels.mhc import hc_head
        m, cfg = self.model, self.cfg
        hh = m.hc_head
        y = self._norm(hc_head(h, hh.fn, hh.base, hh.scale, hh.hc_eps, hh.rms_eps), m.norm, cfg.rms_norm_eps)
        return self._t("logits", self._lin(m.head, y).float())

    def _moe(self, moe, x, ids):
        """Every expert on every row, masked: fixed shapes (the grouped-GEMM kernel replaces this)."""
        idx, w = moe.route(x, ids)
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e, expert in enumerate(moe.experts):
            hit = idx == e
            col = hit.float().argmax(dim=1, keepdim=True)
            out = expert(x, w.gather(1, col).squeeze(1)).float()
            y = y + torch.where(hit.any(dim=1, keepdim=True), out, 0.0)
        return self.num.round(y + moe.shared(x).float())


class CudaGraphDecoder:
    """Captures ``FastDecoder.forward`` once per batch-size bucket and replays it (as vLLM and
    nano-vllm do for decode). Inputs are copied into static buffers; padding rows use the
    decoder's scratch slot and an all -1 block table."""

    def __init__(self, dec: FastDecoder, buckets=(1, 2, 4, 8, 16, 32, 64, 128)):
        self.dec = dec
        dev = dec.cache.device
        self.buckets = [b for b in buckets if b <= dec.cache.max_num_seqs] or [1]
        maxb = self.buckets[-1]
        W = dec.max_blocks
        self.tokens = torch.zeros(maxb, dtype=torch.long, device=dev)
        self.pos = torch.zeros(maxb, dtype=torch.long, device=dev)
        self.slots = torch.full((maxb,), dec.scratch_slot, dtype=torch.long, device=dev)
        self.bt = torch.full((maxb, W), -1, dtype=torch.long, device=dev)
        self.graphs, self.outputs = {}, {}
        self.pool = None
        for b in reversed(self.buckets):
            self._capture(b)

    def _capture(self, b):
        args = (self.tokens[:b], self.pos[:b], self.slots[:b], self.bt[:b])
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):                       # warm up (Triton compiles, allocator settles)
                self.dec.forward(*args)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self.dec.forward(*args)
        self.pool = g.pool()
        self.graphs[b], self.outputs[b] = g, out

    def forward(self, tokens, pos, slots, bt):
        n = tokens.shape[0]
        b = next((x for x in self.buckets if x >= n), None)
        if b is None:
            return self.dec.forward(tokens, pos, slots, bt)
        self.tokens[:n].copy_(tokens)
        self.pos[:n].copy_(pos)
        self.slots[:n].copy_(slots)
        self.bt[:n].copy_(bt)
        self.tokens[n:b].zero_()
        self.pos[n:b].zero_()
        self.slots[n:b].fill_(self.dec.scratch_slot)
        self.bt[n:b].fill_(-1)
        self.graphs[b].replay()
        return self.outputs[b][:n]
