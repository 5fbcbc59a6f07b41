"""What publishing KV events costs the cache's thread (docs/EVENTS.md quotes the figures).

Skipped by default (``--benchmark-skip``); run with
``.venv/bin/python -m pytest tests/bench/test_bench_kv_events.py --benchmark-enable --benchmark-only``.

One call = one scheduler step's batch handed to ``publish``: encoded in the caller's thread and
put on the sender's queue (the sender thread runs meanwhile, as it would in a server, and its
share of the interpreter lock is part of what the caller sees). A subscriber is connected over
loopback and reads everything. Steps are upstream-shaped: one ``BlockStored`` per page.
"""

from __future__ import annotations

import threading

import pytest
import zmq

from uniradix.fast.event_fold import RouterView
from uniradix.fast.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    KVEventSubscriber,
    NullEventPublisher,
    ZmqEventPublisher,
    encode_batch,
)

PAGE = 16


def step(stores: int, removes: int, base: int = 0) -> list:
    evs: list = []
    parent = None
    for i in range(stores):
        h = base + i
        evs.append(BlockStored([h], parent, list(range(h, h + PAGE)), PAGE, None, "GPU"))
        parent = h
    evs.extend(BlockRemoved([base - 1 - i], "GPU") for i in range(removes))
    return evs


STEPS = {"small-4+2": step(4, 2), "large-64+16": step(64, 16)}


@pytest.mark.parametrize("shape", list(STEPS))
def test_bench_null_publish(benchmark, shape):
    pub = NullEventPublisher()
    evs = STEPS[shape]
    benchmark(pub.publish, evs)


@pytest.mark.parametrize("encoding", ["array", "map"])
@pytest.mark.parametrize("shape", list(STEPS))
def test_bench_encode(benchmark, shape, encoding):
    batch = KVEventBatch(1.0, STEPS[shape], 0)
    benchmark(encode_batch, batch, encoding)


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "no-validate"])
@pytest.mark.parametrize("encoding", ["array", "map"])
@pytest.mark.parametrize("shape", list(STEPS))
def test_bench_zmq_publish(benchmark, shape, encoding, validate):
    ctx = zmq.Context()
    cfg = KVEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:*", encoding=encoding,
                         max_queue_size=1_000_000, buffer_steps=10_000)
    pub = ZmqEventPublisher(cfg, context=ctx, validate=validate)
    sub = KVEventSubscriber(pub.endpoint, context=ctx, encoding=encoding)
    stop = threading.Event()
    received = [0]

    def drain():  # a subscriber that keeps up, in its own thread
        s = sub._sub
        while not stop.is_set():
            if s.poll(50):
                s.recv_multipart()
                received[0] += 1

    reader = threading.Thread(target=drain)
    reader.start()
    evs = STEPS[shape]
    try:
        benchmark(pub.publish, evs)
    finally:
        pub.close(timeout_s=30)
        stop.set()
        reader.join()
        sub.close()
        ctx.term()
    assert pub.stats.dropped_batches == 0
    benchmark.extra_info["published_batches"] = pub.stats.published_batches
    benchmark.extra_info["received_batches"] = received[0]


@pytest.mark.parametrize("shape", list(STEPS))
def test_bench_router_fold(benchmark, shape):
    stores = [e for e in STEPS[shape] if isinstance(e, BlockStored)]
    # the same pages stored then removed: every call leaves the view as it found it
    evs = stores + [BlockRemoved(e.block_hashes, "GPU") for e in stores]
    view = RouterView()
    benchmark(view.apply_batch, None, evs)
    assert view.anomalies == [] and len(view) == 0
