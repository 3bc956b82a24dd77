"""Chat-style JSONL for supervised fine-tuning: conversations as documents whose loss counts the
assistant's tokens only.

One conversation per line: ``{"messages": [{"role": ..., "content": ...}, ...]}`` with roles
``system``, ``user`` and ``assistant`` and at least one assistant message. A conversation is
rendered as one document: per message the header ``<|role|>`` and a newline, its content, and
the tokenizer's end-of-document token closing the turn. Its loss mask (one entry per label,
``doc[1:]``) is 1 where the label is a token of an assistant's content or the token closing that
turn, so the model learns to answer and to stop, never to write the user's part. The tokenizer
is the caller's (``dcp.data.tokenizer.build_tokenizer``: byte-level on a CPU, or a local Hugging
Face tokenizer).

DCP's trainer reads a file as a ``ChatDataset`` (``data.source: chat``, ``ChatDataConfig``;
``pretrain/configs/sft_cpu.yaml``, ``make demo-sft``): a document dataset whose documents carry
their loss masks, sampled, planned, checkpointed and resumed as pretraining's are. A plain loop
gives the documents and masks to ``DCPEngine.train_step(tokens, loss_masks=masks)``
(``pretrain/example_sft.py``, ``make demo-sft-engine``). The planner sees the lengths only.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dcp.data.base import check_token_slice, length_stats
from dcp.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer
from dcp.files import FileContentError, iter_lines, parse_json, write_atomic

ROLES: tuple[str, ...] = ("system", "user", "assistant")
"""The roles a message may have; only the assistant's tokens count in the loss."""


@dataclass(frozen=True)
class ChatDocument:
    """One rendered conversation."""

    tokens: np.ndarray
    """Token ids (int64) of the whole conversation."""
    loss_mask: np.ndarray
    """1.0 where the label ``tokens[t + 1]`` is the assistant's, else 0.0 (``len(tokens) - 1``)."""


def render_chat(messages: Sequence[dict], *, tokenizer: Tokenizer) -> ChatDocument:
    """The document and loss mask of one conversation (``messages`` already checked)."""
    parts, counted = [], []
    for message in messages:
        header = tokenizer.encode(f"<|{message['role']}|>\n")
        body = np.append(tokenizer.encode(message["content"]), tokenizer.eod)
        parts += [header, body]
        counted += [False, message["role"] == "assistant"]
    tokens = np.concatenate(parts).astype(np.int64)
    in_answer = np.concatenate([np.full(p.size, c) for p, c in zip(parts, counted, strict=True)])
    return ChatDocument(tokens=tokens, loss_mask=in_answer[1:].astype(np.float32))


def _messages(record: object) -> list[dict]:
    """``record``'s messages, or a ``ValueError`` saying what is wrong with them."""
    if not isinstance(record, dict) or set(record) != {"messages"}:
        raise ValueError('each line must be an object with one key, "messages"')
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ValueError(f'message {i} must be an object with keys "role" and "content"')
        if message["role"] not in ROLES:
            raise ValueError(f"message {i} has role {message['role']!r}; allowed: {ROLES}")
        if not isinstance(message["content"], str):
            raise ValueError(f"message {i}'s content must be a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant message, so nothing to learn")
    return messages


def read_chat_jsonl(
    path: str | os.PathLike[str], *, tokenizer: Tokenizer, max_tokens: int | None
) -> list[ChatDocument]:
    """Every conversation of the JSONL file ``path`` rendered (``render_chat``), in file order;
    blank lines are skipped. A malformed line, a conversation longer than ``max_tokens`` tokens
    (the model's ``max_seq_len + 1``; ``None``: no limit) or a file without conversations is
    refused in one line naming the file and line."""
    documents = []
    for number, line in iter_lines(path, what="chat JSONL"):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            document = render_chat(_messages(parse_json(line, source=where)), tokenizer=tokenizer)
        except FileContentError:
            raise
        except ValueError as exc:
            raise FileContentError(f"{where}: {exc}") from None
        if max_tokens is not None and document.tokens.size > max_tokens:
            raise FileContentError(
                f"{where}: the conversation has {document.tokens.size} tokens, more than the "
                f"{max_tokens} the model takes (max_seq_len + 1); shorten or drop it"
            )
        documents.append(document)
    if not documents:
        raise FileContentError(f"{path}: no conversation in the file")
    return documents


