"""FSDP2 sharding of the GPT and the trainer's checkpoint state: ``.pt`` files and DCP folders.

- `shard_model`: ``fully_shard`` on each transformer block, then on the root (which keeps the tied
  ``wte``/``lm_head`` weight in one parameter). Each rank holds a ``Shard(0)`` slice of every
  parameter, gradients and optimizer state alike; the forward and backward all-gather the weights of
  a block and the backward reduce-scatters its gradients (averaged over the ranks).
- `full_copy`: a plain, unsharded copy of a sharded model (weights and gradients), for the
  diagnostics, which need whole matrices. A collective: every rank calls it.
- `save_dcp` / `load_dcp`: a run's checkpoint through ``torch.distributed.checkpoint``: the model's
  and the optimizers' tensors as DCP shards (each rank writes its own; a load reads the slices it needs,
  so a checkpoint of 2 ranks resumes on 1 or 4), the small state (step, losses, RNG, optimizer
  hyperparameters and counters, config, assignment) in ``trainer.pt`` beside them. Written and
  committed by `geomtrain.runfolder.RunFolder` rules (a new folder, the manifest last).
- `rng_state`, `set_rng_state`, `load_checkpoint`, `check_same_run`: the checkpoint state of any run.

A DCP checkpoint's tensors are keyed ``model/<name>``, ``<optimizer>/<index>/<slot>`` (``index``: the
parameter's position in the optimizer, as in ``Optimizer.state_dict``), so a load rebuilds the state
dicts that ``load_state_dict`` takes; without a process group (one process) it loads plain tensors.
"""

from __future__ import annotations

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
from .runfolder import (
    CHECKPOINT_FORMAT,
    DCP_DIR,
    DCP_MANIFEST,
    DCP_SMALL_STATE,
    CheckpointError,
    RunFolder,
    load_verified_checkpoint,
)
from .runtime import any_rank

__all__ = [
    "shard_model",
    "is_sharded",
    "local",
    "full_copy",
    "save_dcp",
    "load_dcp",
    "new_dcp_folder",
    "commit_dcp",
    "verified_dcp_folder",
    "rebuild_dcp_manifest",
    "load_run_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
    "check_same_run",
]

SMALL_STATE = DCP_SMALL_STATE  # the small state beside the DCP shards
OPTIMIZERS = ("adamw", "muon")  # the optimizer entries of a trainer state


