"""Traces: the trace files (docs/TRACE.md) and their replay on an implementation.

``trace``: reading and writing JSON Lines traces; ``replay``: ``uniradix replay``, every
recorded ``ret`` field checked; ``events``: the KV events an implementation emits, and a
router's fold of them checked against the cached pages."""
