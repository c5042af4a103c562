"""The V4 attention layer (spec §4-§6): its weights as stored, and the one attention orchestration.

One forward for every batch kind (``ctx``: a ``DecodeContext`` of a fixed number of tokens per
sequence with fixed shapes, or a ``PrefillContext`` of chunks): the row-wise projections, q/kv
prologue with the FP8 cache insert, the compressor (and, on CSA layers, indexer) updates, sparse
attention over the window + compressed entries, inverse RoPE and the grouped output projection. The
only difference between the kinds is where a token's window rows and compressor windows come from:
in a decode step every row is written into its slot's ring / pages and read back by index lists
built without host synchronisation (capturable in a CUDA graph), the rows of one sequence (a
speculative verify step) one position after the other; in a prefill chunk the chunk's own keys go to a
scratch page buffer that also holds the ring's previous entries (a long chunk would overwrite its
own ring), and each sequence's compressor update is one launch.

Cache layout: ``dsv4.engine.kv_cache`` (window ring per slot, compressed / index pages per block).
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats.kv_entry import page_bytes, page_views, read_entries
from ..formats.paging import INDEX_PAGE, WINDOW, WINDOW_PAGE, block_entry_ids
from ..parallel import SINGLE
from ..streams import Fork
from .linear import Bf16Linear, Fp8Linear, GroupedFp8, copy_into, copy_part

SCORE_BYTES = 256 << 20          # bound of one block of indexer scores during a prefill chunk


class Rope:
    """RoPE of one layer type: ``rope(positions)`` -> complex64 [n, 32] (the official
    ``precompute_freqs_cis`` angles, fp32 product pos * f)."""

    def __init__(self, freqs: torch.Tensor):
        self.freqs = freqs

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(positions.to(torch.float32), self.freqs)
        return torch.polar(torch.ones_like(angles), angles)


class Compressor(nn.Module):
    """Softmax-pooling KV compressor (spec §5); wkv / wgate live in the attention's merged
    projection."""

    def __init__(self, cfg, ratio: int, dim: int, indexer: bool, rope: Rope, device=None):
        super().__init__()
        self.ratio, self.dim, self.is_indexer, self.rope = ratio, dim, indexer, rope
        self.overlap = ratio == 4
        self.coff = 2 if self.overlap else 1
        self.eps = cfg.rms_norm_eps
        self.register_buffer("ape", torch.empty(ratio, self.coff * dim, dtype=torch.float32, device=device))
        self.register_buffer("norm_w", torch.empty(dim, dtype=torch.float32, device=device))

    def loaders(self, p: str):
        return {p + "ape": copy_into(self.ape, p + "ape"), p + "norm.weight": copy_into(self.norm_w, p + "norm.weight")}


def _copy_entries(dst, dst_ids, src, src_ids, page_size):
    """Byte copy of 584-B entries between two paged buffers (same page size)."""
    dd, ds = page_views(dst, page_size)
    sd, ss = page_views(src, page_size)
    dd[dst_ids // page_size, dst_ids % page_size] = sd[src_ids // page_size, src_ids % page_size]
    ds[dst_ids // page_size, dst_ids % page_size] = ss[src_ids // page_size, src_ids % page_size]


class Attention(nn.Module):
    """Tensor parallelism (``group``, official layout): the q heads are split over the ranks
    (``wq_b`` column-parallel, the head norm, sparse attention, sinks and inverse RoPE on the local
    heads, ``wo_a`` the local heads' groups, ``wo_b`` row-parallel, its bf16 output all-reduced);
    the shared KV head, ``wq_a`` / ``wkv``, the compressors, the indexer (all its heads: its top-k
    must be the same on every rank) and the caches are replicated."""

    # prefill: q's head norm + RoPE at the attention kernel's q load and the output's inverse RoPE in its
    # epilogue (False: kv_insert's q pass and inverse_rope's pass, the A/B of experiments/exp_prefill_ab.py)
    FUSE_PREFILL_QO = True
    # prefill: the attention reads the chunk's window entries and its sequences' compressed entries from bf16
    # workspaces (each entry dequantised once, vLLM's prefill form) instead of dequantising an entry for every row
    # that lists it; the same values, so the same bits (False: from the FP8 pages; the A/B of exp_prefill_ab.py)
    PREFILL_BF16_KV = False
    # decode: the output's inverse RoPE in the attention's combine (or its unsplit epilogue) instead of its own pass
    # (False: inverse_rope's pass; the A/B of benchmarks/decode_step.py --decode-rope)
    FUSE_DECODE_ROPE = True
    # decode with the side stream (``dsv4.streams``): a CSA layer's indexer queries (index wq_b and the q prologue)
    # on the main stream right after qr, ahead of wq_b, so the side stream's scores and top-k start once its
    # compressors are done instead of queueing the queries behind them (the same ops, so the same bits; False: the
    # queries on the side stream after the compressors, the A/B of benchmarks/decode_step.py --index-q)
    INDEX_Q_MAIN = False

    def __init__(self, cfg, layer_id: int, ops, ropes: dict[int, Rope], wo_a_fmt: str, device=None, group=None,
                 prefix: str | None = None):
        """``prefix``: the block's checkpoint prefix (default ``layers.{layer_id}.``; ``mtp.0.`` for
        the MTP block)."""
        super().__init__()
        self.layer_id, self.ops, self.group = layer_id, ops, group or SINGLE
        world = self.group.world
        self.ratio = cfg.layer_ratio(layer_id)
        H, G = cfg.num_attention_heads, cfg.o_groups
        if H % world or G % world:
            raise ValueError(f"tensor parallel size {world} must divide the {H} attention heads and {G} output "
                             f"groups")
        self.H, self.D, self.G = H // world, cfg.head_dim, G // world          # local heads and groups
        self.q_lora, self.eps, self.scale = cfg.q_lora_rank, cfg.rms_norm_eps, cfg.head_dim ** -0.5
        d, a = cfg.hidden_size, (prefix or f"layers.{layer_id}.") + "attn."
        self.prefix = a
        col, row = self.group.split("col"), self.group.split("row")
        self.wq_a_wkv = Fp8Linear(d, [(a + "wq_a", cfg.q_lora_rank), (a + "wkv", cfg.head_dim)], ops, device)
        self.wq_b = Fp8Linear(cfg.q_lora_rank, [(a + "wq_b", H * self.D)], ops, device, col)
        self.wo_a = GroupedFp8(a + "wo_a", G, cfg.o_lora_rank, H * self.D // G, ops, wo_a_fmt, device, col)
        self.wo_b = Fp8Linear(G * cfg.o_lora_rank, [(a + "wo_b", d)], ops, device, row)
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("q_norm", torch.empty(cfg.q_lora_rank, **f32))
        self.register_buffer("kv_norm", torch.empty(cfg.head_dim, **f32))
        self.register_buffer("sink", torch.empty(self.H, **f32))
        self._heads = (self.group.rank * self.H, (self.group.rank + 1) * self.H)
        self.rope = ropes[self.ratio]
        self.compressor = self.index_comp = self.index_wq_b = self.proj = None
        if self.ratio:
            self.compressor = Compressor(cfg, self.ratio, cfg.head_dim, False, self.rope, device)
            c = self.compressor.coff * cfg.head_dim
            members = [(a + "compressor.wkv", c), (a + "compressor.wgate", c)]
            if self.ratio == 4:
                self.index_comp = Compressor(cfg, 4, cfg.index_head_dim, True, self.rope, device)
                self.index_wq_b = Fp8Linear(cfg.q_lora_rank, [(a + "indexer.wq_b", cfg.index_n_heads *
                                                                cfg.index_head_dim)], ops, device)
                ci = 2 * cfg.index_head_dim
                members += [(a + "indexer.compressor.wkv", ci), (a + "indexer.compressor.wgate", ci),
                            (a + "indexer.weights_proj", cfg.index_n_heads)]
                self.index_heads, self.index_dim, self.index_topk = cfg.index_n_heads, cfg.index_head_dim, \
                    cfg.index_topk
            # every linear that reads the layer input besides wq_a / wkv: one fp32-output GEMM
            self.proj = Bf16Linear(d, members, ops, "fp32", device)
        self.lc = None          # this layer's LayerCache, set by the model's attach_cache

    def loaders(self):
        a = self.prefix
        out = {}
        for m in (self.wq_a_wkv, self.wq_b, self.wo_a, self.wo_b, self.proj, self.index_wq_b):
            if m is not None:
                out.update(m.loaders())
        out[a + "q_norm.weight"] = copy_into(self.q_norm, a + "q_norm.weight")
        out[a + "kv_norm.weight"] = copy_into(self.kv_norm, a + "kv_norm.weight")
        out[a + "attn_sink"] = copy_part(self.sink, a + "attn_sink", (self.H * self.group.world,), self._heads)
        if self.compressor is not None:
            out.update(self.compressor.loaders(a + "compressor."))
        if self.index_comp is not None:
            out.update(self.index_comp.loaders(a + "indexer.compressor."))
        return out

    # ------------------------------------------------------------------ shared parts
    def _projections(self, x, pos, ape: bool = True):
        """(q [T, H, D], kv [T, D], qr, compressor rows {name: (k, s)}, indexer head weights)."""
        qr, kv = self._qr_kv(x)
        rows, iw = self._comp_rows(x, pos, ape)
        return self._q(qr), kv, qr, rows, iw

    def _qr_kv(self, x):
        """(q's low-rank rows after q_norm, kv after kv_norm): one GEMM of both projections."""
        ops = self.ops
        return ops.rms_norm_pair(ops.linear(self.wq_a_wkv, x), self.q_norm, self.kv_norm, self.eps)

    def _q(self, qr):
        return self.ops.linear(self.wq_b, qr).view(qr.shape[0], self.H, self.D)

    def _comp_rows(self, x, pos, ape: bool = True):
        """(compressor rows {name: (k, s)}, indexer head weights) from x alone. ``ape``: the score rows
        have their compressor's APE row (position % ratio) added; False leaves that to
        ``compress_decode(ape=...)``, which adds it in its kernel (the same fp32 sum, no launches)."""
        rows, iw = {}, None
        if self.proj is not None:
            z = self.ops.linear(self.proj, x)                 # fp32 [T, sum of members]
            o = 0
            for name, comp in (("main", self.compressor), ("index", self.index_comp)):
                if comp is None:
                    continue
                w = comp.coff * comp.dim
                sc = z[:, o + w:o + 2 * w]
                rows[name] = (z[:, o:o + w], sc + comp.ape[pos % comp.ratio] if ape else sc)
                o += 2 * w
            if self.index_comp is not None:
                iw = z[:, o:]        # fp32: index_scores(w_scale=) rounds it, scales it and rounds again
        return rows, iw

    @property
    def _iw_scale(self) -> float:
        """The indexer head weights' scale (reference: softmax_scale * n_heads^-0.5)."""
        return self.index_dim ** -0.5 * self.index_heads ** -0.5

    def _output(self, o, cos, sin, trace, rotated: bool = False):
        """The attention output o [T, H, 512] after the inverse RoPE (``rotated``: the attention kernel's
        epilogue did it) is the ``sparse_attn`` trace point; then the grouped output projection."""
        T = o.shape[0]
        if not rotated:
            o = self.ops.inverse_rope(o, cos, sin).view(o.shape)
        og = trace(f"L{self.layer_id}.sparse_attn", o).view(T, self.G, -1)
        z = self.wo_a(og)
        return trace(f"L{self.layer_id}.attn", self.group.all_reduce(self.ops.linear(self.wo_b, z.flatten(1))))

    def _index_queries(self, qr, cos, sin):
        T = qr.shape[0]
        iq = self.ops.linear(self.index_wq_b, qr).view(T, self.index_heads, self.index_dim)
        return self.ops.index_q_prologue(iq, cos, sin)

    def forward(self, x, ctx):
        return self._decode(x, ctx) if ctx.decode else self._prefill(x, ctx)

    # ------------------------------------------------------------------ decode step
    def _decode(self, x, ctx):
        """Decode rows: ``ctx.rows`` rows per sequence (1 for a plain step, K+1 for a speculative
        verify), j-major (row j of sequence b at j*B + b, position pos_b + j). Everything row-wise runs
        once over all rows; the per-slot rings are advanced row group by row group, as R plain steps
        would: the compressors' ring write and pooling (a completing row reads rows written by the
        earlier rows of the step; a ring of coff*m rows wraps), then -- with every entry written, each
        row's lists only reaching the entries its own position completes -- the indexer over all rows
        at once, then per group the window insert and the attention (the insert of position p+1
        overwrites position p-127, which row p still reads)."""
        ops, lc, L, trace = self.ops, self.lc, f"L{self.layer_id}.", ctx.trace
        m = ctx.meta
        pos = ctx.pos
        T = pos.shape[0]
        R = ctx.rows
        B = T // R
        groups = [slice(j * B, (j + 1) * B) for j in range(R)]
        _f, cos, sin = m[("attn", id(self.rope))]
        # two branches (``dsv4.streams``): the compressors and the indexer on the side stream, the q path
        # and (one row per sequence) the window insert on this one; joined before the attention reads
        # the entries and picks. Tensors crossing streams (x, qr, the picks) live until the join.
        fork = Fork(x.device, T) if self.ratio else None
        if fork is not None:
            with fork.side():
                rows, iw = self._comp_rows(x, pos, ape=False)
                done = self._compress_step(ctx, rows, groups)
        qr, kv = self._qr_kv(x)
        extra_idx = None
        if fork is not None:
            # the indexer's queries read qr; computed here, they cross to the side stream (live until the join)
            iq = self._index_queries(qr, cos, sin) if self.INDEX_Q_MAIN and self.ratio == 4 else None
            fork.sync()
            with fork.side():
                extra_idx = self._decode_picks(ctx, qr, iw, cos, sin, iq)
        q = self._q(qr)
        win_slot, widx = m["win_slot"], m["widx32"]
        qs, kvs, os_ = [], [], []
        fuse = self.FUSE_DECODE_ROPE
        if R == 1:     # the insert does not touch what the branch reads or writes
            qs, kvs = ops.kv_insert(q, kv, cos, sin, lc.window, win_slot, WINDOW_PAGE, self.eps)
            qs, kvs = [trace(L + "q", qs)], [trace(L + "kv", kvs)]   # a traced value may be replaced (forcing)
        if fork is not None:
            fork.join()
            if ctx.trace.trace_on:
                trace(L + "compressor", torch.cat([torch.where(cp[:, None], new, 0) for new, cp in done]))
        for j, g in enumerate(groups):
            if R > 1:       # the insert of position p+1 overwrites position p-127, which row p still reads
                qg, kvg = ops.kv_insert(q[g], kv[g], cos[g], sin[g], lc.window, win_slot[g], WINDOW_PAGE, self.eps)
                qs.append(qg)
                kvs.append(kvg)
            og = ops.sparse_decode(qs[j], widx[g], lc.window, WINDOW_PAGE, None if extra_idx is None else extra_idx[g],
                                   lc.entries, lc.entries_per_block or 64, sinks=self.sink, scale=self.scale,
                                   rope=(cos[g], sin[g]) if fuse else None)
            os_.append(og)
        if R > 1 and trace.trace_on:
            trace(L + "q", torch.cat(qs))
            trace(L + "kv", torch.cat(kvs))
        return self._output(os_[0] if R == 1 else torch.cat(os_), cos, sin, trace, rotated=fuse)

    def _compress_step(self, ctx, rows, groups):
        """The decode step's compressor updates (ring write + pooling into the pages), row group by row
        group: the indexer's compressor (CSA), then the main one. -> the main one's (new entries,
        completed mask) per group."""
        ops, lc, m = self.ops, self.lc, ctx.meta
        pos, slots = ctx.pos, ctx.slots
        if self.index_comp is not None:
            ic = self.index_comp
            _f, icos, isin = m[(("comp", 4), id(ic.rope))]
            ik, isc = rows["index"]
            wid = m["index_wid"]
            for g in groups:
                ops.compress_decode(lc.index_state, slots[g], pos[g], ik[g], isc[g], ic.norm_w, icos[g], isin[g],
                                    ratio=4, indexer=True, ape=ic.ape, eps=ic.eps, pages=lc.index_keys,
                                    page_slots=wid[g], page_size=INDEX_PAGE)
        c, epb = self.compressor, lc.entries_per_block
        _f, ccos, csin = m[(("comp", c.ratio), id(c.rope))]
        ck, cs = rows["main"]
        wid = m[("wid", self.ratio, epb)]
        return [ops.compress_decode(lc.comp_state, slots[g], pos[g], ck[g], cs[g], c.norm_w, ccos[g], csin[g],
                                    ratio=c.ratio, indexer=False, ape=c.ape, eps=c.eps, pages=lc.entries,
                                    page_slots=wid[g], page_size=epb) for g in groups]

    def _decode_picks(self, ctx, qr, iw, cos, sin, iq=None):
        """The compressed entries each row attends to (int32 entry ids): the indexer's top-k over the
        index keys (CSA; every compressor write of the step is done), or every visible entry (HCA).
        ``iq``: the indexer queries when the caller computed them (else from qr here)."""
        ops, lc, m, L = self.ops, self.lc, ctx.meta, f"L{self.layer_id}."
        epb = lc.entries_per_block
        if self.ratio != 4:
            return m[("visible", self.ratio, epb)].to(torch.int32)
        iq = self._index_queries(qr, cos, sin) if iq is None else iq
        n_max = ctx.max_blocks * INDEX_PAGE
        scores = ops.index_scores(iq, iw, lc.index_keys, ctx.bt, ctx.pos, n=n_max, w_scale=self._iw_scale)
        picks = ops.index_topk(scores, min(self.index_topk, n_max), n_valid=m["index_nvalid"])
        picks = ctx.trace(L + "indexer_topk", picks)
        return ops.entry_ids(ctx.bt, picks, epb, 4).to(torch.int32)

    # ------------------------------------------------------------------ prefill chunks
    def _prefill(self, x, ctx):
        ops, lc, L, trace = self.ops, self.lc, f"L{self.layer_id}.", ctx.trace
        segs, pos, dev = ctx.segs, ctx.pos, x.device
        T = x.shape[0]
        cos, sin = ctx.rope_rows(self.rope)
        q, kv, qr, rows, iw = self._projections(x, pos)
        # scratch window source: per segment [the ring's previous entries | this chunk's entries]
        offs, o = [], 0
        for s in segs:
            offs.append(o)
            o += s.w_prev + s.n
        scratch = torch.empty(-(-o // WINDOW_PAGE), page_bytes(WINDOW_PAGE), dtype=torch.uint8, device=dev)
        chunk_ids = torch.empty(T, dtype=torch.long, device=dev)
        seg_base = torch.empty(T, dtype=torch.long, device=dev)    # scratch id of position 0
        for s, off in zip(segs, offs):
            if s.w_prev:
                prev = torch.arange(s.p0 - s.w_prev, s.p0, device=dev)
                _copy_entries(scratch, off + torch.arange(s.w_prev, device=dev), lc.window,
                              s.slot * WINDOW + prev % WINDOW, WINDOW_PAGE)
            chunk_ids[s.r0:s.r1] = off + s.w_prev + torch.arange(s.n, device=dev)
            seg_base[s.r0:s.r1] = off - (s.p0 - s.w_prev)
        fuse = self.FUSE_PREFILL_QO
        if fuse:    # kv only: the attention kernel normalises and rotates q as it loads it (no pass, no "q" trace)
            _, kv = ops.kv_insert(None, kv, cos, sin, scratch, chunk_ids, WINDOW_PAGE, self.eps)
        else:
            q, kv = ops.kv_insert(q, kv, cos, sin, scratch, chunk_ids, WINDOW_PAGE, self.eps)
            q = trace(L + "q", q)
        trace(L + "kv", kv)
        snaps = [(s, off, b, t) for s, off in zip(segs, offs) for b, t in s.snaps]
        if snaps:
            # prefix-cache snapshots: the window at boundary b (a multiple of 128) is positions
            # b-128 .. b-1, ring row i = position b-128+i, all in the scratch source
            i = torch.arange(WINDOW, device=dev)
            src = torch.cat([off + (b - WINDOW - (s.p0 - s.w_prev)) + i for s, off, b, _t in snaps])
            dst = torch.cat([t * WINDOW + i for _s, _o, _b, t in snaps])
            _copy_entries(lc.snap_window, dst, scratch, src, WINDOW_PAGE)
        # window lists: positions max(0, p-127) .. p, -1 beyond p. Width 128, except a batch of first
        # chunks shorter than the window: their longest chunk's length (the official prefill's
        # min(s, 128)). The attention's 64-entry softmax blocks run over [window | compressed], so the
        # width decides which entries share a block, i.e. the bf16 rounding of the probabilities.
        W = WINDOW if any(s.p0 > 0 or s.n >= WINDOW for s in segs) else max(s.n for s in segs)
        wpos = (pos - (WINDOW - 1)).clamp(min=0)[:, None] + torch.arange(W, device=dev)
        widx = torch.where(wpos <= pos[:, None], seg_base[:, None] + wpos, -1)
        extra_idx, ws_e, ws = None, None, self.PREFILL_BF16_KV
        if self.ratio:
            iq = self._index_queries(qr, cos, sin) if self.index_comp is not None else None
            extra_idx, ws_e = self._compressed(ctx, rows, iq, iw, workspace=ws)
        if ws:      # the scratch source is dense: its slot ids are the workspace's rows
            ws = (read_entries(scratch, torch.arange(scratch.shape[0] * WINDOW_PAGE, device=dev), WINDOW_PAGE), ws_e)
        o = ops.sparse_prefill(q, widx.to(torch.int32), scratch, WINDOW_PAGE,
                               None if extra_idx is None else extra_idx.to(torch.int32),
                               lc.entries if self.ratio else None, lc.entries_per_block or 64,
                               sinks=self.sink, scale=self.scale, rope=(cos, sin) if fuse else None,
                               q_norm_eps=self.eps if fuse else None, kv_bf16=ws or None)
        for s, off in zip(segs, offs):            # the ring keeps each sequence's last 128 entries
            keep = min(s.n, WINDOW)
            p = torch.arange(s.end - keep, s.end, device=dev)
            _copy_entries(lc.window, s.slot * WINDOW + p % WINDOW, scratch, off + s.w_prev + (p - s.p0),
                          WINDOW_PAGE)
        return self._output(o, cos, sin, trace, rotated=fuse)

    def _compress_chunk(self, ctx, comp, ring, s, k, sc, pages, per_block, name, snap_rows=None):
        """Chunk update of one compressor of one sequence: entries completed by the chunk pooled,
        post-processed and written into the paged cache, the ring left holding the pending rows
        (positions [start, end) at pos % R, the layout the decode kernel reads). ``snap_rows``
        (overlapping compressors): the snapshots' pending rows, filled for ``s.snaps``."""
        dev, m = k.device, comp.ratio
        R = ring.shape[1]
        if comp.overlap and s.snaps:
            # rows of positions b-m .. b-1 of each snapshot boundary b: the ring's pending rows
            # before the chunk, then the chunk's own
            lo = max(0, s.p0 - m)
            rows = torch.cat([ring[s.slot, torch.arange(lo, s.p0, device=dev) % R], torch.cat([k, sc], dim=1)])
            q = torch.tensor([b - m + j - lo for b, _t in s.snaps for j in range(m)], device=dev)
            dst = torch.tensor([t for _b, t in s.snaps], device=dev)
            snap_rows[dst] = rows[q].view(len(s.snaps), m, -1)
        first, last = s.p0 // m, s.end // m
        if last > first:
            # rows from the previous window's first position (overlap) or the window's own
            base = max(0, (first - (1 if comp.overlap else 0)) * m)
            old = ring[s.slot, torch.arange(base, s.p0, device=dev) % R]
            w = old.shape[1] // 2
            j = torch.arange(first, last, device=dev)
            cos, sin = ctx.tables(comp.rope, j * m)
            ids, blk = block_entry_ids(s.bt, j[None, :], per_block, m)
            page_slots = torch.where(blk >= 0, ids, ctx.scratch_block * per_block)
            new = self.ops.compress_prefill(torch.cat([old[:, :w], k]), torch.cat([old[:, w:], sc]), base, first,
                                            last, comp.norm_w, cos, sin, ratio=m, indexer=comp.is_indexer,
                                            eps=comp.eps, pages=pages, page_slots=page_slots.view(-1),
                                            page_size=per_block)
            ctx.trace(name, new)
        # the ring keeps the chunk's last R rows, not only the pending ones: a speculative verify
        # chunk that is cut back to an accepted length must find the rows of its accepted positions
        # there (engine.spec_decode); rows before ``start`` are never read otherwise
        keep_from = max(s.end - R, s.p0)
        if s.end > keep_from:
            p = torch.arange(keep_from, s.end, device=dev)
            ring[s.slot, p % R] = torch.cat([k[keep_from - s.p0:], sc[keep_from - s.p0:]], dim=1)

    def _compressed(self, ctx, rows, iq, iw, workspace: bool = False):
        """Compressor (and indexer) updates of every segment -> (extra index lists [T, K] of global entry ids
        into the compressed pages (-1 pad), None); ``workspace``: (lists of rows of the bf16 workspace, the
        workspace: each segment's complete entries in order, dequantised once)."""
        ops, lc, L = self.ops, self.lc, f"L{self.layer_id}."
        dev, epb = ctx.pos.device, lc.entries_per_block
        ck, cs = rows["main"]
        lists, ws_slots, ws_off = [], [], 0
        for s in ctx.segs:
            r = slice(s.r0, s.r1)
            if self.index_comp is not None:
                ik, isc = rows["index"]
                self._compress_chunk(ctx, self.index_comp, lc.index_state, s, ik[r], isc[r], lc.index_keys,
                                     INDEX_PAGE, L + "indexer_compressor", lc.snap_index)
            self._compress_chunk(ctx, self.compressor, lc.comp_state, s, ck[r], cs[r], lc.entries, epb,
                                 L + "compressor", lc.snap_comp)
            n_e = s.end // self.ratio                    # entries complete at the chunk's end
            p = ctx.pos[r]
            if n_e == 0:
                lists.append(torch.full((s.n, 1), -1, dtype=torch.long, device=dev))
                continue
            if self.ratio == 4:
                # scores [rows, n_e] bf16 in row blocks of <= SCORE_BYTES (a 4K-row chunk at 1M
                # context would otherwise hold 2 GB of scores)
                rb = max(1, min(s.n, SCORE_BYTES // (2 * n_e)))
                picks = torch.cat([
                    ops.index_topk(ops.index_scores(iq[r][i:i + rb].contiguous(), iw[r][i:i + rb],
                                                    lc.index_keys, s.bt.expand(min(rb, s.n - i), -1), p[i:i + rb],
                                                    n=n_e, w_scale=self._iw_scale),
                                   min(self.index_topk, n_e), n_valid=(p[i:i + rb] + 1) // 4).long()
                    for i in range(0, s.n, rb)])
                picks = ctx.trace(L + "indexer_topk", picks)
            else:
                j = torch.arange(n_e, device=dev)[None, :].expand(s.n, -1)
                picks = torch.where(j < ((p + 1) // self.ratio)[:, None], j, -1)
            if workspace:       # entries [0, n_e) of the segment at rows ws_off + e
                lists.append(torch.where(picks >= 0, picks + ws_off, -1))
                ws_slots.append(ops.entry_ids(s.bt[:1], torch.arange(n_e, device=dev)[None, :], epb, self.ratio)[0])
                ws_off += n_e
            else:
                lists.append(ops.entry_ids(s.bt.expand(s.n, -1), picks, epb, self.ratio))
        K = max(li.shape[1] for li in lists)
        out = torch.full((ctx.pos.shape[0], K), -1, dtype=torch.long, device=dev)
        for s, li in zip(ctx.segs, lists):
            out[s.r0:s.r1, :li.shape[1]] = li
        if not workspace:
            return out, None
        if not ws_slots:        # no complete entry yet: every list is empty, one zero row stands in
            return out, torch.zeros(1, self.D, dtype=torch.bfloat16, device=dev)
        return out, read_entries(lc.entries, torch.cat(ws_slots).long(), epb)
