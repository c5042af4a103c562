"""The DSpark draft of V4-*-DSpark, V4-Flash-0731 and V4-Pro-0813 (spec dspark-and-0731 §2).

DSpark proposes a block of ``dspark_block_size`` (B) tokens per step: the anchor token (the last
committed one, not yet run through the target) and B-1 noise tokens run in parallel through
``len(dspark_target_layer_ids)`` (S) sliding-window blocks that attend to the target's hidden
states; a Markov head then makes each draft depend on the previous one.

Sources, and which one decided each point where they differ:

* [DS] deepseek-ai/DeepSpec, DeepSeek's own DSpark training/evaluation code
  (``deepspec/modeling/dspark/{common,markov_head}.py``, ``qwen3/modeling.py``,
  ``eval/base_evaluator.py``, ``eval/dspark/{evaluator,draft_ops}.py``); no V4 model in it.
* [REF] transcriptions of the V4-DSpark ``inference/model.py`` (``DSparkAttention``,
  ``DSparkBlock.forward_embed/forward_head``, ``get_dspark_topk_idxs``): warpfront/hipfire's
  forward spec, two msModelSlim ports; the official V4.1 ``inference/model.py`` [REF41] carries the
  same DSpark classes for V4.1.
* [VL] vLLM: ``models/deepseek_v4/nvidia/dspark.py``, ``v1/worker/gpu/spec_decode/dspark/speculator.py``.

1. Target feature, per token the target processes: the residual stream [hc, d] that block L
   outputs, averaged over the hc streams, for L in ``dspark_target_layer_ids``, concatenated in
   that order -> [S*d] (``ReferenceModel.forward(capture=True)``). [REF] (hipfire: "after the
   block runs ... mean-pool over hc_mult"), [DS] (``hidden_states[L + 1]``, the output of layer
   L). V4.1 takes the stream entering block L [REF41]: a different model, not followed.
2. ``main_x = main_norm(main_proj(feature))`` [d], once, shared by every stage, used only as K/V.
   [REF], [VL] ``combine_hidden_states``, [DS] ``hidden_norm(fc(.))``: all agree.
3. Each stage keeps its own ring (``WindowRing``, ``sliding_window`` rows, position p in slot
   p % window): its own ``wkv`` -> ``kv_norm`` -> RoPE at position p (ratio-0 table) -> FP8 QDQ of
   the nope dims, exactly the main model's window KV (``Attention.project_kv``). The QDQ follows
   [REF41] (its ``DSparkAttention`` quantises context and block KV as its main attention does) and
   [VL] (context KV goes through the main SWA cache's quantising insert); hipfire does not mention
   it and the msModelSlim ports strip ``act_quant`` on purpose (calibration). The reference decode
   writes one context row per draft call; ``extend`` writes any number (every accepted token), as
   [VL] ``precompute_and_store_context_kv`` and [DS] (context += accepted + 1 rows) do.
4. Block: ids [anchor, noise x (B-1)], embedded and repeated to the hc streams, at positions
   p .. p+B-1 where p = ring end: the anchor sits at its own position and the context is every
   position before it. [DS] ``create_position_ids`` / mask (context < anchor position), [REF]
   (``freqs_cis[start_pos + seqlen : + block_size]`` with start_pos the last context position).
5. Attention of a stage: q from the block rows (wq_a, q_norm, wq_b, per-head RMS, RoPE); block K/V
   from the block rows (``project_kv``); every block row attends to the written ring slots and to
   all B block rows, bidirectional inside the block (no causal mask), with the sink; inverse RoPE,
   grouped wo_a + wo_b. [REF] ``get_dspark_topk_idxs`` = slots [0, min(window, p)) then the block
   (that key order is kept: it fixes the 64-key blocks of the softmax), [DS] mask. The ring holds
   the last ``window`` context positions only: V4's stages are ratio-0 sliding-window layers
   (DeepSpec's Qwen3 drafts have no window).
6. Stages chain: stage s+1 takes stage s's [B, hc, d] output; each is a full V4 block (hc_pre ->
   attn_norm -> attention -> hc_post, hc_pre -> ffn_norm -> score-routed MoE -> hc_post), layer id
   ``num_hidden_layers + s``. [REF], [VL] agree.
7. Head: ``y = hc_head(h)`` with the last stage's ``hc_head_*`` (sigmoid weights, no Sinkhorn);
   base logits = the target's ``head(norm(y))`` in fp32 with the last stage's ``norm``. [REF], [VL]
   (the draft returns the pre-norm ``hc_head`` output; ``compute_logits`` = head(norm(.))).
8. Markov loop, i = 0 .. N-1 with tok_0 = anchor: ``e_i = markov_w1[tok_i]`` (bf16 row),
   ``logits_i = base_i + markov_w2 @ e_i`` (fp32), ``tok_{i+1} = sample(logits_i)`` (argmax when
   greedy); draft i+1 = tok_{i+1}, so row 0 (the anchor's row) proposes the first draft. [DS]
   ``VanillaMarkov.sample_block_tokens``, [REF] ``forward_head``, [VL] ``_sample_sequential``: all
   agree. The returned logits are the Markov-corrected ones (what the rejection sampler needs).
9. Confidence: ``c_i = proj([y_i; e_i])`` in fp32 with y the pre-norm ``hc_head`` output, and its
   sigmoid, the estimated acceptance probability of draft i+1. [REF] (fp32 proj of ``cat(x,
   markov_embed).float()``, x = hc_head output), [VL] ``compute_confidence`` (sigmoid of the head
   on the pre-norm hidden), [DS] (``sigmoid(logit) < threshold`` truncates the proposal). [DS]'s
   Qwen3 drafts feed their post-norm hidden (they have no hc_head): the V4 code is followed.
10. N = ``n_tokens`` < B: the block still has all B rows (the draft was trained on blocks of B;
    later rows are keys of earlier ones), the Markov loop runs N steps and the first N drafts,
    logits and confidences are returned, i.e. the first N of the full block. [DS] (proposals are
    always a full block, truncated by confidence), the omlx MLX port (only the last stage's
    queries are narrowed, every block row stays a key). [VL] runs N query rows (anchor + N-1
    noise) instead, which changes the first rows' attention when N < B: not followed.

Numerics follow ``Numerics`` like the main model: bf16 activations with FP8 act-quant GEMMs
('official', 'invariant': fp64-accumulated, so a draft does not depend on how its context was
chunked) or fp32 without quantisation ('exact'); head, Markov and confidence GEMMs are fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .attention import sparse_attention
from .block import Block
from .linear import Linear, make_linear
from .mhc import HyperHead
from .norm import rms_norm
from .numerics import Numerics
from .rope import RopeTable
from .state import DSparkState, WindowRing


@dataclass
class DraftResult:
    """One DSpark proposal of N tokens; row i belongs to draft i+1 (row 0 is the anchor's)."""
    tokens: torch.Tensor             # [N] int64 draft ids
    logits: torch.Tensor             # [N, V] fp32 Markov-corrected logits each draft was sampled from
    confidence_logits: torch.Tensor  # [N] fp32 raw confidence-head outputs
    confidence: torch.Tensor         # [N] fp32 sigmoid of them: estimated acceptance probabilities
    hidden: torch.Tensor             # [N, d] pre-norm hc_head output of the rows (confidence input)


class DSparkStage:
    """Stage s (``mtp.{s}.``): a ratio-0 V4 block whose attention reads the stage's ring."""

    def __init__(self, cfg: ModelConfig, s: int, t: dict, num: Numerics, ropes: dict[int, RopeTable]):
        self.block = Block(cfg, cfg.num_hidden_layers + s, f"mtp.{s}.", t, num, ropes)
        self.attn = self.block.attn                 # layer ids past the main stack have ratio 0

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The ring rows of context positions ``positions`` from their ``main_x`` rows."""
        return self.attn.project_kv(main_x, self.attn.rope(positions))

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, ring: WindowRing) -> torch.Tensor:
        return self.block.run(x, lambda a: self._attend(a, positions, ring), ids)

    def _attend(self, a: torch.Tensor, positions: torch.Tensor, ring: WindowRing) -> torch.Tensor:
        attn, B = self.attn, a.shape[0]
        freqs = attn.rope(positions)
        _, q = attn.project_q(a, freqs)
        kv = attn.project_kv(a, freqs)
        slots, count = ring.keys()
        keys = torch.cat([torch.arange(count, device=a.device),
                          slots.shape[0] + torch.arange(B, device=a.device)])
        o = sparse_attention(q, torch.cat([slots, kv]), keys.expand(B, -1), attn.sink, attn.scale, attn.num)
        return attn.project_out(o, freqs)


class DSparkDraft:
    """The draft of a DSpark checkpoint (``mtp.0`` .. ``mtp.{S-1}``), sharing the target's
    embedding and head. Per-sequence state lives in ``DSparkState`` objects (``new_state``)."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], num: Numerics,
                 ropes: dict[int, RopeTable], head: Linear | None = None):
        if cfg.draft_kind != "dspark":
            raise ValueError("dspark_target_layer_ids: the config announces no DSpark draft")
        if "mtp.0.main_proj.weight" not in tensors:
            raise ValueError("mtp.0.main_proj.weight: the checkpoint has no DSpark draft tensors")
        t, last = tensors, f"mtp.{cfg.num_draft_stages - 1}."
        self.cfg, self.num, self.eps = cfg, num, cfg.rms_norm_eps
        self.block_size, self.noise_id = cfg.dspark_block_size, cfg.dspark_noise_token_id
        self.embed = t["embed.weight"]
        self.main_proj = make_linear(t, "mtp.0.main_proj", num)
        self.main_norm = t["mtp.0.main_norm.weight"].float()
        self.stages = [DSparkStage(cfg, s, t, num, ropes) for s in range(cfg.num_draft_stages)]
        self.hc_head = HyperHead(t[last + "hc_head_fn"], t[last + "hc_head_base"], t[last + "hc_head_scale"],
                                 cfg.hc_eps, cfg.rms_norm_eps, num)
        self.norm = t[last + "norm.weight"].float()
        self.head = head if head is not None else Linear(t["head.weight"], "fp32", num)
        self.markov_w1 = t[last + "markov_head.markov_w1.weight"]            # row lookup, stored dtype
        self.markov_w2 = Linear(t[last + "markov_head.markov_w2.weight"], "fp32", num)
        self.confidence = Linear(t[last + "confidence_head.proj.weight"], "fp32", num)

    @property
    def feature_dim(self) -> int:
        return self.main_proj.weight.shape[1]

    def new_state(self) -> DSparkState:
        cfg, dev = self.cfg, self.embed.device
        return DSparkState([WindowRing(cfg.sliding_window, cfg.head_dim, self.num.act_dtype, dev)
                            for _ in self.stages])

    @torch.no_grad()
    def extend(self, state: DSparkState, features: torch.Tensor, p0: int) -> None:
        """Write the context rows of positions p0 .. p0+n-1 (``features`` [n, S*d], captured by
        the target for those tokens) into every stage's ring; p0 must be ``state.pos``. Call it
        for the prompt (any chunking) and for every committed token; drafts nothing."""
        if features.dim() != 2 or features.shape[1] != self.feature_dim:
            raise ValueError(f"features must be [n, {self.feature_dim}] (len(dspark_target_layer_ids) * "
                             f"hidden_size), got {list(features.shape)}")
        if p0 != state.pos:
            raise ValueError(f"DSpark context rows must continue at position {state.pos}, got position {p0}")
        positions = torch.arange(p0, p0 + features.shape[0], device=features.device)
        main_x = rms_norm(self.main_proj(features), self.main_norm, self.eps, self.num)
        for stage, ring in zip(self.stages, state.rings):
            ring.write(stage.context_kv(main_x, positions), p0)

    @torch.no_grad()
    def draft(self, state: DSparkState, anchor: int, n_tokens: int | None = None,
              sampler: Callable[[torch.Tensor], int] | None = None) -> DraftResult:
        """Propose ``n_tokens`` (default and at most ``dspark_block_size``) tokens after ``anchor``,
        the token at position ``state.pos``. ``sampler`` maps a row's fp32 logits [V] to a token
        id; None is greedy (argmax). The state is not changed."""
        B, V = self.block_size, self.embed.shape[0]
        n = B if n_tokens is None else n_tokens
        if not 1 <= n <= B:
            raise ValueError(f"num_speculative_tokens must be in 1..dspark_block_size={B}, got {n}")
        if not 0 <= anchor < V:
            raise ValueError(f"anchor token id {anchor} is outside the vocabulary (0..{V - 1})")
        p = state.pos
        if p == 0:
            raise ValueError("DSpark needs context before it drafts: extend the state with the prompt's features first")
        dev = self.embed.device
        ids = torch.full((B,), self.noise_id, dtype=torch.long, device=dev)
        ids[0] = anchor
        positions = torch.arange(p, p + B, device=dev)
        x = self.num.round(F.embedding(ids, self.embed)).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        for stage, ring in zip(self.stages, state.rings):
            x = stage(x, ids, positions, ring)
        y = self.hc_head(x)                                                    # [B, d], pre-norm
        base = self.head(rms_norm(y, self.norm, self.eps, self.num)).float()  # [B, V]
        tokens, logits, embeds, prev = [], [], [], anchor
        for i in range(n):
            e = self.markov_w1[prev]
            row = base[i] + self.markov_w2(e.unsqueeze(0)).float()[0]
            prev = int(row.argmax()) if sampler is None else int(sampler(row))
            if not 0 <= prev < V:
                raise ValueError(f"the sampler returned token id {prev}, outside the vocabulary (0..{V - 1})")
            tokens.append(prev)
            logits.append(row)
            embeds.append(e)
        conf = self.confidence(torch.cat([y[:n].float(), torch.stack(embeds).float()], dim=-1)).float()[:, 0]
        return DraftResult(torch.tensor(tokens, dtype=torch.long, device=dev), torch.stack(logits),
                           conf, self.num.fn(torch.sigmoid, conf), y[:n])
