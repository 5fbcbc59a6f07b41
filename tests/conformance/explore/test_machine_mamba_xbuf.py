"""The Mamba extra buffer (issue 18 item 3) in the Hypothesis lockstep machine: request-level
ops on Full + Mamba configs with track slots, spec against fast (the state a chunk or a decode
step tracks, the cut of a finished request at its last track point)."""

import random

import pytest

from uniradix.conformance.explore.machine import (
    ACTIONS,
    RandomChooser,
    draw_mamba_xbuf_config,
    make_machine,
)

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

SETTINGS = settings(max_examples=10, stateful_step_count=100, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
# long enough to find a tracked state cached a page short, planted in fast (about 5 minutes
# on a loaded 2-core machine: behind the slow marker)
LONG = settings(SETTINGS, max_examples=60, stateful_step_count=200)


def test_drawn_configs_are_valid_and_cover_both_page_sizes_and_track_slots():
    seen = set()
    for seed in range(40):
        cfg = draw_mamba_xbuf_config(RandomChooser(random.Random(seed)))
        cfg.validate()
        assert cfg.mamba_extra_buffer and cfg.components == ("full", "mamba")
        assert cfg.mamba_cache_chunk_size % cfg.page_size == 0
        assert cfg.mamba_track_interval % cfg.page_size == 0
        seen.add((cfg.page_size, cfg.mamba_track_slots))
    assert seen == {(1, 1), (1, 2), (4, 1), (4, 2)}


def machine() -> type:
    return make_machine(["spec", "fast"], draw=draw_mamba_xbuf_config, actions=ACTIONS,
                        name="MambaXbufMachine")


def test_hypothesis_machine_runs_requests_with_the_mamba_extra_buffer():
    run_state_machine_as_test(machine(), settings=SETTINGS)


@pytest.mark.slow
def test_hypothesis_machine_long_run_with_the_mamba_extra_buffer():
    run_state_machine_as_test(machine(), settings=LONG)
