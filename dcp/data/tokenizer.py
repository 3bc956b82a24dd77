"""Tokenizers for ``tools/prepare_data.py`` and the trainer: a byte-level default, or Hugging Face.

``ByteTokenizer`` needs no download and no vocabulary file: token ids 0..255 are the UTF-8 bytes
of the text and id 256 is the end-of-document (EOD) token, so ``vocab_size == 257``. Decoding is
exact for any text (``decode(encode(t)) == t``). Models usually pad their embedding table to a
multiple of 64/128; that padding is the model builder's business, not the tokenizer's.

``HFTokenizer`` wraps ``transformers.AutoTokenizer`` loaded from a *local* directory only (hub
access is disabled: ``local_files_only=True`` and ``HF_HUB_OFFLINE=1``). ``transformers`` is not a
dependency of DCP; it is imported lazily and a clear error says so when it is missing.

Every tokenizer exposes ``name``, ``vocab_size``, ``eod``, ``encode(text) -> np.ndarray[int64]``,
``decode(ids) -> str`` and ``storage_dtype`` (the smallest numpy dtype that holds every id, used
for the ``.bin`` file).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

TOKENIZER_TYPES: tuple[str, ...] = ("byte", "hf")


@runtime_checkable
class Tokenizer(Protocol):
    """What prepare_data and the trainer need from a tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


def storage_dtype(vocab_size: int) -> type[np.number]:
    """Smallest dtype megatron's indexed dataset accepts for ids in ``[0, vocab_size)``."""
    # megatron-core's DType.optimal_dtype uses the same 65500 threshold.
    return np.uint16 if vocab_size < 65500 else np.int32


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) plus EOD = 256; ``vocab_size`` = 257."""

    NUM_BYTES: int = 256

    @property
    def name(self) -> str:
        return "byte"

    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + 1

    @property
    def eod(self) -> int:
        return self.NUM_BYTES

    @property
    def storage_dtype(self) -> type[np.number]:
        return storage_dtype(self.vocab_size)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Token ids of raw bytes (no decoding needed; exact for any file)."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``; EOD and any id outside 0..255 are dropped, bad UTF-8 is replaced."""
        arr = np.asarray(ids, dtype=np.int64)
        arr = arr[(arr >= 0) & (arr < self.NUM_BYTES)]
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer read from a local directory; never touches the network."""

    def __init__(self, path: str | os.PathLike) -> None:
        local = Path(path)
        if not local.is_dir():
            raise ValueError(
                f"tokenizer path {str(path)!r} is not a local directory; DCP loads Hugging Face "
                "tokenizers from local files only (download one elsewhere and copy it here)"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise RuntimeError(
                "tokenizer type 'hf' needs the `transformers` package, which DCP does not "
                "install; `pip install transformers` in this environment, or use the 'byte' "
                "tokenizer"
            ) from exc
        # Belt and braces: even if a cache miss happened, refuse to reach the hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(local), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"cannot load a Hugging Face tokenizer from {str(local)!r}: {exc}"
            ) from exc
        eod = self._tok.eos_token_id
        if eod is None:
            raise ValueError(
                f"tokenizer at {str(local)!r} has no eos_token; DCP appends it as the "
                "end-of-document token, so it must exist"
            )
        self._eod = int(eod)
        self._name = f"hf:{local.resolve()}"

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        # len() counts added special tokens, which ``tokenizer.vocab_size`` omits.
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def storage_dtype(self) -> type[np.number]:
        return storage_dtype(self.vocab_size)

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = [int(i) for i in np.asarray(ids).reshape(-1) if int(i) != self._eod]
        return self._tok.decode(arr)


def build_tokenizer(kind: str = "byte", path: str | os.PathLike | None = None) -> Tokenizer:
    """``kind='byte'`` (no path) or ``kind='hf'`` with ``path`` a local tokenizer directory."""
    if kind == "byte":
        if path is not None:
            raise ValueError("tokenizer type 'byte' takes no path (got one)")
        return ByteTokenizer()
    if kind == "hf":
        if path is None:
            raise ValueError("tokenizer type 'hf' needs a path to a local tokenizer directory")
        return HFTokenizer(path)
    raise ValueError(f"unknown tokenizer type {kind!r}; allowed: {TOKENIZER_TYPES}")
