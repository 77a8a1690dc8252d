"""A prepared data folder: its layout, reading it and verifying it.

::

    train.bin       np.uint16 token ids; every document is followed by the EOT token
                    (50256 for gpt2, 0 for the trained bpe* vocabularies)
    val.bin         the same for the validation documents
    tokenizer.json  only for the bpe* tokenizers: the byte-level BPE trained on this corpus
    manifest.json   what the files hold (dataset, tokenizer, counts, sha256 of each file,
                    source versions, split rule); written last, so its presence means "complete"
    verified.json   a cache, not part of the data: the sha256 and largest token id last computed
                    for each token file, keyed by its size, mtime, ctime and inode (ignored for
                    a file changed less than RACY_MARGIN_NS before it was hashed)

Three levels of checking: ``verify(d, check_hashes=False)`` (manifest, files and sizes: no
reading), :func:`verify_cached` (what the trainer calls at start: sha256 and token range too, but
computed only when a file's stat key changed since they were last computed, so a second start
reads nothing) and ``verify(d)`` (everything, hashed afresh).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import time
from pathlib import Path

import numpy as np

from .._io import atomic_write_json, read_json, sha256_file
from .tokenizers import BPE_VOCAB_SIZES, BPETokenizer, Tokenizer, check_tokenizer, get_tokenizer

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_DATA_DIR",
    "DEFAULT_DATA_ROOT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "RACY_MARGIN_NS",
    "SPLITS",
    "TOKENIZER_FILE",
    "TOKEN_DTYPE",
    "VERIFIED_NAME",
    "DataError",
    "check_token_range",
    "default_data_dir",
    "load_manifest",
    "load_split",
    "load_tokenizer",
    "missing_folder_message",
    "prepare_command",
    "split_path",
    "verify",
    "verify_cached",
]

FORMAT_VERSION = 1
"""Version of the on-disk layout *and* of the text cleaning; bumping it forces a rebuild."""
SPLITS = ("train", "val")
MANIFEST_NAME = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
VERIFIED_NAME = "verified.json"
VERIFIED_VERSION = 1
TOKEN_DTYPE = np.uint16
DEFAULT_DATA_ROOT = "data"
DEFAULT_DATA_DIR = "data/classics"
HASH_CHOICES = (True, False, "cached")
RACY_MARGIN_NS = 20_000_000
"""20 ms: above the coarsest file timestamp step of a local Linux filesystem (one jiffy, 10 ms at
HZ=100), so two writes that far apart get different mtimes."""


class DataError(ValueError):
    """A prepared data folder that is missing, corrupted or does not fit the model: one line,
    naming the file and the command that rebuilds it."""


def default_data_dir(
    dataset: str = "classics", root: str | os.PathLike = DEFAULT_DATA_ROOT, tokenizer: str = "gpt2"
) -> Path:
    """Where ``prepare`` puts a dataset by default: ``<root>/<dataset>`` for gpt2
    (``data/classics``), ``<root>/<dataset>-<tokenizer>`` otherwise (``data/classics-bpe8k``)."""
    check_tokenizer(tokenizer)
    return Path(root) / (dataset if tokenizer == "gpt2" else f"{dataset}-{tokenizer}")


def load_manifest(data_dir: str | os.PathLike) -> dict:
    """The manifest of a prepared directory (FileNotFoundError if it is not prepared)."""
    with open(Path(data_dir) / MANIFEST_NAME, encoding="utf-8") as f:
        return json.load(f)


def split_path(data_dir: str | os.PathLike, split: str) -> Path:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid choices: {', '.join(SPLITS)}")
    return Path(data_dir) / f"{split}.bin"


def open_tokens(path: Path, block_size: int | None = None) -> np.memmap:
    """A token file as a read-only uint16 memmap: FileNotFoundError saying to prepare if it is missing,
    :class:`DataError` naming it if it is empty or, given ``block_size``, shorter than one batch row
    (``block_size + 1`` tokens: the inputs and the targets shifted by one)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the data first (geomtrain.data.prepare)")
    n_tokens = path.stat().st_size // np.dtype(TOKEN_DTYPE).itemsize
    if n_tokens == 0:  # np.memmap cannot map an empty file
        raise DataError(f"{path} is empty (0 tokens): nothing to draw batches from; prepare the folder from more text")
    if block_size is not None and n_tokens < block_size + 1:
        raise DataError(
            f"{path} holds {n_tokens} tokens, too few for block_size {block_size} (one batch row needs "
            f"block_size + 1 = {block_size + 1}); use a smaller --block-size or prepare the folder from more text"
        )
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def load_split(data_dir: str | os.PathLike, split: str, block_size: int | None = None) -> np.memmap:
    """The tokens of one split as a read-only ``np.memmap`` of uint16; with ``block_size``, refused
    (:class:`DataError`, one line) unless it holds a batch row of that context (`open_tokens`)."""
    return open_tokens(split_path(data_dir, split), block_size)


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
    check_tokenizer(name)
    if name == "gpt2":
        tok = get_tokenizer("gpt2")
    else:
        info = manifest.get("tokenizer_info") or {}
        path = data_dir / info.get("file", TOKENIZER_FILE)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: re-run prepare on {data_dir}")
        raw = path.read_bytes()
        if hashlib.sha256(raw).hexdigest() != info.get("sha256"):
            raise ValueError(f"{path}: sha256 differs from the manifest (corrupted or modified); re-run prepare")
        tok = BPETokenizer(raw.decode("utf-8"), name, path)
    if (tok.n_vocab, tok.eot_token) != (manifest.get("vocab_size"), manifest.get("eot_token")):
        raise ValueError(
            f"{data_dir}: tokenizer {name!r} has vocab {tok.n_vocab} / EOT {tok.eot_token}, the manifest "
            f"says {manifest.get('vocab_size')} / {manifest.get('eot_token')}; re-run prepare"
        )
    return tok


