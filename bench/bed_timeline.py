"""bench/batch_timeline.py across simulated hosts: ringlet and Open MPI's TCP on one bed.

Builds a ``ringlet.testbed.HostBed`` of ``--hosts`` hosts with ``--rate`` links
(root only) and runs ``bench/batch_timeline.py`` with ``--per-host`` ranks on
each, ``--launches`` times per system, alternating: ringlet through ``ringlet
run --hosts`` over the bed's rsh, Open MPI through ``mpirun`` with a hostfile
(TCP, yielding when idle, as ``bench/bed_bench.py`` runs it).  Arguments after
``--`` go to batch_timeline.py (docs/experiments.md, "Across hosts: the 4x2
small broadcast, and the bed's bucket"):

    python3 bench/bed_timeline.py --launches 3 -- --batch 1 --batches 500
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
from ringlet.testbed import HostBed  # noqa: E402

TIMELINE = os.path.join(HERE, "batch_timeline.py")
SRC = os.path.join(os.path.dirname(HERE), "src")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RINGLET_", "OMPI_", "PMIX_"))}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--ringlet-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in ringlet's ranks (repeatable), e.g. RINGLET_BIND=none")
    a = p.parse_args(argv)
    extra = dict(kv.split("=", 1) for kv in a.ringlet_env)
    P = a.hosts * a.per_host
    with HostBed(a.hosts, rate=a.rate) as bed:
        hostfile = os.path.join(bed._dir, "hostfile")
        with open(hostfile, "w") as f:
            f.writelines(f"{h} slots={a.per_host}\n" for h in bed.hosts)
        spec = ",".join(f"{h}:{a.per_host}" for h in bed.hosts)
        mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
        for launch in range(a.launches):
            runs = [("ringlet", [sys.executable, "-m", "ringlet.run", "--hosts", spec, "--rsh",
                                 bed.rsh, "--timeout", "300", TIMELINE, *rest], _env(**extra)),
                    ("mpi-tcp", [mpirun, "--hostfile", hostfile, "--mca", "plm_rsh_agent",
                                 bed.rsh, "-np", str(P), "--map-by",
                                 f"ppr:{a.per_host}:node:OVERSUBSCRIBE", "--bind-to", "none",
                                 "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                                 "--mca", "mpi_yield_when_idle", "1",
                                 "--mca", "btl_tcp_if_include", bed.ifname,
                                 "--mca", "oob_tcp_if_include", bed.ifname,
                                 sys.executable, TIMELINE, "--mpi", *rest],
                     _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))]
            for name, cmd, env in runs:
                r = bed.run("h1", cmd, env, timeout=400)
                print(f"=== {name}, launch {launch + 1} of {a.launches}: exit {r.returncode}")
                print(r.stdout.decode(errors="replace"))
                if r.returncode:
                    print(r.stderr.decode(errors="replace")[-3000:])


if __name__ == "__main__":
    main()
