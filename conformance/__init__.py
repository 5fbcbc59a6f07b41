"""uniradix.conformance: traces, adapters, replay and recording, and the ``uniradix`` CLI."""
