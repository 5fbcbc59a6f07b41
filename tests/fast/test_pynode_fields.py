"""The C core reads the composed tree's nodes, records and LRU ends (fast/node.py Node,
fast/components AuxData, fast/structures.py's sentinels) through their slots' offsets
(fast/_core.c "Python-node fields").  These tests check that every field the C paths use reads
exactly what Python's attribute access reads, that an unset field raises as Python does, and
that an object of any other class is refused rather than read at a wrong offset."""

from __future__ import annotations

import pytest

from uniradix.fast import one_aux  # noqa: F401  (registers the classes with the C core)
from uniradix.fast.cache import _core
from uniradix.fast.components import AuxData
from uniradix.fast.node import Node
from uniradix.fast.structures import LruList

pytestmark = pytest.mark.skipif(_core is None, reason="the C core is not in use")

NODE_FIELDS = ("children", "parent", "key", "value", "lock_ref", "last_access_time",
               "hit_count", "extra_key", "dev_children", "id", "ck", "host_value",
               "host_lock_ref", "aux", "aux_lock", "created", "priority")
AUX_FIELDS = ("node", "value", "lock", "boundary", "lru_prev", "lru_next", "host_value",
              "host_lock", "host_boundary", "former_parent", "split_from")


def _node() -> Node:
    parent = Node(None, None, None, None, 1)
    n = Node("k", "v", parent, "ek", 7, ck="ck")
    for i, name in enumerate(NODE_FIELDS):
        if name not in ("parent",):
            setattr(n, name, (name, i))  # a distinct object per field
    return n


def test_every_node_field_reads_what_python_reads() -> None:
    n = _node()
    for name in NODE_FIELDS:
        assert _core.pynode_get(n, name) is getattr(n, name), name


def test_every_record_and_sentinel_field_reads_what_python_reads() -> None:
    rec = AuxData(_node())
    for i, name in enumerate(AUX_FIELDS):
        setattr(rec, name, (name, i))
    for name in AUX_FIELDS:
        assert _core.pynode_get(rec, name) is getattr(rec, name), name
    lru = LruList()
    assert _core.pynode_get(lru.head, "lru_next") is lru.tail
    assert _core.pynode_get(lru.tail, "lru_prev") is lru.head


def test_an_unset_field_raises_attribute_error() -> None:
    n = _node()
    del n.value
    with pytest.raises(AttributeError, match="value"):
        _core.pynode_get(n, "value")


def test_other_classes_are_refused() -> None:
    class Look:
        __slots__ = NODE_FIELDS

    with pytest.raises(TypeError, match="not a registered class"):
        _core.pynode_get(Look(), "value")
    with pytest.raises(TypeError, match="not a field the C paths use"):
        _core.pynode_get(_node(), "no_such_field")


def test_setup_refuses_a_class_without_those_slots() -> None:
    class Plain:
        pass

    with pytest.raises(TypeError, match="not a __slots__ field"):
        _core.setup_pynode(Plain, AuxData, type(LruList().head))
    _core.setup_pynode(Node, AuxData, type(LruList().head))  # (the registration stays valid)
