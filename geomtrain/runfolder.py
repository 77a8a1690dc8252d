"""`RunFolder`: every file of one training run, and the rules that keep it whole.

A run folder holds::

    config.json          the run's TrainConfig (resumes that change it append to config_history.jsonl)
    env.json             versions, machine, threads, device, seed, git commit, command line
    assignment.json/.txt parameter, shape, optimizer, manifold
    metrics.jsonl        {"kind": "train", "step", "loss", ...} and {"kind": "eval", "step", "val_loss"}
    diagnostics.jsonl    spectral and attention diagnostics per evaluation
    ckpt.pt              the last good checkpoint (atomic), verified against ckpt.json on load
    ckpt.json            {"sha256", "bytes", "step", "previous": {...}, "config"}: checksum and config
    ckpt.dcp/, .json     an ``fsdp`` run's checkpoint instead: step-N/ (DCP shards, trainer.pt) and the
                         manifest naming it with its files' sha256 (`geomtrain.sharding`)
    status.json          running | finished | diverged | interrupted | failed, step, pid, losses
    tensorboard/         with ``tensorboard=True``: every number of metrics and diagnostics as a scalar

Guarantees (tested in ``tests/train/test_faults.py`` and ``tests/train/test_run_lock.py``):

- **One process per folder**: `open` takes ``.lock`` (`geomtrain._io.FileLock`, held by the
  kernel) before it reads or writes anything, and `close` releases it. A second process is refused
  with one line naming the holder's PID and changes nothing; the lock of a killed run is taken over
  with a note.
- **Never appended to by accident**: a folder that holds a run is refused unless the caller
  resumes it or asks to overwrite it.
- **Never half-written**: every file but the JSONL logs is written atomically (temporary file,
  fsync, rename); a torn last JSONL line (a killed process) is cut with a warning on resume.
- **DCP checkpoints**: every rank writes a new ``ckpt.dcp/step-N``; then rank 0 writes its files'
  sha256 into ``ckpt.dcp.json`` (atomic: the commit) and deletes the previous folder. A folder it
  does not name is never loaded (deleted at the next open); a file that does not match is refused.
  A damaged manifest, or a missing one beside a complete folder, is refused and deletes nothing.
- **Never unverified**: ``ckpt.json`` is written *before* the checkpoint is renamed into place
  and names both the new checkpoint's sha256 and the previous one's, so a kill between the two
  renames leaves a checkpoint that still verifies; anything else that does not match is
  corruption, refused with one line naming the file, and nothing is overwritten.
- **Never silently changed**: the checkpoint's own config is the run's config. A resume whose
  run-defining keys differ from it is refused naming them, unless allowed; any change (allowed
  run-defining keys, or settings such as ``eval_interval``) is recorded in ``config_history.jsonl``.
  A missing or damaged ``config.json`` is rebuilt from the checkpoint, with a note.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os
import shutil
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ._io import (
    FileLock,
    append_jsonl,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    read_json,
    read_jsonl,
    truncate_jsonl,
)
from .config import INVOCATION_KEYS, RUN_DEFINING_KEYS, TrainConfig, load_toml, make_config, saved_config

__all__ = [
    "RunFolder",
    "RunFolderError",
    "CheckpointError",
    "config_changes",
    "resume_config",
    "pid_alive",
    "load_verified_checkpoint",
    "flatten_numbers",
    "runs_table",
]

CHECKPOINT_FORMAT = 2
DCP_MANIFEST, DCP_DIR = "ckpt.dcp.json", "ckpt.dcp"  # an FSDP run's checkpoint: manifest and folder of folders
DCP_SMALL_STATE = "trainer.pt"  # in a DCP checkpoint folder, beside the shards: the state that is not tensors
_RUN_FILES = (
    "config.json",
    "env.json",
    "assignment.json",
    "assignment.txt",
    "metrics.jsonl",
    "diagnostics.jsonl",
    "ckpt.pt",
    "ckpt.json",
    DCP_MANIFEST,
    "status.json",
    "config_history.jsonl",
    "init_from.json",
)


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked (exists, differs, unwritable): one line."""


class CheckpointError(RunFolderError):
    """A checkpoint that is corrupted, unverifiable or of another run."""


def config_changes(old: dict, new: dict, keys=RUN_DEFINING_KEYS) -> dict[str, tuple[Any, Any]]:
    """``{key: (old, new)}`` for the ``keys`` (default: the run-defining ones) whose values differ."""
    return {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}


