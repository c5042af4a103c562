"""Batched token sampler (pure torch, device-agnostic) and stop-condition helpers.

Pipeline for one decode step, per row (vLLM order)::

    non-finite check -> [grammar mask] -> [logit_bias] -> [min_tokens: mask eos/stop ids]
        -> penalties -> (greedy rows: argmax, ties -> lowest id)
        -> temperature -> top-k -> top-p -> min-p -> sample (exponential race, per-row RNG)

* Rows whose *raw* logits hold NaN or +-inf are never sampled: their token is ``-1`` and
  ``SamplerOutput.errors[i]`` says why. Other rows in the batch are unaffected.
* Grammar mask (structured outputs): rows with a matcher (``matchers[i]``, an llguidance
  ``LLMatcher``) get the tokens their grammar disallows set to -inf, through one bitmask for all
  constrained rows (``engine.structured``; its docstring gives the cost per step). Rows without a
  matcher are not touched. A matcher in an error state, or one that allows no token, fails its
  row (token ``-1``, ``errors[i]``). The sampler only reads the matchers: the engine advances them
  with the tokens it appends.
* ``logit_bias`` (OpenAI): ``params.logit_bias[t]`` is added to token ``t``'s logit.
* ``logprobs`` are ``log_softmax`` of the logits **after the grammar mask, logit_bias, the
  min_tokens mask and penalties and before temperature / top-k / top-p / min-p**, i.e. the
  model's distribution as adjusted by those. (vLLM by default returns the raw model log-probs;
  with none of them set the two are identical.)
* Reproducibility: a seeded request owns its ``torch.Generator`` (``make_generator``); each step it
  draws exactly one ``[1, V]`` noise tensor from it, and every operation before that is row-wise, so
  the tokens do not depend on what else is in the batch.

The stop-condition logic (``StopChecker`` / ``check_stop`` / ``stop_holdback_len``) is used by the
engine after detokenization; the sampler itself never ends a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional, Sequence, Union

import torch

from .sampling_params import SamplingParams

__all__ = [
    "NonFiniteLogitsError",
    "SamplerOutput",
    "Sampler",
    "apply_penalties",
    "make_generator",
    "StopResult",
    "StopChecker",
    "check_stop",
    "stop_holdback_len",
]

EosIds = Union[int, Iterable[int], None]


class NonFiniteLogitsError(RuntimeError):
    """Raised (or reported per row) when logits contain NaN or +-inf."""


@dataclass
class SamplerOutput:
    #: one sampled token id per row; ``-1`` for rows that could not be sampled (see ``errors``)
    token_ids: list[int]
    #: per row: None (logprobs not requested / row failed) or {token_id: logprob}; holds the
    #: top-``params.logprobs`` tokens plus the chosen token
    logprobs: list[Optional[dict[int, float]]]
    #: per row: None, or a message explaining why the row has no token
    errors: list[Optional[str]] = field(default_factory=list)
    #: per row with logprobs: the chosen token's rank in the logprobs' distribution (1 = the most
    #: likely; vLLM's ``Logprob.rank``), else None
    ranks: list[Optional[int]] = field(default_factory=list)
    #: with ``want_probs``: {row: fp32 [V]} the distribution each sampled (non-greedy) row was drawn
    #: from (after penalties, temperature, top-k, top-p, min-p): speculative rejection sampling's target
    probs: dict = field(default_factory=dict)

    def raise_for_errors(self) -> None:
        """Raise ``NonFiniteLogitsError`` if any row failed."""
        bad = [(i, e) for i, e in enumerate(self.errors) if e is not None]
        if bad:
            raise NonFiniteLogitsError("; ".join(f"row {i}: {e}" for i, e in bad))


def make_generator(seed: Optional[int], device: Union[str, torch.device, None] = "cpu"
                   ) -> Optional[torch.Generator]:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``; ``None`` if ``seed`` is None
    (the row then uses the global RNG)."""
    if seed is None:
        return None
    dev = torch.device(device if device is not None else "cpu")
    g = torch.Generator(device=dev)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


# ---------------------------------------------------------------------------------------------
# penalties
# ---------------------------------------------------------------------------------------------

