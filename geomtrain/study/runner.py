"""Running a study: run locks, the state of a run folder, and the schedulers.

:func:`run_study` trains every (variant, seed) of a :class:`~geomtrain.study.plan.StudyPlan` that
is not done yet, one after the other or (``workers > 1``) in spawned worker processes, records
wall times in ``study.json`` and writes the report. Every run is seeded and independent, so the
results do not depend on the number of workers. A claim (:func:`claim_lock`, ``run_dir/.claim``)
keeps studies that share a ``--runs-dir`` from training the same run twice at once; the run folder's
own lock (``.lock``, taken by `geomtrain.train.train`) keeps anything else out of it.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from .._io import FileLock, atomic_write_json, environment_record, read_json, read_jsonl
from ..checkpoint import CheckpointError
from ..config import INVOCATION_KEYS
from ..runfolder import RunFolder, RunFolderError
from .collect import collect
from .plan import SUMMARY_FORMAT, TERMINAL_STATUSES, StudyError, StudyPlan, Variant
from .report import format_table, write_report
from .tune import run_tuning

__all__ = [
    "claim_lock",
    "run_state",
    "train_one",
    "ensure_data",
    "data_record",
    "threads_per_worker",
    "run_study",
    "save_record",
]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _silent(*args, **kwargs) -> None:
    pass


# ----------------------------------------------------------------------------- one run
def _config_diff(old: dict, new: dict) -> list[str]:
    keys = sorted((set(old) | set(new)) - set(INVOCATION_KEYS))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def run_state(run_dir: Path, cfg) -> str:
    """``new``, ``resume`` or ``done`` for the run folder; ``StudyError`` when it holds other settings."""
    status = read_json(run_dir / "status.json")
    old = RunFolder(run_dir).read_config()  # keys added since it was written read as their defaults
    if old is not None:
        diff = _config_diff(old, cfg.to_dict())
        if diff:
            raise StudyError(
                f"{run_dir} holds a run with other settings ({'; '.join(diff[:3])}); "
                "use another --out / --runs-dir or delete that folder"
            )
    if status is None:
        return "new"
    if status.get("status") in TERMINAL_STATUSES and (
        status.get("status") != "finished" or status.get("step", 0) >= cfg.max_iters
    ):
        return "done"
    return "resume" if (run_dir / "ckpt.pt").exists() else "new"


def claim_lock(run_dir: Path) -> FileLock:
    """``run_dir/.claim``: held by the study process that schedules the run while it (or its worker
    process, which takes the run folder's ``.lock``) trains it."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return FileLock(Path(run_dir) / ".claim")


def _last_logged_step(run_dir: Path) -> int:
    return max((int(r.get("step", 0)) for r in read_jsonl(run_dir / "metrics.jsonl")), default=0)


def train_one(cfg, state: str, print_fn: Callable = print) -> dict:
    """Run (``state="new"``, replacing leftovers of a killed attempt) or resume one training run;
    a numerical exception after the first step is recorded as status ``failed`` (with the error)
    instead of stopping the study."""
    from ..train import train

    run_dir = cfg.resolved_out_dir()
    try:
        return train(cfg, resume=state == "resume", overwrite=state == "new", print_fn=_silent)
    except (RunFolderError, CheckpointError):  # the folder or its checkpoint: not the run's failure
        raise
    except (ValueError, RuntimeError, FloatingPointError) as exc:
        step = _last_logged_step(run_dir)
        if step == 0:
            raise
        traceback.print_exc(file=sys.stderr)
        old = read_json(run_dir / "status.json", {}) or {}
        status = {
            "status": "failed",
            "step": step,
            "failed_step": step,
            "reason": f"{type(exc).__name__}: {exc}".splitlines()[0],
            "best_val_loss": old.get("best_val_loss"),
            "last_val_loss": None,
        }
        atomic_write_json(run_dir / "status.json", status)
        print_fn(f"  run failed at step ~{step}: {status['reason']}")
        return status


def _train_timed(cfg, state: str, print_fn: Callable = _silent) -> tuple[dict, float]:
    """``train_one`` and its wall time (module level, so a worker process can run it)."""
    t0 = time.time()
    status = train_one(cfg, state, print_fn)
    return status, time.time() - t0


def _status_line(status: dict) -> str:
    st = status.get("status")
    ms = status.get("ms_per_step")
    ms_text = f", {ms:.0f} ms/step" if ms else ""
    if st == "finished":
        return f"finished, val loss {status.get('final_val_loss', float('nan')):.4f}{ms_text}"
    if st == "diverged":
        return f"DIVERGED at step {status.get('diverged_step')} ({status.get('reason')}){ms_text}"
    return f"{st} at step {status.get('step')}{ms_text}"


# ----------------------------------------------------------------------------- data and record
def ensure_data(data_dir: str | Path, tokenizer: str | None, dataset: str = "classics", print_fn=print) -> None:
    """Prepare ``data_dir`` (offline corpus) when it does not verify and ``tokenizer`` is given."""
    from .. import data as gdata

    problems = gdata.verify(data_dir, check_hashes=False) if Path(data_dir).exists() else ["missing"]
    if not problems:
        return
    if tokenizer is None:
        raise StudyError(
            f"data in {data_dir} is not usable ({problems[0]}); run `geomtrain prepare` or pass --tokenizer"
        )
    print_fn(f"preparing {dataset} with tokenizer {tokenizer} in {data_dir} ...")
    gdata.prepare(data_dir, dataset=dataset, tokenizer=tokenizer)


def data_record(data_dir: str) -> dict:
    """What identifies the prepared data: dataset, tokenizer, vocabulary, split sizes and hashes."""
    from .. import data as gdata

    m = gdata.load_manifest(data_dir)
    keep = ("dataset", "tokenizer", "vocab_size", "eot_token", "format_version", "source_fingerprint")
    info = {k: m.get(k) for k in keep}
    info["splits"] = {k: {"tokens": v.get("tokens"), "sha256": v.get("sha256")} for k, v in m.get("splits", {}).items()}
    return info


def _environment(device: str) -> dict:
    from ..train import resolve_device

    return environment_record(resolve_device(device))


def _study_record(study: StudyPlan, previous: dict | None) -> dict:
    prev = previous or {}
    environment = _environment(study.base.get("device", "auto"))
    invocation = {"id": f"{os.getpid()}@{time.time():.6f}", "argv": study.argv, "started": _now()}
    return {
        "format": SUMMARY_FORMAT,
        "command": "geomtrain study " + shlex.join(study.argv) if study.argv else prev.get("command"),
        "argv": study.argv or prev.get("argv"),
        "cwd": os.getcwd(),
        "suite": study.suite,
        "options": study.options,
        "variants": [v.to_dict() for v in study.variants],
        "seeds": study.seeds,
        "base_config": study.base,
        "runs_dir": str(study.runs_dir),
        "runs_dir_abs": str(study.runs_dir.resolve()),
        "created": prev.get("created") or _now(),
        "updated": _now(),
        "environment": environment,  # the latest invocation's; each invocation keeps its own
        "data": data_record(study.base["data_dir"]),
        "timing": prev.get("timing", {"runs": {}, "total_s": 0.0}),
        "invocations": prev.get("invocations", []) + [{**invocation, "environment": environment}],
        **({"autoassign": prev["autoassign"]} if "autoassign" in prev else {}),
    }


def save_record(out: Path, record: dict, added: tuple[str, float] | None = None) -> None:
    """Write ``record`` to ``OUT/study.json`` merged with what other invocations wrote since it
    was read (under the lock ``OUT/.study.lock``): every invocation entry, every run's wall time
    (the larger of the two, plus ``added = (run key, seconds)`` just trained here), and the
    totals summed from them. Two studies run into one folder both stay on record."""
    lock = FileLock(Path(out) / ".study.lock")
    while lock.acquire() is not None:
        time.sleep(0.02)
    try:
        disk = read_json(Path(out) / "study.json") or {}
        mine = {i.get("id") for i in record["invocations"]}
        others = [i for i in disk.get("invocations", []) if i.get("id") not in mine]
        record["invocations"] = sorted(record["invocations"] + others, key=lambda i: i.get("started") or "")
        timing = record["timing"]
        runs = timing["runs"]
        for key, seconds in (disk.get("timing") or {}).get("runs", {}).items():
            runs[key] = max(runs.get(key, 0.0), seconds)
        if added:
            runs[added[0]] = runs.get(added[0], 0.0) + added[1]
        timing["probes_s"] = max(timing.get("probes_s", 0.0), (disk.get("timing") or {}).get("probes_s", 0.0))
        timing["total_s"] = sum(runs.values()) + timing["probes_s"]
        timing["elapsed_s"] = sum(i.get("elapsed_s") or 0.0 for i in record["invocations"])
        record["updated"] = _now()
        atomic_write_json(Path(out) / "study.json", record)
    finally:
        lock.release()


def _check_selection(study: StudyPlan, was: dict) -> None:
    """A tuned study continues on the selection runs it chose from: the same length and the same seeds."""
    now = study.options.get("tune") or {}
    if None not in (was.get("fraction"), now.get("fraction")) and was["fraction"] != now["fraction"]:
        raise StudyError(
            f"{study.out} selects at --tune-fraction {was['fraction']:g} (its selection runs have that length); "
            "pass it to continue this study, or use another --out"
        )
    if None not in (was.get("select_seeds"), now.get("select_seeds")) and was["select_seeds"] != now["select_seeds"]:
        raise StudyError(
            f"{study.out} selects on seeds {','.join(map(str, was['select_seeds']))} (its choices were made there); "
            "pass --select-seeds with them to continue this study, or use another --out"
        )


def _check_previous(study: StudyPlan, previous: dict | None) -> None:
    if not previous:
        return
    diff = _config_diff(dict(previous.get("base_config", {})), study.base)
    if diff or previous.get("suite") != study.suite:
        what = "; ".join(diff[:3]) or f"suite {previous.get('suite')} -> {study.suite}"
        raise StudyError(f"{study.out} holds a study with other settings ({what}); use another --out")
    _check_selection(study, ((previous.get("options") or {}).get("tune") or {}))
    before = (previous.get("data") or {}).get("splits")
    now = data_record(study.base["data_dir"])["splits"]
    if before and before != now:  # e.g. a study moved to a machine that prepared another corpus
        raise StudyError(
            f"the data in {study.base['data_dir']} are not the data {study.out} was started on "
            f"(train sha256 {before.get('train', {}).get('sha256', '?')[:12]}, now "
            f"{now.get('train', {}).get('sha256', '?')[:12]}); prepare the same corpus or use another --out"
        )


# ----------------------------------------------------------------------------- the study
def run_study(
    study: StudyPlan,
    print_fn: Callable = print,
    report_after: bool = True,
    drop_checkpoints: bool = False,
    workers: int = 1,
    threads: int | None = None,
) -> int:
    """Train every (variant, seed) not already done, then write the report. Returns an exit code
    (0 done, 130 interrupted).

    ``workers > 1`` trains that many runs at once, each in its own process with ``threads`` torch
    threads (default: CPU count // workers). Every run is seeded and independent, so the results
    are the same as with one worker; only ms/step reflects the shared machine.
    """
    study.out.mkdir(parents=True, exist_ok=True)
    previous = read_json(study.out / "study.json")
    _check_previous(study, previous)
    record = _study_record(study, previous)
    save_record(study.out, record)
    scheduler = _Scheduler(study, record, print_fn, drop_checkpoints)  # its clock includes autoassign's probes
    if study.suite == "autoassign" and not _run_autoassign(study, record, print_fn):
        return 130
    if study.options.get("tune"):
        code = run_tuning(study, record, lambda jobs: scheduler.run(jobs, workers, threads), scheduler.save, print_fn)
    else:
        jobs = [(v, s) for s in study.seeds for v in study.variants]
        if study.suite != "presets":  # plain preset runs may be shared with a presets study: do them last
            from ..assign import PRESETS

            jobs.sort(key=lambda job: job[0].name in PRESETS)
        code = scheduler.run(jobs, workers, threads)
    record["invocations"][-1]["workers"] = workers
    scheduler.save()
    if report_after:
        summary = collect(study.out)
        written = write_report(summary, study.out)
        print_fn(format_table(summary["table"]))
        print_fn(f"report: {', '.join(p.name for p in written)} in {study.out}")
    return code


def _run_autoassign(study: StudyPlan, record: dict, print_fn: Callable) -> bool:
    """The probes of the autoassign suite; adds the policy's variant to ``study``. False when
    interrupted."""
    from .autoassign import propose

    t_start = time.time()
    granularity = study.options.get("granularity", "module")
    try:
        result = propose(
            study.base,
            study.runs_dir / "_probes" / f"{granularity}-s{study.seeds[0]}",
            seed=study.seeds[0],
            probe_iters=study.options.get("probe_iters"),
            granularity=granularity,
            print_fn=print_fn,
        )
    except KeyboardInterrupt:
        print_fn("interrupted during the probes: run the same command again to continue")
        return False
    atomic_write_json(study.out / "autoassign.json", result)
    record["autoassign"] = {k: result[k] for k in ("choice", "rules", "matches_preset", "probe_steps")}
    record["timing"]["probes_s"] = record["timing"].get("probes_s", 0.0) + (time.time() - t_start)
    study.variants = _with_auto_variant(study.variants, result)
    record["variants"] = [v.to_dict() for v in study.variants]
    study.validate()
    save_record(study.out, record)
    return True


def _with_auto_variant(variants: list[Variant], result: dict) -> list[Variant]:
    match = result.get("matches_preset")
    out = list(variants)
    if match:
        if match not in [v.name for v in out]:
            out.append(Variant(match, match, base=match))
        for v in out:
            if v.name == match:
                v.label = f"{match} (= auto choice)"
        return out
    out.append(
        Variant(
            "auto",
            "adamw",
            rules=list(result["rules"]),
            base="auto",
            label="auto: " + ", ".join(f"{g} {m}" for g, m in result["choice"].items()),
        )
    )
    return out


def threads_per_worker(workers: int) -> int:
    """Default torch threads of each of ``workers`` parallel runs: the CPU count shared out."""
    return max(1, (os.cpu_count() or 1) // workers)


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


class _Scheduler:
    """Claims runs (lock held), trains them here or in worker processes, records their wall time."""

    def __init__(self, study: StudyPlan, record: dict, print_fn: Callable, drop_checkpoints: bool):
        self.study, self.record, self.print_fn, self.drop_checkpoints = study, record, print_fn, drop_checkpoints
        self.started = time.time()

    def stamp_elapsed(self) -> None:
        """This invocation's wall time so far, into its ``invocations`` entry (`save_record` sums
        them into ``timing.elapsed_s``): updated after every run, so an invocation killed between
        runs (a session that ends) keeps the time up to its last finished run."""
        self.record["invocations"][-1]["elapsed_s"] = time.time() - self.started

    def save(self, added: tuple[str, float] | None = None) -> None:
        """The record with this invocation's time so far (`save_record`; ``added``: a run just trained)."""
        self.stamp_elapsed()
        save_record(self.study.out, self.record, added)

    def run(self, jobs: list, workers: int, threads: int | None) -> int:
        """Train ``jobs`` (``(variant, seed)`` pairs) not done yet; 0, or 130 when interrupted."""
        return self.run_parallel(jobs, workers, threads) if workers > 1 else self.run_sequential(jobs)

    def claims(self, jobs: list) -> Iterator[tuple]:
        """Yield ``(v, seed, tag, cfg, state, lock)`` for each job that still needs training, its
        lock held; done runs and runs another process is training are reported and passed over.
        Lazy, so a run is claimed only when a worker is free for it."""
        study, say = self.study, self.print_fn
        for i, (v, seed) in enumerate(jobs, 1):
            tag = f"[{i}/{len(jobs)}] {v.name} seed {seed}"
            cfg = study.config(v, seed)
            run_dir = study.run_dir(v, seed)
            if run_state(run_dir, cfg) == "done":
                say(f"{tag}: already {read_json(run_dir / 'status.json', {}).get('status')} (skipped)")
                continue
            lock = claim_lock(run_dir)
            holder = lock.acquire()
            if holder is not None:
                say(f"{tag}: being trained by another process (pid {holder}); skipped, rerun later to include it")
                continue
            state = run_state(run_dir, cfg)  # again, now that the folder is ours
            if state == "done":
                lock.release()
                continue
            say(f"{tag}: {'resuming' if state == 'resume' else 'training'} ...")
            yield v, seed, tag, cfg, state, lock

    def record_run(self, v: Variant, seed: int, tag: str, status: dict, wall: float) -> None:
        self.save(added=(f"{v.name}/s{seed}", wall))
        self.print_fn(f"{tag}: {_status_line(status)} in {wall:.0f} s")
        if self.drop_checkpoints and status.get("status") in TERMINAL_STATUSES:
            (self.study.run_dir(v, seed) / "ckpt.pt").unlink(missing_ok=True)

    def run_sequential(self, jobs: list) -> int:
        try:
            for v, seed, tag, cfg, state, lock in self.claims(jobs):
                try:
                    status, wall = _train_timed(cfg, state, self.print_fn)
                finally:
                    lock.release()
                self.record_run(v, seed, tag, status, wall)
                if _interrupted(status, cfg):
                    self.print_fn("interrupted: run the same command again to continue")
                    return 130
        except KeyboardInterrupt:
            self.print_fn("interrupted: run the same command again to continue")
            return 130
        return 0

    def run_parallel(self, jobs: list, workers: int, threads: int | None) -> int:
        """Up to ``workers`` runs at once in spawned processes; locks and the record stay here."""
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(threads or threads_per_worker(workers),),
        )
        running: dict = {}
        try:
            code = self._drive(pool, self.claims(jobs), running, workers)
        except KeyboardInterrupt:  # the workers got the signal too: they checkpoint and return
            code = 130
            self._drain(running)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if code:
            self.print_fn("interrupted: run the same command again to continue")
        return code

    def _drive(self, pool, claims: Iterator[tuple], running: dict, workers: int) -> int:
        from concurrent.futures import FIRST_COMPLETED, wait
        from concurrent.futures.process import BrokenProcessPool

        code = 0
        while True:
            while len(running) < workers and code == 0:
                claim = next(claims, None)
                if claim is None:
                    break
                v, seed, tag, cfg, state, lock = claim
                try:
                    future = pool.submit(_train_timed, cfg, state)
                except BaseException:
                    lock.release()
                    raise
                running[future] = (v, seed, tag, cfg, lock)
            if not running:
                return code
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                v, seed, tag, cfg, lock = running.pop(future)
                lock.release()
                try:
                    status, wall = future.result()
                except BrokenProcessPool:  # a worker died (Ctrl-C between runs, out of memory)
                    self.print_fn(f"{tag}: its worker process died; rerun the same command to continue")
                    code = code or 130
                    continue
                self.record_run(v, seed, tag, status, wall)
                if _interrupted(status, cfg):
                    code = 130

    def _drain(self, running: dict) -> None:
        """After Ctrl-C: record the runs the workers checkpointed and returned."""
        from concurrent.futures.process import BrokenProcessPool

        for future, (v, seed, tag, _cfg, lock) in running.items():
            try:
                status, wall = future.result()
                self.record_run(v, seed, tag, status, wall)
            except (KeyboardInterrupt, BrokenProcessPool):  # a second Ctrl-C, or the worker died
                pass
            finally:
                lock.release()


def _interrupted(status: dict, cfg) -> bool:
    return status.get("status") == "interrupted" and cfg.stop_after is None
