"""Moving an unfinished study to another machine: ``geomtrain study pack`` / ``unpack``.

A study that takes longer than a machine is kept (a session, a preemptible node) continues
elsewhere from one archive. :func:`pack` writes the study folder and its runs folder into one
``.tar.xz`` holding what resuming needs: every file, less the run locks, temporary files and the
``ckpt.pt`` of runs that are done (finished, diverged, failed: the report reads their metrics,
and resuming skips them), so an interrupted ``--jobs 2`` study packs to about two checkpoints;
with ``restart_unfinished`` not those either: the runs that are not done stay out whole and
train again from step 0 on the next machine (a smaller archive, for a record kept in git).
A ``manifest.json`` member lists every other member with its SHA-256. The archive is written
atomically and read back against the manifest before it replaces an older one.

:func:`unpack` restores both folders, refusing to put anything where a study or run folder
already is, and verifies every member against the manifest before anything appears at the
target (it extracts into temporary folders beside the targets and renames them into place).
Then the study's own command continues it, as on the first machine.

Archive layout: ``manifest.json``, ``study/<path in the study folder>`` and, when the runs
folder is not inside the study folder, ``runs/<path in the runs folder>``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import time
from pathlib import Path, PurePosixPath

from .._io import FileLock, atomic_write_bytes, read_json, sha256_file
from .collect import study_and_runs
from .plan import TERMINAL_STATUSES, StudyError

__all__ = ["PACK_FORMAT", "pack", "unpack"]

PACK_FORMAT = 1


def _skipped(path: Path) -> bool:
    """Run locks and claims and the temporary files of atomic writes (``.NAME.tmp.PID``) never travel."""
    name = path.name
    return name in (".lock", ".claim") or name.startswith(".lock.") or ".tmp." in name


def _live_lock(runs: Path) -> tuple[Path, int] | None:
    for lock in [*runs.rglob(".lock"), *runs.rglob(".claim")]:
        pid = FileLock(lock).live_holder()
        if pid:
            return lock.parent, pid
    return None


def _files(root: Path, restart_unfinished: bool = False) -> list[Path]:
    """Regular files under ``root`` (sorted), less `_skipped` ones and the ``ckpt.pt`` of runs
    that are done (with ``restart_unfinished``: less every file of a run that is not done)."""
    out, statuses = [], {}  # folder -> its status.json (None: not a run folder, or a run not begun), read once
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.is_symlink() or _skipped(path):
            continue
        if path.parent not in statuses:
            statuses[path.parent] = read_json(path.parent / "status.json")
        status = statuses[path.parent]
        done = (status or {}).get("status") in TERMINAL_STATUSES
        if path.name == "ckpt.pt" and done:
            continue
        if restart_unfinished and status is not None and not done:
            continue
        out.append(path)
    return out


def pack(
    out: str | os.PathLike,
    archive: str | os.PathLike,
    runs_dir: str | os.PathLike | None = None,
    restart_unfinished: bool = False,
) -> dict:
    """Write study folder ``out`` and its runs folder (``runs_dir``, default as recorded in
    ``study.json``) into ``archive`` (``.tar.xz``); return the manifest. ``restart_unfinished``:
    leave the runs that are not done out whole (they start again). ``StudyError`` when there is no
    study there or one of its runs is being trained right now."""
    out = Path(out)
    study, runs = study_and_runs(out, runs_dir)
    live = _live_lock(runs)
    if live:
        raise StudyError(f"{live[0]} is being trained (pid {live[1]}): stop the study (Ctrl-C) before packing it")
    inside = runs.resolve().is_relative_to(out.resolve())  # then the runs travel as study/<their path>
    members = [(f"study/{p.relative_to(out).as_posix()}", p) for p in _files(out, restart_unfinished)]
    if not inside:
        members += [(f"runs/{p.relative_to(runs).as_posix()}", p) for p in _files(runs, restart_unfinished)]
    manifest = {
        "format": PACK_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs_dir": study.get("runs_dir"),  # as the study's command line gave it
        "runs_inside_study": runs.resolve().relative_to(out.resolve()).as_posix() if inside else None,
        "files": {name: sha256_file(path) for name, path in members},
    }

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        data = json.dumps(manifest, indent=2).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
        for name, path in members:
            tar.add(path, arcname=name, recursive=False)
    buf.seek(0)
    _verified_members(buf)  # a file changed while it was read fails here, before anything is replaced
    Path(archive).parent.mkdir(parents=True, exist_ok=True)  # e.g. a record's state/ folder, on its first pack
    atomic_write_bytes(archive, buf.getvalue())
    return manifest


def _verified_members(fh) -> tuple[dict, list[tuple[tarfile.TarInfo, bytes]]]:
    """The manifest and every other member's bytes, each checked against the manifest."""
    try:
        with tarfile.open(fileobj=fh, mode="r:xz") as tar:
            members = []
            for info in tar:
                if not info.isfile():
                    raise StudyError(f"archive member {info.name!r} is not a plain file")
                members.append((info, tar.extractfile(info).read()))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise StudyError(f"not a readable study archive ({exc})") from None
    if not members or members[0][0].name != "manifest.json":
        raise StudyError("not a study archive: its first member is not manifest.json")
    manifest = json.loads(members[0][1])
    if manifest.get("format") != PACK_FORMAT:
        raise StudyError(f"study archive format {manifest.get('format')!r}; this version reads {PACK_FORMAT}")
    files, seen = manifest["files"], set()
    for info, data in members[1:]:
        parts = PurePosixPath(info.name).parts
        if parts[0] not in ("study", "runs") or ".." in parts or info.name.startswith("/") or len(parts) < 2:
            raise StudyError(f"archive member {info.name!r} is outside study/ and runs/")
        if hashlib.sha256(data).hexdigest() != files.get(info.name):
            raise StudyError(f"archive member {info.name} does not match its manifest checksum")
        seen.add(info.name)
    if seen != set(files):
        raise StudyError(f"the archive lacks {len(set(files) - seen)} of its manifest's files")
    return manifest, members[1:]