def resume_config(given: dict[str, Any] | None = None, toml_path: str | os.PathLike | None = None) -> TrainConfig:
    """The config a resume runs with: the run's own (`RunFolder.run_config`: the checkpoint's), with
    the keys of ``toml_path`` and then the non-``None`` ``given`` ones on top, as changes (`train`
    refuses run-defining ones unless allowed). The folder is ``out_dir`` from ``given`` (or the
    default template filled from ``given``); `INVOCATION_KEYS` are never taken from the run. A
    folder without a run gives `make_config` of the same arguments (a fresh start)."""
    explicit = load_toml(toml_path) if toml_path is not None else {}  # read once, as make_config would
    explicit.update({k: v for k, v in (given or {}).items() if v is not None})
    fresh = make_config(explicit)
    saved = RunFolder(fresh.resolved_out_dir()).run_config()
    if saved is None:
        return fresh
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    base = {k: v for k, v in saved.items() if k in fields and k not in INVOCATION_KEYS}
    return make_config({**base, "out_dir": fresh.out_dir, **explicit})


def pid_alive(pid: int | None, host: str | None = None) -> bool | None:
    """Whether process ``pid`` runs on this machine (``None``: unknown, e.g. another host)."""
    if not pid or (host and host != socket.gethostname()):
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def flatten_numbers(record: Any, prefix: str) -> list[tuple[str, float]]:
    """``(tag, value)`` for every finite number in a nested record; list entries are named by their
    ``name`` or ``layer`` key (``diagnostics/matrices/transformer.h.0.attn.c_attn.weight/sigma_max``,
    ``diagnostics/attention/layer0/mean_entropy``), else by position. ``step`` is the x axis, not a tag."""
    out: list[tuple[str, float]] = []
    if isinstance(record, dict):
        for key, value in record.items():
            if key not in ("step", "kind", "name", "layer"):
                out += flatten_numbers(value, f"{prefix}/{key}")
    elif isinstance(record, list):
        for i, item in enumerate(record):
            label = item.get("name") if isinstance(item, dict) else None
            if label is None and isinstance(item, dict) and item.get("layer") is not None:
                label = f"layer{item['layer']}"
            out += flatten_numbers(item, f"{prefix}/{label if label is not None else i}")
    elif isinstance(record, (int, float)) and not isinstance(record, bool) and math.isfinite(record):
        out.append((prefix, float(record)))
    return out


