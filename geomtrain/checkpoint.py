"""Checkpoint I/O, in one place: what a trainer checkpoint holds, and how a run folder's is written, verified
and read.

A run folder's checkpoint (`Checkpoint`) is in one of two formats:

- ``ckpt.pt`` (one process, DDP): the whole state, one ``torch.save`` file, written by rank 0. ``ckpt.json``
  beside it holds ``{"format", "sha256", "bytes", "step", "previous": {...}, "config"}`` and is written
  *before* the file is renamed into place, naming the new checkpoint's sha256 and the previous one's, so a
  kill between the two renames leaves a checkpoint that still verifies.
- ``ckpt.dcp/step-N/`` (FSDP2): the model's and the optimizers' tensors as ``torch.distributed.checkpoint``
  shards (each rank writes its own; a load reads the slices it needs, so a checkpoint of 2 ranks resumes on 1
  or 4), the small state (step, losses, RNG, optimizer hyperparameters and counters, config, assignment) in
  ``trainer.pt`` beside them. Every rank writes a new folder; then rank 0 writes its files' sha256 into
  ``ckpt.dcp.json`` (atomic: the commit) and deletes the previous checkpoint. A folder the manifest does not
  name is never loaded; a damaged manifest, or a missing one beside a complete folder, is refused and deletes
  nothing (`Checkpoint.rebuild_dcp_manifest` makes it again from the newest complete folder).

A DCP checkpoint's tensors are keyed ``model/<name>``, ``<optimizer>/<index>/<slot>`` (``index``: the
parameter's position in the optimizer, as in ``Optimizer.state_dict``), so a load rebuilds the state dicts that
``load_state_dict`` takes; without a process group (one process) it loads plain tensors. Anything that does not
verify is a `CheckpointError`: one line naming the file, and nothing changed.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ._io import atomic_write_bytes, atomic_write_json, naming_file, read_json, sha256_file
from .runtime import any_rank
from .sharding import is_sharded, shard_like

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CHECKPOINT_FILES",
    "load_checkpoint",
    "load_verified_checkpoint",
    "load_dcp",
    "rng_state",
    "set_rng_state",
    "check_same_run",
]

CHECKPOINT_FORMAT = 2
PT, PT_MANIFEST = "ckpt.pt", "ckpt.json"  # one process or DDP: the file and its checksum record
DCP_MANIFEST, DCP_DIR = "ckpt.dcp.json", "ckpt.dcp"  # FSDP2: the manifest and its folder of step-N folders
SMALL_STATE = "trainer.pt"  # in a DCP checkpoint folder, beside the shards: the state that is not tensors
CHECKPOINT_FILES = (PT, PT_MANIFEST, DCP_MANIFEST)  # the files of a run folder that make up its checkpoint
OPTIMIZERS = ("adamw", "muon")  # the optimizer entries of a trainer state


class CheckpointError(ValueError):
    """A checkpoint that is corrupted, unverifiable or of another run: one line naming the file."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _valid_dcp_manifest(manifest: Any) -> bool:
    return isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and bool(manifest.get("folder"))


# ----------------------------------------------------------------------------- what a checkpoint holds
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _continue_with(saved_assigned: list[tuple], first: tuple) -> str:
    """How to resume a run whose Muon solvers differ from today's: ``muon_solver=S`` where the checkpoint has one
    solver on every Muon matrix, else its solvers per manifold kind and a ``muon_solver_rules`` example."""
    by_kind: dict[str, set] = {}
    for _, optimizer, manifold, solver in saved_assigned:
        if optimizer == "muon":
            by_kind.setdefault(manifold, set()).add(solver)
    solvers = set().union(*by_kind.values())
    if len(solvers) == 1:
        return f"a run begun with {solvers.pop()} everywhere continues with muon_solver={first[3]}"
    listed = ", ".join(f"{'/'.join(sorted(s))} on {kind} matrices" for kind, s in by_kind.items())
    return f"its solvers are {listed}: name them again with muon_solver_rules, e.g. {first[0]}={first[3]}"


