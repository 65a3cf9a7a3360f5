"""Remote procedure calls between the workers of a ringlet job.

Every rank starts an RPC agent with a unique name; any worker can then call
a *registered* function on any other, synchronously, asynchronously (a
:class:`Future`) or by reference (:func:`remote` returns an :class:`RRef` to
the result, which stays on the callee).  Values travel in a bounded binary
format (no pickle unless every rank opts in with ``allow_pickle=True``) over
RPC's own authenticated TCP connections.  See ``docs/rpc.md``.

Example::

    import ringlet
    from ringlet import rpc

    @rpc.register
    def add(a, b):
        return a + b

    ringlet.init()                      # under `ringlet run -n 2 script.py`
    rpc.init_rpc(f"worker{ringlet.get_rank()}")
    if ringlet.get_rank() == 0:
        assert rpc.rpc_sync("worker1", add, args=(2, 3)) == 5
        fut = rpc.rpc_async(1, "__main__.add", args=(1, 1))
        assert fut.result(timeout=10) == 2
    rpc.shutdown()   # waits until no worker has a call in flight
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Dict, List, Optional

from .._timeout import seconds
from . import registry
from .agent import K_CALL, Agent, WorkerInfo, _check_args, _tls, current_agent
from .future import Future, RemoteError
from .registry import register, registered_names, unregister
from .rref import RRef
from .._wire.codec import Limits

__all__ = [
    "init_rpc", "shutdown", "is_initialized", "register", "unregister", "registered_names",
    "rpc_sync", "rpc_async", "remote", "RRef", "Future", "RemoteError", "WorkerInfo",
    "get_worker_info", "get_worker_infos", "debug_info", "Limits",
]

_MAX_WORKER_NAME = 128
_CLOSE_GRACE_S = 10.0  # past a drain's timeout, for its close() to join the agent's threads


def _world_host() -> str:
    # The interface the ringlet world chose for its own listener: peers can reach it.
    import ringlet

    return ringlet.get_bind_address()


def init_rpc(
    name: str,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    num_worker_threads: int = 8,
    allow_pickle: bool = False,
    rpc_timeout: float = 60.0,
    host: Optional[str] = None,
    limits: Optional[Limits] = None,
    init_timeout: Optional[float] = None,
) -> WorkerInfo:
    """Start this worker's RPC agent (collective: every rank of the world calls it).

    Reuses the initialised ringlet world of this rank, or creates one with
    ``ringlet.init(rank=rank, world_size=world_size)`` (and then closes it
    again in :func:`shutdown`).  Opens a listener on an ephemeral port of the
    world's interface and exchanges ``(name, host, port)`` with every rank.

    Args:
        name: this worker's name, unique in the job (1-128 printable characters).
        rank, world_size: passed to ``ringlet.init`` when no world exists yet;
            when one does, they must match it if given.
        num_worker_threads: size of the pool running incoming calls.
        allow_pickle: send and accept pickled values for types the RPC format
            does not cover.  Pickle is used between two workers only when both
            opted in; a worker that did not opt in refuses pickled frames.
        rpc_timeout: default timeout (seconds) of every call, and the bound on
            any single frame transfer.
        host: address to listen on (default: ``RINGLET_RPC_HOST``, else the
            interface of the ringlet world).
        limits: frame bounds (:class:`Limits`); default 1 GiB frames.
        init_timeout: timeout for ``ringlet.init`` and the endpoint exchange.

    Returns:
        This worker's :class:`WorkerInfo`.

    Raises:
        TypeError, ValueError: bad arguments, a name used by two ranks (named
            in the message), or ``rank``/``world_size`` disagreeing with the world.
        RingletError: already initialised on this worker; rendezvous failures.

    Example::

        info = ringlet.rpc.init_rpc(f"trainer{ringlet.get_rank()}")
    """
    import ringlet

    if not isinstance(name, str):
        raise TypeError(f"init_rpc: name must be a str, got {type(name).__name__}")
    if not name or len(name) > _MAX_WORKER_NAME or not name.isprintable():
        raise ValueError(f"init_rpc: name must be 1..{_MAX_WORKER_NAME} printable characters, got {name!r}")
    if isinstance(num_worker_threads, bool) or not isinstance(num_worker_threads, int) \
            or not 1 <= num_worker_threads <= 1024:
        raise ValueError(f"init_rpc: num_worker_threads must be an int in 1..1024, got {num_worker_threads!r}")
    if not isinstance(allow_pickle, bool):
        raise TypeError(f"init_rpc: allow_pickle must be a bool, got {type(allow_pickle).__name__}")
    rpc_timeout = seconds(rpc_timeout, "init_rpc: rpc_timeout")
    if limits is None:
        limits = Limits()
    elif not isinstance(limits, Limits):
        raise TypeError(f"init_rpc: limits must be a ringlet.rpc.Limits, got {type(limits).__name__}")
    if host is not None and (not isinstance(host, str) or not host):
        raise ValueError(f"init_rpc: host must be a non-empty str, got {host!r}")
    mine = getattr(_tls, "agent", None)
    if mine is not None and not mine.closed:
        raise ringlet.RingletError(f"init_rpc: this worker is already initialised as {mine.name!r}; "
                                   "call ringlet.rpc.shutdown() first")

    created = False
    if ringlet.is_initialized():
        rk, ws = ringlet.get_rank(), ringlet.get_world_size()
        if rank is not None and rank != rk:
            raise ValueError(f"init_rpc: rank={rank} but the ringlet world says this is rank {rk}")
        if world_size is not None and world_size != ws:
            raise ValueError(f"init_rpc: world_size={world_size} but the ringlet world has {ws} ranks")
    else:
        kw: Dict[str, Any] = {"rank": rank, "world_size": world_size}
        if init_timeout is not None:
            kw["timeout"] = init_timeout
        ringlet.init(**kw)
        created = True
        rk, ws = ringlet.get_rank(), ringlet.get_world_size()
    agent: Optional[Agent] = None
    try:
        # RPC gets its own group, so its collectives never interleave with the user's.
        group = ringlet.new_group(list(range(ws)))
        agent = Agent(name=name, rank=rk, world_size=ws, group=group, key=ringlet.job_key("rpc"),
                      host=host or os.environ.get("RINGLET_RPC_HOST") or _world_host(),
                      num_worker_threads=num_worker_threads, allow_pickle=allow_pickle,
                      rpc_timeout=float(rpc_timeout), limits=limits, created_world=created)
        records = ringlet.all_gather_object(agent.endpoint_record(), group=group, timeout=init_timeout)
        agent.start(records)
    except BaseException:
        if agent is not None:
            agent.close("never started")
        if created:
            ringlet.shutdown()
        raise
    return agent.worker_info()


def is_initialized() -> bool:
    """Whether this worker has a running RPC agent."""
    try:
        current_agent()
    except Exception:
        return False
    return True


def shutdown(graceful: bool = True, timeout: Optional[float] = None) -> None:
    """Stop this worker's RPC agent (collective when ``graceful``).

    Graceful shutdown first waits until *no* worker has a call in flight:
    each worker waits for its own pending calls, then the workers agree, in
    rounds of ``all_gather_object``, that every request sent has been
    answered.  Only then are listeners and connections closed, so no worker
    loses a call because another closed early.  ``graceful=False`` closes at
    once; pending calls fail.  If ``init_rpc`` created the ringlet world, it
    is shut down too.  Does nothing when RPC is not initialised.

    It may be called from a done-callback or a ``then`` callback: the drain
    then waits for every other callback, not for the one calling it (nor the
    callbacks after it on the same future, which run once the agent is
    closed).  Meanwhile the callback pool has one thread more, so the
    callbacks of calls completing during the drain run even with
    ``num_worker_threads=1``.  A graceful shutdown that another thread of
    this worker is already running is not started twice: called from a
    callback, this returns at once (that drain waits for the callback); from
    any other thread, it waits for that shutdown to finish.

    Args:
        graceful: drain every worker's outstanding calls first (every rank
            must call ``shutdown(graceful=True)``).
        timeout: seconds the drain may take (default: ``rpc_timeout``).

    Raises:
        CollectiveTimeout: the drain did not finish in time (the agent is
            closed anyway), or the shutdown another thread runs did not
            finish within ``timeout`` plus a few seconds to close.
        TypeError, ValueError: ``timeout`` is not a positive number (the
            agent stays open).
        RingletError: graceful, from inside a function served over RPC (the
            drain would wait for that call's own reply; the agent stays open).

    Example::

        rpc.shutdown()

        # or, on a worker that stops once its last call has answered:
        rpc.rpc_async("ps", "final_report").then(lambda f: rpc.shutdown())
    """
    import ringlet

    try:
        agent = current_agent()
    except ringlet.RingletError:
        return
    if graceful and agent.serving_call():
        # The drain would wait for this very call's reply, which is sent only
        # once the function returns.
        raise ringlet.RingletError(
            f"rpc.shutdown(graceful=True) on worker {agent.name!r} was called inside a function "
            f"served over RPC, whose own reply the drain would wait for; call it from the "
            f"worker's main thread (or a done-callback), or pass graceful=False",
            rank=agent.rank, op="rpc.shutdown")
    if graceful:
        drain_timeout = agent.check_timeout(timeout)
        other = agent.claim_shutdown()
        if other is not None:
            if agent.in_callback():
                # That drain waits for this callback to return: waiting here
                # for the drain would hold both up until its timeout.
                return
            if not agent.wait_closed(drain_timeout + _CLOSE_GRACE_S):
                raise ringlet.CollectiveTimeout(
                    f"rpc shutdown on worker {agent.name!r}: the shutdown started by thread "
                    f"{other.name!r} has not finished after {drain_timeout + _CLOSE_GRACE_S:.3g} s",
                    rank=agent.rank, op="rpc.shutdown")
            return
    try:
        # From a callback: the callbacks the drain waits for (and those of the
        # calls close() fails) run on a spare thread, not queued behind this one.
        with agent.spare_callback_thread():
            try:
                if graceful:
                    agent.drain(drain_timeout)
            finally:
                agent.close("shut down" if graceful else "shut down (not gracefully)")
    finally:
        if agent.created_world:
            ringlet.shutdown()


def _agent_and_name(fn: Any) -> "tuple[Agent, str]":
    agent = current_agent()
    return agent, registry.name_of(fn)


def rpc_async(to: Any, fn: Any, args: Any = (), kwargs: Optional[dict] = None,
              timeout: Optional[float] = None) -> Future:
    """Call registered function ``fn`` on worker ``to``; return a :class:`Future` at once.

    Args:
        to: worker name, rank or :class:`WorkerInfo` (this worker included).
        fn: the registered name, or the registered function itself.
        args, kwargs: arguments, in the RPC value format (plus RRefs).
        timeout: seconds before the future fails with ``CollectiveTimeout``
            (default: ``rpc_timeout``).

    Returns:
        A :class:`Future`; it fails with ``RemoteError`` if ``fn`` raised,
        ``CollectiveTimeout`` past the deadline, ``PeerClosedError`` if the
        callee died.

    Raises:
        TypeError: bad ``to``/``args``/``kwargs``, an argument that cannot be
            serialized (the message gives its path), or ``fn`` neither a str
            nor callable.
        ValueError: unknown worker, unregistered function object, bad timeout,
            arguments larger than the callee's ``max_frame_bytes``.
        RingletError: RPC is not initialised.

    Example::

        fut = rpc_async("ps", "get_weights")
        w = fut.result()
    """
    agent, name = _agent_and_name(fn)
    dst = agent.resolve(to)
    args, kwargs = _check_args(args, kwargs)
    return agent._call(K_CALL, dst, [name, args, kwargs], agent.check_timeout(timeout),
                       f"rpc {name!r} to {agent._label(dst)}")


def rpc_sync(to: Any, fn: Any, args: Any = (), kwargs: Optional[dict] = None,
             timeout: Optional[float] = None) -> Any:
    """Call registered function ``fn`` on worker ``to`` and return its result.

    Same arguments as :func:`rpc_async`.

    Raises:
        RemoteError: ``fn`` raised on the callee (type, message and remote
            traceback included), or ``fn`` is not registered there.
        CollectiveTimeout: no reply within ``timeout`` (names callee and function).
        PeerClosedError: the callee died or closed the connection.
        TypeError, ValueError: as :func:`rpc_async`.

    Example::

        total = rpc_sync("worker1", add, args=(2, 3))
    """
    return rpc_async(to, fn, args, kwargs, timeout).result()


def remote(to: Any, fn: Any, args: Any = (), kwargs: Optional[dict] = None,
           timeout: Optional[float] = None) -> RRef:
    """Run ``fn`` on worker ``to`` and return an :class:`RRef` to its result, which stays there.

    Returns at once; the value is created asynchronously.  Errors surface
    from ``to_here()``, ``local_value()``, method proxies or ``confirmed()``.

    Raises:
        TypeError, ValueError: as :func:`rpc_async`.

    Example::

        ps = remote("ps", ParameterServer, args=(784, 10))
        ps.rpc_sync().push(grads)
    """
    return current_agent().remote(to, fn, args, kwargs, timeout)


def get_worker_info(name_or_rank: Any = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of a worker (name or rank), or of this one.

    Raises:
        TypeError, ValueError: unknown worker.
        RingletError: RPC is not initialised.
    """
    return current_agent().worker_info(name_or_rank)


def get_worker_infos() -> List[WorkerInfo]:
    """Every worker's :class:`WorkerInfo`, in rank order."""
    return list(current_agent().workers)


def debug_info() -> Dict[str, Any]:
    """Counters of this worker's agent: pending calls, owned RRefs, connections, rejections."""
    return current_agent().debug_info()


def _close_all_at_exit() -> None:
    from .agent import _agents, _agents_lock

    with _agents_lock:
        agents = list(_agents)
    for a in agents:
        try:
            a.close("closed at interpreter exit")
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


atexit.register(_close_all_at_exit)
