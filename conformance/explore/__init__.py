"""Exploration: run implementations side by side and look for the first difference.

``lockstep``: the runner comparing every step, and shrinking; ``machine``: the scenario
generator and the Hypothesis state machine; ``exhaustive`` / ``exhaustive_storage``:
bounded exhaustive exploration (``uniradix check``); ``conform``: long randomized runs
(``uniradix conform``) and ``uniradix record``; ``driver`` / ``storage_driver``: the
scheduler-like drivers that record traces (the golden corpora)."""
