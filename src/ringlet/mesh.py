"""``ringlet.mesh``: old import path of ``ringlet.parallel.mesh`` (``DeviceMesh``), kept working."""

from .parallel.mesh import DeviceMesh

__all__ = ["DeviceMesh"]