def _empty_or_absent(path: Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def unpack(
    archive: str | os.PathLike, out: str | os.PathLike, runs_dir: str | os.PathLike | None = None
) -> tuple[Path, Path]:
    """Restore a `pack` archive: the study folder to ``out`` and its runs folder to ``runs_dir``
    (default: the one its command line gave, relative to the current folder); return both.
    ``StudyError``, with nothing written, when either target holds anything or the archive does
    not verify."""
    out = Path(out)
    try:
        with open(archive, "rb") as fh:
            manifest, members = _verified_members(fh)
    except FileNotFoundError:
        raise StudyError(f"no study archive at {archive}") from None
    inside = manifest.get("runs_inside_study")
    if inside is not None:
        runs = out / inside
    elif runs_dir or manifest.get("runs_dir"):
        runs = Path(runs_dir or manifest["runs_dir"])
    else:
        raise StudyError("the archive records no runs folder: give --runs-dir")
    targets = {"study": out} if inside is not None else {"study": out, "runs": runs}
    for target in targets.values():
        if not _empty_or_absent(target):
            raise StudyError(f"{target} is not empty: unpack into a new folder (nothing was written)")
    staging = {}
    try:
        for key, target in targets.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            staging[key] = target.with_name(f".{target.name}.unpack.{os.getpid()}")
            shutil.rmtree(staging[key], ignore_errors=True)
            staging[key].mkdir()
        for info, data in members:
            key, *rest = PurePosixPath(info.name).parts
            dest = staging[key].joinpath(*rest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            os.utime(dest, (info.mtime, info.mtime))
        for key, target in targets.items():
            if target.exists():
                target.rmdir()  # empty (checked above)
            os.replace(staging[key], target)
    finally:
        for tmp in staging.values():
            shutil.rmtree(tmp, ignore_errors=True)
    return out, runs
