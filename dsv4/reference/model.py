"""The reference DeepSeek-V4 model (spec §2): the oracle every fast path is compared against.

``ReferenceModel.forward`` takes a batch of (token ids, SequenceState) chunks, one per sequence,
each continuing its sequence at ``state.pos``: a prefill at 0, a chunk of a longer prefill or a
1-token decode, mixed freely. Tokens are flattened to [T, ...] for row-wise ops (every row is
quantised on its own, so batching does not change numerics); token-mixing ops run per sequence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .attention import Segment
from .block import Block
from .dspark import DSparkDraft
from .linear import Linear, make_linear
from .mhc import HyperHead
from .norm import rms_norm
from .numerics import Numerics
from .rope import RopeTable
from .state import SequenceState


class MTPBlock:
    """Multi-token prediction block (spec §9): its own window cache, the main embedding and head."""

    def __init__(self, cfg, t, num, ropes, prefix="mtp.0."):
        self.num, self.eps = num, cfg.rms_norm_eps
        self.e_proj, self.h_proj = make_linear(t, prefix + "e_proj", num), make_linear(t, prefix + "h_proj", num)
        self.enorm, self.hnorm = t[prefix + "enorm.weight"].float(), t[prefix + "hnorm.weight"].float()
        self.norm = t[prefix + "norm.weight"].float()
        self.block = Block(cfg, cfg.num_hidden_layers, prefix, t, num, ropes)
        self.head = HyperHead(t[prefix + "hc_head_fn"], t[prefix + "hc_head_base"], t[prefix + "hc_head_scale"],
                              cfg.hc_eps, cfg.rms_norm_eps, num)

    def __call__(self, emb, h_main, positions, segs, ids):
        e = rms_norm(emb, self.enorm, self.eps, self.num)
        h = rms_norm(h_main, self.hnorm, self.eps, self.num)      # each stream separately
        x = self.num.round(self.e_proj(e).unsqueeze(1) + self.h_proj(h))
        x = self.block(x, positions, segs, ids)
        return rms_norm(self.head(x), self.norm, self.eps, self.num)


class ReferenceModel:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], numerics: str = "official"):
        self.cfg = cfg
        self.num = num = Numerics(numerics)
        self.device = tensors["embed.weight"].device
        ropes = {r: RopeTable(cfg, r, self.device, num.fp64_accumulate) for r in set(cfg.compress_ratios)}
        self.embed = tensors["embed.weight"]                       # bf16 lookup table
        self.layers = [Block(cfg, i, f"layers.{i}.", tensors, num, ropes) for i in range(cfg.num_hidden_layers)]
        self.hc_head = HyperHead(tensors["hc_head_fn"], tensors["hc_head_base"], tensors["hc_head_scale"],
                                 cfg.hc_eps, cfg.rms_norm_eps, num)
        self.norm = tensors["norm.weight"].float()
        self.head = Linear(tensors["head.weight"], "fp32", num)
        self.mtp = MTPBlock(cfg, tensors, num, ropes) if "mtp.0.e_proj.weight" in tensors else None
        self.dspark = (DSparkDraft(cfg, tensors, num, ropes, head=self.head)
                       if "mtp.0.main_proj.weight" in tensors else None)
        self._trace = None

    @property
    def trace(self) -> dict | None:
        """``dsv4 validate``'s record-only trace of the next forward: set a dict and every main
        layer writes its module values into it (``L<i>.hc_pre``, ``.q``, ``.kv``, ``.indexer_topk``,
        ``.compressor``, ``.indexer_compressor``, ``.sparse_attn``, ``.attn``, ``.moe``,
        ``.hc_post``; ``logits`` of the rows returned), the names the production model's trace
        points use. Recording copies values and changes no computation."""
        return self._trace

    @trace.setter
    def trace(self, d: dict | None) -> None:
        self._trace = d
        for b in self.layers:
            b.attn.trace = d

    @classmethod
    def from_pretrained(cls, path: str, numerics: str = "official", progress: bool = False) -> "ReferenceModel":
        from ..checkpoint.loader import load_checkpoint
        ck = load_checkpoint(path, progress=progress)
        return cls(ck.config, ck.tensors, numerics=numerics)

    def new_state(self) -> SequenceState:
        st = SequenceState(layers=[b.new_state(self.device) for b in self.layers])
        if self.mtp is not None:
            st.mtp = self.mtp.block.new_state(self.device)
        if self.dspark is not None:
            st.dspark = self.dspark.new_state()
        return st

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.num.round(F.embedding(ids, self.embed))

    def _batch(self, chunks, state_of):
        ids = torch.cat([c[0].to(self.device).long().view(-1) for c in chunks])
        positions, segs, start = [], [], 0
        for tok, st in chunks:
            n, p0 = tok.numel(), st.pos if state_of is None else state_of(st)[1]
            if n == 0:
                raise ValueError("every chunk needs at least one token")
            positions.append(torch.arange(p0, p0 + n, device=self.device))
            segs.append((start, start + n, p0))
            start += n
        return ids, torch.cat(positions), segs

    @torch.no_grad()
    def forward(self, chunks: list[tuple[torch.Tensor, SequenceState]], all_logits: bool = False,
                keep_hidden: bool = False, capture: bool = False) -> list[torch.Tensor]:
        """Run each sequence's next chunk; returns per sequence fp32 logits of its last token [V]
        (``all_logits``: of every token [n, V]). Advances every state. ``capture`` stores in
        ``state.last_features`` the DSpark target feature [n, S*d] of every row of the chunk:
        the residual stream after each block of ``dspark_target_layer_ids``, averaged over its hc
        streams, concatenated in that order (see ``dspark.py``)."""
        targets = self.cfg.dspark_target_layer_ids
        if capture and not targets:
            raise ValueError("capture needs dspark_target_layer_ids: this config has no DSpark draft")
        ids, positions, spans = self._batch(chunks, None)
        h = self._embed(ids).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)   # 4 identical streams
        feats = {}
        for i, layer in enumerate(self.layers):
            segs = [Segment(s, e, p0, st.layers[i]) for (s, e, p0), (_, st) in zip(spans, chunks)]
            h = layer(h, positions, segs, ids)
            if capture and i in targets:
                feats[i] = self.num.round(self.num.fn(lambda v: v.mean(dim=1), h))
        y = rms_norm(self.hc_head(h), self.norm, self.cfg.rms_norm_eps, self.num)
        feature = torch.cat([feats[i] for i in targets], dim=-1) if capture else None
        out = []
        for (s, e, _), (_, st) in zip(spans, chunks):
            st.pos = e - s + st.pos
            if keep_hidden:
                st.last_hidden = h[s:e]
            if capture:
                st.last_features = feature[s:e]
            out.append(self.head(y[s:e] if all_logits else y[e - 1]).float())
        if self._trace is not None:
            self._trace["logits"] = torch.cat([o.reshape(-1, o.shape[-1]) for o in out])
        return out

    @torch.no_grad()
    def mtp_forward(self, chunks: list[tuple[torch.Tensor, SequenceState]], h_main: list[torch.Tensor]) -> list[torch.Tensor]:
        """MTP logits for each chunk: token ids combined with the main model's pre-hc_head
        residual ``h_main`` [n, hc, d] of the same rows (spec §9); advances ``state.mtp_pos``."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP weights")
        ids, positions, spans = self._batch(chunks, lambda st: (None, st.mtp_pos))
        segs = [Segment(s, e, p0, st.mtp) for (s, e, p0), (_, st) in zip(spans, chunks)]
        y = self.mtp(self._embed(ids), torch.cat(h_main), positions, segs, ids)
        out = []
        for (s, e, _), (_, st) in zip(spans, chunks):
            st.mtp_pos += e - s
            out.append(self.head(y[e - 1]).float())
        return out
