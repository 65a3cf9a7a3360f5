"""Rendezvous key-value store: how the ranks of a job find each other.

One process (rank 0, or the ``ringlet run`` launcher) runs a ``StoreServer``;
every rank connects a ``Store`` client to it, authenticated with the job
secret (``ringlet._auth``, purpose ``b"store"``).  Ranks publish their
endpoints, count arrivals and wait for each other through it.

The package is split by concept: ``protocol`` (the wire format and limits),
``server`` (the selector loop) and ``client``.
"""

from .client import Store
from .protocol import MAX_KEY_BYTES, MAX_VALUE_BYTES
from .server import StoreServer

__all__ = ["StoreServer", "Store", "MAX_KEY_BYTES", "MAX_VALUE_BYTES"]
