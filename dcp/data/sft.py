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

The documents and masks go to ``DCPEngine.train_step(tokens, loss_masks=masks)``
(``pretrain/example_sft.py``, ``make demo-sft``); the planner sees their lengths only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dcp.data.tokenizer import Tokenizer
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
    path: str | os.PathLike[str], *, tokenizer: Tokenizer, max_tokens: int
) -> list[ChatDocument]:
    """Every conversation of the JSONL file ``path`` rendered (``render_chat``), in file order;
    blank lines are skipped. A malformed line, a conversation longer than ``max_tokens`` tokens
    (the model's ``max_seq_len + 1``) or a file without conversations is refused in one line
    naming the file and line."""
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
        if document.tokens.size > max_tokens:
            raise FileContentError(
                f"{where}: the conversation has {document.tokens.size} tokens, more than the "
                f"{max_tokens} the model takes (max_seq_len + 1); shorten or drop it"
            )
        documents.append(document)
    if not documents:
        raise FileContentError(f"{path}: no conversation in the file")
    return documents


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
