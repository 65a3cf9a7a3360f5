"""ringlet as a ``torch.distributed`` backend: ``import ringlet.torch`` registers ``"ringlet"``.

Example::

    import torch.distributed as dist
    import ringlet.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("ringlet")      # was: "gloo"
    model = torch.nn.parallel.DistributedDataParallel(model)

CPU tensors only.  The default group joins (or starts) ringlet's world; every
other group is formed by its members alone through torch's store.  See
docs/torch.md for what is supported.
"""

from __future__ import annotations

import torch.distributed as _dist

from ._launch import export_env as _export_env
from ._process_group import RingletProcessGroup, create_process_group

__all__ = ["RingletProcessGroup", "BACKEND"]

BACKEND = "ringlet"


def _register() -> None:
    if BACKEND.upper() in getattr(_dist.Backend, "_plugins", {}):
        return  # imported twice (e.g. under another module name)
    # devices as a list: a bare string would be read letter by letter.
    _dist.Backend.register_backend(BACKEND, create_process_group, extended_api=True,
                                   devices=["cpu"])


_register()
# Under `ringlet run`: supply torch's env:// variables (RANK, MASTER_PORT, ...).
_export_env()