def check_same_run(ckpt: dict, model_cfg: dict, assignments) -> None:
    """`CheckpointError` when ``ckpt`` is of another model shape (naming the keys), manifold assignment
    or Muon solver than ``model_cfg`` (a dict) and ``assignments``."""
    saved = ckpt.get("model_config") or {}
    differ = {k: (saved.get(k), v) for k, v in model_cfg.items() if saved.get(k) != v}
    if differ:
        listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in differ.items())
        raise CheckpointError(f"the checkpoint is of another model ({listed})")
    assigned = [(a.name, a.optimizer, a.manifold_name, a.solver) for a in assignments]
    solver_now = {a.name: a.solver for a in assignments}  # a checkpoint without solvers: as now
    saved_assigned = [
        (a["name"], a["optimizer"], a.get("manifold"), a.get("solver", solver_now.get(a["name"])))
        for a in ckpt.get("assignment", [])
    ]
    if saved_assigned and saved_assigned != assigned:
        first = next(((s, n) for s, n in zip(saved_assigned, assigned) if s != n), None)
        where = f": {first[0][0]} has {first[0][1:]} in the checkpoint, {first[1][1:]} now" if first else ""
        hint = ""
        if first and first[0][:3] == first[1][:3]:  # only a solver differs: say how to name the saved ones again
            hint = "; " + _continue_with(saved_assigned, first[0])
        raise CheckpointError(
            "the checkpoint has another manifold assignment or Muon solver (preset, rules, muon_solver or "
            f"muon_solver_rules changed){where} (optimizer, manifold, solver){hint}"
        )


