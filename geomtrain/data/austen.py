"""Jane Austen's six novels, read from the Debian package ``r-cran-janeaustenr``.

The package (MIT; the novels are public domain) ships the texts as an R lazy-load database,
``data/Rdata.rdb`` + ``data/Rdata.rdx``, read here without R:

* ``Rdata.rdx``: gzip-compressed R serialization of a named list; its element ``variables`` maps
  each object name (``emma``, ``mansfieldpark``, ``northangerabbey``, ``persuasion``,
  ``prideprejudice``, ``sensesensibility``) to an integer pair ``(offset, length)`` into the .rdb;
  ``compressed`` is ``TRUE`` (zlib; bzip2 and xz databases are refused).
* ``Rdata.rdb``: at ``[offset, offset + length)``, a 4-byte big-endian uncompressed size, then a
  zlib stream of R serialization; for janeaustenr each object is a character vector of lines.

R serialization (XDR form, the only one read; all integers 32-bit big-endian)::

    b"X\\n", version (2 or 3), writer R version, minimal reader R version
    version 3 only: n, then n bytes naming the native encoding (e.g. "UTF-8")
    one item:  flags = type (low 8 bits) | is-object 0x100 | has-attributes 0x200 | has-tag 0x400
               | levels << 12 (for CHARSXP the encoding bits), then by type:
      NILVALUE_SXP 254   nothing (None)
      SYMSXP 1           a CHARSXP (the name); entered in the reference table
      REFSXP 255         reference index (flags >> 8, or the next int if that is 0), 1-based
      LISTSXP 2          [attributes item] [tag item] CAR item, CDR item (the next node or NIL)
      CHARSXP 9          length (-1 = NA), bytes; UTF-8 0x8 / latin-1 0x4 / ASCII 0x40 in levels,
                         otherwise the native encoding (UTF-8 if the header names none)
      LGLSXP 10, INTSXP 13   length, then that many ints (NA = -2**31)
      STRSXP 16, VECSXP 19   length, then that many items
      a vector's attributes (a pairlist) follow its elements when has-attributes is set;
      a length of -1 means a long length: two more ints, upper and lower 32 bits

Values come back as Python objects: None, str (CHARSXP, SYMSXP), lists (vectors; NA is None),
a list of ``(tag, value)`` pairs (a pairlist); a vector with a ``names`` attribute becomes a dict,
other attributes are dropped. Anything else is a ``ValueError`` naming the type.

:func:`fetch_janeaustenr` puts the two files into a cache folder (``apt-get download`` +
``dpkg-deb -x``; no root needed), :func:`austen_documents` cuts the novels into chapters.
"""

from __future__ import annotations

import codecs
import gzip
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._io import atomic_write_bytes, atomic_write_json, read_json, sha256_file
from .packages import MissingPackageError

__all__ = [
    "AUSTEN_DEB",
    "AUSTEN_NOVELS",
    "CACHE_ENV",
    "austen_documents",
    "austen_novels",
    "austen_source_info",
    "default_cache_dir",
    "fetch_janeaustenr",
    "janeaustenr_dir",
    "read_lazyload",
    "split_chapters",
    "unserialize",
]

AUSTEN_DEB = "r-cran-janeaustenr"
AUSTEN_NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")
CACHE_ENV = "GEOMTRAIN_CACHE"
"""Environment variable naming the folder for downloaded sources (default ``~/.cache/geomtrain``)."""
RDATA_FILES = ("Rdata.rdb", "Rdata.rdx")
SOURCE_JSON = "source.json"
_DATA_IN_DEB = Path("usr/lib/R/site-library/janeaustenr/data")
_COMMAND_TIMEOUT_S = 120


# ----------------------------------------------------------------------------- R serialization
NILVALUE_SXP, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, STRSXP, VECSXP, REFSXP = 254, 1, 2, 9, 10, 13, 16, 19, 255
_HAS_ATTR, _HAS_TAG = 0x200, 0x400
_BYTES, _LATIN1, _UTF8, _ASCII = 0x2, 0x4, 0x8, 0x40  # CHARSXP levels
_NA_INTEGER = -(2**31)
_TYPE_NAMES = {0: "NILSXP", 3: "CLOSXP", 4: "ENVSXP", 6: "LANGSXP", 14: "REALSXP", 15: "CPLXSXP", 24: "RAWSXP"}


