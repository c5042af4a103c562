"""V4 attention block (spec §4): shared 512-d KV head, sliding window + compressed entries, sinks.

Row-wise projections run on all T tokens of the batch at once; the token-mixing part (window,
compressors, indexer, sparse attention) runs per sequence on its explicit state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .compressor import Compressor
from .indexer import Indexer
from .linear import Linear
from .norm import head_rms_norm, rms_norm
from .numerics import Numerics
from .rope import RopeTable, apply_rope
from .state import LayerState
from ..formats.fp8 import fp8_qdq

ATTN_BLOCK = 64        # the official sparse_attn consumes indices in blocks of 64
QUERY_CHUNK = 256      # bounds the memory of the gathered keys in the reference


@dataclass
class Segment:
    """Rows [start, end) of the flattened batch belong to one sequence at positions p0.."""
    start: int
    end: int
    p0: int
    layer: LayerState


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                     scale: float, num: Numerics) -> torch.Tensor:
    """o[n,h] = sum_j p_j kv[idx_j] / (sum_j p_j + exp(sink_h - M)); idx -1 = masked.

    Emulates the official kernel: 64-index blocks with a running max (the sink is not in the
    max), fp32 denominator, probabilities rounded to bf16 before P.V. Never NaN: a row with no
    valid index yields 0 (the sink alone)."""
    n, H, D = q.shape
    out = torch.empty(n, H, D, dtype=num.act_dtype, device=q.device)
    for c0 in range(0, n, QUERY_CHUNK):
        qc, ic = q[c0:c0 + QUERY_CHUNK].float(), idx[c0:c0 + QUERY_CHUNK]
        valid = ic >= 0
        keys = kv[ic.clamp(min=0)].float() * valid.unsqueeze(-1)      # [c, K, D]
        z = num.einsum("chd,ckd->chk", qc, keys) * scale
        z = z.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m = torch.full(qc.shape[:2], float("-inf"), device=q.device)
        denom = torch.zeros(qc.shape[:2], device=q.device)
        acc = torch.zeros_like(qc)
        for b0 in range(0, z.shape[-1], ATTN_BLOCK):
            zb = z[..., b0:b0 + ATTN_BLOCK]
            m_new = torch.maximum(m, zb.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            alpha = num.fn(torch.exp, m - m_safe)
            p = num.fn(torch.exp, zb - m_safe.unsqueeze(-1))
            denom = denom * alpha + num.fn(lambda v: v.sum(-1), p)
            pv = num.round(p).float()
            acc = acc * alpha.unsqueeze(-1) + num.einsum("chk,ckd->chd", pv, keys[:, b0:b0 + ATTN_BLOCK])
            m = m_new
        m_safe = torch.where(torch.isinf(m), 0.0, m)
        o = acc / (denom + num.fn(torch.exp, sink.float() - m_safe)).unsqueeze(-1)
        out[c0:c0 + QUERY_CHUNK] = num.round(o)
    return out


class Attention:
    # ``dsv4 validate``'s record-only trace: {name: value} of this call when a dict is set
    # (``ReferenceModel.trace``); never read back, so the reference's math is the same with it on
    trace: dict | None = None

    def __init__(self, cfg, layer_id: int, lin: dict[str, Linear], t: dict[str, torch.Tensor],
                 rope: RopeTable, compressor: Compressor | None, indexer: Indexer | None, num: Numerics):
        self.cfg, self.layer_id, self.num = cfg, layer_id, num
        self.ratio = cfg.layer_ratio(layer_id)
        self.wq_a, self.wq_b, self.wkv = lin["wq_a"], lin["wq_b"], lin["wkv"]
        self.wo_a, self.wo_b = lin["wo_a"], lin["wo_b"]
        self.q_norm, self.kv_norm = t["q_norm"].float(), t["kv_norm"].float()
        self.sink = t["attn_sink"].float()
        self.rope, self.compressor, self.indexer = rope, compressor, indexer
        self.H, self.D, self.G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.nope = cfg.nope_head_dim
        self.win = cfg.sliding_window
        self.eps = cfg.rms_norm_eps
        self.scale = self.D ** -0.5

    def project_q(self, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q latent ``qr`` [T, q_lora], rotated per-head-normed queries [T, H, D])."""
        qr = rms_norm(self.wq_a(x), self.q_norm, self.eps, self.num)
        q = head_rms_norm(self.wq_b(qr).view(x.shape[0], self.H, self.D), self.eps, self.num)
        return qr, apply_rope(q, freqs)

    def project_kv(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """KV rows [T, D]: norm, RoPE, FP8 QDQ of the nope dims (what attention reads and the
        cache stores)."""
        kv = apply_rope(rms_norm(self.wkv(x), self.kv_norm, self.eps, self.num), freqs)
        if not self.num.exact:
            kv = torch.cat([fp8_qdq(kv[:, :self.nope], 64), kv[:, self.nope:]], dim=-1)
        return kv

    def project_out(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE on the attention output [T, H, D], then the grouped output projection."""
        return self._grouped_out(apply_rope(o, freqs, inverse=True))

    def _grouped_out(self, o: torch.Tensor) -> torch.Tensor:
        """The grouped output projection of the attention output [T, H, D] after its inverse RoPE."""
        og = o.view(o.shape[0], self.G, -1).float()
        wo_a = self.wo_a.weight.view(self.G, -1, og.shape[-1])
        z = self.num.round(self.num.einsum("tgd,grd->tgr", og, wo_a))
        return self.wo_b(z.flatten(1))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, segs: list[Segment]) -> torch.Tensor:
        T, num = x.shape[0], self.num
        freqs = self.rope(positions)
        # 1. query, 2. kv
        qr, q = self.project_q(x, freqs)
        kv = self.project_kv(x, freqs)
        if self.indexer is not None:
            iq, iw = self.indexer.queries(qr, x, freqs)
            ik, isc = self.indexer.compressor.project(x, positions)
        if self.compressor is not None:
            ck, cs = self.compressor.project(x, positions)
        o = torch.empty(T, self.H, self.D, dtype=num.act_dtype, device=x.device)
        rec = {"indexer_topk": [], "compressor": [], "indexer_compressor": []} if self.trace is not None else None
        for sg in segs:
            r = slice(sg.start, sg.end)
            n, st = sg.end - sg.start, sg.layer
            end_pos = sg.p0 + n
            pos = positions[r]
            # window keys: the state's last rows, then this chunk's rows
            window = st.read_window(sg.p0)
            w_prev = window.shape[0]
            kv_ext = torch.cat([window, kv[r]])                   # positions p0-w_prev .. end_pos-1
            # official layouts: decode 128, prefill min(s, 128); one width keeps the 64-blocks of
            # the softmax the same for every call pattern (invariant modes)
            width = self.win if (sg.p0 > 0 or num.fp64_accumulate) else min(n, self.win)
            offs = torch.arange(width, device=x.device)
            first = (pos - (self.win - 1)).clamp(min=0)
            wpos = first[:, None] + offs[None, :]
            widx = torch.where(wpos <= pos[:, None], wpos - (sg.p0 - w_prev), -1)
            parts, extra = [widx], []
            if self.indexer is not None:
                n_before = st.indexer.num_entries
                picks = self.indexer.select(iq[r], iw[r], st.indexer, ik[r], isc[r], pos, end_pos)
                if rec is not None:
                    rec["indexer_topk"].append(picks)
                    rec["indexer_compressor"].append(st.indexer.entries()[n_before:])
            if self.compressor is not None:
                n_before = st.compressor.num_entries
                entries = self.compressor.update(st.compressor, ck[r], cs[r], end_pos)
                if rec is not None:
                    rec["compressor"].append(entries[n_before:])
                base = kv_ext.shape[0]
                if self.ratio == 4:
                    parts.append(torch.where(picks >= 0, picks + base, -1))
                else:
                    E = entries.shape[0]
                    j = torch.arange(E, device=x.device)
                    vis = j[None, :] < ((pos + 1) // self.ratio)[:, None]
                    parts.append(torch.where(vis, j[None, :] + base, -1))
                extra = [entries]
            idx = torch.cat(parts, dim=1)
            kv_all = torch.cat([kv_ext, *extra])
            o[r] = sparse_attention(q[r], kv_all, idx, self.sink, self.scale, num)
            st.write_window(kv[r][-self.win:], end_pos)
        # 6. inverse RoPE on the output, 7. grouped output projection
        o = apply_rope(o, freqs, inverse=True)
        if rec is not None:
            self._record(q, kv, o, rec)
        out = self._grouped_out(o)
        if self.trace is not None:
            self.trace[f"L{self.layer_id}.attn"] = out.clone()
        return out

    def _record(self, q, kv, o, rec) -> None:
        """q (normed, rotated), kv (as the cache stores it), the sparse attention output after the inverse
        RoPE (the production prefill rotates it in the attention kernel's epilogue), and per
        segment the indexer picks ([n, k] entry ids, -1 padded to the batch's widest) and the
        entries each compressor completed."""
        L, t = f"L{self.layer_id}.", self.trace
        t[L + "q"], t[L + "kv"], t[L + "sparse_attn"] = q.clone(), kv.clone(), o.clone()
        if rec["indexer_topk"]:
            k = max(p.shape[1] for p in rec["indexer_topk"])
            t[L + "indexer_topk"] = torch.cat([torch.nn.functional.pad(p, (0, k - p.shape[1]), value=-1)
                                               for p in rec["indexer_topk"]])
        for name in ("compressor", "indexer_compressor"):
            if rec[name]:
                t[L + name] = torch.cat(rec[name]).clone()
