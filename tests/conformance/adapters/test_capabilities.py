"""The adapters' declared capabilities (conformance/adapters/capabilities.py) say exactly what
each implementation runs: over a grid of configs, ``make_adapter`` builds an adapter iff the
declaration misses nothing, and a step is refused ``Unsupported`` iff the declaration has a
gap for it (for the adapters that dispatch through ``StepAdapter``).  Upstream's declaration
is checked against its adapters where sglang imports."""

from __future__ import annotations

import itertools

import pytest

from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.adapters.capabilities import CAPABILITIES, Capabilities, capabilities
from uniradix.spec.config import COMPONENT_SETS, CacheConfig
from uniradix.spec.errors import ConfigError, Unsupported

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def configs(small: bool = False) -> list[CacheConfig]:
    """Valid configs over components x host tier x write policy x storage x eviction policy x
    EAGLE x disabled x page size (``small``: EAGLE and disabled off, page size 1)."""
    out = []
    flags = ((False,),) * 2 if small else ((False, True),) * 2
    for comps, host, wp, storage, policy, eagle, disable, ps in itertools.product(
            COMPONENT_SETS, (0, 16), WRITE_POLICIES, (False, True), ("lru", "lfu"), *flags,
            (1,) if small else (1, 2)):
        if not host and wp != "write_through":
            continue
        kw = dict(components=comps, kv_slots=16, host_slots=host, write_policy=wp,
                  storage=storage, eviction_policy=policy, eagle=eagle, disable=disable,
                  page_size=ps)
        if "swa" in comps:
            kw.update(swa_slots=16, sliding_window=4)
        if "mamba" in comps:
            kw.update(mamba_slots=4)
        config = CacheConfig(**kw)
        try:
            config.validate()
        except ConfigError:
            continue
        out.append(config)
    return out


STEPS = [("req_arrive", {"rid": "r", "tokens": [1, 2]}),
         ("req_arrive", {"rid": "r", "tokens": [1, 2], "session": "s"}),
         ("release_session", {"session": "s"}),
         ("session_held", {}),
         ("req_admit", {"rid": "nope"}),
         ("match_prefix", {"tokens": [1], "cow_mamba": True}),
         ("match_prefix", {"tokens": [1]})]


def impls() -> list[str]:
    out = ["spec", "fast"]
    if upstream_mod.upstream_available():
        out += ["upstream", "upstream-requests"]
    return out


@pytest.mark.parametrize("impl", impls())
def test_declaration_says_which_configs_the_adapter_builds(impl):
    cap = CAPABILITIES[impl]
    wrong = []
    for config in configs():
        try:
            make_adapter(impl, config)
            built, why = True, ""
        except Unsupported as e:
            built, why = False, str(e)
        if built == bool(cap.missing(config)):
            wrong.append((config.to_dict(), why, cap.missing(config)))
    assert not wrong, wrong[:5]


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_declaration_says_which_steps_the_adapter_refuses(impl):
    cap = CAPABILITIES[impl]
    wrong = []
    for config in configs(small=True):
        if cap.missing(config):
            continue
        for op, args in STEPS:
            obs = make_adapter(impl, config).apply({"i": 0, "op": op, "args": args})
            refused = obs.get("error") == "Unsupported"
            gap = cap.step_gap(config, op, args)
            if refused != (gap is not None):
                wrong.append((config.to_dict(), op, args, obs, gap))
    assert not wrong, wrong[:5]


def test_upstream_declares_the_tree_level_api_only():
    """Upstream's adapter has its own dispatch (request ops are UnknownOp there); its
    declaration says what the lockstep runner reads from ``tree_only``."""
    assert upstream_mod.UpstreamAdapter.tree_only
    cap = CAPABILITIES["upstream"]
    assert not cap.request_ops and not cap.request_ops_with_aux and not cap.sessions


def test_refusal_names_everything_missing_and_comes_from_make_adapter():
    config = CacheConfig(components=("full", "mamba"), kv_slots=16, mamba_slots=4, page_size=2,
                         eviction_policy="lfu", eagle=True)
    CAPABILITIES["fast"].check(config)  # fast models all of it now (EAGLE with aux included)
    with pytest.raises(Unsupported) as e:
        make_adapter("upstream", config)  # refused before sglang is imported
    assert str(e.value) == "upstream does not model EAGLE keys with SWA or Mamba, Mamba with page_size 2"
    assert CAPABILITIES["upstream"].missing(config) == ["EAGLE keys with SWA or Mamba",
                                                        "Mamba with page_size 2"]
    CAPABILITIES["spec"].check(config)  # the spec models all of it


def test_step_refusal_names_the_gap():
    """fast drives the request path with SWA (conformance/adapters/fast_hybrid.py); a
    declaration without it refuses the step by name."""
    import dataclasses
    config = CacheConfig(components=("full", "swa"), kv_slots=16, swa_slots=16, sliding_window=4)
    step = {"i": 0, "op": "req_arrive", "args": {"rid": "r", "tokens": [1]}}
    assert make_adapter("fast", config).apply(step) == {}
    narrow = dataclasses.replace(CAPABILITIES["fast"], request_ops_with_aux=False)
    with pytest.raises(Unsupported) as e:
        narrow.check_step(config, "req_arrive", step["args"])
    assert str(e.value) == ("fast does not model op 'req_arrive': the request path with SWA "
                            "or Mamba")


def test_a_new_declaration_is_plain_data():
    cap = Capabilities(name="toy")
    assert cap.summary()["components"] == [["full"]] and cap.summary()["host_tier"] is False
    assert cap.missing(CacheConfig(host_slots=8, kv_slots=8)) == ["a host tier (host_slots > 0)"]
    assert capabilities("spec") is CAPABILITIES["spec"]
    with pytest.raises(Unsupported, match="unknown implementation 'nope'"):
        capabilities("nope")
