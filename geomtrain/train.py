"""The GPT-2 training loop: AdamW + Manifold Muon with module-wise manifolds.

``train(config)`` runs one run into ``config.resolved_out_dir()`` and returns its status dict.
The run folder holds:

- ``config.json``, ``env.json`` (versions, seed, git commit, device, command line);
- ``assignment.json`` / ``assignment.txt``: parameter, shape, optimizer, manifold;
- ``metrics.jsonl``: one JSON object a line, ``{"kind": "train", "step", "loss", "lr", "muon_lr",
  "ms_per_step", "tokens_per_s", "muon": {...}}`` and ``{"kind": "eval", "step", "val_loss"}``;
- ``diagnostics.jsonl``: per evaluation, spectral and attention diagnostics (`geomtrain.diagnostics`);
- ``ckpt.pt``: the last good checkpoint (model, both optimizers, RNG states, step), written atomically;
- ``status.json``: ``running | finished | diverged | interrupted`` with the step and losses.

Batches are a pure function of ``(seed, step, rank)`` (`geomtrain.data.get_batch`), so a
resumed run sees exactly the batches the uninterrupted run would have seen and continues
bit-exactly. Under ``torchrun`` the run is DDP (gloo on CPU, nccl on GPU); the global batch is
split over ranks and rank 0 writes the outputs.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from . import data as gdata
from .assign import assign, format_table
from .config import TrainConfig
from .diagnostics import collect_diagnostics, gradient_norms, jsonable
from .model import GPT, model_config

__all__ = ["train", "lr_at", "build_optimizers", "resolve_device", "load_checkpoint", "environment_info"]


# ----------------------------------------------------------------------------- helpers
def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(name)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr`` over ``warmup_iters``, then cosine decay to ``min_lr`` at ``max_iters``."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    if step >= cfg.max_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def _git_commit() -> dict:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5).stdout.strip())
        return {"commit": commit or None, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def environment_info(device: torch.device, seed: int) -> dict:
    """Versions, machine, device, seed and git commit: recorded with every run."""
    import geoopt

    info = {
        "python": sys.version.split()[0], "torch": torch.__version__, "geoopt": geoopt.__version__,
        "numpy": np.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "device": str(device), "seed": seed,
        "argv": sys.argv, "git": _git_commit(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }
    if device.type == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name(device)
    return info


def _atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """``write(fh)`` into a temporary binary file, fsync, then rename over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda fh: fh.write(text.encode()))


def _atomic_save(obj: Any, path: Path) -> None:
    _atomic_write(path, lambda fh: torch.save(obj, fh))


