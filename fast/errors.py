"""Errors of the fast path.  The class names are those of ``uniradix.spec.errors`` on purpose:
traces record a rejected step by exception type name, and the fast path must reject the same
inputs with the same names (the spec is never imported here; docs/DESIGN.md, dependencies)."""


class CacheError(Exception):
    """Base class of every error the cache raises on purpose."""


class InvalidInput(CacheError, ValueError):
    """An argument has the wrong type, length or sign, or hands over slots the caller does not
    own."""


class NodeNotFound(CacheError, KeyError):
    """A node that is not (or no longer) in the tree, or a path that ends at no node."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "node not found"


class HandleError(CacheError, KeyError):
    """A lock released more often than it was taken."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "bad handle"


class Unsupported(CacheError, NotImplementedError):
    """A configuration the fast path does not support yet."""