# ----------------------------------------------------------------------------- a run folder's checkpoint
class Checkpoint:
    """The checkpoint of the run folder ``path`` (module docstring). Only the writer (``master``, rank 0) writes
    files; reads work on every rank. ``in_place`` is ``{"sha256", "bytes", "step"}`` of the checkpoint known to be
    on disk (from the last load or save)."""

    def __init__(self, path: str | os.PathLike, master: bool = True):
        self.path = Path(path)
        self.master = master
        self.in_place: dict | None = None

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r})"

    def file(self, name: str) -> Path:
        return self.path / name

    # ------------------------------------------------------------------ what is there
    def format(self) -> str | None:
        """``"pt"`` (``ckpt.pt``), ``"dcp"`` (``ckpt.dcp.json``: an FSDP run's, also when it is damaged or missing
        beside a complete folder, `in_doubt`: loading it is refused) or None; when both are there (a kill
        between a save and the removal of the other format), the later step's."""
        pt, dcp = self.file(PT).exists(), self.file(DCP_MANIFEST).exists()
        if self.in_doubt():
            return "dcp"
        if pt and dcp:
            steps = [float((read_json(self.file(n)) or {}).get("step") or 0) for n in (PT_MANIFEST, DCP_MANIFEST)]
            return "dcp" if steps[1] >= steps[0] else "pt"
        return "pt" if pt else "dcp" if dcp else None

    def exists(self) -> bool:
        return self.format() is not None

    def in_doubt(self) -> bool:
        """Whether ``ckpt.dcp.json`` is damaged, or missing while ``ckpt.dcp/`` holds a complete folder and there is
        no ``ckpt.pt`` (a missing manifest beside a ``ckpt.pt`` is a save killed before its first commit)."""
        if self.file(DCP_MANIFEST).exists():
            return not _valid_dcp_manifest(read_json(self.file(DCP_MANIFEST)))
        return not self.file(PT).exists() and bool(self.complete_dcp_folders())

    def complete_dcp_folders(self) -> list[Path]:
        """The ``ckpt.dcp/step-N`` folders whose writes all ended, oldest first: DCP's ``.metadata`` (written once
        every rank's shards are) and ``trainer.pt`` (written last) are there. Committed or not."""
        found = sorted(self.file(DCP_DIR).glob("step-*"))
        return [d for d in found if (d / ".metadata").is_file() and (d / SMALL_STATE).is_file()]

    def saved_config(self) -> dict | None:
        """The config the checkpoint was saved with (from its manifest, or the verified ``ckpt.pt`` of a checkpoint
        written before ``ckpt.json`` carried it); None without a checkpoint."""
        kind = self.format()
        if kind is None:
            return None
        manifest = read_json(self.file(PT_MANIFEST if kind == "pt" else DCP_MANIFEST))
        if isinstance(manifest, dict) and isinstance(manifest.get("config"), dict):
            return manifest["config"]
        if kind == "dcp":
            self.dcp_manifest()  # a damaged or missing manifest: refused naming it, not ckpt.pt
        return self.load().get("config")

    # ------------------------------------------------------------------ removing
    def remove(self) -> None:
        """Delete the checkpoint, both formats (the writer only)."""
        if self.master:
            for name in CHECKPOINT_FILES:
                self.file(name).unlink(missing_ok=True)
            shutil.rmtree(self.file(DCP_DIR), ignore_errors=True)

    def remove_uncommitted_dcp(self) -> list[str]:
        """Delete the ``ckpt.dcp/`` folders ``ckpt.dcp.json`` does not name (a save killed before its commit, or
        the previous checkpoint once a new one is committed); none while the manifest is in doubt (`in_doubt`):
        shards are never deleted on the word of a manifest that cannot be read. Returns their names."""
        if not self.master or self.in_doubt():
            return []
        named = (read_json(self.file(DCP_MANIFEST)) or {}).get("folder")
        stale = [d for d in sorted(self.file(DCP_DIR).glob("step-*")) if f"{DCP_DIR}/{d.name}" != named]
        for d in stale:
            shutil.rmtree(d, ignore_errors=True)
        return [f"{DCP_DIR}/{d.name}" for d in stale]

    # ------------------------------------------------------------------ ckpt.pt
    def save(self, state: dict) -> None:
        """Serialise ``state``; write ``ckpt.json`` (new and previous sha256) and then ``ckpt.pt``, atomically;
        then delete a DCP checkpoint of the same run (older now). The writer only."""
        if not self.master:
            return
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        # "previous" is the checkpoint actually on disk (known from the last load or save), not what
        # ckpt.json says: after a failed write (full disk) ckpt.json names a checkpoint that never landed
        previous = self.in_place
        if previous is None:
            manifest = read_json(self.file(PT_MANIFEST))
            previous = {k: manifest.get(k) for k in ("sha256", "bytes", "step")} if isinstance(manifest, dict) else None
        entry = {"sha256": _sha256(data), "bytes": len(data), "step": state.get("step")}
        manifest = {"format": CHECKPOINT_FORMAT, **entry, "previous": previous, "config": state.get("config")}
        atomic_write_json(self.file(PT_MANIFEST), manifest)
        atomic_write_bytes(self.file(PT), data)
        self.in_place = entry
        self.file(DCP_MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(self.file(DCP_DIR), ignore_errors=True)

    def load(self, map_location: Any = "cpu") -> dict:
        """The verified ``ckpt.pt``; `CheckpointError` (one line, naming the file) when it does not verify."""
        data, digest = _verified_bytes(self.file(PT))
        state = _unpickle(self.file(PT), data, map_location)
        step = state.get("step") if isinstance(state, dict) else None
        self.in_place = {"sha256": digest, "bytes": len(data), "step": step}
        return state

    # ------------------------------------------------------------------ either format
    def load_into(self, model: torch.nn.Module, optimizers: dict, device) -> dict:
        """The checkpoint (``.pt`` or DCP, verified), its tensors laid out as ``model``'s parameters (`load_dcp`;
        a ``.pt`` checkpoint's whole tensors sharded with `geomtrain.sharding.shard_like`). ``optimizers``:
        ``{"adamw": opt, "muon": opt or None}``."""
        if self.format() == "dcp":
            return load_dcp(self.verified_dcp_folder(), model, optimizers, map_location=device)
        ckpt = self.load(map_location=device)
        if any(is_sharded(p) for p in model.parameters()):
            params = dict(model.named_parameters(remove_duplicate=False))
            ckpt["model"] = {k: shard_like(v, params[k]) for k, v in ckpt["model"].items()}
            for name, opt in optimizers.items():
                listed = [p for g in opt.param_groups for p in g["params"]] if opt is not None else []
                for idx, slots in (ckpt.get(name) or {}).get("state", {}).items():
                    for slot, v in slots.items():
                        if isinstance(v, torch.Tensor):
                            slots[slot] = shard_like(v, listed[idx])
        return ckpt

    # ------------------------------------------------------------------ DCP
    def save_sharded(self, state: dict) -> None:
        """Write ``state`` (`geomtrain.train.Trainer.state_dict`) as a DCP checkpoint; every rank calls it. Rank 0
        makes a new ``ckpt.dcp/step-N``, every rank writes its shards, rank 0 the small state; once every rank's
        files are complete rank 0 commits it (`commit_dcp`).

        A write that fails on any rank (a full disk: an OSError, or DCP's ``CheckpointException`` around one) is
        agreed by every rank (`geomtrain.runtime.any_rank`, so none waits in a collective): the new folder is
        removed, the committed checkpoint stays as it was, and each rank raises an OSError naming the folder
        (a `CheckpointError` on a rank whose own writes succeeded), one line in the CLI."""
        distributed = dist.is_available() and dist.is_initialized()
        target = self.new_dcp_folder(state["step"])  # the same on every rank: read before any rank commits
        any_rank(False)  # a barrier: no rank reads the manifest after this

        def make_folder() -> None:
            if self.master:
                shutil.rmtree(target, ignore_errors=True)  # a save of this step killed before its commit
                target.mkdir(parents=True)

        world = dist.get_world_size() if distributed else 1
        stages = (  # each ends when every rank has ended it (the second: every rank's files are complete)
            make_folder,
            lambda: _write_dcp(target, state, self.master, distributed),
            lambda: self.commit_dcp(target, state["step"], state.get("config"), world),
        )
        for stage in stages:
            error = _disk_error(stage, target)
            if any_rank(error is not None):
                break
        else:
            return
        if self.master and (read_json(self.file(DCP_MANIFEST)) or {}).get("folder") != f"{DCP_DIR}/{target.name}":
            shutil.rmtree(target, ignore_errors=True)
        raise error or CheckpointError(
            f"another rank could not write the checkpoint of step {state['step']} into {target}; the last "
            "committed checkpoint is kept"
        )

    def new_dcp_folder(self, step: int) -> Path:
        """Where the DCP checkpoint of ``step`` is written: ``ckpt.dcp/step-N``, or ``step-Nb`` when ``step-N`` is
        the committed one (a second save at the same step must not overwrite it)."""
        name = f"step-{step:08d}"
        if (read_json(self.file(DCP_MANIFEST)) or {}).get("folder") == f"{DCP_DIR}/{name}":
            name += "b"
        return self.file(DCP_DIR) / name

    def commit_dcp(self, target: Path, step: int, config: dict | None, world_size: int) -> None:
        """After every rank wrote ``target``: its files' checksums into ``ckpt.dcp.json`` (atomic, the commit),
        then the previous checkpoint (any other ``ckpt.dcp/`` folder, ``ckpt.pt``) is deleted. Rank 0 only."""
        if not self.master:
            return
        files = {
            str(f.relative_to(target)): {"sha256": sha256_file(f), "bytes": f.stat().st_size}
            for f in sorted(target.rglob("*"))
            if f.is_file()
        }
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "kind": "dcp",
            "folder": f"{DCP_DIR}/{target.name}",
            "step": step,
            "world_size": world_size,
            "files": files,
            "config": config,
        }
        atomic_write_json(self.file(DCP_MANIFEST), manifest)
        self.in_place = {"step": step}
        self.remove_uncommitted_dcp()
        self.file(PT).unlink(missing_ok=True)
        self.file(PT_MANIFEST).unlink(missing_ok=True)

    def dcp_manifest(self) -> dict:
        """``ckpt.dcp.json``; a `CheckpointError` naming it when it is missing or damaged (nothing is changed: the
        advice keeps the shards, `rebuild_dcp_manifest`)."""
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
                f"geomtrain rebuild-manifest {self.path} (geomtrain.runfolder.RunFolder.rebuild_dcp_manifest)"
            )
        raise CheckpointError(
            f"{self.file(DCP_MANIFEST)} {what}, so the checkpoint in {self.file(DCP_DIR)} cannot be verified; "
            f"nothing was changed or deleted: restore it, or {way}"
        )

    def verified_dcp_folder(self) -> Path:
        """The committed DCP checkpoint folder, every file checked against ``ckpt.dcp.json``; `CheckpointError`
        (one line, naming the file) otherwise, also for a damaged or missing manifest."""
        manifest = self.dcp_manifest()
        path = self.file(manifest["folder"])
        for name, entry in manifest["files"].items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"checkpoint file {file} is missing; nothing was changed")
            if file.stat().st_size != entry.get("bytes") or sha256_file(file) != entry.get("sha256"):
                raise CheckpointError(
                    f"checkpoint file {file} is corrupted (does not match {DCP_MANIFEST}); nothing was changed: "
                    "restore it or start over with --overwrite"
                )
        self.in_place = {"step": manifest.get("step")}
        return path

    def rebuild_dcp_manifest(self) -> Path:
        """Write ``ckpt.dcp.json`` anew (it was damaged or deleted) for the newest complete ``ckpt.dcp/step-N``,
        the way a save commits one (`commit_dcp`: the previous folders are then deleted), so that ``--resume``
        continues from it. The folder is checked first against DCP's own ``.metadata`` (every shard there and
        long enough for the tensors it lists) and its ``trainer.pt`` must load; its bytes are trusted as they
        are, since there is no earlier checksum to compare them with. Returns the folder. The caller holds the
        run folder's lock (`geomtrain.runfolder.RunFolder.rebuild_dcp_manifest`)."""
        import torch.distributed.checkpoint as dcp

        complete = self.complete_dcp_folders()
        if not complete:
            raise CheckpointError(f"{self.file(DCP_DIR)} holds no complete checkpoint folder to rebuild from")
        target = complete[-1]
        try:
            storage = dcp.FileSystemReader(str(target)).read_metadata().storage_data
            small = torch.load(target / SMALL_STATE, map_location="cpu", weights_only=False)
            step, config = int(small["step"]), small.get("config")
        except Exception as exc:
            raise CheckpointError(f"{target} cannot be read ({type(exc).__name__}): cannot rebuild from it") from None
        for info in storage.values():
            shard = target / info.relative_path
            if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
                raise CheckpointError(f"{shard} is missing or shorter than its .metadata says: cannot rebuild from it")
        ranks = {info.relative_path.split("_")[2] for info in storage.values()}  # shards are __RANK_N.distcp
        self.commit_dcp(target, step, config, len(ranks))
        return target