def _valid_dcp_manifest(manifest: Any) -> bool:
    return isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and bool(manifest.get("folder"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class RunFolder:
    """All I/O of one run folder. Only the writer (``master``, rank 0 under DDP) touches files;
    reads work on every rank."""

    def __init__(self, path: str | os.PathLike, master: bool = True):
        self.path = Path(path)
        self.master = master
        self.tensorboard = None  # a torch.utils.tensorboard.SummaryWriter once enabled
        self._pending_history: dict | None = None  # a change allowed by check_resume_config, recorded by write_run_info
        self.in_place: dict | None = None  # {"sha256", "bytes", "step"} of the checkpoint known to be on disk
        self.lock = FileLock(self.path / ".lock")  # held by the writer from `open` to `close`
        self.notes: list[str] = []  # things the caller should tell the user (a lock taken over, a rebuilt file)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def file(self, name: str) -> Path:
        return self.path / name

    # ------------------------------------------------------------------ state of the folder
    def holds_run(self) -> bool:
        """True when any run file is present (a run started here before)."""
        return any(
            self.file(n).exists() for n in ("config.json", "metrics.jsonl", "ckpt.pt", DCP_MANIFEST, "status.json")
        )

    def has_checkpoint(self) -> bool:
        return self.checkpoint_format() is not None

    def checkpoint_format(self) -> str | None:
        """``"pt"`` (``ckpt.pt``), ``"dcp"`` (``ckpt.dcp.json``: an FSDP run's, also when it is damaged or missing
        beside a complete folder, `dcp_in_doubt`: loading it is refused) or None; when both are there (a kill
        between a save and the removal of the other format), the later step's."""
        pt, dcp = self.file("ckpt.pt").exists(), self.file(DCP_MANIFEST).exists()
        if self.dcp_in_doubt():
            return "dcp"
        if pt and dcp:
            steps = [float((read_json(self.file(n)) or {}).get("step") or 0) for n in ("ckpt.json", DCP_MANIFEST)]
            return "dcp" if steps[1] >= steps[0] else "pt"
        return "pt" if pt else "dcp" if dcp else None

    def read_config(self) -> dict | None:
        """``config.json``, keys added since it was written filled with their defaults (`saved_config`)."""
        return saved_config(read_json(self.file("config.json")))

    def read_status(self) -> dict | None:
        """``status.json``, with a ``running`` status whose process is gone reported as ``stale``."""
        status = read_json(self.file("status.json"))
        if (
            isinstance(status, dict)
            and status.get("status") == "running"
            and pid_alive(status.get("pid"), status.get("host")) is False
        ):
            status = {
                **status,
                "status": "stale",
                "reason": f"status says running, but pid {status.get('pid')} is gone (killed?); resume with --resume",
            }
        return status

    def read_metrics(self) -> list[dict]:
        return read_jsonl(self.file("metrics.jsonl"))

    def read_diagnostics(self) -> list[dict]:
        return read_jsonl(self.file("diagnostics.jsonl"))

    # ------------------------------------------------------------------ opening
    def open(self, *, resume: bool = False, overwrite: bool = False) -> bool:
        """Take the folder's lock, then make it ready for a run; True when a checkpoint should be loaded.

        - another process holds the lock: `RunFolderError` naming its PID (nothing read or written);
        - a folder holding a run, without ``resume`` or ``overwrite``: `RunFolderError`;
        - ``overwrite``: the run files are deleted first (other files are left alone);
        - ``resume`` without a checkpoint: starts clean (logs of the unfinished start removed).
        A resume's config is checked against the checkpoint by `check_resume_config`. On any error
        the lock is released again."""
        if resume and overwrite:
            raise RunFolderError("--resume and --overwrite exclude each other")
        self.take_lock()
        try:
            return self._open_locked(resume, overwrite)
        except BaseException:
            self.release_lock()
            raise

    def _open_locked(self, resume: bool, overwrite: bool) -> bool:
        if self.holds_run() and not (resume or overwrite):
            status = self.read_status() or {}
            raise RunFolderError(
                f"{self.path} already holds a run (status {status.get('status', 'unknown')}, step "
                f"{status.get('step', '?')}); pass --resume to continue it, --overwrite to replace it, "
                "or choose another --out-dir"
            )
        if resume or overwrite:
            self._refuse_if_in_use()
            self.remove_stale_temporaries()
        if overwrite:
            self._remove_run_files()
        if resume and self.has_checkpoint():
            return True
        if resume and self.holds_run():
            self._remove_run_files()  # nothing to resume from: a clean start, no duplicated log lines
        if self.master and not os.access(self.path, os.W_OK):
            raise RunFolderError(f"run folder {self.path} is not writable")
        return False

    def take_lock(self) -> None:
        """Create the folder if needed and take ``.lock`` (the writer only; other ranks return)."""
        if not self.master or self.lock.held:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            holder = self.lock.acquire()
        except OSError as exc:
            raise RunFolderError(f"cannot create run folder {self.path}: {exc.strerror or exc}") from None
        if holder is not None:
            raise RunFolderError(
                f"{self.path} is in use: another process (pid {holder}) is running in it; wait for it, stop it "
                "(SIGTERM checkpoints it) or choose another --out-dir"
            )
        if self.lock.took_over is not None:
            self.notes.append(
                f"took over the lock of {self.path} from pid {self.lock.took_over}, which is gone (killed?)"
            )

    def release_lock(self) -> None:
        self.lock.release()

    def _refuse_if_in_use(self) -> None:
        """`RunFolderError` when ``status.json`` says running and its process is alive on this host
        though it holds no lock (a run of an older version, or on another host sharing the folder).
        Only the writer checks: under DDP the other ranks may get here after rank 0 has written its
        own running status."""
        status = read_json(self.file("status.json"))
        if not self.master or not isinstance(status, dict) or status.get("status") != "running":
            return
        pid = status.get("pid")
        if pid != os.getpid() and pid_alive(pid, status.get("host")) is True:
            raise RunFolderError(
                f"{self.path} is in use: a run (pid {pid}) is still writing it; stop it first "
                f"(SIGTERM checkpoints it) or choose another --out-dir (if pid {pid} is no run, "
                f"delete {self.file('status.json')})"
            )

    def remove_stale_temporaries(self) -> list[str]:
        """Delete the temporary files (``.NAME.tmp.PID``, see `geomtrain._io.atomic_write`) that a
        killed writer left beside the run files; those of a live process are kept. Returns their names."""
        removed = []
        if not self.master or not self.path.is_dir():
            return removed
        for tmp in self.path.glob(".*.tmp.*"):
            name, _, pid = tmp.name[1:].rpartition(".tmp.")
            if name in _RUN_FILES and pid.isdigit() and pid_alive(int(pid)) is False:
                tmp.unlink(missing_ok=True)
                removed.append(tmp.name)
        return removed + self.remove_uncommitted_dcp()

    def remove_uncommitted_dcp(self) -> list[str]:
        """Delete the ``ckpt.dcp/`` folders ``ckpt.dcp.json`` does not name (a save killed before its commit, or
        the previous checkpoint once a new one is committed); none while the manifest is in doubt (`dcp_in_doubt`):
        shards are never deleted on the word of a manifest that cannot be read. Returns their names."""
        if self.dcp_in_doubt():
            return []
        named = (read_json(self.file(DCP_MANIFEST)) or {}).get("folder")
        stale = [d for d in sorted(self.file(DCP_DIR).glob("step-*")) if f"{DCP_DIR}/{d.name}" != named]
        for d in stale:
            shutil.rmtree(d, ignore_errors=True)
        return [f"{DCP_DIR}/{d.name}" for d in stale]

    def complete_dcp_folders(self) -> list[Path]:
        """The ``ckpt.dcp/step-N`` folders whose writes all ended, oldest first: DCP's ``.metadata`` (written once
        every rank's shards are) and ``trainer.pt`` (written last) are there. Committed or not."""
        found = sorted(self.file(DCP_DIR).glob("step-*"))
        return [d for d in found if (d / ".metadata").is_file() and (d / DCP_SMALL_STATE).is_file()]

    def dcp_in_doubt(self) -> bool:
        """Whether ``ckpt.dcp.json`` is damaged, or missing while ``ckpt.dcp/`` holds a complete folder and there is
        no ``ckpt.pt`` (a missing manifest beside a ``ckpt.pt`` is a save killed before its first commit)."""
        if self.file(DCP_MANIFEST).exists():
            return not _valid_dcp_manifest(read_json(self.file(DCP_MANIFEST)))
        return not self.file("ckpt.pt").exists() and bool(self.complete_dcp_folders())

    def dcp_manifest(self) -> dict:
        """``ckpt.dcp.json``; a `CheckpointError` naming it when it is missing or damaged (nothing is changed: the
        advice keeps the shards, `geomtrain.sharding.rebuild_dcp_manifest`)."""
        manifest = read_json(self.file(DCP_MANIFEST))
        if _valid_dcp_manifest(manifest):
            return manifest
        what = "is damaged (unreadable, or names no checkpoint folder)"
        if not self.file(DCP_MANIFEST).exists():
            what = "is missing (deleted, or a save was killed before its first commit)"
        complete = self.complete_dcp_folders()
        way = "start over with --overwrite"
        if complete:
            way = (
                f"rebuild it from {DCP_DIR}/{complete[-1].name} (its files then trusted unverified) with: "
                f"geomtrain rebuild-manifest {self.path} (geomtrain.sharding.rebuild_dcp_manifest)"
            )
        raise CheckpointError(
            f"{self.file(DCP_MANIFEST)} {what}, so the checkpoint in {self.file(DCP_DIR)} cannot be verified; "
            f"nothing was changed or deleted: restore it, or {way}"
        )

    def _remove_run_files(self) -> None:
        if self.master:
            for name in _RUN_FILES:
                self.file(name).unlink(missing_ok=True)
            shutil.rmtree(self.file("tensorboard"), ignore_errors=True)
            shutil.rmtree(self.file(DCP_DIR), ignore_errors=True)

    def run_config(self) -> dict | None:
        """The run's config: the checkpoint's own (from ``ckpt.json``, or the verified ``ckpt.pt`` of
        a checkpoint written before ``ckpt.json`` carried it), else ``config.json``; ``None`` when
        the folder holds neither. Keys added since are filled with their defaults (`saved_config`)."""
        if self.has_checkpoint():
            manifest = read_json(self.file("ckpt.json" if self.checkpoint_format() == "pt" else DCP_MANIFEST))
            if isinstance(manifest, dict) and isinstance(manifest.get("config"), dict):
                return saved_config(manifest["config"])
            if self.checkpoint_format() == "dcp":
                self.dcp_manifest()  # a damaged or missing manifest: refused naming it, not ckpt.pt
            return saved_config(self.load_checkpoint().get("config"))
        return self.read_config()

    def check_resume_config(self, config: dict, saved: dict | None, allow: bool) -> None:
        """Check a resume's ``config`` against the checkpoint's ``saved`` one (the source of truth).

        Different run-defining keys: `RunFolderError` naming them, unless ``allow``. Every change
        (but of `INVOCATION_KEYS`) is recorded in ``config_history.jsonl`` once the run starts
        (`write_run_info`). A missing or unreadable ``config.json`` is noted: it is rebuilt."""
        if not isinstance(self.read_config(), dict):
            self.notes.append(f"{self.file('config.json')} was missing or unreadable: rebuilt from the checkpoint")
        if saved is None:
            return
        saved = saved_config(saved)
        keys = [k for k in {**saved, **config} if k not in INVOCATION_KEYS]
        changes = config_changes(saved, config, keys)
        defining = {k: v for k, v in changes.items() if k in RUN_DEFINING_KEYS}
        if defining and not allow:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in defining.items())
            raise RunFolderError(
                f"resume of {self.path} would change the run ({listed}); pass --allow-config-change "
                "to continue with the new values (recorded in config_history.jsonl)"
            )
        if changes:
            # recorded by write_run_info, i.e. once the checkpoint loaded into the changed run
            self._pending_history = {
                "step": (self.in_place or {}).get("step"),
                "time": time.time(),
                "changes": {k: {"old": a, "new": b} for k, (a, b) in changes.items()},
            }

    # ------------------------------------------------------------------ writing
    def write_run_info(self, config: dict, environment: dict, assignment: list[dict], table: str) -> None:
        if self.master:
            if self._pending_history is not None:
                loaded_step = (self.in_place or {}).get("step")  # the checkpoint the changed run continues
                append_jsonl(
                    self.file("config_history.jsonl"),
                    {**self._pending_history, **({"step": loaded_step} if loaded_step is not None else {})},
                )
                self._pending_history = None
            atomic_write_json(self.file("config.json"), config)
            atomic_write_json(self.file("env.json"), environment)
            atomic_write_json(self.file("assignment.json"), assignment)
            atomic_write_text(self.file("assignment.txt"), table + "\n")

    def write_json(self, name: str, obj: Any) -> None:
        """Another JSON file of the run (atomic), e.g. ``init_from.json``."""
        if self.master:
            atomic_write_json(self.file(name), obj)

    def log(self, record: dict) -> None:
        if self.master:
            append_jsonl(self.file("metrics.jsonl"), record)
            self._scalars(record.get("kind", "metrics"), record)

    def log_diagnostics(self, record: dict) -> None:
        if self.master:
            append_jsonl(self.file("diagnostics.jsonl"), record)
            self._scalars("diagnostics", record)

    # ------------------------------------------------------------------ TensorBoard
    def enable_tensorboard(self, purge_step: int | None = None) -> None:
        """Mirror every logged number into ``tensorboard/`` (needs the ``tensorboard`` package:
        ``pip install 'geomtrain[tensorboard]'``). On resume, ``purge_step`` drops events logged
        after the checkpoint, as the JSONL logs are truncated."""
        if not self.master:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RunFolderError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
        self.tensorboard = SummaryWriter(str(self.file("tensorboard")), purge_step=purge_step)

    def close(self) -> None:
        """Close the TensorBoard writer and release the lock."""
        try:
            if self.tensorboard is not None:
                self.tensorboard.close()
                self.tensorboard = None
        finally:
            self.release_lock()

    def _scalars(self, prefix: str, record: dict) -> None:
        if self.tensorboard is None or "step" not in record:
            return
        for tag, value in flatten_numbers(record, prefix):
            self.tensorboard.add_scalar(tag, value, global_step=int(record["step"]))
        self.tensorboard.flush()

    def truncate_logs(self, step: int) -> None:
        """Drop log records after ``step`` (a resumed run writes them again, identically)."""
        if self.master:
            truncate_jsonl(self.file("metrics.jsonl"), step)
            truncate_jsonl(self.file("diagnostics.jsonl"), step)

    def write_status(self, status: str, **info: Any) -> dict:
        record = {"status": status, **info, "pid": os.getpid(), "host": socket.gethostname(), "updated": time.time()}
        if self.master:
            atomic_write_json(self.file("status.json"), record)
        return record

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, state: dict) -> None:
        """Serialise ``state``; write ``ckpt.json`` (new and previous sha256) and then ``ckpt.pt``, atomically."""
        if not self.master:
            return
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        # "previous" is the checkpoint actually on disk (known from the last load or save), not what
        # ckpt.json says: after a failed write (full disk) ckpt.json names a checkpoint that never landed
        previous = self.in_place
        if previous is None:
            manifest = read_json(self.file("ckpt.json"))
            previous = {k: manifest.get(k) for k in ("sha256", "bytes", "step")} if isinstance(manifest, dict) else None
        entry = {"sha256": _sha256(data), "bytes": len(data), "step": state.get("step")}
        manifest = {"format": CHECKPOINT_FORMAT, **entry, "previous": previous, "config": state.get("config")}
        atomic_write_json(self.file("ckpt.json"), manifest)
        atomic_write_bytes(self.file("ckpt.pt"), data)
        self.in_place = entry
        self.file(DCP_MANIFEST).unlink(missing_ok=True)  # a DCP checkpoint of this run (--fsdp before) is older now
        shutil.rmtree(self.file(DCP_DIR), ignore_errors=True)

    def load_checkpoint(self, map_location: Any = "cpu") -> dict:
        """The verified checkpoint; `CheckpointError` (one line, naming the file) when it does not verify."""
        data, digest = _verified_bytes(self.file("ckpt.pt"))
        state = _unpickle(self.file("ckpt.pt"), data, map_location)
        step = state.get("step") if isinstance(state, dict) else None
        self.in_place = {"sha256": digest, "bytes": len(data), "step": step}
        return state