class _XDRReader:
    """A cursor over one R serialization stream (XDR form)."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError(f"not an R serialization in XDR form (starts with {data[:2]!r}, expected b'X\\n')")
        self.data, self.pos, self.refs = data, 2, []
        version, _writer, _min_reader = self.ints(3)
        if version not in (2, 3):
            raise ValueError(f"R serialization version {version} is not supported; valid versions: 2, 3")
        self.encoding = "utf-8"
        if version == 3:
            name = self.take(self.int()).decode("ascii")
            try:
                self.encoding = codecs.lookup(name).name
            except LookupError:
                raise ValueError(f"R serialization names an unknown native encoding {name!r}") from None

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError(f"R serialization truncated at byte {self.pos} (wanted {n} more)")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def ints(self, n: int) -> tuple[int, ...]:
        return struct.unpack(f">{n}i", self.take(4 * n))

    def int(self) -> int:
        return self.ints(1)[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:
            upper, lower = struct.unpack(">II", self.take(8))
            n = (upper << 32) | lower
        return n

    def item(self) -> Any:
        flags = self.int()
        kind = flags & 0xFF
        if kind == NILVALUE_SXP:
            return None
        if kind == REFSXP:
            index = (flags >> 8) or self.int()
            if not 1 <= index <= len(self.refs):
                raise ValueError(f"R serialization refers to object {index}, only {len(self.refs)} seen")
            return self.refs[index - 1]
        if kind == SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == LISTSXP:
            return self.pairlist(flags)
        if kind == CHARSXP:
            return self.charsxp(flags)
        if kind in (LGLSXP, INTSXP):
            values = self.ints(self.length())
            to = bool if kind == LGLSXP else int
            value = [None if v == _NA_INTEGER else to(v) for v in values]
        elif kind in (STRSXP, VECSXP):
            value = [self.item() for _ in range(self.length())]
        else:
            name = _TYPE_NAMES.get(kind, f"type {kind}")
            raise ValueError(
                f"R serialization item {name} (flags {flags:#x} at byte {self.pos - 4}) is not supported; "
                "supported: NULL, symbols, pairlists, strings, logical, integer, character and list vectors"
            )
        if flags & _HAS_ATTR:
            names = dict(self.pairlist(self.int())).get("names")
            if names is not None:
                if len(names) != len(value):
                    raise ValueError(f"R vector of length {len(value)} has {len(names)} names")
                value = dict(zip(names, value, strict=True))
        return value

    def charsxp(self, flags: int) -> str | None:
        n = self.int()
        if n == -1:
            return None
        levels = flags >> 12
        if levels & _BYTES:
            raise ValueError("R strings marked as bytes (no encoding) are not supported")
        encoding = "latin-1" if levels & _LATIN1 else "utf-8" if levels & (_UTF8 | _ASCII) else self.encoding
        return self.take(n).decode(encoding)

    def pairlist(self, flags: int) -> list[tuple[Any, Any]]:
        """Nodes until the NIL that ends the list (read in a loop, not by recursion on the CDR)."""
        nodes = []
        while (flags & 0xFF) == LISTSXP:
            if flags & _HAS_ATTR:
                self.item()  # a node's own attributes: unused
            tag = self.item() if flags & _HAS_TAG else None
            nodes.append((tag, self.item()))
            flags = self.int()
        if (flags & 0xFF) != NILVALUE_SXP:
            raise ValueError(f"R pairlist ends in type {flags & 0xFF}, expected NULL ({NILVALUE_SXP})")
        return nodes


def unserialize(data: bytes) -> Any:
    """One R object from R serialization bytes (XDR, version 2 or 3; see the module docstring)."""
    reader = _XDRReader(data)
    value = reader.item()
    if reader.pos != len(data):
        raise ValueError(f"R serialization has {len(data) - reader.pos} bytes after its object")
    return value


def read_lazyload(rdb_path: str | os.PathLike, rdx_path: str | os.PathLike) -> dict[str, Any]:
    """Every object of an R lazy-load database (``.rdb`` + ``.rdx``), by name; for janeaustenr,
    each is a list of lines (str)."""
    index = unserialize(gzip.decompress(Path(rdx_path).read_bytes()))
    if not isinstance(index, dict) or not isinstance(index.get("variables"), dict):
        raise ValueError(f"{rdx_path}: not a lazy-load index (no named list 'variables')")
    if index.get("compressed") not in (None, [True]):
        raise ValueError(f"{rdx_path}: compression {index['compressed']!r} is not supported; only zlib (TRUE)")
    rdb = Path(rdb_path).read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        chunk = rdb[offset : offset + length]
        if len(chunk) != length or length < 4:
            raise ValueError(f"{rdb_path}: object {name!r} at [{offset}, {offset + length}) is past the end")
        data = zlib.decompress(chunk[4:])
        if len(data) != struct.unpack(">I", chunk[:4])[0]:
            raise ValueError(f"{rdb_path}: object {name!r} decompresses to the wrong size")
        objects[name] = unserialize(data)
    return objects


# ----------------------------------------------------------------------------- the files
def default_cache_dir() -> Path:
    """Where downloaded sources are kept: ``$GEOMTRAIN_CACHE``, else ``$XDG_CACHE_HOME/geomtrain``,
    else ``~/.cache/geomtrain`` (like the pip data packages, outside any data folder and shared by
    all of them)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "geomtrain"