# ----------------------------------------------------------------------------- reading a checkpoint anywhere
def load_checkpoint(path, map_location="cpu") -> dict:
    """A checkpoint written by `geomtrain.train.train` as one dict of whole tensors: a run folder (its
    ``ckpt.pt`` or DCP checkpoint, verified) or a ``ckpt.pt`` file (verified against its ``ckpt.json``); a
    ``ckpt.dcp.json`` stands for its run folder."""
    path = os.fspath(path)
    if os.path.basename(path) == DCP_MANIFEST:
        path = os.path.dirname(path) or "."
    if os.path.isdir(path):
        checkpoint = Checkpoint(path, master=False)
        if checkpoint.format() == "dcp":
            return load_dcp(checkpoint.verified_dcp_folder(), no_dist=True, map_location=map_location)
        path = os.path.join(path, PT)
    return load_verified_checkpoint(path, map_location)


def load_verified_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load the ``.pt`` file ``path`` after checking it against the ``.json`` checksum record beside it.

    A checkpoint without one (written before checksums existed) loads with a warning."""
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


# ----------------------------------------------------------------------------- DCP files
def _split(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A trainer state as ``(tensors, small)``: the model's and the optimizers' tensors by DCP key, and the rest."""
    tensors = {f"model/{k}": v for k, v in state["model"].items()}
    small = {k: v for k, v in state.items() if k != "model"}
    for name in OPTIMIZERS:
        sd = state.get(name)
        if sd is None:
            continue
        kept = {}
        for idx, slots in sd["state"].items():
            kept[idx] = {s: v for s, v in slots.items() if not isinstance(v, torch.Tensor)}
            tensors.update({f"{name}/{idx}/{s}": v for s, v in slots.items() if isinstance(v, torch.Tensor)})
        small[name] = {**sd, "state": kept}
    return tensors, small


