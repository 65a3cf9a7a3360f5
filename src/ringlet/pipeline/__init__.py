"""``ringlet.pipeline``: old import path of ``ringlet.parallel.pipeline``, kept working.

The submodules (``ringlet.pipeline.runtime``, ``.schedules``, ...) are the
very modules of ``ringlet.parallel.pipeline``, registered under the old names
too, so ``import ringlet.pipeline.runtime`` and ``from ringlet.pipeline import
runtime`` give the same module object as the new path.
"""

import sys as _sys

from ..parallel import pipeline as _new
from ..parallel.pipeline import *  # noqa: F401,F403 - the same objects, old path
from ..parallel.pipeline import layout, runtime, schedules, split, stage

for _m in (layout, runtime, schedules, split, stage):
    _sys.modules[f"{__name__}.{_m.__name__.rsplit('.', 1)[1]}"] = _m

__all__ = list(_new.__all__)
