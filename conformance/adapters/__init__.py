"""Adapters: one per implementation (the spec, ``uniradix.fast``, upstream SGLang), each taking
one trace step and returning one observation (docs/DESIGN.md, ``CacheUnderTest``).

``base`` holds the shared step dispatch, the op tables, the spec's adapter and
``make_adapter``; ``host_ops`` / ``storage_ops`` the spec's host and storage ops;
``fast_adapter`` / ``fast_hybrid`` the fast path; ``upstream*`` upstream's caches with the
controller models they need; ``spec_api`` the spec behind upstream's tree-level API."""
