"""`RunFolder`: every file of one training run, and the rules that keep it whole.

A run folder holds::

    config.json          the run's TrainConfig (resumes that change it append to config_history.jsonl)
    env.json             versions, machine, threads, device, seed, git commit, command line
    assignment.json/.txt parameter, shape, optimizer, manifold
    metrics.jsonl        {"kind": "train", "step", "loss", ...} and {"kind": "eval", "step", "val_loss"}
    diagnostics.jsonl    spectral and attention diagnostics per evaluation
    ckpt.pt, ckpt.json   the last good checkpoint (atomic) and its checksum record (`geomtrain.checkpoint`)
    ckpt.dcp/, .json     an ``fsdp`` run's checkpoint instead: step-N/ (DCP shards, trainer.pt) and the
                         manifest naming it with its files' sha256 (`geomtrain.checkpoint`)
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
- **Never unverified**: every checkpoint read and write goes through `RunFolder.checkpoint`
  (`geomtrain.checkpoint.Checkpoint`): written atomically with its checksums, verified on load;
  anything that does not match is corruption, refused with one line naming the file, and nothing
  is overwritten. A DCP folder its manifest does not name is deleted at the next open.
- **Never silently changed**: the checkpoint's own config is the run's config. A resume whose
  run-defining keys differ from it is refused naming them, unless allowed; any change (allowed
  run-defining keys, or settings such as ``eval_interval``) is recorded in ``config_history.jsonl``.
  A missing or damaged ``config.json`` is rebuilt from the checkpoint, with a note.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from ._io import (
    FileLock,
    append_jsonl,
    atomic_write_json,
    atomic_write_text,
    read_json,
    read_jsonl,
    truncate_jsonl,
)
from .checkpoint import CHECKPOINT_FILES, DCP_MANIFEST, PT, Checkpoint
from .config import INVOCATION_KEYS, RUN_DEFINING_KEYS, TrainConfig, load_toml, make_config, saved_config

__all__ = [
    "RunFolder",
    "RunFolderError",
    "config_changes",
    "resume_config",
    "pid_alive",
    "flatten_numbers",
    "runs_table",
]

_RUN_FILES = (
    "config.json",
    "env.json",
    "assignment.json",
    "assignment.txt",
    "metrics.jsonl",
    "diagnostics.jsonl",
    *CHECKPOINT_FILES,
    "status.json",
    "config_history.jsonl",
    "init_from.json",
)


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked (exists, differs, unwritable): one line."""


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


class RunFolder:
    """All I/O of one run folder. Only the writer (``master``, rank 0 under DDP) touches files;
    reads work on every rank."""

    def __init__(self, path: str | os.PathLike, master: bool = True):
        self.path = Path(path)
        self.master = master
        self.tensorboard = None  # a torch.utils.tensorboard.SummaryWriter once enabled
        self._pending_history: dict | None = None  # a change allowed by check_resume_config, recorded by write_run_info
        self.checkpoint = Checkpoint(self.path, master)  # ckpt.pt or ckpt.dcp/: every checkpoint read and write
        self.lock = FileLock(self.path / ".lock")  # held by the writer from `open` to `close`
        self.notes: list[str] = []  # things the caller should tell the user (a lock taken over, a rebuilt file)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def file(self, name: str) -> Path:
        return self.path / name

    # ------------------------------------------------------------------ state of the folder
    def holds_run(self) -> bool:
        """True when any run file is present (a run started here before)."""
        return any(self.file(n).exists() for n in ("config.json", "metrics.jsonl", PT, DCP_MANIFEST, "status.json"))

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
        if resume and self.checkpoint.exists():
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
        return removed + self.checkpoint.remove_uncommitted_dcp()

    def _remove_run_files(self) -> None:
        if self.master:
            for name in _RUN_FILES:
                self.file(name).unlink(missing_ok=True)
            shutil.rmtree(self.file("tensorboard"), ignore_errors=True)
            self.checkpoint.remove()

    def run_config(self) -> dict | None:
        """The run's config: the checkpoint's own (`Checkpoint.saved_config`), else ``config.json``; ``None`` when
        the folder holds neither. Keys added since are filled with their defaults (`saved_config`)."""
        if self.checkpoint.exists():
            return saved_config(self.checkpoint.saved_config())
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
                "step": (self.checkpoint.in_place or {}).get("step"),
                "time": time.time(),
                "changes": {k: {"old": a, "new": b} for k, (a, b) in changes.items()},
            }

    # ------------------------------------------------------------------ writing
    def write_run_info(self, config: dict, environment: dict, assignment: list[dict], table: str) -> None:
        if self.master:
            if self._pending_history is not None:
                loaded_step = (self.checkpoint.in_place or {}).get("step")  # the checkpoint the changed run continues
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
    def rebuild_dcp_manifest(self) -> Path:
        """`Checkpoint.rebuild_dcp_manifest` under the folder's lock (``geomtrain rebuild-manifest RUN``): a damaged
        or deleted ``ckpt.dcp.json`` made again from the newest complete ``ckpt.dcp/step-N``. Returns the folder."""
        self.take_lock()
        try:
            return self.checkpoint.rebuild_dcp_manifest()
        finally:
            self.release_lock()


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
