"""The spec's plug-in hooks (spec/core.py ``Plugin``): declared once, composed once per config
(spec/state.py), and the spec's modules import each other at the top only, without a cycle."""

from __future__ import annotations

import ast
import inspect
import os

import pytest

from uniradix.spec import components, host, storage
from uniradix.spec.config import CacheConfig
from uniradix.spec.core import Plugin
from uniradix.spec.state import compose, new_state

SPEC = os.path.dirname(inspect.getfile(Plugin))


def spec_modules() -> dict[str, ast.Module]:
    out = {}
    for name in sorted(os.listdir(SPEC)):
        if name.endswith(".py"):
            with open(os.path.join(SPEC, name)) as f:
                out[name[:-3]] = ast.parse(f.read(), name)
    return out


def local_imports(tree: ast.Module) -> list[str]:
    """The spec modules one module imports at its top level (``from . import x``,
    ``from .x import y``)."""
    out = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:
                out.extend(a.name for a in node.names)
            else:
                out.append(node.module.split(".")[0])
    return out


def test_no_import_inside_a_function_or_a_guard():
    """Every import of a spec module sits at its top level (no guarded local imports)."""
    for name, tree in spec_modules().items():
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                pytest.fail(f"spec/{name}.py line {node.lineno}: an import below the top level")


def test_the_import_graph_has_no_cycle():
    graph = {name: set(local_imports(tree)) for name, tree in spec_modules().items()}
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 2:
            return
        if state.get(m) == 1:
            pytest.fail("import cycle: " + " -> ".join(path + [m]))
        state[m] = 1
        for dep in sorted(graph.get(m, ())):
            visit(dep, path + [m])
        state[m] = 2

    for m in graph:
        visit(m, [])


def test_only_the_standard_library():
    stdlib = {"__future__", "ast", "collections", "contextlib", "dataclasses", "functools",
              "hashlib", "heapq", "typing"}
    for name, tree in spec_modules().items():
        for node in tree.body:
            if isinstance(node, ast.Import):
                mods = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module.split(".")[0]]
            else:
                continue
            assert set(mods) <= stdlib, f"spec/{name}.py imports {mods}"


@pytest.mark.parametrize("cfg, expected", [
    ({}, []),
    ({"components": ["full", "swa"], "sliding_window": 4, "swa_slots": 32}, [components.SWA]),
    ({"components": ["full", "mamba"], "mamba_slots": 4}, [components.MAMBA]),
    ({"host_slots": 16}, [host.HOST_PLUGIN]),
    ({"host_slots": 16, "storage": True}, [host.HOST_PLUGIN, storage.STORAGE_PLUGIN]),
])
def test_compose_names_the_plugins_of_the_config_in_hook_order(cfg, expected):
    config = CacheConfig.from_dict({"kv_slots": 32, **cfg})
    assert list(compose(config)) == expected
    assert list(new_state(config).plugins) == expected


def test_every_override_keeps_the_declared_signature():
    """A plug-in's hook takes exactly the parameters spec/core.py declares for it."""
    hooks = {n: inspect.signature(f) for n, f in vars(Plugin).items()
             if callable(f) and not n.startswith("_")}
    for plugin in (components.SWA, components.MAMBA, host.HOST_PLUGIN, storage.STORAGE_PLUGIN):
        for name, declared in hooks.items():
            mine = inspect.signature(getattr(type(plugin), name))
            assert list(mine.parameters) == list(declared.parameters), (type(plugin), name)