def _write_dcp(target: Path, state: dict, master: bool, distributed: bool) -> None:
    """The shards of ``state`` (every rank) and, by rank 0, its small state, into ``target``. A write that
    failed raises the OSError behind it (DCP reports it inside a ``CheckpointException``), or a `CheckpointError`
    on a rank whose own writes succeeded while another rank's failed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tensors, small = _split(state)
    writer = _recording_writer(target)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, checkpoint_id=target, storage_writer=writer, no_dist=not distributed)
    except CheckpointException as exc:
        if writer.os_error is not None:
            raise writer.os_error from None
        if (dist.get_rank() if distributed else 0) in exc.failures:  # not a disk's error here: a bug, kept whole
            raise
        failed = ", ".join(map(str, sorted(exc.failures)))
        raise CheckpointError(f"rank {failed} could not write its part of the checkpoint {target}") from None
    if master:
        buf = io.BytesIO()
        torch.save(small, buf)
        atomic_write_bytes(target / SMALL_STATE, buf.getvalue())


def _recording_writer(target: Path):
    """DCP's ``FileSystemWriter`` of ``target`` that keeps, as ``os_error``, the OSError behind a failed write
    of its own (a full disk: torch's serializer turns it into a RuntimeError whose context is the OSError, and
    DCP sends that between ranks pickled, which drops the context)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class RecordingWriter(FileSystemWriter):
        os_error: OSError | None = None

        def write_data(self, *args, **kwargs):
            return self._recorded(super().write_data, *args, **kwargs)

        def finish(self, *args, **kwargs):
            return self._recorded(super().finish, *args, **kwargs)

        def _recorded(self, method, *args, **kwargs):
            try:
                return method(*args, **kwargs)
            except BaseException as exc:
                self.os_error = _os_error_in(exc)
                raise

    return RecordingWriter(target)


