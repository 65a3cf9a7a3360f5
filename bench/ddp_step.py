"""DistributedDataParallel step time: overlap on vs off, and the wait after backward.

The model is an MLP of ``--layers`` Linear(width, width) + ReLU blocks
(``--width 2048 --layers 6``: 25.2 M float32 parameters, 101 MB of gradients).
Each rank runs forward, an MSE loss, backward, ``sync_gradients`` and an SGD
step on its own ``--batch`` rows.

``--compute numpy`` (default) does the real matrix products on the CPU, where
they compete with the communication thread for cores.  ``--compute sleep``
stands in for an accelerator: each layer's forward and backward take a fixed
wall time (``--layer-ms`` for backward, half that forward) spent sleeping,
off the CPU, and the backward adds a precomputed gradient of the full size,
so the gradient buffers and all communication are exactly as real.

Three configurations, each with its own model, measured in interleaved steps
(one step of each in turn, so background load hits all three alike):

- ``local``: no DDP at all (the compute-only floor of a step);
- ``ddp, overlap off``: all bucket all-reduces run inside ``sync_gradients``;
- ``ddp, overlap on``: each bucket's all-reduce starts from backward as soon as
  its gradients are final.

Reported per configuration (median over ``--steps`` after ``--warmup``, the
slowest rank's value): step time, backward time, and "wait": the time
``sync_gradients`` blocks after backward has returned.

Run under the launcher (one configuration set, one world size)::

    ringlet run -n 4 bench/ddp_step.py
    ringlet run -n 2 bench/ddp_step.py --width 1024 --layers 10

or let it launch 2 and 4 ranks itself and print a markdown table::

    PYTHONPATH=src python3 bench/ddp_step.py --ranks 2 4

BLAS threads per rank default to (cores / ranks) - 1, leaving a core for the
communication thread; ``--blas-threads`` overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=128, help="rows per rank")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--compute", choices=["numpy", "sleep"], default="numpy")
    ap.add_argument("--layer-ms", type=float, default=25.0,
                    help="--compute sleep: backward ms per layer (forward: half)")
    ap.add_argument("--blas-threads", type=int, default=0, help="0: (cores / ranks) - 1")
    ap.add_argument("--ranks", type=int, nargs="*", default=None,
                    help="launch these world sizes with ringlet run and print a table")
    ap.add_argument("--json", action="store_true", help="rank 0 prints one JSON line")
    return ap.parse_args(argv)


def _set_blas_threads(args) -> int:
    world = int(os.environ.get("RINGLET_WORLD_SIZE", "1"))
    n = args.blas_threads or max(1, (os.cpu_count() or 2) // world - 1)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(n))
    return int(os.environ["OPENBLAS_NUM_THREADS"])


def _rank_main(args) -> None:
    blas = _set_blas_threads(args)  # before numpy starts its thread pool
    import numpy as np

    import ringlet
    from ringlet import nn, optim
    from ringlet.parallel import DDP

    ringlet.init()
    rank, world = ringlet.get_rank(), ringlet.get_world_size()

    class SleepLinear(nn.Module):
        """Linear-sized parameters, compute time spent off the CPU (see --compute sleep)."""

        def __init__(self, i):
            super().__init__()
            self.weight = nn.Parameter(np.zeros((args.width, args.width), np.float32))
            self.bias = nn.Parameter(np.zeros(args.width, np.float32))
            self._gw = np.full(self.weight.shape, 1e-3 * (i + 1), np.float32)
            self._gb = np.full(self.bias.shape, 1e-3, np.float32)

        def forward(self, x):
            time.sleep(args.layer_ms / 2e3)
            self._save(None, (self.weight, self.bias))
            return x

        def backward(self, g):
            self._pop()
            time.sleep(args.layer_ms / 1e3)
            self.weight.accumulate_grad(self._gw)
            self.bias.accumulate_grad(self._gb)
            return g

    def make_model():
        layers = []
        for i in range(args.layers):
            if args.compute == "sleep":
                layers.append(SleepLinear(i))
            else:
                layers += [nn.Linear(args.width, args.width, rng=i), nn.ReLU()]
        return nn.Sequential(*layers)

    g = np.random.default_rng(rank)
    x = g.standard_normal((args.batch, args.width)).astype(np.float32)
    y = g.standard_normal((args.batch, args.width)).astype(np.float32)

    modes = ("local", "no_overlap", "overlap")
    setups = {}
    for mode in modes:
        model = make_model()
        ddp = None if mode == "local" else DDP(model, bucket_cap_mb=args.bucket_cap_mb,
                                                overlap=(mode == "overlap"))
        setups[mode] = (model, ddp, optim.SGD(model.parameters(), lr=1e-4), [])

    def step(model, ddp, opt, rows, record):
        runner = ddp or model
        ringlet.barrier()  # start every step together
        t0 = time.perf_counter()
        opt.zero_grad()
        _, gy = nn.mse_loss(runner(x), y)
        t1 = time.perf_counter()
        runner.backward(gy)
        t2 = time.perf_counter()
        if ddp is not None:
            ddp.sync_gradients()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if record:
            rows.append((t4 - t0, t2 - t1, t3 - t2))

    for k in range(args.warmup + args.steps):
        for mode in modes:
            step(*setups[mode], record=k >= args.warmup)

    results = {}
    for mode in modes:
        model, ddp, _, rows = setups[mode]
        worst = np.median(np.array(rows), axis=0).astype(np.float64)
        ringlet.all_reduce(worst, ringlet.ReduceOp.MAX)  # the slowest rank sets the pace
        results[mode] = dict(step_ms=worst[0] * 1e3, backward_ms=worst[1] * 1e3,
                             wait_ms=worst[2] * 1e3,
                             params=sum(p.size for p in model.parameters()),
                             buckets=len(ddp.buckets) if ddp is not None else 0)
    if rank == 0:
        info = dict(world=world, width=args.width, layers=args.layers, batch=args.batch,
                    compute=args.compute, layer_ms=args.layer_ms,
                    bucket_cap_mb=args.bucket_cap_mb, blas_threads=blas, cpus=os.cpu_count(),
                    machine=platform.processor() or platform.machine(), results=results)
        if args.json:
            print("DDPBENCH " + json.dumps(info), flush=True)
        else:
            print(_table([info]), flush=True)
    ringlet.shutdown()


def _table(infos) -> str:
    lines = ["| ranks | params | buckets | config | step ms | backward ms | wait after "
             "backward ms | step vs overlap off |",
             "|---:|---:|---:|---|---:|---:|---:|---:|"]
    for info in infos:
        res = info["results"]
        off = res["no_overlap"]["step_ms"]
        for key, label in (("local", "no DDP (compute only)"), ("no_overlap", "DDP, overlap off"),
                           ("overlap", "DDP, overlap on")):
            r = res[key]
            rel = f"{(r['step_ms'] / off - 1) * 100:+.0f}%" if key != "no_overlap" else "—"
            lines.append(f"| {info['world']} | {r['params'] / 1e6:.1f} M | {r['buckets'] or '—'} "
                         f"| {label} | {r['step_ms']:.1f} | {r['backward_ms']:.1f} | "
                         f"{r['wait_ms']:.1f} | {rel} |")
    return "\n".join(lines)


def _launch_all(args) -> None:
    infos = []
    passthrough = [a for a in sys.argv[1:]]
    if "--ranks" in passthrough:
        i = passthrough.index("--ranks")
        j = i + 1
        while j < len(passthrough) and not passthrough[j].startswith("--"):
            j += 1
        del passthrough[i:j]
    for n in args.ranks:
        cmd = [sys.executable, "-m", "ringlet.run", "-n", str(n), "--no-prefix",
               os.path.abspath(__file__), "--json", *passthrough]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            sys.stderr.write(out.stdout + out.stderr)
            raise SystemExit(f"world size {n} failed with exit code {out.returncode}")
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("DDPBENCH "))
        infos.append(json.loads(line[len("DDPBENCH "):]))
    first = infos[0]
    compute = ("numpy on the CPU" if first["compute"] == "numpy" else
               f"sleep (accelerator stand-in), {first['layer_ms']} ms backward per layer")
    print(f"MLP {first['layers']} x Linear({first['width']}, {first['width']}), batch "
          f"{first['batch']} per rank, bucket cap {first['bucket_cap_mb']} MB, float32, "
          f"compute: {compute}; "
          f"{first['cpus']} cores, BLAS threads per rank: "
          + ", ".join(f"{i['world']} ranks -> {i['blas_threads']}" for i in infos))
    print(_table(infos))


def main() -> None:
    args = _args()
    if args.ranks:
        _launch_all(args)
    else:
        _rank_main(args)


if __name__ == "__main__":
    main()
