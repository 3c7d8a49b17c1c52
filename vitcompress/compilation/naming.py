"""What the rewrite names in a rewritten graph module, and the error it raises: shared by the
rewriter and its windowed part, and read by the layers that find the reducers again (the
training losses, the search's warm-up, visualize)."""

from __future__ import annotations

from vitcompress.errors import UserError

REDUCER_PREFIX = "tps"  # the submodule holding the reducers, one per location: tps.0, tps.1, ...
HOOK_PREFIX = "tps_hooks"  # the attention hooks, restores and window modules


class RewriteError(UserError):
    """The plan cannot be carried out on this graph."""


class RewrittenModelError(RewriteError):
    """The rewritten graph fails on one example image: refused in one line, though the cause may
    be the rewrite's as much as the model's (the compatibility matrix counts it as an error)."""
