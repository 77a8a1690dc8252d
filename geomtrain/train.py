"""The GPT-2 trainer: AdamW + Manifold Muon with module-wise manifolds.

Two layers:

- `Trainer` holds model, data, optimizers and the step counter. ``trainer.step()`` runs one training step in
  named phases (schedule, forward/backward, non-finite check, clip, optimizers) and returns a `StepResult`;
  ``evaluate()``, ``diagnostics()``, ``state_dict()`` / ``load_state_dict()`` complete it. It writes no files:
  benchmarks drive it directly.
- `train(config)` is the loop over a `Trainer` and a `geomtrain.runfolder.RunFolder` (all files): log,
  evaluate, checkpoint, detect divergence, stop on SIGINT/SIGTERM at a step boundary.

**Non-finite policy.** A non-finite loss or gradient (anywhere, after the DDP all-reduce) is detected
*before* clipping and before any optimizer: the whole step is skipped (no weight, no momentum, no Adam
moment changes), counted (``skipped`` in the train record, ``n_skipped`` in the status) and the step counter
moves on, so the batches stay a function of the step. ``nonfinite_patience`` skipped steps in a row mark the
run diverged.

Batches are a pure function of ``(seed, step, rank)`` (`geomtrain.data.get_batch`), so a resumed run sees
exactly the batches the uninterrupted run would have seen and continues bit-exactly. Under ``torchrun`` the
run is DDP (gloo on CPU, nccl on GPU), or with ``fsdp`` FSDP2 (`geomtrain.sharding`: parameters, gradients
and optimizer state sharded; DCP checkpoints by `geomtrain.checkpoint`); rank 0 writes the outputs. Every
collective (the non-finite check, clipping, evaluation, the diagnostics' gathers) runs on every rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import data as gdata
from ._io import environment_record, to_jsonable
from .assign import assign, assignment_label, format_table, is_gpt_matrix
from .checkpoint import CheckpointError, check_same_run, load_checkpoint, rng_state, set_rng_state
from .config import TrainConfig, import_manifold_modules
from .diagnostics import collect_diagnostics, gradient_norms
from .groups import build_optimizers, project_onto_manifolds
from .hardware import matmul_precision, mfu, model_flops_per_token, model_matmul_precision, peak_bf16_flops
from .model import GPT, load_hf_gpt2_folder, match_qkv_layout, model_config
from .runfolder import RunFolder, RunFolderError
from .runtime import StopSignals, any_rank, distributed_from_env, resolve_device
from .sharding import full_copy, local, shard_model
from .slow_paths import slow_path_notes

__all__ = [
    "Trainer",
    "StepResult",
    "StopSignals",
    "train",
    "lr_at",
    "resolve_device",
    "load_checkpoint",
    "distributed_from_env",
    "import_manifold_modules",
    "rng_state",
    "set_rng_state",
    "RunFolderError",
    "CheckpointError",
]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr`` over ``warmup_iters``, then cosine decay to ``min_lr`` at ``max_iters``."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    if step >= cfg.max_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


@dataclass
class StepResult:
    """What one `Trainer.step` did."""

    step: int  # the step counter after this step
    loss: float  # rank-averaged training loss (may be non-finite)
    lr: float  # AdamW lr of this step
    muon_lr: float
    seconds: float  # wall time of the step (CUDA-synchronised)
    skipped: str | None = None  # why the update was skipped (non-finite loss / gradient), else None
    muon: dict = field(default_factory=dict)  # ManifoldMuon.last_stats


# ----------------------------------------------------------------------------- the trainer
class Trainer:
    """Model, data, optimizers and step counter of one run (no files; see `train`)."""

    def __init__(self, cfg: TrainConfig, assignments=None, custom_manifolds=None):
        self.cfg = cfg
        self.ddp = dist.is_available() and dist.is_initialized()
        self.fsdp = self.ddp and cfg.fsdp  # in one process, fsdp only makes the checkpoints DCP
        self.rank = dist.get_rank() if self.ddp else 0
        self.world = dist.get_world_size() if self.ddp else 1
        self.device = resolve_device(cfg.device)
        # TF32 for the model's passes only: the optimizer's Gram-space solves keep IEEE float32
        self.matmul_precision = model_matmul_precision(self.device, cfg.tf32)
        if self.ddp and self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the number of ranks {self.world}")
        import_manifold_modules(cfg.manifold_modules)
        self._load_data()
        torch.manual_seed(cfg.seed)
        overrides = {"vocab_size": self.vocab_size}
        if cfg.block_size is not None:
            overrides["block_size"] = cfg.block_size
        if cfg.n_embd is not None:
            overrides["n_embd"] = cfg.n_embd
        if cfg.split_qkv:
            overrides["split_qkv"] = True
        self.model_cfg = model_config(cfg.model, **overrides)
        self.block = self.model_cfg.block_size
        self.model = GPT(self.model_cfg).to(self.device)
        if cfg.init_from:
            self._load_pretrained(cfg.init_from)
        named = list(self.model.named_parameters())
        self.assignments = assignments or assign(
            named, cfg.preset, cfg.rules, custom_manifolds, is_gpt_matrix, "2-D weights (and a split c_attn)"
        )
        self.projection = project_onto_manifolds(dict(named), self.assignments)  # start on the manifolds
        if self.fsdp:
            shard_model(self.model)  # in place: the optimizers get the sharded parameters
        self.adamw, self.muon = build_optimizers(self.model, self.assignments, cfg)
        self._steps_done = 0
        self.n_skipped = 0
        self.skipped_in_a_row = 0
        self.best_val = float("inf")
        self.last_val: float | None = None
        self.grad_norms: dict[str, float] = {}
        self.net = self.model
        if self.ddp and not self.fsdp:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        if cfg.compile:
            self.net = torch.compile(self.net)
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if cfg.dtype == "bfloat16"
            else contextlib.nullcontext()
        )
        self.eval_batches = list(
            gdata.iter_eval_batches(self.val_tokens, min(cfg.batch_size, 16), self.block, cfg.eval_iters, cfg.seed)
        )
        self.diag_batch = gdata.fixed_batch(self.val_tokens, cfg.diag_batch_size, self.block, cfg.seed + 1)[0]

    def _load_data(self) -> None:
        """Token files verified (sizes, cached sha256, ids below the vocabulary, a batch row of the
        context in each split) before any use, so a bad folder is refused before a run folder is made."""
        cfg = self.cfg
        try:
            vocab = int(gdata.load_manifest(cfg.data_dir)["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            vocab = None  # verify_cached names the problem with the manifest
        manifest = gdata.verify_cached(cfg.data_dir, vocab_size=vocab)
        block = cfg.block_size if cfg.block_size is not None else model_config(cfg.model).block_size
        self.train_tokens = gdata.load_split(cfg.data_dir, "train", block_size=block)
        self.val_tokens = gdata.load_split(cfg.data_dir, "val", block_size=block)
        self.vocab_size = int(manifest["vocab_size"])

    @torch.no_grad()
    def _load_pretrained(self, path: str) -> None:
        """Weights of a Hugging Face GPT-2 folder whose shape is this run's model (``init_from``)."""
        pretrained = load_hf_gpt2_folder(path, block_size=self.block)
        keys = ("vocab_size", "n_layer", "n_head", "n_embd", "bias")
        differ = [
            f"{k}: {getattr(pretrained.config, k)!r} there, {getattr(self.model_cfg, k)!r} here"
            for k in keys
            if getattr(pretrained.config, k) != getattr(self.model_cfg, k)
        ]
        if differ:
            raise ValueError(
                f"init_from {path} is not a {self.cfg.model!r} model on this data ({'; '.join(differ)}); "
                "choose the matching --model and a data folder with its tokenizer"
            )
        self.model.load_state_dict(match_qkv_layout(pretrained.state_dict(), self.model_cfg))

    @property
    def steps_done(self) -> int:
        """Steps taken so far (skipped ones included): the next step's schedule position."""
        return self._steps_done

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.adamw, self.muon) if o is not None]

    # --------------------------------------------------------------- one step, in phases
    def set_lr(self) -> tuple[float, float]:
        """Schedule phase: AdamW lr of this step; Muon's follows it (``muon_lr * lr_t / lr``)."""
        lr = lr_at(self._steps_done, self.cfg)
        muon_lr = self.cfg.muon_lr * lr / self.cfg.lr
        for g in self.adamw.param_groups:
            g["lr"] = lr
        for g in self.muon.param_groups if self.muon is not None else ():
            g["lr"] = muon_lr
        return lr, muon_lr

    def forward_backward(self) -> torch.Tensor:
        """Loss over ``grad_accum`` micro-batches (rank-averaged), gradients accumulated."""
        cfg = self.cfg
        per_rank = cfg.batch_size // self.world
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = gdata.get_batch(
                self.train_tokens,
                per_rank,
                self.block,
                seed=cfg.seed,
                step=self._steps_done * cfg.grad_accum + micro,
                rank=self.rank,
                world_size=self.world,
                device=self.device,
            )
            last = micro == cfg.grad_accum - 1
            if self.fsdp:
                self.model.set_requires_gradient_sync(last)
            sync = self.net.no_sync() if self.ddp and not self.fsdp and not last else contextlib.nullcontext()
            with sync:
                with self.autocast:
                    _, loss = self.net(x, y)
                (loss / cfg.grad_accum).backward()
            total += loss.detach().float() / cfg.grad_accum
        if self.ddp:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        return total

    def nonfinite_reason(self, loss: torch.Tensor) -> str | None:
        """Why this step must be skipped (non-finite loss or gradient), or None; one host sync.

        A gradient counts as non-finite when its squared norm is: NaN and Inf entries, and also
        finite entries too large for AdamW's second moment (``g**2`` overflows float32 above
        ~1.8e19, writing Inf into ``exp_avg_sq`` when clipping is off). Under FSDP the squared norms of
        the shards are summed over the ranks (one all-reduce)."""
        named = [(n, local(p.grad)) for n, p in self.model.named_parameters() if p.grad is not None]
        squares = torch.stack([torch.linalg.vector_norm(g.float()).square() for _, g in named])
        if self.fsdp:
            dist.all_reduce(squares)
        checks = torch.cat([torch.isfinite(loss).reshape(1), torch.isfinite(squares)])
        if bool(checks.all()):
            return None
        if not bool(checks[0]):
            return f"non-finite loss ({float(loss)})"
        bad = [(n, g) for (n, g), ok in zip(named, checks[1:].tolist()) if not ok]
        what = "non-finite gradient" if not bool(torch.isfinite(bad[0][1]).all()) else "gradient overflowing float32"
        return f"{what} in {bad[0][0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")

    def zero_grad(self) -> None:
        for opt in self.optimizers():
            opt.zero_grad(set_to_none=True)

    def step(self, record_grads: bool = False) -> StepResult:
        """One training step: schedule, forward/backward, non-finite check, clip, optimizers.

        With ``record_grads`` the raw gradient norms of Muon matrices go to ``self.grad_norms``."""
        t0 = time.perf_counter()
        lr, muon_lr = self.set_lr()
        with matmul_precision(self.matmul_precision):
            loss = self.forward_backward()
        skipped = self.nonfinite_reason(loss)
        if skipped is None:
            if record_grads:
                self.grad_norms = gradient_norms(self.full_model(grads=True), self.assignments)
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            for opt in self.optimizers():
                opt.step()
        self.zero_grad()
        self._steps_done += 1
        self.n_skipped += skipped is not None
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats = dict(self.muon.last_stats) if self.muon is not None and skipped is None else {}
        return StepResult(self._steps_done, float(loss), lr, muon_lr, time.perf_counter() - t0, skipped, stats)

    # --------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed evaluation batches; updates ``last_val``."""
        self.model.eval()
        losses = []
        for x, y in self.eval_batches:
            with self.autocast, matmul_precision(self.matmul_precision):
                _, loss = self.model(x.to(self.device), y.to(self.device))
            losses.append(float(loss))
        self.model.train()
        self.last_val = float(np.mean(losses))
        return self.last_val

    def full_model(self, grads: bool = False) -> torch.nn.Module:
        """The model with whole weights (and gradients): itself, or under FSDP a gathered copy (every rank)."""
        return full_copy(self.model, lambda: GPT(self.model_cfg), grads) if self.fsdp else self.model

    def diagnostics(self) -> dict:
        """Spectral and attention diagnostics on the fixed diagnostic batch (`geomtrain.diagnostics`); under
        FSDP every rank gathers the weights and rank 0 computes them (the others return ``{}``)."""
        model = self.full_model()
        if self.rank != 0:
            return {}
        return collect_diagnostics(model, self.assignments, self.diag_batch.to(self.device), grad_norms=self.grad_norms)

    # --------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "format": 2,
            "step": self._steps_done,
            "best_val": self.best_val,
            "last_val": self.last_val,
            "n_skipped": self.n_skipped,
            "skipped_in_a_row": self.skipped_in_a_row,
            "model": self.model.state_dict(),
            "adamw": self.adamw.state_dict(),
            "muon": self.muon.state_dict() if self.muon is not None else None,
            "rng": rng_state(),
            "config": self.cfg.to_dict(),
            "model_config": self.model_cfg.to_dict(),
            "assignment": [a.to_dict() for a in self.assignments],
        }

    def load_state_dict(self, ckpt: dict) -> None:
        """Restore a `state_dict` (its tensors laid out as this run's: `geomtrain.checkpoint.Checkpoint.load_into`);
        a checkpoint of another model, assignment or solver is a `CheckpointError` (`check_same_run`)."""
        check_same_run(ckpt, self.model_cfg.to_dict(), self.assignments)
        self.model.load_state_dict(ckpt["model"])
        self.adamw.load_state_dict(ckpt["adamw"])
        if self.muon is not None and ckpt["muon"] is not None:
            self.muon.load_state_dict(ckpt["muon"])
        self._steps_done, self.best_val, self.last_val = ckpt["step"], ckpt["best_val"], ckpt["last_val"]
        self.n_skipped, self.skipped_in_a_row = ckpt.get("n_skipped", 0), ckpt.get("skipped_in_a_row", 0)
        set_rng_state(ckpt["rng"])

    def save_checkpoint(self, folder: RunFolder) -> None:
        """This state into ``folder``: a DCP checkpoint with ``fsdp`` (every rank writes), else ``ckpt.pt`` (rank 0
        writes). A write that fails (a full disk) raises on every rank (`any_rank`), so none waits in a collective."""
        if self.cfg.fsdp:
            folder.checkpoint.save_sharded(self.state_dict())
            return
        error = None
        try:
            folder.checkpoint.save(self.state_dict())
        except OSError as exc:
            error = exc
        if any_rank(error is not None):
            raise error or CheckpointError(f"rank 0 could not write {folder.file('ckpt.pt')}; the last one is kept")