# ----------------------------------------------------------------------------- checks
def check_token_range(tokens: np.ndarray, vocab_size: int, path: str | os.PathLike | None = None) -> int | None:
    """The largest token id of ``tokens`` (a memmap is reduced in place, nothing is copied);
    :class:`DataError` (a ValueError) naming ``path``, that id and ``vocab_size`` if it is
    ``>= vocab_size`` (an embedding lookup would fail with an IndexError deep in the model).
    ``None`` for an empty array."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if len(tokens) == 0:
        return None
    largest = int(np.max(tokens))
    if largest >= vocab_size:
        raise DataError(_out_of_vocab(path if path is not None else "tokens", largest, int(vocab_size)))
    return largest


def _out_of_vocab(path, largest: int, vocab_size: int) -> str:
    return (
        f"{path}: token id {largest} is outside the vocabulary of {vocab_size} (ids 0..{vocab_size - 1}); "
        "the file was prepared with another tokenizer or is corrupted"
    )


def prepare_command(data_dir: str | os.PathLike, manifest: dict | None = None) -> str:
    """The ``geomtrain prepare`` command that rebuilds ``data_dir`` (from its manifest if given)."""
    m = manifest if isinstance(manifest, dict) else {}
    words = ["geomtrain", "prepare", "--out", str(data_dir)]
    if m.get("dataset"):
        words += ["--dataset", str(m["dataset"])]
    if m.get("tokenizer"):
        words += ["--tokenizer", str(m["tokenizer"])]
    cmd = shlex.join([*words, "--force"])
    return cmd + " --text-files FILES..." if m.get("dataset") == "text" else cmd


def _stat_key(path: Path) -> dict:
    """What identifies one version of a file without reading it. ``ctime`` and the inode are set
    by the kernel (``os.utime`` cannot restore them), so an edit that puts the old mtime back is
    still seen."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _trusted(entry: dict) -> bool:
    """An entry is trusted only if its stat key was taken more than :data:`RACY_MARGIN_NS` after the
    file last changed: a write within the timestamp granularity of the one before it could leave
    mtime and ctime unchanged (git's "racy clean" problem). A racy entry is re-hashed next time."""
    checked, changed = entry.get("checked_ns"), max(entry.get("mtime_ns") or 0, entry.get("ctime_ns") or 0)
    return isinstance(checked, int) and checked - changed > RACY_MARGIN_NS


def _read_cache(data_dir: Path) -> dict:
    cache = read_json(data_dir / VERIFIED_NAME, default=None)
    ok = isinstance(cache, dict) and cache.get("version") == VERIFIED_VERSION and isinstance(cache.get("files"), dict)
    return cache["files"] if ok else {}