def _token_counts(rows: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] float32 counts of each token id per row. Ids outside [0, vocab) are
    ignored (they are routed to a padding column that is dropped)."""
    n = len(rows)
    max_len = max((len(r) for r in rows), default=0)
    if max_len == 0:
        return torch.zeros(n, vocab, dtype=torch.float32, device=device)
    ids = torch.full((n, max_len), vocab, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    ids = ids.to(device)
    ids = torch.where((ids < 0) | (ids > vocab), torch.full_like(ids, vocab), ids)
    counts = torch.zeros(n, vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor,
                    prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]],
                    params: Sequence[SamplingParams]) -> torch.Tensor:
    """vLLM penalty semantics, batched. Returns a new tensor (the input is not modified); returns
    ``logits`` itself when no row has penalties.

    * repetition penalty ``r`` on every token seen in prompt OR output: ``l / r`` if ``l > 0``
      else ``l * r``;
    * frequency penalty: ``l -= frequency_penalty * count_in_output``;
    * presence penalty: ``l -= presence_penalty * (count_in_output > 0)``.

    Also accepts one row: ``logits`` [V], ``prompt_token_ids`` list[int], ``output_token_ids``
    list[int], ``params`` a single ``SamplingParams``.
    """
    if logits.dim() == 1:
        return apply_penalties(logits[None], [prompt_token_ids], [output_token_ids],
                               [params])[0]
    if isinstance(params, SamplingParams):
        params = [params]
    B, V = logits.shape
    if not (len(params) == len(prompt_token_ids) == len(output_token_ids) == B):
        raise ValueError("apply_penalties: logits, prompt_token_ids, output_token_ids and params "
                         "must have the same batch size")
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    dev = logits.device
    sub = logits[rows].to(torch.float32)
    out_counts = _token_counts([output_token_ids[i] for i in rows], V, dev)

    rep = torch.tensor([params[i].repetition_penalty for i in rows], dtype=torch.float32,
                       device=dev)[:, None]
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=torch.float32,
                        device=dev)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=torch.float32,
                        device=dev)[:, None]

    if any(params[i].repetition_penalty != 1.0 for i in rows):
        prompt_seen = _token_counts([prompt_token_ids[i] for i in rows], V, dev) > 0
        seen = prompt_seen | (out_counts > 0)
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
    sub = sub - freq * out_counts
    sub = sub - pres * (out_counts > 0).to(torch.float32)

    out = logits.to(torch.float32, copy=True)
    out[rows] = sub
    return out


# ---------------------------------------------------------------------------------------------
# filters (operate on a sub-batch; every op is row-wise so results don't depend on the batch)
# ---------------------------------------------------------------------------------------------

#: top-p first looks for the nucleus among this many highest-logit tokens (exact: rows whose
#: nucleus may extend past them fall back to a full sort)
TOP_P_CANDIDATES = 1024


def _top_k_mask(sub: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Keep exactly k tokens per row; among logits equal to the k-th largest value the lowest
    token ids are kept. O(V) per row (topk + compares), independent of topk's tie order."""
    dev = sub.device
    kmax = max(ks)
    k_t = torch.tensor(ks, device=dev)[:, None]
    kth = torch.topk(sub, kmax, dim=-1).values.gather(1, k_t - 1)          # [N, 1]
    greater = sub > kth
    n_gt = greater.sum(dim=-1, keepdim=True)
    eq = sub == kth
    eq_rank = torch.cumsum(eq.to(torch.int32), dim=-1)
    keep = greater | (eq & (eq_rank <= (k_t - n_gt)))
    return sub.masked_fill(~keep, float("-inf"))


