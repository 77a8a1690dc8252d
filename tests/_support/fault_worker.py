"""``python -m geomtrain ARGS`` with one fault injected, for the subprocess tests of
tests/train/test_faults*.py.

usage: python tests/_support/fault_worker.py FAULT ARGS...

FAULT is one of

- ``none``                      run as ``python -m geomtrain ARGS``
- ``kill-at-step:N``            SIGKILL this process as training step N returns (before it is logged)
- ``kill-renaming:NAME:K``      SIGKILL at the K-th rename of a temporary file onto run file NAME: the
                                temporary file is complete and fsynced, NAME still holds the old version
                                (``ckpt.pt``: ``ckpt.json`` already names the new checkpoint)
- ``kill-after-checkpoint:K``   SIGKILL right after the K-th checkpoint is in place (before the status update)
- ``full-disk-at-checkpoint:K`` the K-th ``ckpt.pt`` write fails with ENOSPC (rank 0 writes it; under torchrun
                                the other ranks' writes are no-ops)
- ``slow-after-step:N``         step N writes ``OUT_DIR/.reached-N``, later steps sleep 0.3 s each, so that
                                a test can send a signal at a known point of a run

Only public names are patched: ``os.replace``, ``geomtrain.train.Trainer.step`` and
``geomtrain.checkpoint.Checkpoint.save``.
"""

import errno
import os
import runpy
import signal
import sys
import time
from pathlib import Path


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _out_dir(argv: list[str]) -> Path:
    return Path(argv[argv.index("--out-dir") + 1])


def _patch_step(after) -> None:
    from geomtrain.train import Trainer

    original = Trainer.step

    def step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        after(result.step)
        return result

    Trainer.step = step


def install(fault: str, argv: list[str]) -> None:
    kind, _, arg = fault.partition(":")
    if kind == "none":
        return
    if kind == "kill-at-step":
        n = int(arg)
        _patch_step(lambda step: _die() if step == n else None)
    elif kind == "kill-renaming":
        name, k = arg.split(":")
        real_replace, seen = os.replace, [0]

        def replace(src, dst, *a, **kw):
            if Path(dst).name == name:
                seen[0] += 1
                if seen[0] == int(k):
                    _die()
            return real_replace(src, dst, *a, **kw)

        os.replace = replace
    elif kind == "kill-after-checkpoint":
        from geomtrain.checkpoint import Checkpoint

        original, seen = Checkpoint.save, [0]

        def save(self, state):
            original(self, state)
            seen[0] += 1
            if seen[0] == int(arg):
                _die()

        Checkpoint.save = save
    elif kind == "full-disk-at-checkpoint":
        from geomtrain.checkpoint import Checkpoint

        original, seen = Checkpoint.save, [0]

        def save(self, state):
            seen[0] += 1
            if seen[0] == int(arg) and self.master:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.file("ckpt.pt")))
            original(self, state)

        Checkpoint.save = save
    elif kind == "slow-after-step":
        n, marker = int(arg), _out_dir(argv) / f".reached-{arg}"

        def after(step):
            if step == n:
                marker.write_text("")
            elif step > n:
                time.sleep(0.3)

        _patch_step(after)
    else:
        raise SystemExit(f"fault_worker: unknown fault {fault!r}")


if __name__ == "__main__":
    fault, args = sys.argv[1], sys.argv[2:]
    install(fault, args)
    sys.argv = ["geomtrain", *args]
    runpy.run_module("geomtrain", run_name="__main__", alter_sys=True)