def _os_error_in(exc: BaseException | None) -> OSError | None:
    """The first OSError along ``exc``'s chain of causes and contexts, or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _disk_error(write, target: Path) -> OSError | CheckpointError | None:
    """Run ``write()``; the OSError it raised (named ``target`` when it names no file) or the `CheckpointError`
    of another rank's failed write; None when it succeeded. Any other error propagates."""
    try:
        write()
    except OSError as exc:
        return naming_file(exc, target) if exc.filename is None else exc
    except CheckpointError as exc:
        return exc
    return None


def load_dcp(path: Path, model=None, optimizers=None, no_dist: bool = False, map_location="cpu") -> dict:
    """The trainer state saved by `save_dcp` in ``path`` (a ``ckpt.dcp/step-N``): the dict `save_dcp` was
    given. Each tensor is read into a tensor laid out as the live one it replaces: the ``model``'s
    parameter, an optimizer slot of its parameter's shape sharded as the parameter; any other (and all
    without ``model``) a whole tensor on every rank. ``optimizers``: ``{"adamw": opt, "muon": opt or None}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    small = torch.load(path / SMALL_STATE, map_location=map_location, weights_only=False)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    live = dict(model.state_dict()) if model is not None else {}
    listed = {
        name: [p for g in opt.param_groups for p in g["params"]]
        for name, opt in (optimizers or {}).items()
        if opt is not None
    }

    def target(key: str, md: TensorStorageMetadata) -> torch.Tensor:
        kind, _, rest = key.partition("/")
        like = live.get(rest) if kind == "model" else None
        if kind in listed:
            like = listed[kind][int(rest.split("/")[0])]
        if like is not None and tuple(like.shape) == tuple(md.size):
            return torch.empty_like(like, dtype=md.properties.dtype)
        return torch.empty(md.size, dtype=md.properties.dtype, device=map_location)

    targets = {k: target(k, md) for k, md in metadata.items() if isinstance(md, TensorStorageMetadata)}
    no_dist = no_dist or not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, checkpoint_id=path, no_dist=no_dist)
    state = dict(small, model={k.partition("/")[2]: v for k, v in targets.items() if k.startswith("model/")})
    for name in OPTIMIZERS:
        if small.get(name) is None:
            continue
        slots = {idx: dict(kept) for idx, kept in small[name]["state"].items()}
        for key, value in targets.items():
            kind, _, rest = key.partition("/")
            if kind == name:
                idx, _, slot = rest.partition("/")
                slots.setdefault(int(idx), {})[slot] = value
        state[name] = {**small[name], "state": slots}
    return state