def _write_cache(data_dir: Path, files: dict) -> None:
    """Best effort: a read-only data folder (a shared dataset) just means no cache."""
    try:
        atomic_write_json(data_dir / VERIFIED_NAME, {"version": VERIFIED_VERSION, "files": files})
    except OSError as exc:
        log.debug("%s: cannot write %s (%s); hashes will be recomputed next time", data_dir, VERIFIED_NAME, exc)


def _file_facts(path: Path, cache: dict, use_cache: bool) -> dict:
    """``{stat key..., "checked_ns", "sha256", "max_token"}`` of a token file: from ``cache`` when
    ``use_cache``, its stat key matches and the entry is not racy; else computed (the stat is taken
    before the file is read, so a write during the read changes the key)."""
    checked_ns = time.time_ns()
    key = _stat_key(path)
    hit = cache.get(path.name)
    if use_cache and isinstance(hit, dict) and all(hit.get(k) == v for k, v in key.items()) and _trusted(hit):
        return hit
    tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r") if key["size"] else np.zeros(0, TOKEN_DTYPE)
    largest = int(np.max(tokens)) if len(tokens) else None
    facts = {**key, "checked_ns": checked_ns, "sha256": sha256_file(path), "max_token": largest}
    if isinstance(hit, dict) and _trusted(hit) and all(hit.get(k) == v for k, v in facts.items() if k != "checked_ns"):
        return hit  # confirmed: keep the entry, so a full verify of a sound folder writes nothing
    return facts


# ----------------------------------------------------------------------------- verify
def _manifest_problem(data_dir: Path) -> tuple[dict | None, str | None]:
    try:
        manifest = load_manifest(data_dir)
    except FileNotFoundError:
        return None, f"{data_dir / MANIFEST_NAME}: missing"
    except (OSError, ValueError) as e:
        return None, f"{data_dir / MANIFEST_NAME}: unreadable ({e})"
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        found = manifest.get("format_version") if isinstance(manifest, dict) else None
        return None, f"{data_dir / MANIFEST_NAME}: format version {found!r}, expected {FORMAT_VERSION}"
    return manifest, None


def _tokenizer_file_problems(data_dir: Path, manifest: dict) -> list[str]:
    """The trained tokenizer's file against its manifest entry (always hashed: it is small)."""
    if manifest.get("tokenizer") not in BPE_VOCAB_SIZES:
        return []
    info = manifest.get("tokenizer_info")
    if not isinstance(info, dict) or not info.get("sha256"):
        return [f"{data_dir / MANIFEST_NAME}: no tokenizer file entry for {manifest['tokenizer']!r}"]
    path = data_dir / info.get("file", TOKENIZER_FILE)
    if not path.is_file():
        return [f"{path}: missing"]
    if sha256_file(path) != info["sha256"]:
        return [f"{path}: sha256 differs from the manifest (corrupted or modified)"]
    return []


def _split_problems(data_dir: Path, manifest: dict, split: str, check_hashes, cache: dict) -> list[str]:
    """One split's file: present, the manifest's size, and (unless ``check_hashes`` is False) its
    sha256 and token range. Updates ``cache`` with what it computed."""
    entry = manifest.get("splits", {}).get(split)
    if not isinstance(entry, dict):
        return [f"{data_dir / MANIFEST_NAME}: no entry for split {split!r}"]
    path = data_dir / entry.get("file", f"{split}.bin")
    if not path.is_file():
        return [f"{path}: missing"]
    size, expected = path.stat().st_size, int(entry.get("tokens", -1)) * np.dtype(TOKEN_DTYPE).itemsize
    if size != expected:
        return [f"{path}: {size} bytes, manifest says {expected} (truncated or modified)"]
    if check_hashes is False:
        return []
    facts = _file_facts(path, cache, use_cache=check_hashes == "cached")
    cache[path.name] = facts
    if facts["sha256"] != entry.get("sha256"):
        return [f"{path}: sha256 differs from the manifest (corrupted or modified)"]
    vocab = manifest.get("vocab_size")
    if isinstance(vocab, int) and facts["max_token"] is not None and facts["max_token"] >= vocab:
        return [_out_of_vocab(path, facts["max_token"], vocab)]
    return []


