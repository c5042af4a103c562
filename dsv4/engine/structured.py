"""Structured outputs: decoding constrained by a grammar, with llguidance.

A request's ``StructuredOutputsParams`` (JSON schema, JSON object, regex, choice or Lark grammar)
is compiled once by :class:`GrammarCompiler` into an llguidance grammar; every sample of the
request (``n > 1``) gets its own ``LLMatcher`` (``CompiledGrammar.matcher``), which lives on the
``Sequence`` and advances by exactly the tokens appended to ``output_ids``. A preempted sequence
keeps its output tokens and re-prefills them, so its matcher is already at the right state when
the next token is sampled; nothing is rolled back or replayed.

Per step the sampler calls :func:`fill_bitmask` for the constrained rows of the batch (one
``[k, ceil(V/32)]`` int32 bitmask, one row per constrained sequence, filled by llguidance's
executor in parallel) and :func:`apply_bitmask` once on those rows' logits; unconstrained rows are
not touched (the batch's logits are copied once when any row is constrained), and a batch without
constrained rows never calls into llguidance.

Cost per step, measured on the 2-core CPU with one torch thread (vocabulary 129,280;
``experiments/exp_structured_mask.py``, walking each grammar as the random tiny model does):

* llguidance's mask for one row: median 0.03-0.04 ms for JSON schemas, JSON objects and the DSML
  tool-call grammar (their lexer states repeat and llguidance caches them), 0.4-0.6 ms for a
  bounded regex whose state changes every step; at most ~3 ms (a state whose allowed set is
  nearly the whole vocabulary, walked for the first time);
* applying it: ~0.25 ms per constrained row (unpacking 129,280 bits, one ``masked_fill``);
* advancing the matcher by the sampled token: ~5 us;
* the whole sampler: +0.6-1.2 ms per constrained row on top of ~1.1 ms per greedy row.

So a constrained row costs about 1 ms per step here, against a decode step of ~200 ms for the tiny
model on this CPU. Compiling a grammar takes 1-3 ms (JSON schema, DSML tool call), once per request
(``n`` samples copy the compiled matcher); the first compile builds llguidance's tokenizer (~1.2 s).

The bitmask is filled through llguidance's matcher / executor calls directly and applied with plain
torch ops: ``llguidance.torch`` would do the same but importing it costs 2.6 s (it sets up
``torch.compile``) and its ``apply_token_bitmask_inplace`` is compiled on its first call (22 s on this
CPU, and it needs a C compiler). The bit layout is llguidance's: bit ``t % 32`` of word ``t // 32``
allows token ``t``.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import torch

from .sampling_params import StructuredOutputsParams

__all__ = ["GrammarCompiler", "CompiledGrammar", "grammar_source", "fill_bitmask", "apply_bitmask",
           "JSON_COMPACT", "JSON_FLEXIBLE", "JSON_WHITESPACE", "first_line"]

#: JSON whitespace by default: none (``{"a":1,"b":[2,3]}``), as OpenAI's structured outputs and
#: vLLM's ``disable_any_whitespace`` give it: a model unsure of its next token cannot fill its
#: output with blanks and newlines (llguidance's own default allows any amount).
JSON_COMPACT = {"whitespace_flexible": False}
#: With ``disable_any_whitespace=False``: at each place JSON allows whitespace, none, one space, or
#: a newline and up to 20 spaces / tabs of indentation (one-line ``{"a": 1}`` and pretty-printed
#: JSON fit; runs of blanks still do not).
JSON_WHITESPACE = r"(\x20|\n[\x20\t]{0,20})"
JSON_FLEXIBLE = {"whitespace_pattern": JSON_WHITESPACE}
THINK_END = "</think>"
_MAX_ERROR_CHARS = 2000


def first_line(msg: str) -> str:
    """The first line of an llguidance error (the rest is a dump of the parser state)."""
    return msg.strip().split("\n", 1)[0]


def _json_grammar(schema, compact: bool) -> str:
    import llguidance as llg
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_COMPACT if compact else JSON_FLEXIBLE)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid JSON schema: {e}") from None


def grammar_source(spec: StructuredOutputsParams, think_end_id: Optional[int] = None) -> str:
    """The llguidance grammar (its JSON text) for ``spec``; not yet checked against a tokenizer.
    ``spec.thinking`` needs ``think_end_id``, the id of V4's ``</think>`` token."""
    import llguidance as llg
    if spec.json is not None:
        g = _json_grammar(spec.json, spec.disable_any_whitespace)
    elif spec.json_object:
        g = _json_grammar({"type": "object"}, spec.disable_any_whitespace)
    elif spec.regex is not None:
        g = llg.LLMatcher.grammar_from_regex(spec.regex)
    elif spec.choice is not None:
        # JSON string escapes are valid Lark string literals
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        g = json.dumps({"grammars": [{"lark_grammar": lark}]})
    else:
        g = json.dumps({"grammars": [{"lark_grammar": spec.grammar}]})
    if not spec.thinking:
        return g
    if think_end_id is None:
        raise ValueError(f"the tokenizer has no {THINK_END} token, so a thinking-mode grammar cannot be built")
    top = json.loads(g)
    inner = top["grammars"]
    inner[0]["name"] = "answer"
    # reasoning: any text that does not spell "</think>"; then the </think> token itself
    wrapper = {"name": "reasoning",
               "lark_grammar": f"start: REASONING <[{int(think_end_id)}]> @answer\n"
                               "REASONING: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/\n"}
    return json.dumps({**top, "grammars": [wrapper] + inner})


