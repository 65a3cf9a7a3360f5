"""The ``ringlet`` command: ``run`` (launch ranks), ``info`` (environment report), ``bench``,
``trace`` (merge flight records).

Examples::

    ringlet run -n 4 train.py
    ringlet info
    ringlet bench --help
    ringlet trace /tmp/ringlet-trace-0123456789abcdef
"""

from __future__ import annotations

import argparse
import platform
import sys
from typing import List, Optional, Sequence

__all__ = ["main"]

_COMMANDS = {
    "run": "start N ranks of a job on this host (see `ringlet run -h`)",
    "info": "print versions, the detected launch environment and the core's build",
    "bench": "run the collective benchmarks (see `ringlet bench -h`)",
    "trace": "merge the ranks' flight records in DIR: who is stuck where (`ringlet trace -h`)",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringlet", description="ringlet: collectives for distributed training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {k:<6} {v}" for k, v in _COMMANDS.items()))
    p.add_argument("command", choices=sorted(_COMMANDS), metavar="command",
                   help="one of: " + ", ".join(_COMMANDS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the command")
    return p


def _version() -> str:
    mod = sys.modules.get("ringlet")
    v = getattr(mod, "__version__", None)
    if v:
        return str(v)
    try:
        from importlib.metadata import version

        return version("ringlet")
    except Exception:  # noqa: BLE001 - not installed (source tree)
        return "unknown"


def info_lines() -> List[str]:
    """The lines ``ringlet info`` prints (versions, launch environment, core build)."""
    from . import environment

    lines = [f"ringlet {_version()}",
             f"python {platform.python_version()} ({sys.executable})",
             f"platform {platform.platform()}"]
    try:
        import numpy

        lines.append(f"numpy {numpy.__version__}")
    except ImportError as exc:
        lines.append(f"numpy: not installed ({exc})")
    try:
        env = environment.detect()
    except Exception as exc:  # noqa: BLE001 - report, do not crash
        lines.append(f"launch: invalid launcher environment ({type(exc).__name__}: {exc})")
    else:
        if env is None:
            lines.append("launch: none detected (a stand-alone process is a world of one)")
        else:
            where = (f"{env.master_addr}:{env.master_port}" if env.master_addr
                     else "none (bootstrap through mpi4py)")
            lines.append(f"launch: {env.source} rank {env.rank}/{env.world_size} local "
                         f"{env.local_rank}/{env.local_world_size} master {where}")
    try:
        secret = environment.load_secret()
        lines.append("secret: " + ("set" if secret else "not set"))
    except ValueError as exc:
        lines.append(f"secret: invalid ({exc})")
    for k, v in environment._environ_summary().items():
        lines.append(f"env {k}={v}")
    try:
        from . import _core

        build = _core.build_info()
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken build
        lines.append(f"core: not built ({type(exc).__name__}: {exc})")
    else:
        for k, v in dict(build).items():
            lines.append(f"core {k}: {v}")
    return lines


def _info(args: Sequence[str]) -> int:
    argparse.ArgumentParser(prog="ringlet info",
                            description=_COMMANDS["info"]).parse_args(list(args))
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