def _check_folder(data_dir: Path, check_hashes: bool | str) -> tuple[dict | None, list[str], dict]:
    """(manifest or None, problems, ``{file name: facts}`` of the token files hashed or cached)."""
    if check_hashes not in HASH_CHOICES or not isinstance(check_hashes, (bool, str)):
        raise ValueError(f"check_hashes must be one of {', '.join(map(repr, HASH_CHOICES))}, got {check_hashes!r}")
    manifest, problem = _manifest_problem(data_dir)
    if problem:
        return None, [problem], {}
    problems = _tokenizer_file_problems(data_dir, manifest)
    cache = _read_cache(data_dir) if check_hashes is not False else {}
    before = dict(cache)
    for split in SPLITS:
        problems += _split_problems(data_dir, manifest, split, check_hashes, cache)
    if check_hashes is not False and cache != before:
        _write_cache(data_dir, cache)
    return manifest, problems, cache


def verify(data_dir: str | os.PathLike, *, check_hashes: bool | str = True) -> list[str]:
    """Problems with a prepared directory, one readable line each naming its file; ``[]`` means
    it is sound.

    Checks the manifest (present, parseable, current format version); for a trained ``bpe*``
    tokenizer, that ``tokenizer.json`` exists and has the manifest's sha256 (always: it is small);
    per split, that the .bin file exists and has the size the manifest states. Unless
    ``check_hashes`` is False, also each split's sha256 and that its largest token id is below the
    manifest's ``vocab_size``: computed afresh for ``True``; for ``"cached"`` taken from
    ``verified.json`` when the file's (size, mtime_ns, ctime_ns, inode) are those it was last
    computed for. Both refresh that cache (best effort: a read-only folder is checked, not cached).
    """
    return _check_folder(Path(data_dir), check_hashes)[1]


def missing_folder_message(data_dir: str | os.PathLike) -> str:
    """One line for a data folder that does not exist: the prepared folder (holding a manifest) beside
    it or under :data:`DEFAULT_DATA_ROOT` whose name is closest, if one is close; else the command
    that prepares the default corpus, and the prepared folders found."""
    from ..suggest import did_you_mean

    data_dir = Path(data_dir)
    roots = (data_dir.parent, Path(DEFAULT_DATA_ROOT))
    prepared: dict[Path, Path] = {}  # resolved -> as found (the first root's spelling)
    for manifest in (m for r in roots if r.is_dir() for m in sorted(r.glob(f"*/{MANIFEST_NAME}"))):
        prepared.setdefault(manifest.parent.resolve(), manifest.parent)
    found = ", ".join(map(str, prepared.values())) or f"none in {' or '.join(map(str, dict.fromkeys(roots)))}"
    close = did_you_mean(data_dir.name, {p.name: str(p) for p in prepared.values()})
    if close:
        return f"data folder {data_dir} does not exist{close}; prepared folders: {found}"
    return (
        f"data folder {data_dir} does not exist; prepared folders: {found}; `geomtrain prepare` prepares "
        f"the default corpus into {DEFAULT_DATA_DIR}"
    )


def verify_cached(data_dir: str | os.PathLike, vocab_size: int | None = None) -> dict:
    """Check a prepared folder at train start; return its manifest.

    ``verify(data_dir, check_hashes="cached")``: sizes always, sha256 and token range only for
    files changed since they were last hashed (so the second start reads nothing); then, if
    ``vocab_size`` is given (the model's), that every token id is below it. Raises
    :class:`DataError` (a ValueError) with one line: the first problem, naming its file, and the
    ``geomtrain prepare ... --force`` command that rebuilds the folder; for a folder that does not
    exist, `missing_folder_message`."""
    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise DataError(missing_folder_message(data_dir))
    manifest, problems, facts = _check_folder(data_dir, "cached")
    if not problems and vocab_size is not None:
        for split in SPLITS:
            path = data_dir / manifest["splits"][split].get("file", f"{split}.bin")
            largest = facts[path.name]["max_token"]
            if largest is not None and largest >= vocab_size:
                problems.append(_out_of_vocab(path, largest, vocab_size))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        manifest = manifest or read_json(data_dir / MANIFEST_NAME)
        raise DataError(f"{problems[0]}{more}; rebuild it with `{prepare_command(data_dir, manifest)}`")
    return manifest