def _nucleus_drop(sorted_x: torch.Tensor, probs_sorted: torch.Tensor, ps: torch.Tensor
                  ) -> torch.Tensor:
    """Drop mask (sorted space): keep the fewest leading tokens whose mass reaches p."""
    cum = torch.cumsum(probs_sorted, dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    pos = torch.arange(sorted_x.shape[-1], device=sorted_x.device)[None, :]
    return (before >= ps) & (pos > 0)


def _top_p_full_sort(sub: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    sorted_x, order = torch.sort(sub, dim=-1, descending=True, stable=True)
    drop = _nucleus_drop(sorted_x, torch.softmax(sorted_x, dim=-1), ps)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(sub).scatter_(1, order, sorted_x)


def _top_p(sub: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Minimal nucleus per row; ties in the sort order are broken towards the lowest token id.
    Fast path: stable-sort only the TOP_P_CANDIDATES best tokens, which is exact whenever the
    candidates strictly above the smallest candidate value already hold mass >= p (decided per
    row from its own data, so the result does not depend on the batch)."""
    N, V = sub.shape
    C = min(V, TOP_P_CANDIDATES)
    if C == V:
        return _top_p_full_sort(sub, ps)
    probs = torch.softmax(sub, dim=-1)
    vals, idx = torch.topk(sub, C, dim=-1)
    # deterministic order: value descending, token id ascending
    idx, perm = torch.sort(idx, dim=-1)
    vals = vals.gather(1, perm)
    vals, perm = torch.sort(vals, dim=-1, descending=True, stable=True)
    idx = idx.gather(1, perm)
    pr = probs.gather(1, idx)
    smallest = vals[:, -1:]
    ok = ((pr * (vals > smallest)).sum(dim=-1, keepdim=True) >= ps)[:, 0]   # [N]
    drop = _nucleus_drop(vals, pr, ps)
    fast = torch.full_like(sub, float("-inf")).scatter_(
        1, idx, vals.masked_fill(drop, float("-inf")))
    ok_list = ok.tolist()
    if all(ok_list):
        return fast
    slow_rows = [i for i, o in enumerate(ok_list) if not o]
    st = torch.tensor(slow_rows, device=sub.device)
    fast[st] = _top_p_full_sort(sub[st], ps[st])
    return fast


def _apply_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """x: [N, V] temperature-scaled logits. top_k[i] <= 0 or >= V: off; top_p[i] >= 1: off.
    Keeps exactly k candidates (ties broken towards the lowest token id) and then the minimal
    nucleus: the fewest highest-probability tokens whose cumulative probability reaches p."""
    N, V = x.shape
    k_rows = [i for i in range(N) if 0 < top_k[i] < V]
    p_rows = [i for i in range(N) if top_p[i] < 1.0]
    if not k_rows and not p_rows:
        return x
    dev = x.device
    x = x.clone()
    if k_rows:
        kt = torch.tensor(k_rows, device=dev)
        x[kt] = _top_k_mask(x[kt], [top_k[i] for i in k_rows])
    if p_rows:
        pt = torch.tensor(p_rows, device=dev)
        ps = torch.tensor([top_p[i] for i in p_rows], dtype=torch.float32, device=dev)[:, None]
        x[pt] = _top_p(x[pt], ps)
    return x


def _apply_min_p(x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p * max_prob`` (vLLM semantics)."""
    need = [i for i, m in enumerate(min_p) if m > 0.0]
    if not need:
        return x
    sub = x[need]
    probs = torch.softmax(sub, dim=-1)
    mp = torch.tensor([min_p[i] for i in need], dtype=torch.float32, device=x.device)[:, None]
    thr = mp * probs.max(dim=-1, keepdim=True).values
    sub = sub.masked_fill(probs < thr, float("-inf"))
    x = x.clone()
    x[need] = sub
    return x


def _as_id_set(eos: EosIds) -> set[int]:
    if eos is None:
        return set()
    if isinstance(eos, int):
        return {eos}
    return {int(t) for t in eos}


# ---------------------------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------------------------

class Sampler:
    """Batched sampler. ``eos_token_id`` (int or ids) is only used to suppress EOS while a row
    has generated fewer than ``params.min_tokens`` tokens (vLLM's min_tokens logits processor
    also suppresses ``stop_token_ids`` then)."""

    def __init__(self, eos_token_id: EosIds = None):
        self.eos_token_ids = _as_id_set(eos_token_id)

    def __call__(self,
                 logits: torch.Tensor,
                 params: Sequence[SamplingParams],
                 prompt_ids: Optional[Sequence[Sequence[int]]] = None,
                 output_ids: Optional[Sequence[Sequence[int]]] = None,
                 generators: Optional[Sequence[Optional[torch.Generator]]] = None,
                 matchers: Optional[Sequence] = None,
                 forced: Optional[Sequence[Optional[int]]] = None,
                 want_probs: bool = False,
                 ) -> SamplerOutput:
        """``forced``: per row None or a token id the row takes instead of a draw (speculative
        decoding decided it; the row's logprobs and rank are reported for it). ``want_probs``: fill
        ``SamplerOutput.probs``."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        B, V = logits.shape
        if len(params) != B:
            raise ValueError(f"got {len(params)} SamplingParams for {B} logits rows")
        prompt_ids = list(prompt_ids) if prompt_ids is not None else [[] for _ in range(B)]
        output_ids = list(output_ids) if output_ids is not None else [[] for _ in range(B)]
        generators = list(generators) if generators is not None else [None] * B
        matchers = list(matchers) if matchers is not None else [None] * B
        if not (len(prompt_ids) == len(output_ids) == len(generators) == len(matchers) == B):
            raise ValueError("prompt_ids, output_ids, generators and matchers must have one entry per row")

        dev = logits.device
        x = logits.to(torch.float32)
        token_ids: list[int] = [-1] * B
        logprobs: list[Optional[dict[int, float]]] = [None] * B
        errors: list[Optional[str]] = [None] * B
        ranks: list[Optional[int]] = [None] * B

        # ---- 1. non-finite rows (checked on the raw logits, before any processing) ----------
        finite = torch.isfinite(x)
        row_ok = finite.all(dim=-1)
        if not bool(row_ok.all()):
            n_nan = torch.isnan(x).sum(dim=-1).tolist()
            n_inf = torch.isinf(x).sum(dim=-1).tolist()
            for i, ok in enumerate(row_ok.tolist()):
                if not ok:
                    errors[i] = (f"non-finite logits (NaN={n_nan[i]}, inf={n_inf[i]} of {V}); "
                                 f"row not sampled")
            x = torch.where(row_ok[:, None], x, torch.zeros((), dtype=x.dtype, device=dev))
        good = [i for i in range(B) if errors[i] is None]
        if not good:
            return SamplerOutput(token_ids, logprobs, errors, ranks)

        # ---- 2a. grammar mask: one bitmask for the constrained rows, applied once -----------
        cons = [i for i in good if matchers[i] is not None]
        if cons:
            from .structured import apply_bitmask, fill_bitmask
            bm, merr = fill_bitmask([matchers[i] for i in cons], V)
            empty = (bm == 0).all(dim=-1).tolist()
            for j, i in enumerate(cons):
                if merr[j] is not None:
                    errors[i] = f"structured output: the grammar matcher failed: {merr[j]}"
                elif empty[j]:
                    errors[i] = "structured output: the grammar allows no next token"
            x = x.clone() if x is logits else x
            ci = torch.tensor(cons, device=dev)
            x[ci] = apply_bitmask(x[ci], bm)
            good = [i for i in good if errors[i] is None]
            if not good:
                return SamplerOutput(token_ids, logprobs, errors, ranks)

        # ---- 2b. logit_bias: added to the listed tokens' logits -----------------------------
        bias_rows, bias_cols, bias_vals = [], [], []
        for i in good:
            for t, b in (params[i].logit_bias or {}).items():
                if 0 <= t < V:
                    bias_rows.append(i)
                    bias_cols.append(t)
                    bias_vals.append(b)
        if bias_rows:
            x = x.clone() if x is logits else x
            x.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev)),
                         torch.tensor(bias_vals, dtype=x.dtype, device=dev), accumulate=True)

        # ---- 2c. min_tokens: suppress eos / stop token ids ----------------------------------
        mask_rows, mask_cols = [], []
        for i in good:
            p = params[i]
            if p.min_tokens > 0 and len(output_ids[i]) < p.min_tokens:
                ids = set(p.stop_token_ids)
                if not p.ignore_eos:
                    ids |= self.eos_token_ids
                for t in ids:
                    if 0 <= t < V:
                        mask_rows.append(i)
                        mask_cols.append(t)
        if mask_rows:
            x = x.clone() if x is logits else x
            x[torch.tensor(mask_rows, device=dev), torch.tensor(mask_cols, device=dev)] = \
                float("-inf")

        # ---- 3. penalties ------------------------------------------------------------------
        checked = x
        x = apply_penalties(x, prompt_ids, output_ids, params)
        # processed logits may legitimately hold -inf (masks) but not NaN / +inf / all -inf; logits no
        # step changed are the finite ones checked in 1 (one sync and eight launches fewer per step)
        changed = x is not checked or bool(cons) or bool(bias_rows) or bool(mask_rows)
        bad_after = torch.isnan(x).any(-1) | torch.isposinf(x).any(-1) | torch.isneginf(x).all(-1) \
            if changed else None
        if changed and bool(bad_after[good].any()):
            for i in good:
                if bool(bad_after[i]):
                    errors[i] = ("logits became non-finite (or every token was masked) after the grammar mask, "
                                 "logit_bias, min_tokens and penalties; row not sampled")
            good = [i for i in good if errors[i] is None]
            x = torch.where(bad_after[:, None], torch.zeros((), dtype=x.dtype, device=dev), x)

        greedy = [i for i in good if params[i].is_greedy]
        rand = [i for i in good if not params[i].is_greedy]

        # ---- 4a. greedy rows: argmax (first maximal index = lowest id on ties) --------------
        if len(greedy) == B:                    # every row greedy and good: no gather, no scatter
            chosen = torch.argmax(x, dim=-1)
        else:
            chosen = torch.full((B,), -1, dtype=torch.long, device=dev)
        if greedy and len(greedy) < B:
            gi = torch.tensor(greedy, device=dev)
            chosen[gi] = torch.argmax(x[gi], dim=-1)

        # ---- 4b. random rows: temperature -> top-k -> top-p -> min-p -> sample ---------------
        if rand:
            ri = torch.tensor(rand, device=dev)
            temps = torch.tensor([params[i].temperature for i in rand], dtype=torch.float32,
                                 device=dev)[:, None]
            xr = x[ri] / temps
            xr = _apply_top_k_top_p(xr, [params[i].top_k for i in rand],
                                    [params[i].top_p for i in rand])
            xr = _apply_min_p(xr, [params[i].min_p for i in rand])
            probs = torch.softmax(xr, dim=-1)

            # group rows by generator object (None = global RNG); a seeded request owns its
            # generator, so its group is just that row -> batch-independent draws
            groups: dict[int, tuple[Optional[torch.Generator], list[int]]] = {}
            for j, i in enumerate(rand):
                g = generators[i]
                groups.setdefault(id(g) if g is not None else 0, (g, []))[1].append(j)
            sampled = torch.empty(len(rand), dtype=torch.long, device=dev)
            tiny = torch.finfo(torch.float32).tiny
            for g, js in groups.values():
                gdev = g.device if g is not None else dev
                q = torch.empty(len(js), V, dtype=torch.float32, device=gdev)
                q.exponential_(generator=g)
                q = q.clamp_min_(tiny).to(dev)
                jt = torch.tensor(js, device=dev)
                # exponential race: argmax p_i / E_i  ~  Categorical(p)
                sampled[jt] = torch.argmax(probs[jt] / q, dim=-1)
            chosen[ri] = sampled

        if forced is not None:
            fi = [i for i in good if forced[i] is not None]
            if fi:
                chosen[torch.tensor(fi, device=dev)] = torch.tensor([forced[i] for i in fi], device=dev)
        probs_out = {}
        if want_probs and rand:
            probs_out = {i: probs[j] for j, i in enumerate(rand)}
        chosen_list = chosen.tolist()
        for i in good:
            token_ids[i] = int(chosen_list[i])

        # ---- 5. logprobs (after penalties, before temperature & filters) --------------------
        lp_rows = [i for i in good if params[i].logprobs is not None]
        if lp_rows:
            li = torch.tensor(lp_rows, device=dev)
            lp = torch.log_softmax(x[li], dim=-1)
            k = max(params[i].logprobs for i in lp_rows)
            chosen_lp_t = lp.gather(1, chosen[li][:, None])
            chosen_lp = chosen_lp_t[:, 0].tolist()
            for r, rank in zip(lp_rows, ((lp > chosen_lp_t).sum(-1) + 1).tolist()):
                ranks[r] = int(rank)
            if k > 0:
                top_v, top_i = torch.topk(lp, min(k, V), dim=-1)
                top_v, top_i = top_v.tolist(), top_i.tolist()
            for r, i in enumerate(lp_rows):
                d: dict[int, float] = {}
                n = params[i].logprobs
                if n > 0:
                    for t, v in zip(top_i[r][:n], top_v[r][:n]):
                        d[int(t)] = float(v)
                d.setdefault(token_ids[i], float(chosen_lp[r]))
                logprobs[i] = d

        return SamplerOutput(token_ids, logprobs, errors, ranks, probs_out)


# ---------------------------------------------------------------------------------------------
# stop conditions
# ---------------------------------------------------------------------------------------------

class StopResult(NamedTuple):
    finished: bool
    finish_reason: Optional[str]          # 'stop' | 'length' | None
    text: str                             # text to keep (stop string trimmed when applicable)
    stop_reason: Union[int, str, None]    # matched stop string / stop token id (vLLM extra)


def stop_holdback_len(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of ``text`` must not be streamed yet because they are a
    (proper) prefix of some stop string and could turn into a stop match with the next token."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopChecker:
    """Stop logic for one request, vLLM-style. Order of checks for a new token:

    1. fewer than ``min_tokens`` generated -> never finished (eos/stop ids/stop strings ignored);
    2. eos (unless ``ignore_eos``) -> 'stop' (text untouched);
    3. token in ``stop_token_ids`` -> 'stop' (text untouched; the token stays in the output);
    4. a stop string in the text -> 'stop', text cut before it (or after it with
       ``include_stop_str_in_output``);
    5. ``num_generated >= max_tokens`` -> 'length'.
    """

    def __init__(self, params: SamplingParams, eos_token_id: EosIds = None,
                 max_tokens: Optional[int] = None):
        self.params = params
        self.eos_token_ids = _as_id_set(eos_token_id)
        #: effective limit: the smaller of ``params.max_tokens`` and the engine's value (what is left
        #: of the model length after the prompt); either may be None (no limit from that side)
        limits = [m for m in (params.max_tokens, max_tokens) if m is not None]
        self.max_tokens = min(limits) if limits else None

    def check(self, text_so_far: str, new_token_id: int, num_generated: int,
              new_text_len: Optional[int] = None) -> StopResult:
        """``text_so_far``: all generated text including the new token's; ``num_generated``:
        number of generated tokens including the new one; ``new_text_len``: chars the new token
        added (stop strings are then searched only where they could newly appear; None = search
        the whole text)."""
        p = self.params
        if num_generated < p.min_tokens:
            return StopResult(False, None, text_so_far, None)
        if not p.ignore_eos and new_token_id in self.eos_token_ids:
            return StopResult(True, "stop", text_so_far, None)
        if new_token_id in p.stop_token_ids:
            return StopResult(True, "stop", text_so_far, new_token_id)
        if p.stop:
            best: Optional[tuple[int, str]] = None
            for s in p.stop:
                start = 0
                if new_text_len is not None:
                    start = max(0, len(text_so_far) - new_text_len - len(s) + 1)
                idx = text_so_far.find(s, start)
                if idx >= 0 and (best is None or idx < best[0]):
                    best = (idx, s)
            if best is not None:
                idx, s = best
                end = idx + len(s) if p.include_stop_str_in_output else idx
                return StopResult(True, "stop", text_so_far[:end], s)
        if self.max_tokens is not None and num_generated >= self.max_tokens:
            return StopResult(True, "length", text_so_far, None)
        return StopResult(False, None, text_so_far, None)

    def holdback(self, text_so_far: str) -> int:
        """Trailing characters to withhold from a stream (see ``stop_holdback_len``)."""
        return stop_holdback_len(text_so_far, self.params.stop)


def check_stop(text_so_far: str, new_token_id: int, params: SamplingParams,
               eos_token_id: EosIds, num_generated: int, *,
               new_text_len: Optional[int] = None, max_tokens: Optional[int] = None
               ) -> tuple[bool, Optional[str], str]:
    """Functional form of ``StopChecker.check``: returns ``(finished, finish_reason,
    trimmed_text)``. ``max_tokens`` is the engine's limit; the smaller of it and ``params.max_tokens`` holds."""
    r = StopChecker(params, eos_token_id, max_tokens).check(
        text_so_far, new_token_id, num_generated, new_text_len)
    return r.finished, r.finish_reason, r.text
