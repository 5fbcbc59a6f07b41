"""uniradix.conformance: the harness that checks the spec, the fast path and upstream SGLang
against each other, and the ``uniradix`` CLI (``cli``, ``run``).

Sub-packages by family (docs/ARCHITECTURE.md): ``adapters`` (one per implementation),
``env`` (environment models), ``explore`` (lockstep, machine, exhaustive, conform, record),
``traces`` (trace files and replay), ``bench`` (the benchmark loop, results, dashboard)."""