# ----------------------------------------------------------------------------- the loop
def train(
    cfg: TrainConfig,
    resume: bool = False,
    assignments=None,
    print_fn: Callable = print,
    on_finish=None,
    custom_manifolds=None,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> dict:
    """Run (or with ``resume=True`` continue) one training run; returns the final status dict.

    ``overwrite`` replaces a run already in the folder; ``allow_config_change`` lets a resume change
    run-defining keys (recorded). ``custom_manifolds`` maps extra names usable in ``cfg.rules`` to
    ``GramManifold`` instances; ``assignments`` overrides preset and rules entirely;
    ``on_finish(model)`` is called with the trained model before returning. Raises `RunFolderError`
    (a ValueError) for a folder that cannot be used as asked."""
    master = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    folder = RunFolder(cfg.resolved_out_dir(), master=master)
    trainer = Trainer(cfg, assignments=assignments, custom_manifolds=custom_manifolds)
    sync = dist.barrier if trainer.ddp else lambda: None  # every rank opens the folder before rank 0 writes
    sync()
    has_checkpoint = folder.open(resume=resume, overwrite=overwrite)  # takes the folder's lock
    sync()
    try:
        if has_checkpoint:
            optimizers = {"adamw": trainer.adamw, "muon": trainer.muon}
            ckpt = folder.checkpoint.load_into(trainer.model, optimizers, trainer.device)
            folder.check_resume_config(cfg.to_dict(), ckpt.get("config"), allow_config_change)
            with warnings.catch_warnings(record=True) as caught:  # e.g. a matrix whose warm start is damaged
                warnings.simplefilter("always", RuntimeWarning)
                trainer.load_state_dict(ckpt)
            folder.notes += [str(w.message) for w in caught]  # each a one-line note
            del ckpt
            folder.truncate_logs(trainer.steps_done)
            print_fn(f"resuming {folder.path} from step {trainer.steps_done}")
        elif resume:
            print_fn(f"no checkpoint in {folder.path} yet: starting from step 0")
        if cfg.fsdp and not trainer.ddp:
            folder.notes.append("fsdp runs under torchrun; in one process it only keeps the checkpoints DCP")
        if master:  # the folder's notes, then one line per slow path of a custom mask (geomtrain.slow_paths)
            for note in [*folder.notes, *slow_path_notes(trainer.assignments, dict(trainer.model.named_parameters()))]:
                print_fn(f"note: {note}")
        status = _start_and_loop(trainer, folder, resume, print_fn)
    finally:
        folder.close()
    if on_finish is not None:
        on_finish(trainer.model)
    if master:
        print_fn(
            f"{status['status']} at step {status['step']}: val loss {trainer.last_val} "
            f"(best {_finite_or_none(trainer.best_val)}); outputs in {folder.path}"
        )
    return status


def _start_and_loop(trainer: Trainer, folder: RunFolder, resume: bool, print_fn: Callable) -> dict:
    """Write the run's info files, then run `_loop`; an exception in it is recorded as ``failed``."""
    cfg, master = trainer.cfg, folder.master
    if cfg.tensorboard:
        folder.enable_tensorboard(purge_step=trainer.steps_done + 1 if trainer.steps_done else None)
    table = format_table(trainer.assignments)
    folder.write_run_info(
        cfg.to_dict(),
        environment_record(trainer.device, seed=cfg.seed, tf32=trainer.matmul_precision == "high"),
        [a.to_dict() for a in trainer.assignments],
        table,
    )
    if master:
        print_fn(table)
    if cfg.init_from and not resume:
        folder.write_json("init_from.json", {"init_from": cfg.init_from, "relative_move": trainer.projection})
        print_fn(_projection_table(cfg.init_from, trainer.projection))
    try:
        return _loop(trainer, folder, print_fn)
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            with contextlib.suppress(OSError):
                folder.write_status("failed", step=trainer.steps_done, error=f"{type(exc).__name__}: {exc}"[:500])
        raise


def _projection_table(path: str, moved: dict[str, float]) -> str:
    lines = [f"initialised from {path}; constrained matrices projected onto their manifolds, ||P(W) - W|| / ||W||:"]
    lines += [f"  {name:<40} {value:.3f}" for name, value in moved.items()]
    return "\n".join(lines)


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _status(trainer: Trainer, folder: RunFolder, status: str, **extra: Any) -> dict:
    return folder.write_status(
        status,
        step=trainer.steps_done,
        best_val_loss=_finite_or_none(trainer.best_val),
        last_val_loss=trainer.last_val,
        n_skipped=trainer.n_skipped,
        **extra,
    )


def _loop(trainer: Trainer, folder: RunFolder, print_fn: Callable) -> dict:
    """The training loop proper: step, log, evaluate, checkpoint, stop. Returns the status record."""
    cfg = trainer.cfg
    if trainer.steps_done >= cfg.max_iters:
        return _status(trainer, folder, "finished", final_val_loss=trainer.last_val)
    _status(trainer, folder, "running")
    progress = _progress_bar(cfg, trainer) if folder.master else None
    tokens_per_step = cfg.batch_size * cfg.grad_accum * trainer.block
    flops = (model_flops_per_token(trainer.model, trainer.block), peak_bf16_flops(trainer.device), trainer.world)
    step_times: list[float] = []
    ckpt_every = cfg.checkpoint_interval or cfg.eval_interval
    end: dict | None = None
    with StopSignals() as stop:
        while trainer.steps_done < cfg.max_iters and end is None:
            next_step = trainer.steps_done + 1
            is_eval = next_step % cfg.eval_interval == 0 or next_step == cfg.max_iters
            r = trainer.step(record_grads=is_eval and cfg.diagnostics)
            step_times.append(r.seconds)
            muon_skipped = bool(r.muon and r.muon.get("skipped"))  # a matrix update skipped: log which
            if r.step % cfg.log_interval == 0 or r.step == cfg.max_iters or r.skipped or muon_skipped:
                folder.log(_train_record(r, tokens_per_step, trainer.n_skipped, flops))
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{r.loss:.3f}", tok_s=f"{tokens_per_step / r.seconds:,.0f}")
            if r.skipped and progress is not None:
                progress.write(f"step {r.step}: update skipped ({r.skipped})")
            if trainer.skipped_in_a_row >= cfg.nonfinite_patience:
                end = {
                    "status": "diverged",
                    "diverged_step": r.step,
                    "reason": f"{trainer.skipped_in_a_row} steps in a row skipped, last: {r.skipped}",
                }
            elif is_eval:
                end = _evaluate(trainer, folder, progress, r.loss)
            if end is None and r.step % ckpt_every == 0 and r.step < cfg.max_iters:  # the last: after the loop
                trainer.save_checkpoint(folder)
                _status(trainer, folder, "running", checkpoint_step=r.step)
            if end is None and (
                stop.requested(trainer.ddp) or (cfg.stop_after is not None and r.step >= cfg.stop_after)
            ):
                trainer.save_checkpoint(folder)
                end = {"status": "interrupted", **({"signal": stop.received} if stop.received else {})}
    if progress is not None:
        progress.close()
    ms = 1000 * float(np.median(step_times)) if step_times else None
    if end is None:
        trainer.save_checkpoint(folder)
        end = {"status": "finished", "final_val_loss": trainer.last_val}
    return _status(trainer, folder, end.pop("status"), ms_per_step=ms, **end)


def _train_record(r: StepResult, tokens_per_step: int, n_skipped: int, flops=(0.0, None, 1)) -> dict:
    """The ``train`` record of one step; ``flops`` is ``(flops_per_token, peak FLOP/s of one device or
    None, devices)`` for ``mfu`` (`geomtrain.flops.mfu`: None without a known peak, e.g. on CPU)."""
    record = {
        "kind": "train",
        "step": r.step,
        "loss": r.loss,
        "lr": r.lr,
        "muon_lr": r.muon_lr,
        "ms_per_step": 1000 * r.seconds,
        "tokens_per_s": tokens_per_step / r.seconds,
        "mfu": mfu(flops[0], tokens_per_step / r.seconds, flops[1], flops[2]),
    }
    if r.muon:
        record["muon"] = to_jsonable(r.muon)
    if r.skipped:
        record.update(skipped=r.skipped, n_skipped=n_skipped)
    return record


def _evaluate(trainer: Trainer, folder: RunFolder, progress, train_loss: float) -> dict | None:
    """Evaluation phase: val loss, diagnostics, divergence test. Returns the end record if diverged."""
    cfg, step = trainer.cfg, trainer.steps_done
    val = trainer.evaluate()
    folder.log({"kind": "eval", "step": step, "val_loss": val, "train_loss": train_loss})
    if cfg.diagnostics and (folder.master or trainer.fsdp):
        diagnostics = trainer.diagnostics()  # under FSDP every rank gathers the weights
        folder.log_diagnostics({"step": step, **diagnostics})
    if progress is not None:
        progress.write(f"step {step}: val loss {val:.4f}")
    if not math.isfinite(val) or val > trainer.best_val + cfg.divergence_margin:
        return {
            "status": "diverged",
            "diverged_step": step,
            "reason": f"val loss {val:.4g} vs best {trainer.best_val:.4g} + margin {cfg.divergence_margin}",
        }
    trainer.best_val = min(trainer.best_val, val)
    return None


def _progress_bar(cfg: TrainConfig, trainer: Trainer):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(
        total=cfg.max_iters,
        initial=trainer.steps_done,
        desc=assignment_label(cfg.preset, cfg.rules),
        dynamic_ncols=True,
    )
