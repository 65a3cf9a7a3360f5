"""Checkpoint throughput: save and load GB/s per rank, and training time lost per save.

Four ranks (one process each, ``run_world`` process mode) hold a ~200 MB
state: float32 parameters plus an equally large momentum buffer, either
sharded FSDP-style (each rank a flat quarter of every tensor, ``--layout
fsdp``) or replicated DDP-style (every rank holds everything and the save
spreads the writing over the ranks, ``--layout ddp``).

Measured, per rank, median over ``--reps``:

* sync ``save``: wall time of the collective call; GB/s = bytes this rank
  wrote (its shard file) / that time.  Includes hashing (two SHA-256 passes)
  and fsync.
* ``load`` into the same layout: GB/s = bytes this rank read / time,
  including checksum verification.  With ``--cold`` the page cache is
  dropped first (needs root), else the reads hit the cache the save filled.
* training time lost per save: ``--steps`` simulated training steps (the
  step's compute plus an all_reduce of a ``--grad-mb`` gradient) are timed alone,
  after a blocking ``save``, and with an ``AsyncCheckpointer.save_async``
  issued before them and ``wait()`` after; lost = time minus the
  steps-alone time.  The compute is, with ``--compute gpu`` (default), a
  fixed ``--step-ms`` spent off the CPU, like a kernel on an accelerator, so
  the background save may use the host's cores; with ``--compute cpu`` it is
  a numpy matmul competing with the save for the cores.

Run::

    PYTHONPATH=src python3 bench/checkpoint_bench.py                # prints a markdown table
    PYTHONPATH=src python3 bench/checkpoint_bench.py --quick        # small smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core per rank
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

P = 4


def _state(r, P, mb, layout, fill=True):
    """~``mb`` MB: params and momentum, 12 tensors each, sizes 1..12 parts."""
    total = int(mb * 1e6) // 4 // 2  # float32 elements per half (params / momentum)
    parts = np.arange(1, 13)
    sizes = (parts * total // parts.sum()).tolist()
    from ringlet.checkpoint import ShardedTensor, ShardSpec

    out = {"model": {}, "optim": {}}
    rng = np.random.default_rng(r)
    for half in ("model", "optim"):
        for i, n in enumerate(sizes):
            shape = (n // 256, 256)
            n = shape[0] * 256
            if layout == "ddp":
                arr = np.full(shape, i, np.float32) if fill else np.zeros(shape, np.float32)
                out[half][f"t{i}"] = arr
            else:
                per = -(-n // P)
                s, e = min(n, r * per), min(n, (r + 1) * per)
                loc = (rng.random(e - s, dtype=np.float32) if fill
                       else np.zeros(e - s, np.float32))
                out[half][f"t{i}"] = ShardedTensor(loc, ShardSpec.flat(shape, s, e))
    out["step"] = 100
    return out


def _drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _rank(r, P, a):
    import ringlet
    from ringlet.checkpoint import AsyncCheckpointer, load, save

    path = os.path.join(a["dir"], "ck")
    state = _state(r, P, a["mb"], a["layout"])
    out = {"save_s": [], "save_bytes": 0, "load_s": [], "load_bytes": 0}
    save(state, path)  # warm-up: connections, page allocation, imports
    for _ in range(a["reps"]):
        ringlet.barrier()
        t0 = time.perf_counter()
        save(state, path)
        out["save_s"].append(time.perf_counter() - t0)
    with open(os.path.join(path, "manifest.json")) as f:
        files = json.load(f)["files"]
    out["save_bytes"] = sum(v["size"] for v in files.values() if v["rank"] == r)

    tmpl = _state(r, P, a["mb"], a["layout"], fill=False)
    cold = False
    for _ in range(a["reps"]):
        ringlet.barrier()
        if a["cold"] and r == 0:
            cold = _drop_caches()
        ringlet.barrier()
        t0 = time.perf_counter()
        res = load(tmpl, path)
        out["load_s"].append(time.perf_counter() - t0)
        out["load_bytes"] = res.bytes_read
    out["cold"] = cold

    # simulated training: compute + gradient all_reduce
    rng = np.random.default_rng(0)
    A = rng.random((a["mat"], a["mat"]), dtype=np.float32)
    grad = np.ones(int(a["grad_mb"] * (1 << 20)) // 4, np.float32)

    def steps():
        for _ in range(a["steps"]):
            if a["compute"] == "gpu":
                time.sleep(a["step_ms"] / 1000)  # the accelerator computes; the host is free
            else:
                A @ A
            ringlet.all_reduce(grad)

    def timed(fn):
        ringlet.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    ck = AsyncCheckpointer()
    base, sync_t, async_t, call_t = [], [], [], []
    for i in range(a["reps"]):
        base.append(timed(steps))
        sync_t.append(timed(lambda: (save(state, path), steps())))

        def overlapped():
            t0 = time.perf_counter()
            ck.save_async(state, path)
            call_t.append(time.perf_counter() - t0)
            steps()
            ck.wait()

        async_t.append(timed(overlapped))
    ck.close()
    out.update(base=base, sync=sync_t, async_=async_t, call=call_t)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=200.0, help="global state size in MB")
    ap.add_argument("--layout", choices=["fsdp", "ddp"], default="fsdp")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60, help="training steps per measurement")
    ap.add_argument("--compute", choices=["gpu", "cpu"], default="gpu",
                    help="simulated step compute: off-CPU wait (gpu) or a numpy matmul (cpu)")
    ap.add_argument("--step-ms", type=float, default=30.0, help="--compute gpu: ms per step")
    ap.add_argument("--mat", type=int, default=384, help="--compute cpu: matmul size")
    ap.add_argument("--grad-mb", type=float, default=1.0, help="all_reduce size per step (MiB)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before loads")
    ap.add_argument("--quick", action="store_true", help="20 MB, 1 rep, 10 steps")
    ap.add_argument("--json", default=None, help="also write raw results here")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.reps, args.steps = 20.0, 1, 10
    base = tempfile.mkdtemp(prefix="ringlet-ckbench-", dir=args.dir)
    from ringlet.testing import run_world

    try:
        a = dict(dir=base, mb=args.mb, layout=args.layout, reps=args.reps, steps=args.steps,
                 mat=args.mat, cold=args.cold, compute=args.compute, step_ms=args.step_ms,
                 grad_mb=args.grad_mb)
        res = run_world(_rank, P, mode="process", timeout=1800, args=(a,))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = statistics.median
    gb = 1e9
    save_bw = [r["save_bytes"] / med(r["save_s"]) / gb for r in res]
    load_bw = [r["load_bytes"] / med(r["load_s"]) / gb for r in res]
    # per repetition: the slowest rank's time, minus that repetition's baseline
    reps = range(len(res[0]["base"]))
    base_i = [max(r["base"][i] for r in res) for i in reps]
    base_t = med(base_i)
    sync_lost = med(max(r["sync"][i] for r in res) - base_i[i] for i in reps)
    async_lost = med(max(r["async_"][i] for r in res) - base_i[i] for i in reps)
    call = med(max(r["call"][i] for r in res) for i in reps)
    print(f"# checkpoint bench: {P} ranks (processes), {args.mb:.0f} MB global state, layout "
          f"{args.layout}, median of {args.reps}")
    print(f"# host: {platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}, numpy {np.__version__}; dir {os.path.dirname(base)}; "
          f"loads {'cold (page cache dropped)' if res[0]['cold'] else 'from the page cache'}")
    print()
    print("| | per rank | value |")
    print("|---|---|---|")
    written = ", ".join(f"{r['save_bytes'] / 1e6:.0f}" for r in res)
    read = ", ".join(f"{r['load_bytes'] / 1e6:.0f}" for r in res)
    print(f"| sync save | MB written | {written} |")
    print(f"| sync save | GB/s (mean, min) | {statistics.mean(save_bw):.2f}, {min(save_bw):.2f} |")
    print(f"| load | MB read | {read} |")
    print(f"| load | GB/s (mean, min) | {statistics.mean(load_bw):.2f}, {min(load_bw):.2f} |")
    what = (f"{args.step_ms:g} ms off-CPU" if args.compute == "gpu"
            else f"{args.mat}x{args.mat} matmul")
    print(f"| sync save | s (slowest rank) | {max(med(r['save_s']) for r in res):.3f} |")
    print(f"| load | s (slowest rank) | {max(med(r['load_s']) for r in res):.3f} |")
    print(f"| {args.steps} training steps alone ({what} + {args.grad_mb:g} MiB all_reduce) | s | "
          f"{base_t:.3f} |")
    print(f"| training time lost per sync save | s | {sync_lost:.3f} |")
    print(f"| training time lost per async save | s | {async_lost:.3f} "
          f"(save_async call: {call:.3f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": res}, f, indent=1)


if __name__ == "__main__":
    main()