class CompiledGrammar:
    """A validated grammar; :meth:`matcher` gives a fresh matcher at its start (a copy of a
    template matcher, cheaper than compiling again)."""

    def __init__(self, source: str, template):
        self.source = source
        self._template = template

    def matcher(self):
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer, with an LRU cache of compiled
    grammars keyed by the grammar text. Thread-safe: the server compiles (and so validates) a
    request's grammar on a worker thread before the engine thread adds the request, whose own
    compile is then a cache hit. The llguidance tokenizer (~1.2 s to build for V4's
    vocabulary) is built on first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int, cache_size: int = 64):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_id = int(eos_token_id)
        self.think_end_id = tokenizer.token_to_id(THINK_END)
        self.cache_size = cache_size
        self._ll = None
        self._ll_lock = threading.Lock()       # held while the tokenizer is built (seconds)
        self._lock = threading.Lock()          # the cache (never held long: the engine thread takes it)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    @property
    def ll_tokenizer(self):
        with self._ll_lock:
            if self._ll is None:
                import llguidance as llg
                # the tokenizer.json text: llguidance reads the byte-level BPE vocabulary from it
                self._ll = llg.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                           eos_token=self.eos_token_id)
            return self._ll

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Raises ``ValueError`` naming what is wrong with the schema / grammar."""
        import llguidance as llg
        source = grammar_source(spec, self.think_end_id)
        with self._lock:
            hit = self._cache.get(source)
            if hit is not None:
                self._cache.move_to_end(source)
                return hit
        m = llg.LLMatcher(self.ll_tokenizer, source, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid grammar: {m.get_error()[:_MAX_ERROR_CHARS]}")
        compiled = CompiledGrammar(source, m)
        with self._lock:
            self._cache[source] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


# ---------------------------------------------------------------------------------------------
# the per-step mask
# ---------------------------------------------------------------------------------------------

_executor = None
_BITS: dict = {}                  # device -> arange(32) int32, the bit positions of a mask word


def _get_executor():
    global _executor
    if _executor is None:
        import llguidance as llg
        _executor = llg.LLExecutor()
    return _executor


def fill_bitmask(matchers: Sequence, vocab_size: int) -> tuple[torch.Tensor, list[Optional[str]]]:
    """The next-token bitmask of each matcher: ``[len(matchers), ceil(vocab_size / 32)]`` int32 on
    the CPU (bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed; pinned when CUDA is
    there), and per row None or the error of a matcher that is (or just went) into an error state;
    such a row allows nothing. (``llguidance.torch`` does the same, but importing it costs 2.6 s:
    it sets up ``torch.compile``.)"""
    words = (vocab_size + 31) // 32
    bm = torch.full((len(matchers), words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
    errors: list[Optional[str]] = [None] * len(matchers)
    live = []
    for i, m in enumerate(matchers):
        if m.is_error():
            errors[i] = first_line(m.get_error())
        else:
            live.append((m, i))
    if len(live) == 1:
        m, i = live[0]
        m.unsafe_compute_mask_ptr(bm[i].data_ptr(), words * 4)
    elif live:
        _get_executor().unsafe_compute_mask_ptr(live, bm.data_ptr(), words * 4, len(matchers))
    for m, i in live:
        if m.is_error():
            errors[i] = first_line(m.get_error())
    for i, e in enumerate(errors):
        if e is not None:
            bm[i] = 0
    return bm, errors


def apply_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``x`` [k, V] with the tokens a bitmask row disallows set to -inf (a new tensor)."""
    bits = _BITS.get(x.device)
    if bits is None:
        bits = _BITS[x.device] = torch.arange(32, dtype=torch.int32, device=x.device)
    k, V = x.shape
    bm = bitmask.to(x.device, non_blocking=True)
    allowed = ((bm.unsqueeze(-1) >> bits) & 1).view(k, -1)[:, :V].bool()
    return x.masked_fill(~allowed, float("-inf"))
