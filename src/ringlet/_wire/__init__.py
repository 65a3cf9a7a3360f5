"""The wire layer every Python subsystem shares.

- ``codec``: the object codec (bounded, pickle-free by default) used by RPC,
  the store's structured values and ``broadcast_object``/``all_gather_object``.
- ``stream``: connect, send and receive exactly, all under one deadline; the
  store client and the handshake move their bytes through it.

Above it, ``ringlet._auth.open_connection`` is the one way the store and RPC
open an authenticated connection (connect, then the handshake specified in
docs/security.md).  The dtype registry is ``ringlet._dtypes``.
"""
