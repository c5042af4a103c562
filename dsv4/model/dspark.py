"""The production DSpark draft (V4-*-DSpark, V4-Flash-0731, V4-Pro-0813): the checkpoint's
``mtp.0`` .. ``mtp.{S-1}`` stages on their native weights, run through the op table.

The math is ``dsv4.reference.dspark`` (its module doc lists the sources and which one decided each
point); this module only says where the state lives and how a batch runs:

* **Context rings** (one per stage): the stage's draft layer of the KV cache
  (``KVCache.draft_layers[s]``), a 128-entry window ring per slot in the main window's FP8 entry
  format. ``extend`` writes the context rows of committed positions: the target's feature ->
  ``main_proj`` -> ``main_norm`` -> the stage's ``wkv`` -> ``kv_norm`` -> RoPE + FP8 QDQ
  (``ops.kv_insert``, the main window's own insert), position p in slot p % 128. Only the last 128
  rows of a call are computed. Nothing else writes a ring: the draft block never does, so a
  rejected draft leaves nothing to roll back.
* **Draft block**: B rows per sequence (anchor + B-1 noise tokens at positions p .. p+B-1, p = the
  anchor's position). Each stage is a production ``Block`` (mHC, norms, score-routed MoE on the
  stage's own experts) whose attention (``DSparkAttention``) reads the ring's written slots through
  the sparse-attention kernel's window list (``min(p, 128)`` slots in slot order, -1 beyond) and the
  block's own B rows, inserted into a per-call scratch page, through its extra list: every block row
  sees every ring slot and all B block rows (bidirectional), the reference's key order.
* **Head**: the last stage's ``hc_head`` and ``norm``, the target's head (fp32 logits); then the
  Markov loop on the device: ``logits_i = base_i + markov_w2 @ markov_w1[tok_i]``, ``tok_{i+1} =
  argmax`` (greedy) or a draw from ``softmax(logits_i / T)`` (``draft_sample_method``
  'probabilistic'); the confidence head ``proj([y_i; e_i])`` (fp32) when asked.

Every shape of a call depends only on the number of sequences and B, and no value is read back to
the host, so a draft step can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..formats.kv_entry import page_bytes
from ..formats.paging import WINDOW, WINDOW_PAGE
from ..layers.attention import Attention
from ..layers.linear import Bf16Linear, Fp8Linear, copy_into
from .deepseek_v4 import Block, HyperConnection, Trace

EXTRA_PAGE = 64          # entries per page of a draft call's scratch (the block rows)


@dataclass
class DraftContext:
    """One draft call over ``n`` sequences of B rows each (row r = sequence r // B, block row r % B).
    ``widx`` [n*B, 128] int32: ring entries (slot*128 + i, -1 past the written slots); ``xidx``
    [n*B, B] int32: the sequence's block rows in the scratch pages; ``scratch_ids`` [n*B] int64:
    where each row's KV goes in the scratch."""
    ids: torch.Tensor
    pos: torch.Tensor
    widx: torch.Tensor
    xidx: torch.Tensor
    scratch_ids: torch.Tensor
    tables: object
    trace: Trace = field(default_factory=Trace)
    decode = False
    _rope: dict = field(default_factory=dict)

    def rope_rows(self, rope):
        key = id(rope)
        if key not in self._rope:
            self._rope[key] = self.tables(rope, self.pos)
        return self._rope[key]


class DSparkAttention(Attention):
    """A DSpark stage's attention (module doc): the main sliding-window attention's weights, read
    over the stage's ring and the draft block."""

    def forward(self, x, ctx: DraftContext):
        ops = self.ops
        cos, sin = ctx.rope_rows(self.rope)
        q, kv, _qr, _rows, _iw = self._projections(x, ctx.pos)
        T = x.shape[0]
        scratch = torch.empty(-(-T // EXTRA_PAGE), page_bytes(EXTRA_PAGE), dtype=torch.uint8, device=x.device)
        q, kv = ops.kv_insert(q, kv, cos, sin, scratch, ctx.scratch_ids, EXTRA_PAGE, self.eps)
        o = ops.sparse_prefill(q, ctx.widx, self.lc.window, WINDOW_PAGE, ctx.xidx, scratch, EXTRA_PAGE,
                               sinks=self.sink, scale=self.scale, rope=(cos, sin))
        return self._output(o, cos, sin, ctx.trace, rotated=True)

    def write_context(self, main_x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      ring_ids: torch.Tensor) -> None:
        """Ring rows of context rows ``main_x`` [n, d] (bf16) at ``ring_ids`` (slot*128 + p % 128)."""
        ops = self.ops
        y = ops.linear(self.wq_a_wkv, main_x)
        kv = ops.rms_norm(y[:, self.q_lora:], self.kv_norm, self.eps)
        q = torch.zeros(kv.shape[0], 1, kv.shape[1], dtype=kv.dtype, device=kv.device)
        ops.kv_insert(q, kv, cos, sin, self.lc.window, ring_ids, WINDOW_PAGE, self.eps)


class DSparkDraft(nn.Module):
    """The draft's weights (``mtp.{s}.*``) and its two calls, ``extend`` and ``draft`` (module doc).
    ``blocks[s]`` is stage s: a production ``Block`` (layer id ``num_hidden_layers + s``, ratio 0)
    with a ``DSparkAttention``. The embedding and head are the target's (``DeepseekV4``)."""

    def __init__(self, cfg: ModelConfig, ops, ropes, expert_fmt: str, wo_a_fmt: str, device=None, group=None):
        super().__init__()
        if cfg.draft_kind != "dspark":
            raise ValueError("dspark_target_layer_ids: the config announces no DSpark draft")
        S, d = cfg.num_draft_stages, cfg.hidden_size
        last = f"mtp.{S - 1}."
        self.cfg, self.ops, self.eps = cfg, ops, cfg.rms_norm_eps
        self.block_size, self.noise_id = cfg.dspark_block_size, cfg.dspark_noise_token_id
        self.targets = tuple(cfg.dspark_target_layer_ids)
        self.main_proj = Fp8Linear(S * d, [("mtp.0.main_proj", d)], ops, device)
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("main_norm", torch.empty(d, **f32))
        self.register_buffer("norm", torch.empty(d, **f32))
        self.blocks = nn.ModuleList(Block(cfg, cfg.num_hidden_layers + s, ops, ropes, expert_fmt, wo_a_fmt, device,
                                          group, prefix=f"mtp.{s}.", attn_cls=DSparkAttention) for s in range(S))
        self.hc_head = HyperConnection(cfg, cfg.hc_mult, device)
        r, V = cfg.dspark_markov_rank, cfg.vocab_size
        self.register_buffer("markov_w1", torch.empty(V, r, dtype=torch.bfloat16, device=device))
        self.markov_w2 = Bf16Linear(r, [(last + "markov_head.markov_w2", V)], ops, "fp32", device)
        self.register_buffer("confidence_w", torch.empty(1, d + r, **f32))
        self._last = last

    @property
    def feature_dim(self) -> int:
        return len(self.targets) * self.cfg.hidden_size

    def loaders(self):
        last = self._last
        out = {"mtp.0.main_norm.weight": copy_into(self.main_norm, "mtp.0.main_norm.weight"),
               last + "norm.weight": copy_into(self.norm, last + "norm.weight"),
               last + "markov_head.markov_w1.weight": copy_into(self.markov_w1, last + "markov_head.markov_w1.weight"),
               last + "confidence_head.proj.weight": copy_into(self.confidence_w,
                                                               last + "confidence_head.proj.weight")}
        out.update(self.main_proj.loaders())
        out.update(self.markov_w2.loaders())
        out.update(self.hc_head.loaders(last + "hc_head_"))
        for b in self.blocks:
            out.update(b.loaders())
        return out

    # ------------------------------------------------------------------ context rings
    @torch.no_grad()
    def extend(self, features: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, rope_rows) -> None:
        """Write the ring rows of context rows ``features`` [n, S*d] (the target's, ``DeepseekV4.forward``
        with ``keep_hidden``) at ``positions`` [n] of the sequences in ``slots`` [n] into every stage's
        ring. A (slot, position % 128) may appear once per call: pass only each sequence's last 128 rows."""
        if features.dim() != 2 or features.shape[1] != self.feature_dim:
            raise ValueError(f"features must be [n, {self.feature_dim}] (len(dspark_target_layer_ids) * "
                             f"hidden_size), got {list(features.shape)}")
        ops = self.ops
        main_x = ops.rms_norm(ops.linear(self.main_proj, features.to(torch.bfloat16).contiguous()), self.main_norm,
                              self.eps)
        ring_ids = slots * WINDOW + positions % WINDOW
        for b in self.blocks:
            cos, sin = rope_rows(b.attn.rope, positions)
            b.attn.write_context(main_x, cos, sin, ring_ids)

    # ------------------------------------------------------------------ draft block
    def context(self, slots: torch.Tensor, anchors: torch.Tensor, anchor_pos: torch.Tensor, rope_rows,
                trace=None) -> DraftContext:
        """The draft call's context for sequences in ``slots`` [n] whose anchors ``anchors`` [n] sit at
        ``anchor_pos`` [n] (device tensors; nothing is read back)."""
        B, dev = self.block_size, anchors.device
        n = anchors.shape[0]
        ids = torch.full((n, B), self.noise_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        pos = anchor_pos[:, None] + torch.arange(B, device=dev)
        i = torch.arange(WINDOW, device=dev)
        count = anchor_pos.clamp(max=WINDOW)
        widx = torch.where(i[None, :] < count[:, None], slots[:, None] * WINDOW + i[None, :], -1)
        rows = torch.arange(n * B, device=dev)
        xidx = (rows.view(n, B)[:, None, :]).expand(n, B, B)
        ctx = DraftContext(ids.view(-1), pos.view(-1), widx.repeat_interleave(B, 0).to(torch.int32).contiguous(),
                           xidx.reshape(n * B, B).to(torch.int32).contiguous(), rows, rope_rows)
        if trace is not None:
            ctx.trace = trace
        return ctx

    @torch.no_grad()
    def forward(self, ctx: DraftContext, embed: torch.Tensor, head, n_tokens: int, temperature=None,
                generator=None, confidence: bool = False) -> dict:
        """Draft ``n_tokens`` (1 .. B) per sequence. ``head(y [rows, d]) -> fp32 logits`` is the target's
        head after this draft's norm is applied here. ``temperature`` None: greedy; else a [n] fp32
        tensor (> 0) of per-sequence temperatures for 'probabilistic' drafting. Returns ``tokens``
        [n, N] int64, ``logits`` [n, N, V] fp32 (the Markov-corrected rows the tokens came from) and,
        with ``confidence``, ``confidence_logits`` [n, N] and ``hidden`` [n, N, d]."""
        B, cfg, ops = self.block_size, self.cfg, self.ops
        if not 1 <= n_tokens <= B:
            raise ValueError(f"num_speculative_tokens must be in 1..dspark_block_size={B}, got {n_tokens}")
        n = ctx.ids.shape[0] // B
        x = F.embedding(ctx.ids, embed).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        for b in self.blocks:
            x = b(x, ctx)
        hh = self.hc_head
        y = ops.hc_head(x, hh.fn, hh.base, hh.scale, hh.hc_eps, hh.rms_eps)            # [n*B, d] pre-norm
        y = ctx.trace("dspark.hc_head", y)
        base = head(ops.rms_norm(y, self.norm, self.eps)).view(n, B, -1)
        prev = ctx.ids.view(n, B)[:, 0]
        tokens, logits, embeds = [], [], []
        for i in range(n_tokens):
            e = self.markov_w1[prev]                                                    # [n, r] bf16
            row = base[:, i] + ops.linear(self.markov_w2, e).float()
            if temperature is None:
                prev = row.argmax(dim=-1)
            else:
                p = torch.softmax(row / temperature[:, None], dim=-1)
                prev = torch.multinomial(p, 1, generator=generator)[:, 0]
            tokens.append(prev)
            logits.append(row)
            embeds.append(e)
        out = {"tokens": torch.stack(tokens, 1), "logits": torch.stack(logits, 1)}
        ctx.trace("dspark.logits", out["logits"].reshape(n * n_tokens, -1))
        if confidence:
            yv = y.view(n, B, -1)[:, :n_tokens]
            z = torch.cat([yv.float(), torch.stack(embeds, 1).float()], dim=-1)
            out["confidence_logits"] = (z @ self.confidence_w.t())[..., 0]
            out["hidden"] = yv
        return out


class CudaGraphDraft:
    """Greedy DSpark draft calls of ``n_tokens`` drafts replayed from CUDA graphs, one per batch
    bucket (as ``CudaGraphDecoder``): the Markov loop is inside the graph. Padding rows draft for
    the model's scratch slot at position 0 (no ring slot is read) and are dropped."""

    def __init__(self, model, max_num_seqs: int, n_tokens: int, buckets=(1, 2, 4, 8, 16, 32, 64, 128)):
        self.model, self.n_tokens = model, n_tokens
        dev = model.device
        self.buckets = [b for b in buckets if b <= max_num_seqs] or [1]
        maxb = self.buckets[-1]
        self.slots = torch.full((maxb,), model.scratch_slot, dtype=torch.long, device=dev)
        self.anchors = torch.zeros(maxb, dtype=torch.long, device=dev)
        self.pos = torch.zeros(maxb, dtype=torch.long, device=dev)
        self.graphs, self.outputs, self.pool = {}, {}, None
        for b in reversed(self.buckets):
            self._capture(b)

    def _run(self, b):
        return self.model.dspark_draft(self.slots[:b], self.anchors[:b], self.pos[:b], self.n_tokens)["tokens"]

    def _capture(self, b):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):                       # warm up (Triton compiles, allocator settles)
                self._run(b)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self._run(b)
        self.pool = g.pool()
        self.graphs[b], self.outputs[b] = g, out

    def __call__(self, slots: torch.Tensor, anchors: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Draft tokens [n, n_tokens] (int64, on the device)."""
        n = slots.shape[0]
        b = next((x for x in self.buckets if x >= n), None)
        if b is None:
            return self.model.dspark_draft(slots, anchors, pos, self.n_tokens)["tokens"]
        self.slots[:n].copy_(slots)
        self.anchors[:n].copy_(anchors)
        self.pos[:n].copy_(pos)
        self.slots[n:b].fill_(self.model.scratch_slot)
        self.anchors[n:b].zero_()
        self.pos[n:b].zero_()
        self.graphs[b].replay()
        return self.outputs[b][:n]


__all__ = ["CudaGraphDraft", "DSparkAttention", "DSparkDraft", "DraftContext"]