# ----------------------------------------------------------------------------- FSDP2
def shard_model(model: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """``fully_shard`` each block of ``model.transformer.h``, then the root (in place; returns ``model``).
    ``mesh``: a 1-D device mesh over all ranks (default: on the model's device type)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return t.to_local() if is_sharded(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective); a plain tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t


@torch.no_grad()
def full_copy(model: torch.nn.Module, make_model, grads: bool = False) -> torch.nn.Module:
    """A plain copy of ``model`` (``make_model()`` built on the meta device, then filled) with whole
    weights and, with ``grads``, whole gradients. All-gathers every parameter: call it on every rank."""
    device = next(model.parameters()).device
    with torch.device("meta"):
        copy = make_model()
    copy.to_empty(device=device)
    source = dict(model.named_parameters(remove_duplicate=False))
    gathered: dict[int, tuple] = {}  # by parameter: a tied weight is gathered once
    for name, q in copy.named_parameters(remove_duplicate=False):  # to_empty may untie: fill every name
        p = source[name]
        if id(p) not in gathered:
            gathered[id(p)] = (full(p.detach()), full(p.grad) if grads and p.grad is not None else None)
        weight, grad = gathered[id(p)]
        q.copy_(weight)
        q.grad = grad
    return copy


def shard_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor, equal on every rank) laid out as ``param``: sharded as it is, when it is a
    DTensor of ``value``'s shape; else ``value`` itself."""
    from torch.distributed.tensor import distribute_tensor

    if is_sharded(param) and not is_sharded(value) and value.shape == param.shape:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value


# ----------------------------------------------------------------------------- state of any run
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


def continue_with(saved_assigned: list[tuple], first: tuple) -> str:
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
            hint = "; " + continue_with(saved_assigned, first[0])
        raise CheckpointError(
            "the checkpoint has another manifold assignment or Muon solver (preset, rules, muon_solver or "
            f"muon_solver_rules changed){where} (optimizer, manifold, solver){hint}"
        )


def load_checkpoint(path, map_location="cpu") -> dict:
    """A checkpoint written by `geomtrain.train.train` as one dict of whole tensors: a run folder (its
    ``ckpt.pt`` or DCP checkpoint, verified) or a ``ckpt.pt`` file (verified against its ``ckpt.json``); a
    ``ckpt.dcp.json`` stands for its run folder."""
    path = os.fspath(path)
    if os.path.basename(path) == DCP_MANIFEST:
        path = os.path.dirname(path) or "."
    if os.path.isdir(path):
        folder = RunFolder(path, master=False)
        if folder.checkpoint_format() == "dcp":
            return load_dcp(verified_dcp_folder(folder), no_dist=True, map_location=map_location)
        path = os.path.join(path, "ckpt.pt")
    return load_verified_checkpoint(path, map_location)


def load_run_checkpoint(folder: RunFolder, model: torch.nn.Module, optimizers: dict, device) -> dict:
    """The checkpoint of ``folder`` (``.pt`` or DCP, verified), its tensors laid out as ``model``'s
    parameters (`load_dcp`; a ``.pt`` checkpoint's whole tensors sharded with `shard_like`)."""
    if folder.checkpoint_format() == "dcp":
        return load_dcp(verified_dcp_folder(folder), model, optimizers, map_location=device)
    ckpt = folder.load_checkpoint(map_location=device)
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


# ----------------------------------------------------------------------------- DCP
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


def save_dcp(folder: RunFolder, state: dict) -> None:
    """Write ``state`` (`geomtrain.train.Trainer.state_dict`) as a DCP checkpoint of ``folder``; every rank
    calls it. Rank 0 makes a new ``ckpt.dcp/step-N``, every rank writes its shards, rank 0 the small
    state; once every rank's files are complete rank 0 commits it (`commit_dcp`).

    A write that fails on any rank (a full disk: an OSError, or DCP's ``CheckpointException`` around one) is
    agreed by every rank (`geomtrain.runtime.any_rank`, so none waits in a collective): the new folder is
    removed, the committed checkpoint stays as it was, and each rank raises an OSError naming the folder
    (a `CheckpointError` on a rank whose own writes succeeded), one line in the CLI."""
    distributed = dist.is_available() and dist.is_initialized()
    target = new_dcp_folder(folder, state["step"])  # the same on every rank: read before any rank commits
    any_rank(False)  # a barrier: no rank reads the manifest after this

    def make_folder() -> None:
        if folder.master:
            shutil.rmtree(target, ignore_errors=True)  # a save of this step killed before its commit
            target.mkdir(parents=True)

    world = dist.get_world_size() if distributed else 1
    stages = (  # each ends when every rank has ended it (the second: every rank's files are complete)
        make_folder,
        lambda: _write_dcp(target, state, folder.master, distributed),
        lambda: commit_dcp(folder, target, state["step"], state.get("config"), world),
    )
    for stage in stages:
        error = _disk_error(stage, target)
        if any_rank(error is not None):
            break
    else:
        return
    if folder.master and (read_json(folder.file(DCP_MANIFEST)) or {}).get("folder") != f"{DCP_DIR}/{target.name}":
        shutil.rmtree(target, ignore_errors=True)
    raise error or CheckpointError(
        f"another rank could not write the checkpoint of step {state['step']} into {target}; the last "
        "committed checkpoint is kept"
    )


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


def new_dcp_folder(folder: RunFolder, step: int) -> Path:
    """Where the DCP checkpoint of ``step`` is written: ``ckpt.dcp/step-N``, or ``step-Nb`` when ``step-N`` is
    the committed one (a second save at the same step must not overwrite it)."""
    name = f"step-{step:08d}"
    if (read_json(folder.file(DCP_MANIFEST)) or {}).get("folder") == f"{DCP_DIR}/{name}":
        name += "b"
    return folder.file(DCP_DIR) / name


def commit_dcp(folder: RunFolder, target: Path, step: int, config: dict | None, world_size: int) -> None:
    """After every rank wrote ``target``: its files' checksums into ``ckpt.dcp.json`` (atomic, the commit), then
    the previous checkpoint (any other ``ckpt.dcp/`` folder, ``ckpt.pt``) is deleted. Rank 0 only."""
    if not folder.master:
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
    atomic_write_json(folder.file(DCP_MANIFEST), manifest)
    folder.in_place = {"step": step}
    folder.remove_uncommitted_dcp()
    folder.file("ckpt.pt").unlink(missing_ok=True)
    folder.file("ckpt.json").unlink(missing_ok=True)


def verified_dcp_folder(folder: RunFolder) -> Path:
    """The committed DCP checkpoint folder of ``folder``, every file checked against ``ckpt.dcp.json``;
    `CheckpointError` (one line, naming the file) otherwise, also for a damaged or missing manifest."""
    manifest = folder.dcp_manifest()
    path = folder.file(manifest["folder"])
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing; nothing was changed")
        if file.stat().st_size != entry.get("bytes") or sha256_file(file) != entry.get("sha256"):
            raise CheckpointError(
                f"checkpoint file {file} is corrupted (does not match {DCP_MANIFEST}); nothing was changed: "
                "restore it or start over with --overwrite"
            )
    folder.in_place = {"step": manifest.get("step")}
    return path


def rebuild_dcp_manifest(run: str | os.PathLike) -> Path:
    """Write a run folder's ``ckpt.dcp.json`` anew (it was damaged or deleted) for its newest complete
    ``ckpt.dcp/step-N``, the way a save commits one (`commit_dcp`: the previous folders are then deleted), so
    that ``--resume`` continues from it. The folder is checked first against DCP's own ``.metadata`` (every
    shard there and long enough for the tensors it lists) and its ``trainer.pt`` must load; its bytes are
    trusted as they are, since there is no earlier checksum to compare them with. Returns the folder."""
    import torch.distributed.checkpoint as dcp

    folder = RunFolder(run)
    complete = folder.complete_dcp_folders()
    if not complete:
        raise CheckpointError(f"{folder.file(DCP_DIR)} holds no complete checkpoint folder to rebuild from")
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
    folder.take_lock()
    try:
        commit_dcp(folder, target, step, config, len(ranks))
    finally:
        folder.release_lock()
    return target


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
