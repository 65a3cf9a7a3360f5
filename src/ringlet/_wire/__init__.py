"""The wire layer every Python subsystem shares.

- ``codec``: the object codec (bounded, pickle-free by default) used by RPC,
  the store's structured values and ``broadcast_object``/``all_gather_object``.
- ``sockets``: connect, authenticate and move framed bytes with deadlines,
  for the store and RPC.

The dtype registry is ``ringlet._dtypes``; the handshake is ``ringlet._auth``
(specified, with the C core's, in docs/security.md).
"""
