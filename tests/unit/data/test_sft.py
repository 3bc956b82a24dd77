"""Chat JSONL for SFT: each conversation one document, the loss mask on the assistant's tokens
(and the token closing its turn) only; bad lines refused in one line naming file and line."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from dcp.data.sft import chat_batches, read_chat_jsonl, render_chat, write_demo_chats
from dcp.data.tokenizer import ByteTokenizer
from dcp.files import FileContentError

BYTES = ByteTokenizer()


def test_only_the_assistants_tokens_and_its_turn_end_are_labels_that_count():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6."},
    ]
    doc = render_chat(messages, tokenizer=BYTES)
    assert doc.loss_mask.shape == (doc.tokens.size - 1,)
    counted = doc.tokens[1:][doc.loss_mask > 0]  # the labels the loss sees
    # "4" + end of turn, "6." + end of turn
    assert counted.tolist() == [ord("4"), BYTES.eod, ord("6"), ord("."), BYTES.eod]
    text = BYTES.decode(doc.tokens)
    assert text == "<|system|>\nBe brief.<|user|>\n2+2?<|assistant|>\n4<|user|>\nand 3+3?" + (
        "<|assistant|>\n6."
    )
    assert (doc.tokens == BYTES.eod).sum() == len(messages)


def _write(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_a_file_reads_in_order_and_blank_lines_are_skipped(tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = _write(tmp_path / "c.jsonl", chat, "", chat)
    docs = read_chat_jsonl(path, tokenizer=BYTES, max_tokens=100)
    assert len(docs) == 2
    np.testing.assert_array_equal(docs[0].tokens, docs[1].tokens)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"c.jsonl:2"),
        ({"messages": []}, r"c.jsonl:2: \"messages\" must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role 'tool'"),
        ({"messages": [{"role": "assistant", "content": 3}]}, "content must be a string"),
        ({"msgs": []}, 'one key, "messages"'),
        ({"messages": [{"role": "assistant", "content": "x" * 200}]}, "more than the 100"),
    ],
)
def test_a_bad_line_is_refused_naming_file_and_line(tmp_path, line, message):
    good = {"messages": [{"role": "assistant", "content": "ok"}]}
    path = _write(tmp_path / "c.jsonl", good, line)
    with pytest.raises(FileContentError, match=message) as err:
        read_chat_jsonl(path, tokenizer=BYTES, max_tokens=100)
    assert "\n" not in str(err.value)


def test_an_empty_file_is_refused(tmp_path):
    with pytest.raises(FileContentError, match="no conversation"):
        read_chat_jsonl(_write(tmp_path / "c.jsonl", ""), tokenizer=BYTES, max_tokens=100)


def test_batches_fill_the_token_budget_and_repeat_alike(tmp_path):
    path = write_demo_chats(tmp_path / "d" / "demo.jsonl", num_chats=40, seed=1)
    docs = read_chat_jsonl(path, tokenizer=BYTES, max_tokens=1025)
    assert len({d.tokens.size for d in docs}) > 10  # lengths vary
    first = list(itertools.islice(chat_batches(docs, tokens_per_batch=2048, seed=3), 6))
    again = list(itertools.islice(chat_batches(docs, tokens_per_batch=2048, seed=3), 6))
    assert [[id(d) for d in b] for b in first] == [[id(d) for d in b] for b in again]
    for batch in first:
        assert batch and (len(batch) == 1 or sum(d.tokens.size for d in batch) <= 2048)


def test_a_chat_dataset_serves_documents_and_masks_as_the_trainer_reads_them(tmp_path):
    from dcp.data.base import MaskedDocumentDataset
    from dcp.data.build import build_document_dataset
    from dcp.data.sampler import GlobalBatch
    from dcp.data.sft import ChatDataConfig
    from dcp.runtime.dispatch import LabelledSource, counted_labels
    from dcp.step.batches import DatasetSource

    path = write_demo_chats(tmp_path / "demo.jsonl", num_chats=12, seed=2)
    chats = read_chat_jsonl(path, tokenizer=BYTES, max_tokens=None)
    dataset = build_document_dataset(ChatDataConfig(path=str(path)), vocab_size=257)
    assert isinstance(dataset, MaskedDocumentDataset) and len(dataset) == 12
    assert dataset.vocab_size == 257 and dataset.eod == BYTES.eod
    assert dataset.doc_lengths.tolist() == [c.tokens.size for c in chats]
    batch = GlobalBatch(
        doc_ids=(7, 3),
        lengths=(chats[7].tokens.size, chats[3].tokens.size),
        epoch=0,
        index_in_epoch=0,
        step=0,
    )
    source = DatasetSource(dataset, batch)
    assert isinstance(source, LabelledSource)
    for seq_id, doc in enumerate((7, 3)):
        n = chats[doc].tokens.size - 1
        np.testing.assert_array_equal(source.read(seq_id, 0, n + 1), chats[doc].tokens)
        np.testing.assert_array_equal(source.label_mask(seq_id, 0, n), chats[doc].loss_mask)
        np.testing.assert_array_equal(source.label_mask(seq_id, 5, 9), chats[doc].loss_mask[5:9])
        assert counted_labels(source, seq_id) == int(chats[doc].loss_mask.sum()) < n
        assert source.label_values(seq_id, 0, n) == {}
    with pytest.raises(IndexError):
        dataset.label_mask(3, 1, chats[3].tokens.size - 1)  # one past the last label
    # The fingerprint covers the tokens and masks: another tokenization of the file differs.
    assert (
        dataset.content_fingerprint()
        == build_document_dataset(ChatDataConfig(path=str(path))).content_fingerprint()
    )
    other = write_demo_chats(tmp_path / "other.jsonl", num_chats=12, seed=3)
    assert (
        dataset.content_fingerprint()
        != build_document_dataset(ChatDataConfig(path=str(other))).content_fingerprint()
    )


def test_a_pretraining_dataset_source_counts_every_label():
    from dcp.data.sampler import GlobalBatch
    from dcp.data.synthetic import SyntheticDataConfig, SyntheticDocumentDataset
    from dcp.runtime.dispatch import counted_labels
    from dcp.step.batches import DatasetSource

    dataset = SyntheticDocumentDataset(SyntheticDataConfig(num_docs=4))
    lengths = tuple(int(n) for n in dataset.doc_lengths[:2])
    source = DatasetSource(dataset, GlobalBatch((0, 1), lengths, 0, 0, 0))
    assert counted_labels(source, 1) == lengths[1] - 1
    np.testing.assert_array_equal(source.label_mask(0, 2, 6), np.ones(4, dtype=np.float32))


def test_a_conversation_longer_than_the_model_is_refused_naming_its_line(tmp_path):
    from dcp.schema import load_config
    from dcp.step.batches import build_dataset
    from dcp.train.config import DataConfig

    long = {"messages": [{"role": "assistant", "content": "x" * 300}]}
    short = {"messages": [{"role": "assistant", "content": "ok"}]}
    path = _write(tmp_path / "c.jsonl", short, long)
    cfg = load_config(DataConfig, None, ["source=chat", f"chat.path={path}"])
    with pytest.raises(FileContentError, match=r"c.jsonl:2: .* more than the 257"):
        build_dataset(cfg, vocab_size=257, max_seq_len=256)
    assert len(build_dataset(cfg, vocab_size=257, max_seq_len=400)) == 2
    with pytest.raises(ValueError, match="smaller than the dataset's vocabulary"):
        build_dataset(cfg, vocab_size=200, max_seq_len=400)