def _austen_dir(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_dir() / "janeaustenr"


def _by_hand(folder: Path) -> str:
    return (
        f"run `apt-get download {AUSTEN_DEB} && dpkg-deb -x {AUSTEN_DEB}_*.deb x` and copy "
        f"x/{_DATA_IN_DEB}/Rdata.rdb and Rdata.rdx into {folder}"
    )


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``cmd`` in ``cwd``; MissingPackageError with the last line of its output if it fails."""
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise MissingPackageError(f"`{' '.join(cmd)}` failed ({exc})") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise MissingPackageError(f"`{' '.join(cmd)}` failed ({lines[-1] if lines else f'exit {done.returncode}'})")
    return done


def fetch_janeaustenr(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding ``Rdata.rdb``/``Rdata.rdx`` of ``r-cran-janeaustenr``, downloading them
    first if missing (``apt-get download`` and ``dpkg-deb -x`` in a temporary folder; one line
    printed). ``source.json`` beside them records the .deb's version and sha256.

    ``cache_dir`` (the folder of the two files) defaults to ``<default_cache_dir()>/janeaustenr``.
    Without ``apt-get`` or ``dpkg-deb``, or when they fail, raises :class:`MissingPackageError`:
    one line saying how to get the two files by hand and where to put them."""
    folder = _austen_dir(cache_dir)
    if all((folder / f).is_file() for f in RDATA_FILES):
        return folder
    missing = [tool for tool in ("apt-get", "dpkg-deb") if shutil.which(tool) is None]
    try:
        if missing:
            raise MissingPackageError(f"{' and '.join(missing)} not found")
        print(f"geomtrain: fetching {AUSTEN_DEB} (Jane Austen's novels) into {folder}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="geomtrain-austen-") as tmp:
            tmp = Path(tmp)
            _run(["apt-get", "download", AUSTEN_DEB], tmp)
            debs = sorted(tmp.glob(f"{AUSTEN_DEB}_*.deb"))
            if len(debs) != 1:
                raise MissingPackageError(f"apt-get download left {len(debs)} .deb files")
            version = _run(["dpkg-deb", "-f", str(debs[0]), "Version"], tmp).stdout.strip()
            _run(["dpkg-deb", "-x", str(debs[0]), "x"], tmp)
            folder.mkdir(parents=True, exist_ok=True)
            deb = {"deb": debs[0].name, "version": version, "sha256": sha256_file(debs[0])}
            atomic_write_json(folder / SOURCE_JSON, deb)
            for name in RDATA_FILES:  # Rdata.rdx last: both files there means the fetch completed
                atomic_write_bytes(folder / name, (tmp / "x" / _DATA_IN_DEB / name).read_bytes())
    except (MissingPackageError, OSError) as exc:
        why = str(exc).rstrip(".")
        raise MissingPackageError(
            f"Jane Austen's novels need {AUSTEN_DEB}, and fetching it failed ({why}); {_by_hand(folder)}"
        ) from None
    return folder


def janeaustenr_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding the two files, or :class:`MissingPackageError` saying how to get them."""
    folder = _austen_dir(cache_dir)
    for name in RDATA_FILES:
        if not (folder / name).is_file():
            raise MissingPackageError(
                f"Jane Austen's novels need {folder / name}: {_by_hand(folder)}, "
                "or let `geomtrain prepare` fetch it (no --no-fetch)"
            )
    return folder


def austen_source_info(cache_dir: str | os.PathLike | None = None) -> dict:
    """What the manifest records: the .deb's name, version and sha256 (``None`` for files put in
    by hand) and the sha256 of the two files read."""
    folder = janeaustenr_dir(cache_dir)
    deb = read_json(folder / SOURCE_JSON, default={}) or {}
    info = {"deb": deb.get("deb"), "version": deb.get("version"), "deb_sha256": deb.get("sha256")}
    info.update({f"{name}_sha256": sha256_file(folder / name) for name in RDATA_FILES})
    return info


# ----------------------------------------------------------------------------- documents
_HEADING = re.compile(r"^\s*(chapter|volume)\s+([ivxlc]+|\d+)\.?\s*$", re.I)


def _only_headings(lines: list[str]) -> bool:
    """A heading and nothing but headings and blank lines (``VOLUME II`` before its ``CHAPTER I``)."""
    return any(_HEADING.match(line) for line in lines) and all(
        _HEADING.match(line) or not line.strip() for line in lines
    )


def austen_novels(cache_dir: str | os.PathLike | None = None) -> dict[str, list[str]]:
    """``{novel: lines}`` for the six novels (``None`` lines, R's NA, become empty)."""
    folder = janeaustenr_dir(cache_dir)
    objects = read_lazyload(folder / "Rdata.rdb", folder / "Rdata.rdx")
    if set(objects) != set(AUSTEN_NOVELS):
        raise ValueError(
            f"{folder}: expected the novels {', '.join(AUSTEN_NOVELS)}, found {', '.join(sorted(objects))}"
        )
    novels = {}
    for name in AUSTEN_NOVELS:
        lines = objects[name]
        if not isinstance(lines, list) or not all(line is None or isinstance(line, str) for line in lines):
            raise ValueError(f"{folder}: object {name!r} is not a character vector")
        novels[name] = ["" if line is None else line for line in lines]
    return novels


def split_chapters(lines: list[str]) -> list[str]:
    """A novel's lines cut before each chapter heading (``CHAPTER I``, ``Chapter 1``,
    ``CHAPTER XII.``); a volume heading (``VOLUME II``) goes with the chapter that follows it.
    Item 0 is the text before the first heading (the title page; empty if there is none)."""
    chapters: list[list[str]] = [[]]
    for line in lines:
        if _HEADING.match(line) and not _only_headings(chapters[-1]):
            chapters.append([])
        chapters[-1].append(line)
    return ["\n".join(chapter).strip() for chapter in chapters]


def austen_documents(cache_dir: str | os.PathLike | None = None) -> Iterator[tuple[str, str]]:
    """One document per chapter, named ``austen/<novel>/<NN>``: ``00`` is the text before the
    first chapter (title, author, year; for Northanger Abbey also the author's advertisement),
    kept so that every line is used; ``01``... number the chapters through the novel, across its
    volumes (Emma's three volumes each restart at CHAPTER I)."""
    for novel, lines in austen_novels(cache_dir).items():
        chapters = split_chapters(lines)
        if len(chapters) < 2:
            raise ValueError(f"{novel}: no chapter headings found")
        for i, text in enumerate(chapters):
            if text:
                yield f"austen/{novel}/{i:02d}", text + "\n"