def load_verified_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load ``path`` after checking it against the ``ckpt.json`` beside it.

    A checkpoint without ``ckpt.json`` (written before checksums existed) loads with a warning."""
    path = Path(path)
    return _unpickle(path, _verified_bytes(path)[0], map_location)


def _verified_bytes(path: Path) -> tuple[bytes, str]:
    """The bytes of checkpoint ``path`` and their sha256, checked against ``ckpt.json`` beside it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    digest = _sha256(data)
    manifest_path = path.with_name(path.stem + ".json")
    manifest = read_json(manifest_path)
    if manifest_path.exists() and not (isinstance(manifest, dict) and manifest.get("sha256")):
        raise CheckpointError(
            f"{manifest_path} is unreadable or holds no sha256, so {path} cannot be verified; "
            "restore it, or delete it to load the checkpoint unverified"
        )
    if isinstance(manifest, dict) and manifest.get("sha256"):
        known = {manifest["sha256"], (manifest.get("previous") or {}).get("sha256")}
        if digest not in known:
            raise CheckpointError(
                f"checkpoint {path} is corrupted (sha256 {digest[:12]}... matches neither "
                f"{path.stem}.json entry); nothing was changed: restore it or start over with --overwrite"
            )
    else:
        warnings.warn(f"{path}: no checksum file beside it; loading unverified", RuntimeWarning, stacklevel=3)
    return data, digest


