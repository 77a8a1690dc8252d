"""Checking a prepared folder: sha256 cached by file identity, token ids against the vocabulary."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest

from geomtrain import data
from geomtrain.data import folder

pytest_plugins = ["data_corpora"]


@pytest.fixture
def hash_counter(monkeypatch):
    """Counts the token-file hashes `geomtrain.data.folder` computes."""
    calls = []
    real = folder.sha256_file

    def counting(path, *args, **kwargs):
        calls.append(os.path.basename(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(folder, "sha256_file", counting)
    return calls


@pytest.fixture
def copy(prepared, tmp_path):
    """A copy of a prepared folder (its files get new inodes and ctimes: nothing cached yet)."""
    out, manifest, _ = prepared
    dst = tmp_path / "copy"
    shutil.copytree(out, dst)
    (dst / data.VERIFIED_NAME).unlink()
    time.sleep(2 * folder.RACY_MARGIN_NS / 1e9)  # files older than the racy margin, as at a real start
    return dst, manifest


def flip_bytes(path, offset=100):
    """Change two bytes in place, keeping the size (and a valid uint16 id below 50257)."""
    raw = bytearray(path.read_bytes())
    new = (262).to_bytes(2, "little")
    raw[offset : offset + 2] = new if raw[offset : offset + 2] != new else (13).to_bytes(2, "little")
    with open(path, "r+b") as fh:
        fh.write(bytes(raw))


def test_second_start_hashes_nothing(copy, hash_counter):
    out, manifest = copy
    assert data.verify_cached(out) == manifest
    assert sorted(hash_counter) == ["train.bin", "val.bin"]
    cache = json.loads((out / data.VERIFIED_NAME).read_text())
    assert {name: e["sha256"] for name, e in cache["files"].items()} == {
        e["file"]: e["sha256"] for e in manifest["splits"].values()
    }
    hash_counter.clear()
    for _ in range(3):
        assert data.verify_cached(out) == manifest
    assert hash_counter == []
    assert not list(out.glob(".*tmp*"))
    # A full verify hashes again.
    assert data.verify(out) == [] and sorted(hash_counter) == ["train.bin", "val.bin"]


def test_a_file_hashed_right_after_it_changed_is_hashed_again(copy, hash_counter):
    # Within the timestamp granularity a second write can leave mtime and ctime unchanged, so an
    # entry taken less than RACY_MARGIN_NS after the file changed is not trusted (git's racy clean).
    out, _ = copy
    future = time.time_ns() + 3600 * 10**9  # "changed just now", whatever the machine's load
    for split in data.SPLITS:
        os.utime(out / f"{split}.bin", ns=(future, future))
    data.verify_cached(out)
    data.verify_cached(out)
    assert len(hash_counter) == 4
    past = time.time_ns() - 3600 * 10**9
    for split in data.SPLITS:
        os.utime(out / f"{split}.bin", ns=(past, past))  # ctime is now
    time.sleep(2 * folder.RACY_MARGIN_NS / 1e9)
    data.verify_cached(out)  # a new key: hashed, and now trusted
    data.verify_cached(out)
    assert len(hash_counter) == 6


def test_prepare_leaves_a_warm_cache(prepared, hash_counter):
    out, manifest, _ = prepared
    assert data.verify_cached(out) == manifest and hash_counter == []


def test_same_size_corruption_is_caught_and_named(copy):
    out, manifest = copy
    data.verify_cached(out)  # cached while sound
    path = out / "train.bin"
    size = path.stat().st_size
    flip_bytes(path)
    assert path.stat().st_size == size
    with pytest.raises(data.DataError) as e:
        data.verify_cached(out)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "sha256" in msg
    assert f"geomtrain prepare --out {out} --dataset text --tokenizer gpt2 --force --text-files FILES..." in msg
    assert isinstance(e.value, ValueError)  # the CLI's one-line, exit-2 errors


def test_corruption_with_the_old_mtime_put_back_is_caught(copy):
    out, _ = copy
    data.verify_cached(out)
    path = out / "val.bin"
    st = path.stat()
    flip_bytes(path, offset=8)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(data.DataError, match="val.bin: sha256 differs"):
        data.verify_cached(out)


def test_truncated_or_missing_file_is_named(copy):
    out, _ = copy
    path = out / "val.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(data.DataError, match=r"val\.bin: \d+ bytes, manifest says \d+"):
        data.verify_cached(out)
    path.unlink()
    with pytest.raises(data.DataError, match=r"val\.bin: missing; rebuild it with `geomtrain prepare"):
        data.verify_cached(out)
    (out / "empty").mkdir()
    with pytest.raises(data.DataError, match=r"manifest\.json: missing"):
        data.verify_cached(out / "empty")  # a folder without a manifest
    with pytest.raises(data.DataError, match=r"data folder \S+nowhere does not exist; prepared folders: "):
        data.verify_cached(out / "nowhere")


def test_read_only_folder_is_checked_without_a_cache(copy, hash_counter, monkeypatch):
    out, manifest = copy

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(folder, "atomic_write_json", refuse)
    assert data.verify_cached(out) == manifest
    assert data.verify_cached(out) == manifest
    assert len(hash_counter) == 4 and not (out / data.VERIFIED_NAME).exists()  # hashed each time


def test_a_garbled_cache_is_ignored(copy, hash_counter):
    out, manifest = copy
    (out / data.VERIFIED_NAME).write_text("{not json")
    assert data.verify_cached(out) == manifest and len(hash_counter) == 2
    # A cache claiming the manifest's sha256 for a changed file does not hide the change:
    # the file's stat key no longer matches, so it is hashed again.
    flip_bytes(out / "train.bin")
    with pytest.raises(data.DataError, match="train.bin"):
        data.verify_cached(out)


def test_check_token_range():
    tokens = np.array([0, 5, 8191, 3], dtype=np.uint16)
    assert data.check_token_range(tokens, 8192, "x.bin") == 8191
    with pytest.raises(ValueError) as e:
        data.check_token_range(tokens, 8000, "data/x/train.bin")
    assert str(e.value).startswith("data/x/train.bin: token id 8191 is outside the vocabulary of 8000")
    assert "\n" not in str(e.value)
    assert data.check_token_range(np.zeros(0, np.uint16), 10) is None
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="vocab_size"):
            data.check_token_range(tokens, bad)


def test_check_token_range_reads_a_memmap_in_place(prepared):
    out, manifest, _ = prepared
    tokens = data.load_split(out, "train")
    assert data.check_token_range(tokens, manifest["vocab_size"], out / "train.bin") == 50256  # the EOT
    with pytest.raises(ValueError, match=r"train\.bin: token id 50256 .* vocabulary of 50000"):
        data.check_token_range(tokens, 50000, out / "train.bin")


def test_out_of_vocabulary_ids_are_named(copy):
    out, manifest = copy
    # The files are sound, but the model's vocabulary is smaller than the data's.
    with pytest.raises(data.DataError, match=r"train\.bin: token id 50256 is outside the vocabulary of 8192"):
        data.verify_cached(out, vocab_size=8192)
    # A manifest that says the data fits a smaller vocabulary (a mixed-up folder) fails verify too.
    m = json.loads((out / "manifest.json").read_text())
    m["vocab_size"] = 1000
    (out / "manifest.json").write_text(json.dumps(m))
    problems = data.verify(out)
    assert len(problems) == 2 and all("outside the vocabulary of 1000" in p for p in problems)
    assert data.verify(out, check_hashes=False) == []  # sizes only: no reading
    with pytest.raises(data.DataError, match="outside the vocabulary of 1000"):
        data.verify_cached(out)


def test_check_hashes_choices(prepared):
    out, _, _ = prepared
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="check_hashes"):
            data.verify(out, check_hashes=bad)
