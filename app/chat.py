"""One browser tab's session: a live session on its model's shared pool (streaming/hosted.py).

The engine's model thread answers questions at turn boundaries; the session hands each question's tokens to the
page event that asked it, keeps the memory series for the graph (sampled after every turn) and ends everything on
`close()`, called when the page leaves or the session idles out.
"""

from streaming.hosted import (  # noqa: F401  (the page's names for them)
    CHECKPOINTS,
    MODELS,
    BadInput,
    Settings,
    _adapters,
    add_checkpoint,
    shared_adapter,
    shared_pool,
)
from streaming.hosted import HostedSession as Chat  # noqa: F401
