"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

Field names, defaults and accepted ranges follow ``vllm/sampling_params.py`` (see
``shared/spec/serving-conventions.md`` §1.2) so that the offline API (§1.6) and the HTTP server
can pass user values straight through:

================================  =========  ============================================
field                             default    accepted values
================================  =========  ============================================
``n``                             1          int >= 1
``temperature``                   1.0        float >= 0; < 1e-5 means greedy (argmax)
``top_p``                         1.0        float in (0, 1]; 1 = off
``top_k``                         -1         int >= 1, or -1 / 0 / None = off (stored as -1)
``min_p``                         0.0        float in [0, 1]; 0 = off
``seed``                          None       int or None
``presence_penalty``              0.0        float in [-2, 2]
``frequency_penalty``             0.0        float in [-2, 2]
``repetition_penalty``            1.0        float > 0; 1 = off
``stop``                          None       str | list[str] | None, no empty strings
                                             (stored as a list, ``[]`` when None)
``stop_token_ids``                None       list[int] of ids >= 0 (stored as a list)
``max_tokens``                    16         int >= 0 (0: score the prompt only), or None = up to the
                                             model length
``min_tokens``                    0          int >= 0, <= max_tokens
``ignore_eos``                    False      bool
``logprobs``                      None       int in [0, 20] or None
``prompt_logprobs``               None       int >= 0 or None: the prompt tokens' logprobs + top k
``skip_special_tokens``           True       bool
``include_stop_str_in_output``    False      bool
``logit_bias``                    None       {token id >= 0: bias in [-100, 100]} (OpenAI): the
                                             bias is added to that token's logit before sampling
``structured_outputs``            None       ``StructuredOutputsParams``: the text must follow a
                                             JSON schema / regex / choice / Lark grammar
================================  =========  ============================================

Every violation raises ``ValueError`` whose message starts with the parameter name and states the
allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["SamplingParams", "StructuredOutputsParams", "GREEDY_EPS", "MAX_LOGPROBS", "MAX_LOGIT_BIAS"]

#: Temperatures below this are treated as greedy (vLLM uses the same threshold).
GREEDY_EPS = 1e-5
#: Largest accepted ``logprobs`` (OpenAI's ``top_logprobs`` limit).
MAX_LOGPROBS = 20
#: Largest accepted ``|logit_bias|`` value (OpenAI's range is [-100, 100]).
MAX_LOGIT_BIAS = 100.0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class StructuredOutputsParams:
    """What the generated text must match (vLLM's ``StructuredOutputsParams``); exactly one of
    ``json``, ``json_object``, ``regex``, ``choice`` and ``grammar`` is set. The engine compiles it
    with llguidance (``engine.structured``) and masks every step's logits to the tokens the
    grammar allows; generation stops (finish_reason "stop") once the grammar is complete.

    * ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON object;
    * ``regex``: the whole text matches it (Rust ``regex`` syntax);
    * ``choice``: the text is exactly one of these strings;
    * ``grammar``: a Lark grammar in llguidance's dialect (``%json {...}`` sub-schemas, special
      tokens as ``<[id]>``);
    * ``thinking``: the text starts inside V4's ``<think>`` (a chat prompt in thinking mode):
      free reasoning without ``</think>``, then the ``</think>`` token, then the constrained part;
    * ``disable_any_whitespace`` (vLLM's name): JSON without whitespace between its tokens
      (``{"a":1}``), the default here (vLLM's default is False); False allows a space or an
      indented newline wherever JSON allows whitespace (``engine.structured.JSON_WHITESPACE``).
    """
    json: Optional[Union[dict, str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    thinking: bool = False
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object is True:
            given.append("json_object")
        elif not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, "
                             f"grammar; got {', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        for name in ("thinking", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        # n
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")

        # floats: type + finiteness first
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            setattr(self, name, float(v))

        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")

        # top_k: None / 0 / -1 all mean "off"; stored as -1
        if self.top_k is None:
            self.top_k = -1
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an int (-1 or 0 = off, or >= 1), got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if self.top_k == 0:
            self.top_k = -1

        # seed
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not -(2 ** 63) <= self.seed < 2 ** 64:
            raise ValueError(f"seed must fit in 64 bits ([-2**63, 2**64)), got {self.seed}")

        # stop strings -> list[str]
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a str, a list of str or None, got {self.stop!r}")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if s == "":
                raise ValueError("stop must not contain an empty string")

        # stop token ids -> list[int]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of int token ids >= 0, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be a list of int token ids >= 0, "
                                 f"got element {t!r}")

        # lengths
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be an int >= 0 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")

        # logprobs
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, "
                             f"got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be an int >= 0 or None, "
                             f"got {self.prompt_logprobs!r}")

        # bools
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool, got {v!r}")

        # logit_bias -> dict[int, float] (None when empty); the vocabulary bound is the engine's check
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            lb: dict[int, float] = {}
            for t, b in self.logit_bias.items():
                if not _is_int(t) or t < 0:
                    raise ValueError(f"logit_bias keys must be int token ids >= 0, got {t!r}")
                if not _is_number(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                                     f"{MAX_LOGIT_BIAS:g}], got {b!r} for token {t}")
                lb[t] = float(b)
            self.logit_bias = lb or None

        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    # ------------------------------------------------------------------ helpers
    @property
    def is_greedy(self) -> bool:
        """True when the request is decoded with argmax (temperature < 1e-5)."""
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k is not None and self.top_k > 0