@dataclass(kw_only=True, frozen=True)
class ChatDataConfig:
    """A chat JSONL file as the trainer's documents (``data.source: chat``)."""

    path: str
    """The JSONL file: one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line."""
    tokenizer: str = "byte"
    """``byte`` (UTF-8 bytes + end-of-document, 257 ids) or ``hf`` (a local Hugging Face
    tokenizer directory, ``tokenizer_path``)."""
    tokenizer_path: str | None = None
    """tokenizer=hf: the local tokenizer directory (required); tokenizer=byte: must be unset."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("data.chat.path: name the chat JSONL file")
        if self.tokenizer not in TOKENIZER_TYPES:
            raise ValueError(
                f"data.chat.tokenizer={self.tokenizer!r}; allowed: {', '.join(TOKENIZER_TYPES)}"
            )
        if (self.tokenizer == "hf") != (self.tokenizer_path is not None):
            raise ValueError(
                "data.chat.tokenizer_path: required with tokenizer=hf (a local tokenizer "
                "directory), and not taken by tokenizer=byte"
            )


class ChatDataset:
    """The conversations of a chat JSONL file as a document dataset whose documents carry
    their loss masks (``dcp.data.base.MaskedDocumentDataset``): every conversation rendered
    once at start (``read_chat_jsonl``), tokens and masks held in memory."""

    def __init__(self, config: ChatDataConfig, *, max_tokens: int | None = None) -> None:
        """``max_tokens``: the longest conversation the model takes (``max_seq_len + 1``)."""
        self.config = config
        self._tokenizer = build_tokenizer(config.tokenizer, config.tokenizer_path)
        chats = read_chat_jsonl(config.path, tokenizer=self._tokenizer, max_tokens=max_tokens)
        self._lengths = np.array([c.tokens.size for c in chats], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._lengths)[:-1]])
        self._tokens = np.concatenate([c.tokens for c in chats])
        # A document of n tokens has n - 1 labels: its mask starts n_before - doc_id in.
        self._masks = np.concatenate([c.loss_mask for c in chats])
        self._counted = np.array([int(c.loss_mask.sum()) for c in chats], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._lengths.size)

    @property
    def doc_lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    @property
    def eod(self) -> int:
        return self._tokenizer.eod

    @property
    def stats(self) -> dict:
        """Counts a trainer logs (the keys of the other datasets', and the counted labels)."""
        lengths = self._lengths
        return {
            **length_stats(lengths),
            "counted_labels": int(self._counted.sum()),
            "labels": int(lengths.sum() - lengths.size),
        }

    def get_tokens(self, doc_id: int, start: int = 0, length: int | None = None) -> np.ndarray:
        doc_len = check_token_slice(doc_id, start, length, self._lengths)
        stop = doc_len if length is None else start + length
        first = int(self._starts[doc_id])
        return self._tokens[first + start : first + stop]

    def label_mask(self, doc_id: int, start: int, length: int) -> np.ndarray:
        """1.0 where labels [start, start + length) of the document count in the loss."""
        check_token_slice(doc_id, start, length, self._lengths - 1)
        first = int(self._starts[doc_id]) - doc_id
        return self._masks[first + start : first + start + length]

    def num_counted(self, doc_id: int) -> int:
        """Labels of the document that count in the loss (the assistant's)."""
        return int(self._counted[doc_id])

    def content_fingerprint(self) -> list[str]:
        """One fingerprint of what the run trains on, the rendered tokens and masks (so the
        file and the tokenizer both), for a resume to compare (``dcp.train.resume``)."""
        digest = hashlib.sha256(self._lengths.tobytes())
        digest.update(self._tokens.tobytes())
        digest.update(self._masks.tobytes())
        return [digest.hexdigest()[:32]]


def chat_batches(
    documents: Sequence[ChatDocument], *, tokens_per_batch: int, seed: int
) -> Iterator[list[ChatDocument]]:
    """Endless global batches: the conversations in a seeded shuffled order (a new order each
    pass), each batch as many as fit ``tokens_per_batch`` tokens (at least one). The same on
    every rank with the same seed."""
    if tokens_per_batch < 1:
        raise ValueError(f"tokens_per_batch must be >= 1, got {tokens_per_batch}")
    rng = np.random.default_rng(seed)
    batch, used = [], 0
    while True:
        for i in rng.permutation(len(documents)):
            document = documents[int(i)]
            if batch and used + document.tokens.size > tokens_per_batch:
                yield batch
                batch, used = [], 0
            batch.append(document)
            used += document.tokens.size


def write_demo_chats(path: str | os.PathLike[str], *, num_chats: int, seed: int = 0) -> Path:
    """A demo corpus for ``make demo-sft``: arithmetic questions after a reading passage of 0
    to ~800 bytes (long prompts, short answers: the lengths vary as SFT data does), some with
    a system message; the answers are learnable. Written atomically; returns the path."""
    rng = np.random.default_rng(seed)
    words = "the of and to in is was for on that with as by at from it an be this".split()
    lines = []
    for _ in range(num_chats):
        a, b = (int(x) for x in rng.integers(0, 100, size=2))
        passage = " ".join(rng.choice(words, size=min(int(rng.exponential(60)), 220)))
        messages = [{"role": "user", "content": f"{passage}\nWhat is {a} + {b}?"}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "Answer with the sum."})
        messages.append({"role": "assistant", "content": f"{a} + {b} = {a + b}."})
        lines.append(json.dumps({"messages": messages}))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "\n".join(lines) + "\n")
    return Path(path)
