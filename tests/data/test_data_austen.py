"""Jane Austen's novels: the R serialization reader on hand-built bytes, a tiny lazy-load
database, chapter documents, the fetch errors, prepare with a synthetic cache, and (skipped
without the cache or apt-get) the real ``r-cran-janeaustenr``."""

from __future__ import annotations

import gzip
import hashlib
import shutil
import struct
import zlib

import pytest

from geomtrain import data
from geomtrain.data import austen

# ----------------------------------------------------------------------------- writing R's XDR format
HAS_ATTR, HAS_TAG = 0x200, 0x400
NIL = struct.pack(">i", 254)


def ints(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def header(version: int = 3) -> bytes:
    return b"X\n" + ints(version, 0x040201, 0x030500) + (ints(5) + b"UTF-8" if version == 3 else b"")


def charsxp(text: str | None, encoding: str = "utf-8") -> bytes:
    if text is None:
        return ints(9, -1)
    levels = {"utf-8": 0x8, "latin-1": 0x4, "ascii": 0x40, "native": 0}[encoding]
    raw = text.encode("utf-8" if encoding == "native" else encoding)
    return ints(9 | levels << 12, len(raw)) + raw


def vector(kind: int, items: bytes, n: int, attributes: bytes = b"") -> bytes:
    return ints(kind | (HAS_ATTR if attributes else 0), n) + items + attributes


def strsxp(texts, attributes: bytes = b"", encoding: str = "utf-8") -> bytes:
    return vector(16, b"".join(charsxp(t, encoding) for t in texts), len(texts), attributes)


def intsxp(values, kind: int = 13) -> bytes:
    return vector(kind, ints(*values), len(values))


def names_attribute(names, first_use: bool = True) -> bytes:
    """The pairlist ``names = c(...)``; the symbol ``names`` is written once, then referred to."""
    symbol = ints(1) + charsxp("names", "ascii") if first_use else ints(1 << 8 | 255)
    return ints(2 | HAS_TAG) + symbol + strsxp(names) + NIL


def named_list(items: dict, first_use: bool = True) -> bytes:
    return vector(19, b"".join(items.values()), len(items), names_attribute(list(items), first_use))


def write_lazyload(folder, objects: dict[str, bytes]) -> None:
    """``Rdata.rdb`` (size + zlib chunk per object) and ``Rdata.rdx`` (gzip of the index)."""
    folder.mkdir(parents=True, exist_ok=True)
    rdb, variables = b"", {}
    for name, payload in objects.items():
        chunk = struct.pack(">I", len(payload)) + zlib.compress(payload)
        variables[name] = intsxp([len(rdb), len(chunk)])
        rdb += chunk
    # a list's names follow its elements: the inner list writes the symbol `names`, the outer refers to it
    index = named_list({"variables": named_list(variables), "compressed": intsxp([1], kind=10)}, first_use=False)
    (folder / "Rdata.rdb").write_bytes(rdb)
    (folder / "Rdata.rdx").write_bytes(gzip.compress(header() + index))


NOVEL = [
    "A NOVEL",
    "",
    "By Somebody",
    "",
    "VOLUME I",
    "",
    "CHAPTER I",
    "",
    "It was a dark night.",
    "CHAPTER II.",
    "Morning came.",
    "",
    "VOLUME II",
    "",
    "",
    "Chapter 1",
    "Chapter the first of the second volume, said she.",
    "  CHAPTER 12  ",
    "THE END",
]


def write_novels(folder, lines=NOVEL) -> None:
    write_lazyload(folder, {name: header() + strsxp(lines) for name in austen.AUSTEN_NOVELS})


# ----------------------------------------------------------------------------- the reader
@pytest.mark.parametrize("version", [2, 3])
def test_character_vector_with_na_latin1_and_native(version):
    raw = header(version) + vector(
        16,
        charsxp("EMMA", "ascii") + charsxp(None) + charsxp("£5, café", "latin-1") + charsxp("naïve") + charsxp(""),
        5,
    )
    assert austen.unserialize(raw) == ["EMMA", None, "£5, café", "naïve", ""]
    native = header(version) + strsxp(["été"], encoding="native")
    assert austen.unserialize(native) == ["été"]


def test_named_list_of_integer_vectors_and_references():
    inner = named_list({"a": intsxp([0, 10]), "b": intsxp([10, -(2**31)])})
    outer = vector(19, inner + intsxp([1, 0, -(2**31)], kind=10), 2, names_attribute(["x", "flags"], first_use=False))
    assert austen.unserialize(header() + outer) == {"x": {"a": [0, 10], "b": [10, None]}, "flags": [True, False, None]}
    assert austen.unserialize(header(2) + vector(19, b"", 0)) == []
    assert austen.unserialize(header() + NIL) is None


@pytest.mark.parametrize(
    "raw, match",
    [
        (header() + ints(14, 1) + struct.pack(">d", 1.5), r"REALSXP .* not supported; supported: NULL, symbols"),
        (header() + ints(4), r"ENVSXP .* not supported"),
        (header() + ints(16, 1) + ints(9 | 0x2 << 12, 1) + b"x", "bytes"),
        (header() + ints(1 << 8 | 255), "refers to object 1, only 0 seen"),
        (header() + strsxp(["abc"])[:-2], "truncated"),
        (header() + NIL + b"\0", "bytes after its object"),
        (b"A\n" + header()[2:] + NIL, "not an R serialization in XDR form"),
        (b"X\n" + ints(4, 0, 0) + NIL, "version 4 is not supported; valid versions: 2, 3"),
    ],
)
def test_unsupported_or_broken_input_is_a_clear_error(raw, match):
    with pytest.raises(ValueError, match=match):
        austen.unserialize(raw)


def test_lazyload_round_trip(tmp_path):
    objects = {"first": ["line 1", "", "line 3"], "second": [], "third": ["ünïcode", None]}
    write_lazyload(tmp_path, {name: header() + strsxp(lines) for name, lines in objects.items()})
    assert austen.read_lazyload(tmp_path / "Rdata.rdb", tmp_path / "Rdata.rdx") == objects
    (tmp_path / "Rdata.rdb").write_bytes((tmp_path / "Rdata.rdb").read_bytes()[:-3])
    with pytest.raises(ValueError, match="'third' at .* is past the end"):
        austen.read_lazyload(tmp_path / "Rdata.rdb", tmp_path / "Rdata.rdx")


# ----------------------------------------------------------------------------- chapters
def test_split_chapters_keeps_volume_headings_with_their_chapter():
    chapters = austen.split_chapters(NOVEL)
    assert chapters == [
        "A NOVEL\n\nBy Somebody",
        "VOLUME I\n\nCHAPTER I\n\nIt was a dark night.",
        "CHAPTER II.\nMorning came.",
        "VOLUME II\n\n\nChapter 1\nChapter the first of the second volume, said she.",
        "CHAPTER 12  \nTHE END",
    ]
    assert austen.split_chapters(["CHAPTER 1", "a", "CHAPTER 2", "b"]) == ["", "CHAPTER 1\na", "CHAPTER 2\nb"]
    assert "\n".join(austen.split_chapters(NOVEL)).split() == "\n".join(NOVEL).split()  # every word kept


def test_austen_documents_one_per_chapter(tmp_path):
    write_novels(tmp_path)
    docs = list(austen.austen_documents(tmp_path))
    assert [name for name, _ in docs[:5]] == [f"austen/emma/{i:02d}" for i in range(5)]
    assert len(docs) == 5 * len(austen.AUSTEN_NOVELS)
    assert docs[1][1] == "VOLUME I\n\nCHAPTER I\n\nIt was a dark night.\n"
    assert docs[-1][0] == "austen/sensesensibility/04"
    write_novels(tmp_path, ["no chapters here"])
    with pytest.raises(ValueError, match="emma: no chapter headings found"):
        list(austen.austen_documents(tmp_path))


# ----------------------------------------------------------------------------- fetching
def test_fetch_without_apt_get_is_one_line_saying_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    folder = tmp_path / "cache"
    with pytest.raises(data.MissingPackageError) as e:
        austen.fetch_janeaustenr(folder)
    message = str(e.value)
    assert "\n" not in message and "apt-get and dpkg-deb not found" in message
    assert "`apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb x`" in message
    assert message.endswith(f"Rdata.rdb and Rdata.rdx into {folder}")
    assert not folder.exists()


def test_fetch_with_the_files_in_the_cache_runs_nothing(tmp_path, monkeypatch):
    def no_commands(*args, **kwargs):
        raise AssertionError("ran a command")

    monkeypatch.setattr(austen.subprocess, "run", no_commands)
    write_novels(tmp_path)
    assert austen.fetch_janeaustenr(tmp_path) == tmp_path
    monkeypatch.setenv(austen.CACHE_ENV, str(tmp_path / "root"))
    assert austen.default_cache_dir() == tmp_path / "root"


@pytest.mark.slow
def test_prepare_classics_austen_from_a_cache_put_in_by_hand(tmp_path, monkeypatch):
    monkeypatch.setenv(austen.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(data.MissingPackageError, match=r"^Jane Austen's novels need .*Rdata\.rdb: run `apt-get"):
        data.prepare(tmp_path / "out", dataset="classics+austen", fetch=False)
    assert not (tmp_path / "out").exists()
    write_novels(tmp_path / "cache" / "janeaustenr")
    m = data.prepare(tmp_path / "out", dataset="classics+austen", fetch=False)
    source = m["sources"]["r-cran-janeaustenr"]
    assert source["version"] is None and source["deb_sha256"] is None
    rdb = (tmp_path / "cache" / "janeaustenr" / "Rdata.rdb").read_bytes()
    assert source["Rdata.rdb_sha256"] == hashlib.sha256(rdb).hexdigest()
    names = m["splits"]["train"]["document_names"] + m["splits"]["val"]["document_names"]
    assert sum(name.startswith("austen/") for name in names) == 30
    assert any(name.startswith("kjv/") for name in names)


# ----------------------------------------------------------------------------- the real package
REAL_LINES = {
    "emma": 16235,
    "mansfieldpark": 15349,
    "northangerabbey": 7856,
    "persuasion": 8328,
    "prideprejudice": 13030,
    "sensesensibility": 12624,
}


@pytest.mark.slow
def test_the_real_janeaustenr(tmp_path):
    try:
        folder = austen.janeaustenr_dir()
    except data.MissingPackageError:
        if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
            pytest.skip("r-cran-janeaustenr is not in the cache and apt-get/dpkg-deb are not available")
        try:
            folder = austen.fetch_janeaustenr(tmp_path / "janeaustenr")
        except data.MissingPackageError as exc:
            pytest.skip(f"could not fetch r-cran-janeaustenr: {exc}")
    novels = austen.austen_novels(folder)
    assert {name: len(lines) for name, lines in novels.items()} == REAL_LINES
    assert novels["emma"][:3] == ["EMMA", "", "By Jane Austen"]
    assert len("\n".join(novels["emma"])) == 883_027
    docs = dict(austen.austen_documents(folder))
    chapters = {novel: sum(name.startswith(f"austen/{novel}/") for name in docs) - 1 for novel in REAL_LINES}
    assert chapters == {
        "emma": 55,
        "mansfieldpark": 48,
        "northangerabbey": 31,
        "persuasion": 24,
        "prideprejudice": 61,
        "sensesensibility": 50,
    }
    assert docs["austen/emma/19"].startswith("VOLUME II\n\n\n\nCHAPTER I\n")
    assert 0.05 < sum(data.split_of(name) == "val" for name in docs) / len(docs) < 0.15
