"""Run a function on every rank of a local job: the harness of ringlet's own tests.

``run_world(fn, n)`` starts a rendezvous store, runs ``fn(rank, n, *args,
**kwargs)`` on n ranks inside an initialised ringlet world and returns the
results in rank order.  Thread mode runs the ranks as threads of this process
over the same C code and real loopback sockets (it also proves the GIL is
released: n ranks can only make progress together if every blocking call
drops it).  Process mode spawns real processes (for crashes, signals and
launch paths).  If any rank fails, ``WorldError`` carries every failing
rank's traceback, labelled, and the results of the ranks that finished.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from . import _world

__all__ = ["run_world", "WorldError"]


class WorldError(RuntimeError):
    """One or more ranks of ``run_world`` failed.

    Attributes:
        failures: rank -> formatted traceback (or exit description).
        exceptions: rank -> exception object (thread mode only).
        results: rank -> return value of the ranks that succeeded.
    """

    def __init__(self, failures: Dict[int, str], exceptions: Dict[int, BaseException],
                 results: Dict[int, Any]) -> None:
        parts = [f"{len(failures)} rank(s) failed: {sorted(failures)}"]
        for r in sorted(failures):
            body = failures[r].rstrip().replace("\n", f"\n[rank {r}] ")
            parts.append(f"[rank {r}] {body}")
        super().__init__("\n".join(parts))
        self.failures = failures
        self.exceptions = exceptions
        self.results = results


def _store(secret: bytes):
    from .store import StoreServer

    return StoreServer("127.0.0.1", 0, secret=secret)


def run_world(fn: Callable[..., Any], world_size: int, *, mode: str = "thread",
              timeout: float = 60.0, args: tuple = (), kwargs: Optional[dict] = None,
              init_timeout: Optional[float] = None,
              host_ids: Optional[List[str]] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results.

    Args:
        fn: the per-rank function (module-level in process mode: it is pickled).
        world_size: number of ranks.
        mode: "thread" or "process".
        timeout: seconds for the whole run; stragglers are cancelled (threads)
            or killed (processes) and reported.
        init_timeout: operation timeout given to ``ringlet.init`` (default: ``timeout``).
        host_ids: each rank's same-host identity, to simulate hosts on one
            machine (process mode sets ``RINGLET_HOST_ID`` in each rank); default:
            the real one.
    Raises:
        WorldError: some rank raised, died or did not finish in time.
    """
    if mode not in ("thread", "process"):
        raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    kwargs = kwargs or {}
    if host_ids is not None and len(host_ids) != world_size:
        raise ValueError(f"host_ids has {len(host_ids)} entries for {world_size} ranks")
    secret = secrets.token_bytes(32)
    server = _store(secret)
    try:
        cfg = dict(master_addr="127.0.0.1", master_port=server.port, secret=secret,
                   timeout=init_timeout or timeout)
        if host_ids is not None:
            cfg["_host_ids"] = list(host_ids)
        if mode == "thread":
            return _run_threads(fn, world_size, timeout, args, kwargs, cfg)
        return _run_processes(fn, world_size, timeout, args, kwargs, cfg)
    finally:
        server.close()


def _run_threads(fn, n, timeout, args, kwargs, cfg):
    results: Dict[int, Any] = {}
    failures: Dict[int, str] = {}
    excs: Dict[int, BaseException] = {}
    worlds: Dict[int, Any] = {}

    def body(rank: int) -> None:
        _world._scope_thread()
        try:
            _world.init(rank=rank, world_size=n, _external_store=True, **_rank_cfg(cfg, rank))
            worlds[rank] = _world._current()
            results[rank] = fn(rank, n, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported with its rank
            excs[rank] = exc
            failures[rank] = traceback.format_exc()
        finally:
            try:
                _world.shutdown()
            except BaseException as exc:  # noqa: BLE001
                failures.setdefault(rank, f"shutdown failed: {exc!r}")

    threads = [threading.Thread(target=body, args=(r,), name=f"ringlet-rank{r}", daemon=True)
               for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        # Cancel every rank's groups so blocked C calls return, then collect.
        for w in list(worlds.values()):
            w._cancel_all(_core_status("TIMEOUT"), "run_world deadline passed")
        for r in stuck:
            threads[r].join(10.0)
            failures.setdefault(r, f"still running after the {timeout}s run_world deadline")
    if failures:
        raise WorldError(failures, excs, results)
    return [results[r] for r in range(n)]


def _rank_cfg(cfg: dict, rank: int) -> dict:
    out = dict(cfg)
    ids = out.pop("_host_ids", None)
    if ids is not None:
        out["_host_id"] = ids[rank]
    return out


def _core_status(name: str) -> int:
    from . import _core

    return _core.STATUS[name]


def _process_main(rank, n, fn, args, kwargs, cfg, conn) -> None:
    os.environ["RINGLET_EXTERNAL_STORE"] = "1"
    try:
        cfg = _rank_cfg(cfg, rank)
        if "_host_id" in cfg:  # a process simulates its host the way users do
            os.environ["RINGLET_HOST_ID"] = cfg.pop("_host_id")
        _world.init(rank=rank, world_size=n, **cfg)
        result = fn(rank, n, *args, **kwargs)
        _world.shutdown()
        conn.send(("ok", result))
    except BaseException:  # noqa: BLE001 - sent to the parent with its rank
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _run_processes(fn, n, timeout, args, kwargs, cfg):
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    for r in range(n):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_process_main, args=(r, n, fn, args, kwargs, cfg, child),
                        name=f"ringlet-rank{r}", daemon=True)
        p.start()
        child.close()
        procs.append(p)
        pipes.append(parent)
    results: Dict[int, Any] = {}
    failures: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    pending = set(range(n))
    while pending and time.monotonic() < deadline:
        ready = mp.connection.wait([pipes[r] for r in pending] + [procs[r].sentinel for r in pending],
                                   timeout=max(0.0, deadline - time.monotonic()))
        for r in list(pending):
            if pipes[r] not in ready and procs[r].sentinel not in ready:
                continue
            msg = None
            if pipes[r].poll():
                try:
                    msg = pipes[r].recv()
                except EOFError:  # died without reporting
                    msg = None
            if msg is not None:
                kind, val = msg
                (results if kind == "ok" else failures)[r] = val
                pending.discard(r)
            elif not procs[r].is_alive() or pipes[r].poll():
                procs[r].join(5.0)
                code = procs[r].exitcode
                failures[r] = (f"process exited with code {code} without a result"
                               if code is None or code >= 0 else f"process killed by signal {-code}")
                pending.discard(r)
    for r in pending:
        failures[r] = f"still running after the {timeout}s run_world deadline (killed)"
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5.0)
    if failures:
        raise WorldError(failures, {}, results)
    return [results[r] for r in range(n)]