def build_optimizers(model: torch.nn.Module, assignments, cfg: TrainConfig):
    """AdamW for the ``adamw`` parameters (weight decay on 2-D ones only) and ManifoldMuon for
    the ``muon`` parameters, one param group per manifold. Returns ``(adamw, muon_or_None)``."""
    params = dict(model.named_parameters())
    decay = [params[a.name] for a in assignments if a.optimizer == "adamw" and params[a.name].dim() >= 2]
    no_decay = [params[a.name] for a in assignments if a.optimizer == "adamw" and params[a.name].dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    by_manifold: dict[str, dict] = {}
    for a in assignments:
        if a.optimizer == "muon":
            group = by_manifold.setdefault(a.manifold_name, {"params": [], "manifold": a.manifold, "manifold_name": a.manifold_name})
            group["params"].append(params[a.name])
    muon = None
    if by_manifold:
        from .optim import ManifoldMuon

        kwargs = dict(lr=cfg.muon_lr, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                      weight_decay=cfg.muon_weight_decay)
        if cfg.muon_solver is not None:
            kwargs["solver"] = cfg.muon_solver
        muon = ManifoldMuon(list(by_manifold.values()), **kwargs)
    return adamw, muon


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load a checkpoint written by `train` (a plain dict of tensors and Python values)."""
    return torch.load(path, map_location=map_location, weights_only=False)


class _Interrupt:
    """Turns SIGINT into a flag checked between steps, so a step is never half-applied."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals only work there
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # second Ctrl-C: give up immediately
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


# ----------------------------------------------------------------------------- the run
class _Run:
    """State of one training run; `train` drives it."""

    def __init__(self, cfg: TrainConfig, resume: bool, assignments_override=None, custom_manifolds=None):
        self.cfg = cfg
        self.ddp = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.ddp else 0
        self.world = dist.get_world_size() if self.ddp else 1
        self.master = self.rank == 0
        self.device = resolve_device(cfg.device)
        if self.ddp and self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the number of ranks {self.world}")
        self.out = cfg.resolved_out_dir()
        if cfg.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"unknown dtype {cfg.dtype!r}; valid: float32, bfloat16")

        problems = gdata.verify(cfg.data_dir, check_hashes=False)
        if problems:
            raise ValueError(f"data in {cfg.data_dir} is not usable ({problems[0]}); run `geomtrain prepare` first")
        self.train_tokens = gdata.load_split(cfg.data_dir, "train")
        self.val_tokens = gdata.load_split(cfg.data_dir, "val")
        self.vocab_size = int(gdata.load_manifest(cfg.data_dir)["vocab_size"])

        torch.manual_seed(cfg.seed)
        overrides = {"vocab_size": self.vocab_size}
        if cfg.block_size is not None:
            overrides["block_size"] = cfg.block_size
        self.model_cfg = model_config(cfg.model, **overrides)
        self.block = self.model_cfg.block_size
        self.model = GPT(self.model_cfg).to(self.device)
        named = list(self.model.named_parameters())
        self.assignments = assignments_override or assign(named, preset=cfg.preset, rules=cfg.rules,
                                                          custom_manifolds=custom_manifolds)
        with torch.no_grad():  # constrained matrices start on their manifold
            params = dict(named)
            for a in self.assignments:
                if a.manifold is not None and a.manifold_name != "euclidean":
                    params[a.name].copy_(a.manifold.projx(params[a.name].float()).to(params[a.name].dtype))
        self.adamw, self.muon = build_optimizers(self.model, self.assignments, cfg)
        self.step = 0
        self.grad_norms: dict[str, float] = {}
        self.best_val = float("inf")
        self.last_val = None
        if resume and (self.out / "ckpt.pt").exists():
            self._load(self.out / "ckpt.pt")
        self.net = self.model
        if self.ddp:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if cfg.compile:
            self.net = torch.compile(self.net)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                         if cfg.dtype == "bfloat16" else contextlib.nullcontext())
        self.eval_batches = list(gdata.iter_eval_batches(self.val_tokens, min(cfg.batch_size, 16), self.block, cfg.eval_iters, cfg.seed))
        self.diag_batch = gdata.fixed_batch(self.val_tokens, cfg.diag_batch_size, self.block, cfg.seed + 1)[0]

    # --------------------------------------------------------------- persistence
    def _state(self) -> dict:
        return {
            "format": 1, "step": self.step, "best_val": self.best_val, "last_val": self.last_val,
            "model": self.model.state_dict(), "adamw": self.adamw.state_dict(),
            "muon": self.muon.state_dict() if self.muon is not None else None,
            "rng": _rng_state(), "config": self.cfg.to_dict(), "model_config": self.model_cfg.to_dict(),
            "assignment": [a.to_dict() for a in self.assignments],
        }

    def save(self) -> None:
        if self.master:
            _atomic_save(self._state(), self.out / "ckpt.pt")

    def _load(self, path: Path) -> None:
        ckpt = load_checkpoint(path, map_location=self.device)
        self.model.load_state_dict(ckpt["model"])
        self.adamw.load_state_dict(ckpt["adamw"])
        if self.muon is not None and ckpt["muon"] is not None:
            self.muon.load_state_dict(ckpt["muon"])
        self.step, self.best_val, self.last_val = ckpt["step"], ckpt["best_val"], ckpt["last_val"]
        _set_rng_state(ckpt["rng"])
        _truncate_jsonl(self.out / "metrics.jsonl", self.step)
        _truncate_jsonl(self.out / "diagnostics.jsonl", self.step)

    def log(self, record: dict, file: str = "metrics.jsonl") -> None:
        if self.master:
            with open(self.out / file, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def write_status(self, status: str, **extra) -> dict:
        info = {"status": status, "step": self.step, "best_val_loss": _finite_or_none(self.best_val),
                "last_val_loss": self.last_val, **extra}
        if self.master:
            _atomic_write_text(self.out / "status.json", json.dumps(info, indent=2))
        return info

    # --------------------------------------------------------------- steps
    def set_lr(self) -> tuple[float, float]:
        lr = lr_at(self.step, self.cfg)
        for g in self.adamw.param_groups:
            g["lr"] = lr
        muon_lr = self.cfg.muon_lr * lr / self.cfg.lr
        if self.muon is not None:
            for g in self.muon.param_groups:
                g["lr"] = muon_lr
        return lr, muon_lr

    def train_step(self, record_grads: bool = False) -> float:
        """Forward/backward over ``grad_accum`` micro-batches, then both optimizer steps.

        Returns the (rank-averaged) loss; a non-finite loss returns before any update. With
        ``record_grads`` the raw gradient norms of Muon matrices go to ``self.grad_norms``."""
        cfg = self.cfg
        per_rank = cfg.batch_size // self.world
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = gdata.get_batch(self.train_tokens, per_rank, self.block, seed=cfg.seed,
                                   step=self.step * cfg.grad_accum + micro, rank=self.rank,
                                   world_size=self.world, device=self.device)
            sync = contextlib.nullcontext()
            if self.ddp and micro < cfg.grad_accum - 1:
                sync = self.net.no_sync()
            with sync, self.autocast:
                _, loss = self.net(x, y)
            with sync:
                (loss / cfg.grad_accum).backward()
            total += loss.detach().float() / cfg.grad_accum
        if self.ddp:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        loss_value = float(total)
        if not math.isfinite(loss_value):
            self.adamw.zero_grad(set_to_none=True)
            if self.muon is not None:
                self.muon.zero_grad(set_to_none=True)
            return loss_value
        if record_grads:
            self.grad_norms = gradient_norms(self.model, self.assignments)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.adamw.step()
        if self.muon is not None:
            self.muon.step()
        self.adamw.zero_grad(set_to_none=True)
        if self.muon is not None:
            self.muon.zero_grad(set_to_none=True)
        return loss_value

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        for x, y in self.eval_batches:
            with self.autocast:
                _, loss = self.model(x.to(self.device), y.to(self.device))
            losses.append(float(loss))
        self.model.train()
        return float(np.mean(losses))


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _truncate_jsonl(path: Path, step: int) -> None:
    """Drop records logged after ``step`` (a resumed run rewrites them identically)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    _atomic_write_text(path, "".join(line + "\n" for line in keep))


@contextlib.contextmanager
def distributed_from_env():
    """Initialise ``torch.distributed`` when launched by torchrun (``RANK`` set); tear it down cleanly."""
    if "RANK" not in os.environ or dist.is_initialized():
        yield
        return
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        yield
    finally:
        import gc

        gc.collect()  # nothing that touched the process group (DDP model, optimizer) may outlive it
        dist.barrier()
        dist.destroy_process_group()


def train(cfg: TrainConfig, resume: bool = False, assignments=None, print_fn=print, on_finish=None,
          custom_manifolds=None) -> dict:
    """Run (or with ``resume=True`` continue) one training run; returns the final status dict.

    ``custom_manifolds`` maps extra names usable in ``cfg.rules`` to ``GramManifold`` instances;
    ``assignments`` overrides preset and rules entirely; ``on_finish(model)`` is called with the
    trained model before returning."""
    run = _Run(cfg, resume=resume, assignments_override=assignments, custom_manifolds=custom_manifolds)
    out = run.out
    if run.master:
        out.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(out / "config.json", json.dumps(cfg.to_dict(), indent=2))
        _atomic_write_text(out / "env.json", json.dumps(environment_info(run.device, cfg.seed), indent=2))
        _atomic_write_text(out / "assignment.json", json.dumps([a.to_dict() for a in run.assignments], indent=2))
        table = format_table(run.assignments)
        _atomic_write_text(out / "assignment.txt", table + "\n")
        print_fn(table)
    if run.step >= cfg.max_iters:
        return run.write_status("finished", final_val_loss=run.last_val)
    run.write_status("running")

    progress = None
    if cfg.progress and run.master:
        from tqdm.auto import tqdm

        progress = tqdm(total=cfg.max_iters, initial=run.step, desc=f"{cfg.preset}", dynamic_ncols=True)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * run.block
    step_times: list[float] = []
    status = None
    ckpt_every = cfg.checkpoint_interval or cfg.eval_interval
    with _Interrupt() as interrupt:
        while run.step < cfg.max_iters:
            lr, muon_lr = run.set_lr()
            t0 = time.perf_counter()
            next_step = run.step + 1
            is_eval = next_step % cfg.eval_interval == 0 or next_step == cfg.max_iters
            loss = run.train_step(record_grads=is_eval and cfg.diagnostics)
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                status = run.write_status("diverged", diverged_step=run.step, reason=f"non-finite training loss ({loss})")
                break
            run.step += 1
            step_times.append(dt)
            record = {"kind": "train", "step": run.step, "loss": loss, "lr": lr, "muon_lr": muon_lr,
                      "ms_per_step": 1000 * dt, "tokens_per_s": tokens_per_step / dt}
            if run.muon is not None and getattr(run.muon, "last_stats", None):
                record["muon"] = jsonable(run.muon.last_stats)
            if run.step % cfg.log_interval == 0 or run.step == cfg.max_iters:
                run.log(record)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
            if is_eval:
                val = run.evaluate()
                run.last_val = val
                run.log({"kind": "eval", "step": run.step, "val_loss": val, "train_loss": loss})
                if cfg.diagnostics and run.master:
                    diag = collect_diagnostics(run.model, run.assignments, run.diag_batch.to(run.device),
                                               grad_norms=run.grad_norms)
                    run.log({"step": run.step, **diag}, "diagnostics.jsonl")
                if progress is not None:
                    progress.write(f"step {run.step}: val loss {val:.4f}")
                if not math.isfinite(val) or val > run.best_val + cfg.divergence_margin:
                    status = run.write_status("diverged", diverged_step=run.step,
                                              reason=f"val loss {val:.4g} vs best {run.best_val:.4g} + margin {cfg.divergence_margin}")
                    break
                run.best_val = min(run.best_val, val)
                if run.step % ckpt_every == 0 or run.step == cfg.max_iters:
                    run.save()
            if interrupt.requested or (cfg.stop_after is not None and run.step >= cfg.stop_after):
                run.save()
                status = run.write_status("interrupted")
                break
    if progress is not None:
        progress.close()
    ms = 1000 * float(np.median(step_times)) if step_times else None
    if status is None:
        run.save()
        status = run.write_status("finished", final_val_loss=run.last_val, ms_per_step=ms)
    else:
        status = run.write_status(status["status"], ms_per_step=ms,
                                  **{k: status[k] for k in ("diverged_step", "reason") if k in status})
    if on_finish is not None:
        on_finish(run.model)
    if run.master:
        print_fn(f"{status['status']} at step {status['step']}: val loss {run.last_val} (best {_finite_or_none(run.best_val)}); outputs in {out}")
    return status

