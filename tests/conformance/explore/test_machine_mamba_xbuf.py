"""The Mamba extra buffer (issue 18 item 3) in the Hypothesis lockstep machine: request-level
ops on Full + Mamba configs with track slots, spec against fast (the state a chunk or a decode
step tracks, the cut of a finished request at its last track point)."""

import random

import pytest

from machine_runs import run_machine
from uniradix.conformance.explore.machine import RandomChooser, draw_mamba_xbuf_config

# the long run is long enough to find a tracked state cached a page short, planted in fast
# (about 5 minutes on a loaded 2-core machine: behind the slow marker)


def test_drawn_configs_are_valid_and_cover_page_sizes_track_slots_and_lazy():
    seen = set()
    for seed in range(40):
        cfg = draw_mamba_xbuf_config(RandomChooser(random.Random(seed)))
        cfg.validate()
        assert cfg.mamba_extra_buffer and cfg.components == ("full", "mamba")
        assert cfg.mamba_cache_chunk_size % cfg.page_size == 0
        assert cfg.mamba_track_interval % cfg.page_size == 0
        seen.add((cfg.page_size, cfg.mamba_track_slots, cfg.mamba_extra_buffer_lazy))
    # the lazy variant too, always with two track slots (spec/config.py refuses one)
    assert seen == {(1, 1, False), (1, 2, False), (4, 1, False), (4, 2, False),
                    (1, 2, True), (4, 2, True)}


def test_hypothesis_machine_runs_requests_with_the_mamba_extra_buffer():
    run_machine(draw_mamba_xbuf_config, "MambaXbufMachine", examples=10, steps=100)


@pytest.mark.slow
def test_hypothesis_machine_long_run_with_the_mamba_extra_buffer():
    run_machine(draw_mamba_xbuf_config, "MambaXbufMachine", examples=60, steps=200)
