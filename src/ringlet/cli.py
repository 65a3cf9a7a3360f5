"""The ``ringlet`` command: ``run`` (launch ranks), ``info`` (environment report), ``bench``,
``trace`` (merge flight records).

Examples::

    ringlet run -n 4 train.py
    ringlet info --json
    ringlet --version
    ringlet bench --help
    ringlet trace /tmp/ringlet-trace-4f0c2a9e
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["main"]

_COMMANDS = {
    "run": "start N ranks of a job on this host or several (see `ringlet run -h`)",
    "info": "print versions, the detected launch environment and the core's build",
    "bench": "run the collective benchmarks (see `ringlet bench -h`)",
    "trace": "merge the ranks' flight records in DIR: who is stuck where (`ringlet trace -h`)",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringlet", description="ringlet: collectives for distributed training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {k:<6} {v}" for k, v in _COMMANDS.items()))
    p.add_argument("-V", "--version", action="version", version=f"ringlet {_version()}",
                   help="print the version and exit")
    p.add_argument("command", choices=sorted(_COMMANDS), metavar="command",
                   help="one of: " + ", ".join(_COMMANDS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the command")
    return p


def _version() -> str:
    from ._version import __version__

    return __version__


def info_dict() -> Dict[str, Any]:
    """What ``ringlet info`` reports, as data (``ringlet info --json`` prints it).

    Keys: ``version``, ``python``, ``executable``, ``platform``, ``numpy`` (None
    when missing), ``launch`` (None when no launcher is detected, else source,
    ranks and master; ``{"error": ...}`` for an invalid launcher environment),
    ``secret`` ("set", "not set" or "invalid: ..."; never the secret), ``transport``
    (``RINGLET_TRANSPORT``'s mode and this process's host id, or ``{"error": ...}``),
    ``single_copy`` (the kernel's Yama ``ptrace_scope``, None without Yama), ``env``
    (launcher variables, secrets redacted) and ``core`` (the build facts, or
    ``{"error": ...}`` when the extension is not built).
    """
    from . import environment

    d: Dict[str, Any] = {"version": _version(), "python": platform.python_version(),
                         "executable": sys.executable, "platform": platform.platform()}
    try:
        import numpy

        d["numpy"] = numpy.__version__
    except ImportError as exc:
        d["numpy"] = None
        d["numpy_error"] = str(exc)
    try:
        env = environment.detect()
    except Exception as exc:  # noqa: BLE001 - report, do not crash
        d["launch"] = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        d["launch"] = None if env is None else {
            "source": env.source, "rank": env.rank, "world_size": env.world_size,
            "local_rank": env.local_rank, "local_world_size": env.local_world_size,
            "master_addr": env.master_addr, "master_port": env.master_port}
    try:
        d["secret"] = "set" if environment.load_secret() else "not set"
    except ValueError as exc:
        d["secret"] = f"invalid: {exc}"
    d["env"] = dict(environment._environ_summary())
    try:
        from ._shm import transport_mode
        from ._topology import host_id

        d["transport"] = {"mode": transport_mode(), "host_id": host_id()}
    except (ValueError, ImportError) as exc:
        d["transport"] = {"error": str(exc)}
    try:
        from ._shm import ptracer_mode, yama_ptrace_scope

        d["single_copy"] = {"yama_ptrace_scope": yama_ptrace_scope(), "ptracer": ptracer_mode()}
    except (ImportError, OSError, ValueError) as exc:
        d["single_copy"] = {"error": str(exc)}
    try:
        from ._topology import bind_mode

        d["binding"] = {"mode": bind_mode(), "cpus": sorted(os.sched_getaffinity(0))}
    except (ValueError, AttributeError, OSError) as exc:
        d["binding"] = {"error": str(exc)}
    try:
        from . import _core

        d["core"] = dict(_core.build_info())
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken build
        d["core"] = {"error": f"{type(exc).__name__}: {exc}"}
    return d


def _cpu_ranges(cpus: Sequence[int]) -> str:
    """0,1,2,5 -> "CPUs 0-2,5"."""
    if not cpus:
        return "no CPUs it can name"
    parts, start = [], cpus[0]
    for prev, cur in zip(cpus, list(cpus[1:]) + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return "CPUs " + ",".join(parts)


def info_lines() -> List[str]:
    """The lines ``ringlet info`` prints (versions, launch environment, core build)."""
    d = info_dict()
    lines = [f"ringlet {d['version']}", f"python {d['python']} ({d['executable']})",
             f"platform {d['platform']}"]
    lines.append(f"numpy {d['numpy']}" if d["numpy"] is not None
                 else f"numpy: not installed ({d['numpy_error']})")
    env = d["launch"]
    if env is None:
        lines.append("launch: none detected (a stand-alone process is a world of one)")
    elif "error" in env:
        lines.append(f"launch: invalid launcher environment ({env['error']})")
    else:
        where = (f"{env['master_addr']}:{env['master_port']}" if env["master_addr"]
                 else "none (bootstrap through mpi4py)")
        lines.append(f"launch: {env['source']} rank {env['rank']}/{env['world_size']} local "
                     f"{env['local_rank']}/{env['local_world_size']} master {where}")
    lines.append(f"secret: {d['secret']}")
    t = d["transport"]
    if "error" in t:
        lines.append(f"transport: invalid ({t['error']})")
    else:
        how = {"auto": "shared memory within a host, TCP across hosts",
               "shm": "shared memory only (a group spanning hosts fails)",
               "tcp": "TCP only"}[t["mode"]]
        lines.append(f"transport: {t['mode']} ({how}); host id {t['host_id']}")
    sc = d["single_copy"]
    if "error" in sc:
        lines.append(f"single copy: unknown ({sc['error']})")
    else:
        from ._shm import single_copy_outlook

        lines.append("single copy: " + single_copy_outlook(sc["yama_ptrace_scope"],
                                                           sc["ptracer"]))
    b = d["binding"]
    if "error" in b:
        lines.append(f"cpu binding: invalid ({b['error']})")
    else:
        how = ("each rank of a host that talks over shared memory takes a block of the CPUs "
               "below" if b["mode"] == "auto" else "CPUs left as the launcher set them")
        lines.append(f"cpu binding: {b['mode']} ({how}); this process may run on "
                     f"{_cpu_ranges(b['cpus'])}")
    for k, v in d["env"].items():
        lines.append(f"env {k}={v}")
    if set(d["core"]) == {"error"}:
        lines.append(f"core: not built ({d['core']['error']})")
    else:
        for k, v in d["core"].items():
            lines.append(f"core {k}: {v}")
    return lines


def _info(args: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="ringlet info", description=_COMMANDS["info"])
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (see ringlet.cli.info_dict) instead of lines")
    ns = p.parse_args(list(args))
    if ns.json:
        print(json.dumps(info_dict(), indent=2, sort_keys=True, default=str))
        return 0
    for line in info_lines():
        print(line)
    return 0


def _bench(args: Sequence[str]) -> int:
    try:
        from . import bench
    except ImportError as exc:
        print(f"ringlet bench: the benchmark module is not available ({exc})", file=sys.stderr)
        return 2
    rc = bench.main(list(args))
    return int(rc or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``ringlet`` console script; returns the exit code.

    Example::

        raise SystemExit(main(["info"]))
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(f"ringlet {_version()}")
        return 0
    # `run` and `bench` own everything after their name (the program's own
    # options included), so they are dispatched before argparse sees them.
    if argv and argv[0] == "run":
        from . import run

        return run.main(argv[1:])
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "trace":
        from . import trace

        return trace.main(argv[1:])
    if not argv:
        _parser().print_help(sys.stderr)
        return 2
    ns = _parser().parse_args(argv)
    if ns.command == "info":
        return _info(ns.args)
    if ns.command == "bench":
        return _bench(ns.args)
    from . import run

    return run.main(ns.args)


if __name__ == "__main__":
    sys.exit(main())
