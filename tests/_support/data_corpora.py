"""Small synthetic corpora and prepared folders for the data tests.

A pytest plugin: the data test modules import its helpers and load its fixtures with
``pytest_plugins = ["data_corpora"]``. It holds no assertions, so it is not assertion-rewritten
(PYTEST_DONT_REWRITE), which lets a module import it before pytest loads it as a plugin.
"""

from __future__ import annotations

import numpy as np
import pytest

from geomtrain import data

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise owls sing of "
    "rivers mountains kings and the slow turning of the patient stars"
).split()


def write_corpus(root, n_files=12, seed=0):
    """``n_files`` text files of 150-400 random words each (deterministic in ``seed``)."""
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


def names_in_split(split, n, prefix="doc"):
    """``n`` file names that the split rule sends to ``split``."""
    names = (f"{prefix}_{i:03d}.txt" for i in range(10_000))
    return [name for name in names if data.split_of(name) == split][:n]


def write_docs(root, texts_by_name):
    root.mkdir(parents=True, exist_ok=True)
    for name, text in texts_by_name.items():
        (root / name).write_text(text, encoding="utf-8")
    return [root / name for name in texts_by_name]


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def prepared(tmp_path, corpus):
    """(folder, manifest, corpus files) of the corpus prepared with the GPT-2 tokenizer."""
    out = tmp_path / "prepared"
    manifest = data.prepare(out, dataset="text", text_files=corpus)
    return out, manifest, corpus


@pytest.fixture
def bpe_prepared(tmp_path, corpus):
    """The same corpus prepared with a trained 8k BPE (smaller: the corpus is tiny)."""
    out = tmp_path / "bpe"
    manifest = data.prepare(out, dataset="text", text_files=corpus, tokenizer="bpe8k")
    return out, manifest, corpus
