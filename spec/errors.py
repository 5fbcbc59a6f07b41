"""The typed errors of the cache and of its environment models.

Every rejected operation raises one of these *before* it changes any state, so a caller (or a
trace replay) can rely on "error => nothing happened". Trace files record a rejected step as
``{"error": "<class name>"}``; the class names below are therefore part of the trace contract.
"""


class CacheError(Exception):
    """Base class of every error the cache raises on purpose."""


class InvalidInput(CacheError, ValueError):
    """An argument has the wrong type, length or sign (tokens not ints, a value whose length
    differs from the key, a negative count, a malformed path, ...)."""


class ConfigError(CacheError, ValueError):
    """A configuration is malformed: an unknown key, a bad value, an unsupported combination."""


class UnknownOp(CacheError, ValueError):
    """A trace step names an operation this implementation does not know."""


class Unsupported(CacheError, NotImplementedError):
    """A known operation or configuration that this implementation does not support yet."""


class NodeNotFound(CacheError, KeyError):
    """A path names no node of the tree (locking a path that is not a node)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "node not found"


class HandleError(CacheError, KeyError):
    """A lock handle was never issued, or was already released."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "bad handle"


class AllocatorError(CacheError, RuntimeError):
    """The environment's pool was misused: freeing a slot that is not allocated, freeing it
    twice, freeing part of a page, or asking for more than is free."""
