"""Our KV event bytes against upstream SGLang 0.5.13.post1's own event classes and publisher.

Run inside the upstream venv (scripts/upstream-venv.sh): VENV/bin/python -m pytest
tests/fast/test_kv_events_upstream.py. Everywhere else the module is skipped.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.fast.event_fold import RouterView
from uniradix.fast.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    KVEventSubscriber,
    ZmqEventPublisher,
    encode_batch,
)

pytestmark = pytest.mark.upstream

if not upstream_mod.upstream_available():
    pytest.skip("upstream sglang is not importable here (build the venv with "
                "scripts/upstream-venv.sh and run pytest with its python)",
                allow_module_level=True)

from sglang.srt.disaggregation import kv_events as up  # noqa: E402  (after the skip)

LOOP = "tcp://127.0.0.1:*"


def ours_and_theirs():
    ours = KVEventBatch(1234.5, [
        BlockStored([-(1 << 63)], None, [1, 2, 3, 4], 4, None, "GPU"),
        BlockStored([(1 << 63) - 1], -(1 << 63), [5, 6, 7, 8], 4, None, "CPU_PINNED"),
        BlockStored([42], 7, [9], 1, 3),
        BlockRemoved([42], "GPU"), BlockRemoved([7]), AllBlocksCleared()], 1)
    theirs = up.KVEventBatch(ts=1234.5, attn_dp_rank=1, events=[
        up.BlockStored(block_hashes=[-(1 << 63)], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                       block_size=4, lora_id=None, medium=up.StorageMedium.GPU),
        up.BlockStored(block_hashes=[(1 << 63) - 1], parent_block_hash=-(1 << 63),
                       token_ids=[5, 6, 7, 8], block_size=4, lora_id=None,
                       medium=up.StorageMedium.CPU),
        up.BlockStored(block_hashes=[42], parent_block_hash=7, token_ids=[9], block_size=1,
                       lora_id=3),
        up.BlockRemoved(block_hashes=[42], medium=up.StorageMedium.GPU),
        up.BlockRemoved(block_hashes=[7]), up.AllBlocksCleared()])
    return ours, theirs


def as_tuples(batch):
    return (batch.ts, batch.attn_dp_rank,
            [(type(e).__name__, msgspec.structs.astuple(e)) for e in batch.events])


def test_our_bytes_are_upstreams_bytes():
    ours, theirs = ours_and_theirs()
    assert encode_batch(ours) == msgspec.msgpack.Encoder().encode(theirs)


def test_upstream_decodes_what_our_publisher_sends():
    ours, _ = ours_and_theirs()
    decoder = msgspec.msgpack.Decoder(up.KVEventBatch)
    ctx = zmq.Context()
    try:
        cfg = KVEventsConfig(publisher="zmq", endpoint=LOOP, replay_endpoint=LOOP)
        with ZmqEventPublisher(cfg, attn_dp_rank=1, context=ctx) as pub:
            pub.publish(ours.events, ts=ours.ts)
            deadline = time.monotonic() + 5
            while pub.stats.published_batches < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            try:  # upstream's replay protocol, spoken by hand
                dealer.connect(pub.replay_endpoint)
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                assert dealer.poll(2000)
                _, seq, payload = dealer.recv_multipart()
                assert dealer.poll(2000)
                assert dealer.recv_multipart() == [b"", up.ZmqEventPublisher.END_SEQ, b""]
            finally:
                dealer.close(linger=0)
    finally:
        ctx.term()
    theirs = decoder.decode(payload)
    assert int.from_bytes(seq, "big") == 0
    assert as_tuples(theirs) == as_tuples(ours)


def test_our_subscriber_reads_upstreams_publisher_and_its_replay():
    _, theirs = ours_and_theirs()
    pub = up.ZmqEventPublisher(attn_dp_rank=0, endpoint=LOOP, replay_endpoint=LOOP,
                               buffer_steps=100, topic="kv")
    try:
        endpoint = pub._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = pub._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        with KVEventSubscriber(endpoint, topic="kv", replay_endpoint=replay) as sub:
            got = None
            deadline = time.monotonic() + 5
            while got is None and time.monotonic() < deadline:
                pub.publish(up.KVEventBatch(ts=1.0, events=[up.AllBlocksCleared()]))
                got = sub.recv(0.05)
            assert got is not None
            pub.publish(theirs)
            live = sub.recv(2.0)
            while live is not None and live[1].ts != theirs.ts:  # probes still in flight
                live = sub.recv(2.0)
            assert live is not None
            replayed = sub.replay(0)
    finally:
        pub.shutdown()
    assert as_tuples(live[1]) == as_tuples(ours_and_theirs()[0])
    assert [s for s, _ in replayed] == list(range(live[0] + 1))
    view = RouterView()
    for seq, batch in replayed:
        view.apply_batch(seq, batch.events)
    assert view.snapshot() == {}  # the batch ends with AllBlocksCleared


def test_the_fold_reads_upstreams_event_objects():
    _, theirs = ours_and_theirs()
    view = RouterView()
    for e in theirs.events[:3]:
        view.apply(e)
    assert view.snapshot() == {"GPU": {-(1 << 63), 42}, "CPU_PINNED": {(1 << 63) - 1}}
