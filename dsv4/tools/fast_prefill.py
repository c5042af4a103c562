"""Prefill chunks through the kernels (the fused hot path's prefill side).

``FastPrefiller.forward(chunks)`` runs the same math as ``ReferenceModel.forward`` on a
``PagedSequenceState`` cache, for any mix of sequences and chunk lengths, with every hot op in a
kernel: mHC pre/post/head, the FP8 block-scaled GEMMs, q-norm/RoPE/FP8 insert (``kv_insert``),
the compressors' chunk update (``compress_prefill``), the indexer (q prologue, paged MXFP4
scores, top-k), sparse attention over the FP8 caches (``sparse_prefill``), inverse RoPE and the
grouped MoE. Row-wise work runs once over all chunks' rows; the per-sequence part is index
arithmetic plus one kernel launch per compressor.

A chunk's own keys are not in the 128-token window ring while it is processed (a long chunk
would overwrite itself), so each layer encodes them into a scratch FP8 page buffer that also
holds a copy of the ring's previous entries of that sequence; attention reads its window rows
from there (the same 584-byte entries the ring gets: the decoded values are identical), and the
last 128 entries are then copied into the ring.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats.kv_entry import page_bytes
from ..formats.kv_entry import page_views as _page_views
from ..formats.paging import INDEX_PAGE, WINDOW, WINDOW_PAGE

SCORE_BYTES = 256 << 20          # bound of one block of indexer scores during a prefill chunk


def _copy_entries(dst, dst_ids, src, src_ids, page_size):
    """Byte copy of 584-B entries between two paged buffers (same page size)."""
    dd, ds = _page_views(dst, page_size)
    sd, ss = _page_views(src, page_size)
    dd[dst_ids // page_size, dst_ids % page_size] = sd[src_ids // page_size, src_ids % page_size]
    ds[dst_ids // page_size, dst_ids % page_size] = ss[src_ids // page_size, src_ids % page_size]


class _Seg:
    """One chunk: rows [r0, r1) of the flattened batch, positions p0 .. p0+n-1 of one sequence."""

    def __init__(self, r0, ids, st, dev, max_blocks):
        self.r0, self.n, self.st = r0, ids.numel(), st
        self.r1 = r0 + self.n
        self.p0, self.end = st.pos, st.pos + self.n
        self.slot = st.slot
        self.w_prev = min(self.p0, WINDOW)
        bt = torch.full((1, max_blocks), -1, dtype=torch.long)
        bt[0, :len(st.block_table)] = torch.tensor(st.block_table, dtype=torch.long)
        self.bt = bt.to(dev)


class KernelOps:
    """The kernels the fused prefill calls, or (``twins=True``) their torch twins, same signatures:
    CPU tests check the prefill's orchestration (index lists, scratch window, rings, pages) with
    the twins, since the Triton interpreter runs a whole prefill too slowly; each kernel is
    tested against its twin on its own."""

    def __init__(self, dec, twins: bool = False):
        from ..kernels import compressor, indexer, inverse_rope, kv_insert, mhc, moe, norm, paging
        from ..kernels import sparse_attention as sa

        def pick(mod, name):
            return getattr(mod, name + "_torch" if twins else name)
        for mod, names in ((mhc, ("hc_pre", "hc_post", "hc_head")), (kv_insert, ("kv_insert",)),
                           (norm, ("rms_norm",)), (paging, ("entry_ids",)),
                           (inverse_rope, ("inverse_rope",)), (compressor, ("compress_prefill",)),
                           (indexer, ("index_q_prologue", "index_scores", "index_topk"))):
            for n in names:
                setattr(self, n, pick(mod, n))
        self.sparse_prefill = sa.sparse_attention_torch if twins else sa.sparse_prefill
        layers = dec.model.layers
        num = dec.num
        if twins:   # the reference Linear / MoE / fp32 wo_a einsum: the twins of the GEMM kernels
            self.wo_a = lambda i, og: num.round(num.einsum(
                "tgd,grd->tgr", og.float(), dec._wo_a[i].float()))
            self.linear = lambda lin, x: lin(x)
            self.project = lambda comp, x, pos: comp.project(x, pos)
            self.moe = lambda i, x, ids: layers[i].moe(x, ids)
        else:
            self.linear, self.project = dec._lin, dec.project
            self.wo_a = lambda i, og: torch.einsum("tgd,grd->tgr", og.to(torch.bfloat16), dec._wo_a[i])
            self.moe = lambda i, x, ids: moe.moe_forward(x, ids, dec.moe_weights[i])


class FastPrefiller:
    """Shares weights and the cache with a fused ``FastDecoder``."""

    def __init__(self, dec, twins: bool = False):
        if not dec.fused:
            raise ValueError("FastPrefiller needs a FastDecoder built with fused=True")
        self.dec, self.model, self.cfg, self.num = dec, dec.model, dec.cfg, dec.num
        self.cache = dec.cache
        self.k = KernelOps(dec, twins)
        self.trace: dict | None = None      # as FastDecoder's: per-module values for `dsv4 validate`
        self.force: dict | None = None

    def _t(self, name, t):
        if self.trace is not None:
            self.trace[name] = t.detach().clone()
        if self.force is not None and name in self.force:
            return self.force[name].to(t.dtype)
        return t

    @torch.no_grad()
    def forward(self, chunks, all_logits: bool = False):
        """chunks: [(token ids [n], PagedSequenceState)]: fp32 logits of each chunk's last token
        ([V]; ``all_logits``: [n, V]); advances every state to the chunk's end."""
        m, cfg, num, dec, k = self.model, self.cfg, self.num, self.dec, self.k
        dev = self.cache.device
        ids = torch.cat([c[0].to(dev).long().view(-1) for c in chunks])
        segs, r0 = [], 0
        for tok, st in chunks:
            if tok.numel() == 0:
                raise ValueError("every chunk needs at least one token")
            if st.blocks_missing(tok.numel()):
                raise ValueError(f"sequence in slot {st.slot}: block table too short for "
                                 f"{st.pos + tok.numel()} tokens")
            segs.append(_Seg(r0, tok, st, dev, dec.max_blocks))
            r0 += tok.numel()
        pos = torch.cat([torch.arange(s.p0, s.end, device=dev) for s in segs])
        h = num.round(F.embedding(ids, m.embed)).unsqueeze(1).repeat(1, cfg.hc_mult, 1)

        def pre(hc, x):
            return k.hc_pre(x, hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps, hc.rms_eps)
        for i, blk in enumerate(m.layers):
            freqs = blk.attn.rope(pos)
            a, post, comb = pre(blk.hc_attn, h)
            a = self._t(f"L{i}.hc_pre", a)
            a = self._attention(blk, self.cache.layers[i], k.rms_norm(a, blk.attn_norm, cfg.rms_norm_eps),
                                pos, segs, freqs)
            self.dec._gx = None            # the decoder's grouped-linear output of this layer's x
            h = k.hc_post(a, h, post, comb)
            f, post, comb = pre(blk.hc_ffn, h)
            f = self._t(f"L{i}.moe", k.moe(i, k.rms_norm(f, blk.ffn_norm, cfg.rms_norm_eps), ids))
            h = self._t(f"L{i}.hc_post", k.hc_post(f, h, post, comb))
        rows = torch.arange(h.shape[0], device=dev) if all_logits else \
            torch.tensor([s.r1 - 1 for s in segs], device=dev)
        hh = m.hc_head
        y = k.rms_norm(k.hc_head(h[rows].contiguous(), hh.fn, hh.base, hh.scale, hh.hc_eps, hh.rms_eps), m.norm,
                       cfg.rms_norm_eps)
        logits = self._t("logits", k.linear(m.head, y).float())
        out = []
        for j, s in enumerate(segs):
            s.st.advance_to(s.end)
            out.append(logits[s.r0:s.r1] if all_logits else logits[j])
        return out

    # ------------------------------------------------------------------ attention of one layer
    def _attention(self, blk, lc, x, pos, segs, freqs):
        at, dev, k = blk.attn, x.device, self.k
        T = x.shape[0]
        cos, sin = freqs.real.float().contiguous(), freqs.imag.float().contiguous()
        qr = k.rms_norm(k.linear(at.wq_a, x), at.q_norm, at.eps)
        q = k.linear(at.wq_b, qr).view(T, at.H, at.D)
        kv = k.rms_norm(k.linear(at.wkv, x), at.kv_norm, at.eps)
        # scratch window source: per segment [the ring's previous entries | this chunk's entries]
        offs, o = [], 0
        for s in segs:
            offs.append(o)
            o += s.w_prev + s.n
        scratch = torch.empty(-(-o // WINDOW_PAGE), page_bytes(WINDOW_PAGE), dtype=torch.uint8, device=dev)
        chunk_ids = torch.empty(T, dtype=torch.long, device=dev)
        for s, off in zip(segs, offs):
            if s.w_prev:
                prev = torch.arange(s.p0 - s.w_prev, s.p0, device=dev)
                _copy_entries(scratch, off + torch.arange(s.w_prev, device=dev), lc.window,
                              s.slot * WINDOW + prev % WINDOW, WINDOW_PAGE)
            chunk_ids[s.r0:s.r1] = off + s.w_prev + torch.arange(s.n, device=dev)
        q, kv = k.kv_insert(q, kv, cos, sin, scratch, chunk_ids, WINDOW_PAGE, at.eps)
        L = f"L{blk.layer_id}."
        q = self._t(L + "q", q)
        self._t(L + "kv", kv)
        # window lists: positions max(0, p-127) .. p (the reference layout), -1 beyond p
        wpos = (pos - (WINDOW - 1)).clamp(min=0)[:, None] + torch.arange(WINDOW, device=dev)
        seg_base = torch.empty(T, dtype=torch.long, device=dev)    # scratch id of position 0
        for s, off in zip(segs, offs):
            seg_base[s.r0:s.r1] = off - (s.p0 - s.w_prev)
        widx = torch.where(wpos <= pos[:, None], seg_base[:, None] + wpos, -1)
        extra_idx = None
        if blk.ratio:
            extra_idx = self._compressed(blk, lc, x, qr, pos, segs, freqs)
        o = k.sparse_prefill(q, widx.to(torch.int32), scratch, WINDOW_PAGE,
                           None if extra_idx is None else extra_idx.to(torch.int32),
                           lc.entries if blk.ratio else None, lc.entries_per_block or 64,
                           sinks=at.sink, scale=at.scale)
        o = self._t(L + "sparse_attn", o)
        # the ring keeps each sequence's last 128 entries
        for s, off in zip(segs, offs):
            keep = min(s.n, WINDOW)
            p = torch.arange(s.end - keep, s.end, device=dev)
            _copy_entries(lc.window, s.slot * WINDOW + p % WINDOW, scratch,
                          off + s.w_prev + (p - s.p0), WINDOW_PAGE)
        og = k.inverse_rope(o, cos, sin).view(T, at.G, -1)
        z = k.wo_a(blk.layer_id, og)
        return self._t(L + "attn", k.linear(at.wo_b, z.flatten(1)))

    def _compress(self, comp, ring, s, k, sc, pages, per_block, m, name):
        """Chunk update of one compressor of one sequence: entries completed by the chunk pooled,
        post-processed and written into the paged cache, the ring left holding the pending rows
        (positions [start, end) at pos % R, the layout the decode kernel reads)."""
        dev = k.device
        R = ring.shape[1]
        first, last = s.p0 // m, s.end // m
        if last > first:
            # rows from the previous window's first position (overlap) or the window's own
            base = max(0, (first - (1 if comp.overlap else 0)) * m)
            prev = torch.arange(base, s.p0, device=dev)
            old = ring[s.slot, prev % R]
            w = old.shape[1] // 2
            rows_k = torch.cat([old[:, :w], k])
            rows_s = torch.cat([old[:, w:], sc])
            j = torch.arange(first, last, device=dev)
            f = comp.rope(j * m)
            page_slots = self.dec._entry_ids(s.bt, j[None, :], per_block, m, torch.ones_like(j[None, :], dtype=torch.bool))
            new = self.k.compress_prefill(rows_k, rows_s, base, first, last, comp.norm_w, f.real.float().contiguous(),
                             f.imag.float().contiguous(), ratio=m, indexer=comp.is_indexer, eps=comp.eps,
                             pages=pages, page_slots=page_slots.view(-1), page_size=per_block)
            self._t(name, new)
        start = m * max(0, last - 1) if comp.overlap else m * last
        keep_from = max(start, s.p0)
        if s.end > keep_from:
            p = torch.arange(keep_from, s.end, device=dev)
            ring[s.slot, p % R] = torch.cat([k[keep_from - s.p0:], sc[keep_from - s.p0:]], dim=1)

    def _compressed(self, blk, lc, x, qr, pos, segs, freqs):
        """Compressor (and indexer) updates of every segment; extra index lists [T, K] of global
        entry ids into ``lc.entries`` (-1 pad)."""
        at, dev, k = blk.attn, x.device, self.k
        T, epb = x.shape[0], lc.entries_per_block
        ck, cs = k.project(at.compressor, x, pos)
        if at.indexer is not None:
            ix = at.indexer
            iq = k.linear(ix.wq_b, qr).view(T, ix.n_heads, ix.head_dim)
            iq = k.index_q_prologue(iq, freqs.real.float().contiguous(), freqs.imag.float().contiguous())
            r = self.num.round      # as the decoder: the bf16 linear's rounding, then the scaled weights'
            iw = r(r(k.linear(ix.weights_proj, x)) * (ix.head_dim ** -0.5 * ix.n_heads ** -0.5))
            ik, isc = k.project(ix.compressor, x, pos)
        lists = []
        for s in segs:
            r = slice(s.r0, s.r1)
            if at.indexer is not None:
                self._compress(ix.compressor, lc.index_state, s, ik[r], isc[r], lc.index_keys, INDEX_PAGE, 4,
                               f"L{blk.layer_id}.indexer_compressor")
            self._compress(at.compressor, lc.comp_state, s, ck[r], cs[r], lc.entries, epb, blk.ratio,
                           f"L{blk.layer_id}.compressor")
            n_e = s.end // blk.ratio                    # entries complete at the chunk's end
            p = pos[r]
            if n_e == 0:
                lists.append(torch.full((s.n, 1), -1, dtype=torch.long, device=dev))
                continue
            if blk.ratio == 4:
                # scores [rows, n_e] bf16 in row blocks of <= SCORE_BYTES (a 4K-row chunk at 1M
                # context would otherwise hold 2 GB of scores)
                rb = max(1, min(s.n, SCORE_BYTES // (2 * n_e)))
                picks = torch.cat([
                    k.index_topk(k.index_scores(iq[r][i:i + rb].contiguous(), iw[r][i:i + rb].contiguous(),
                                                lc.index_keys, s.bt.expand(min(rb, s.n - i), -1), p[i:i + rb], n=n_e),
                                 min(ix.topk, n_e), n_valid=(p[i:i + rb] + 1) // 4).long()
                    for i in range(0, s.n, rb)])
                picks = self._t(f"L{blk.layer_id}.indexer_topk", picks)
                lists.append(k.entry_ids(s.bt.expand(s.n, -1), picks, epb, 4))
            else:
                j = torch.arange(n_e, device=dev)[None, :].expand(s.n, -1)
                vis = j < ((p + 1) // blk.ratio)[:, None]
                lists.append(k.entry_ids(s.bt.expand(s.n, -1), torch.where(vis, j, -1), epb, blk.ratio))
        K = max(li.shape[1] for li in lists)
        out = torch.full((T, K), -1, dtype=torch.long, device=dev)
        for s, li in zip(segs, lists):
            out[s.r0:s.r1, :li.shape[1]] = li
        return out
