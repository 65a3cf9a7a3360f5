"""The RPC wire format; the codec itself lives in ``ringlet._wire.codec``.

Kept so that ``ringlet.rpc.serialization`` imports keep working; RPC,
the store and ``broadcast_object`` share the one codec.
"""

from ringlet._wire.codec import *  # noqa: F401,F403
from ringlet._wire.codec import DEFAULT_LIMITS, __all__  # noqa: F401
