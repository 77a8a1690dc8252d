"""Where the exact solver's time goes on a GPU: the kernels it is built from, timed side by side.

    python lab/2026-12-04-gpu-profile/gpu_profile.py OUT.json      # on a CUDA machine

Times (median of 5 after 2 warm-up calls, CUDA-synchronised) a symmetric eigendecomposition
(``torch.linalg.eigh``, the solver's polar evaluation) with cuSOLVER and with MAGMA, single and
batched, in float32 and float64; one 5-step Polar Express msign in bfloat16 (plain Muon's
direction); an n x n float32 product; then profiles one warm `spectral_direction` per manifold at
2304x768 and 768x768: the GPU kernel time and the time inside ``eigh`` against the wall time, the
kernels that take it, and the host synchronisations. Written for the docs' "On a GPU" section
(docs/manifold-muon.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from geomtrain._io import atomic_write_json
from geomtrain.optim import spectral_direction
from manifolds import DGram, Stiefel, msign


def timed(fn, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` on the GPU."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernels() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, batch in ((768, 1), (768, 12), (128, 1), (128, 12)):
        for dtype in (torch.float32, torch.float64):
            X = torch.randn(batch, 2 * n, n, device="cuda", dtype=dtype, generator=gen)
            M = X.mT @ X
            row = {"n": n, "batch": batch, "dtype": str(dtype).replace("torch.", "")}
            for lib in ("cusolver", "magma"):
                torch.backends.cuda.preferred_linalg_library(lib)
                try:
                    row[f"eigh_{lib}_ms"] = 1000 * timed(lambda: torch.linalg.eigh(M))  # noqa: B023
                except RuntimeError as exc:  # a backend that is not built in
                    row[f"eigh_{lib}_ms"] = None
                    row[f"eigh_{lib}_error"] = str(exc).splitlines()[0]
            torch.backends.cuda.preferred_linalg_library("default")
            row["matmul_nn_ms"] = 1000 * timed(lambda: M @ M)  # noqa: B023
            rows.append(row)
            print(json.dumps(row), flush=True)
    for m, n, batch in ((2304, 768, 1), (3072, 768, 1), (768, 768, 1), (2304, 768, 12)):
        G = torch.randn(batch, m, n, device="cuda", generator=gen)
        row = {"msign_shape": f"{batch}x{m}x{n}"}
        row["msign_bf16_ms"] = 1000 * timed(lambda: msign(G, "polar_express", 5, torch.bfloat16))  # noqa: B023
        row["msign_fp32_ms"] = 1000 * timed(lambda: msign(G, "polar_express", 5, torch.float32))  # noqa: B023
        row["gram_fp32_ms"] = 1000 * timed(lambda: G.mT @ G)  # noqa: B023
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def profile_solves() -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for man in (Stiefel(), DGram()):
        for shape in ((2304, 768), (768, 768)):
            gen = torch.Generator().manual_seed(1)
            W = man.random(*shape, generator=gen).cuda()
            G = torch.randn(*shape, generator=gen).cuda()
            _, st = spectral_direction(man, W, G)  # warm-up, and the warm start below
            G2 = 0.95 * G + 0.05 * torch.randn_like(G)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                _, st2 = spectral_direction(man, W, G2, dual=st.dual, escalate=st.escalated)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            events = prof.key_averages()
            # Kernel rows only: an operator's row repeats the device time of the kernels it launched.
            kernels = [e for e in events if e.device_type == DeviceType.CUDA]
            gpu_total = sum(e.self_device_time_total for e in kernels) / 1000
            eigh_ms = sum(e.device_time_total for e in events if e.key == "aten::_linalg_eigh") / 1000
            top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:12]
            syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
            copies = sum(e.count for e in events if e.key in ("cudaMemcpyAsync", "cudaMemcpy"))
            label = f"{type(man).__name__} {shape[0]}x{shape[1]} warm"
            out[label] = {
                "wall_ms_profiled": 1000 * wall,
                "evaluations": int(st2.evaluations),
                "gpu_kernel_ms": gpu_total,
                "eigh_ms": eigh_ms,
                "host_syncs": syncs,
                "memcpy_calls": copies,
                "top_gpu_ops": [
                    {"op": e.key[:60], "gpu_ms": e.self_device_time_total / 1000, "calls": e.count} for e in top
                ],
            }
            print(label, json.dumps(out[label]), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON to write (kernels first, then the profiles)")
    path = parser.parse_args().out
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["kernels"] = kernels()
    atomic_write_json(path, result)  # the kernels survive a failed profile
    result["profiles"] = profile_solves()
    atomic_write_json(path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
