"""Benchmarks: one scheduler loop timing the cache calls of every implementation.

``loop``: ``uniradix bench`` and its loop; ``host`` / ``hybrid``: the steps a host tier or a
hybrid model adds; ``results``: versioned bench records and their history;
``dashboard``: the static page and the regression check (``uniradix dashboard``)."""