def _unpickle(path: Path, data: bytes, map_location: Any) -> dict:
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    except Exception as exc:  # an unverified file that does not unpickle: still one line
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {str(exc)[:120]})") from None


def runs_table(paths) -> str:
    """Markdown table of plain run folders: assignment (the preset, or the rules and the preset they apply
    before), status (a dead ``running`` is ``stale``), step, best and last val loss, skipped steps, median ms per
    step (``geomtrain report RUN [RUN ...]``)."""
    from .assign import assignment_label

    head = "| run | assignment | status | step | best val | last val | skipped | ms/step |"
    lines = [head, "|" + "---|" * 8]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for path in paths:
        folder = RunFolder(path)
        if not folder.holds_run():
            raise RunFolderError(f"{path} is neither a study folder nor a run folder")
        cfg, st = folder.read_config() or {}, folder.read_status() or {}
        step = f"{st.get('step', '?')}/{cfg.get('max_iters', '?')}"
        status = st.get("status", "unknown") + (
            f" ({st['reason']})" if st.get("status") in ("diverged", "stale") else ""
        )
        cells = [
            folder.path.name,
            assignment_label(cfg.get("preset"), cfg.get("rules") or ()) if cfg.get("preset") else "-",
            status,
            step,
            fmt(st.get("best_val_loss"), ".4f"),
            fmt(st.get("last_val_loss"), ".4f"),
            str(st.get("n_skipped", 0)),
            fmt(st.get("ms_per_step"), ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
