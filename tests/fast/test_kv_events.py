"""uniradix.fast.kv_events: the wire format routers read, and a real publisher/subscriber pair over
loopback (127.0.0.1, ephemeral ports; every socket and thread is closed by the test)."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from uniradix.fast.errors import InvalidInput
from uniradix.fast.event_fold import RouterView
from uniradix.fast.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    KVEventSubscriber,
    NullEventPublisher,
    ZmqEventPublisher,
    create_publisher,
    decode_batch,
    encode_batch,
    offset_endpoint,
)

LOOP = "tcp://127.0.0.1:*"


def stored(h, parent=None, tokens=(1, 2), medium="GPU"):
    return BlockStored([h], parent, list(tokens), len(tokens), None, medium)


def zmq_config(**kw) -> KVEventsConfig:
    kw.setdefault("endpoint", LOOP)
    return KVEventsConfig(publisher="zmq", **kw)


def wait_live(pub, sub, timeout_s=5.0) -> int:
    """Publish harmless probe batches until the subscriber gets one (a SUB socket only receives
    once its subscription reached the PUB socket); returns the probe's sequence number."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()])
        got = sub.recv(0.02)
        if got is not None:
            while (more := sub.recv(0.05)) is not None:  # drain probes still in flight
                got = more
            return got[0]
    raise AssertionError("subscriber never received a batch")


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()  # blocks if a test left a socket open: the test then hangs instead of passing


# --- encoding ------------------------------------------------------------------------------------

def test_array_encoding_is_0_5_13_layout():
    batch = KVEventBatch(1.5, [stored(7, None, (1, 2)), stored(-8, 7, (3, 4)),
                               BlockRemoved([7], "CPU_PINNED"), BlockRemoved([9]),
                               AllBlocksCleared()], 3)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [1.5, [["BlockStored", [7], None, [1, 2], 2, None, "GPU"],
                         ["BlockStored", [-8], 7, [3, 4], 2, None, "GPU"],
                         ["BlockRemoved", [7], "CPU_PINNED"],
                         ["BlockRemoved", [9], None],
                         ["AllBlocksCleared"]], 3]
    assert decode_batch(encode_batch(batch)) == batch


def test_map_encoding_tags_events_and_leaves_out_a_missing_medium():
    batch = KVEventBatch(2.0, [stored(7), BlockRemoved([9]), AllBlocksCleared()], 0)
    raw = msgspec.msgpack.decode(encode_batch(batch, "map"))
    assert raw == [2.0, [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                          "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU"},
                         {"type": "BlockRemoved", "block_hashes": [9]},
                         {"type": "AllBlocksCleared"}], 0]
    assert decode_batch(encode_batch(batch, "map"), "map") == batch


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_eagle_bigram_pages_round_trip_and_nothing_else_does(encoding):
    """An EAGLE page's token_ids are its (token, next token) pairs, as 0.5.13.post1 sends them
    ([[a, b], ...], block_size counting pairs); a mix of ids and pairs, or a pair of three, is
    refused."""
    eagle = BlockStored([5], None, [(1, 2), (2, 3)], 2, None, "GPU")
    batch = KVEventBatch(1.0, [eagle, stored(6, 5, (3, 4))], 0)
    payload = encode_batch(batch, encoding)
    raw = msgspec.msgpack.decode(payload)[1][0]
    assert (raw[3] if encoding == "array" else raw["token_ids"]) == [[1, 2], [2, 3]]
    assert decode_batch(payload, encoding) == batch
    for bad in ([[1, 2], 3], [3, [1, 2]], [[1, 2, 3]], [[1]]):
        ev = (["BlockStored", [5], None, bad, 2, None, "GPU"] if encoding == "array" else
              {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
               "token_ids": bad, "block_size": 2, "lora_id": None})
        with pytest.raises(InvalidInput, match=r"events\[0\]|\$\[1\]\[0\]"):
            decode_batch(msgspec.msgpack.encode([1.0, [ev], 0]), encoding)
    if encoding == "array":  # a token past int64 takes the slow check: still refused
        big = ["BlockStored", [7], None, [1 << 63, 1], 2, None, "GPU"]
        assert decode_batch(msgspec.msgpack.encode([1.0, [raw, big], 0])).events[1].token_ids[0] == 1 << 63
        big[3] = [1 << 63, [1, 2]]
        with pytest.raises(InvalidInput, match=r"events\[1\]"):
            decode_batch(msgspec.msgpack.encode([1.0, [raw, big], 0]))


@pytest.mark.parametrize("payload", [
    msgspec.msgpack.encode([1.0, [["BlockRemoved", [1 << 63]]], 0]),        # hash past int64
    msgspec.msgpack.encode([1.0, [["BlockRemoved", ["x"]]], 0]),            # hash not an int
    msgspec.msgpack.encode([1.0, [["BlockMoved", [1]]], 0]),                # unknown event
    msgspec.msgpack.encode({"ts": 1.0}),                                     # not an array
    b"\xc1",                                                                 # not msgpack
])
def test_decode_refuses_malformed_batches(payload):
    with pytest.raises(InvalidInput):
        decode_batch(payload)


def test_encoding_is_checked_by_name():
    with pytest.raises(InvalidInput, match="encoding"):
        encode_batch(KVEventBatch(0.0, []), "json")  # type: ignore[arg-type]


# --- configuration -------------------------------------------------------------------------------

def test_config_json_round_trip_and_defaults_match_upstream():
    c = KVEventsConfig.from_json('{"publisher": "zmq", "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert (c.publisher, c.endpoint, c.topic) == ("zmq", "tcp://*:6000", "kv")
    assert (c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size) == (None, 10_000, 100_000,
                                                                            100_000)
    assert KVEventsConfig.from_json(c.to_json()) == c


@pytest.mark.parametrize("text, needle", [
    ('{"publisher": "zmq", "replay_endpint": "tcp://*:1"}', "replay_endpint"),
    ('{"publisher": "kafka"}', "publisher"),
    ('{"publisher": "zmq", "endpoint": "udp://x:1"}', "endpoint"),
    ('{"publisher": "zmq", "replay_endpoint": 5}', "replay_endpoint"),
    ('{"publisher": "zmq", "buffer_steps": -1}', "buffer_steps"),
    ('{"publisher": "zmq", "hwm": 1.5}', "hwm"),
    ('{"publisher": "zmq", "max_queue_size": 0}', "max_queue_size"),
    ('{"publisher": "zmq", "max_queue_size": true}', "max_queue_size"),
    ('{"publisher": "zmq", "topic": 3}', "topic"),
    ('{"publisher": "zmq", "encoding": "json"}', "encoding"),
    ('{"publisher": "zmq", "bind": "yes"}', "bind"),
    ('["zmq"]', "JSON object"),
    ('{"publisher": ', "not valid JSON"),
])
def test_config_refuses_bad_settings_by_name(text, needle):
    with pytest.raises(InvalidInput, match=needle):
        KVEventsConfig.from_json(text)


def test_null_config_gives_a_publisher_that_sends_nothing():
    for cfg in (None, "", '{"publisher": "null"}'):
        p = create_publisher(cfg)
        assert isinstance(p, NullEventPublisher)
        assert p.publish([stored(1)]) is True
        p.close()


def test_offset_endpoint_per_dp_rank():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://127.0.0.1:*", 2) == "tcp://127.0.0.1:*"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint("ipc://kv-events", 2) == "ipc://kv-events_dp2"


# --- live publisher and subscriber ---------------------------------------------------------------

def test_live_stream_decodes_with_contiguous_sequence_numbers(ctx):
    with ZmqEventPublisher(zmq_config(topic="kv"), attn_dp_rank=0, context=ctx) as pub, \
            KVEventSubscriber(pub.endpoint, topic="kv", context=ctx) as sub:
        first = wait_live(pub, sub)
        sent = [[stored(1000 + i, tokens=(i, i + 1)), BlockRemoved([i])] for i in range(200)]
        for evs in sent:
            assert pub.publish(evs) is True
        got = []
        while len(got) < len(sent):
            item = sub.recv(2.0)
            assert item is not None, f"only {len(got)} of {len(sent)} batches arrived"
            got.append(item)
    assert [s for s, _ in got] == list(range(first + 1, first + 1 + len(sent)))
    assert [b.events for _, b in got] == sent
    assert all(b.attn_dp_rank == 0 and b.ts > 0 for _, b in got)
    assert not pub._thread.is_alive()


def test_topic_filters_subscribers(ctx):
    with ZmqEventPublisher(zmq_config(topic="kv-a"), context=ctx) as pub, \
            KVEventSubscriber(pub.endpoint, topic="kv-a", context=ctx) as mine, \
            KVEventSubscriber(pub.endpoint, topic="kv-b", context=ctx) as other:
        wait_live(pub, mine)
        pub.publish([stored(1)])
        assert mine.recv(2.0) is not None
        assert other.recv(0.2) is None


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_late_subscriber_replays_what_it_missed_and_folds_to_the_same_view(ctx, encoding):
    cfg = zmq_config(replay_endpoint=LOOP, encoding=encoding)
    with ZmqEventPublisher(cfg, context=ctx) as pub:
        early = [[stored(h, h - 1 if h > 1 else None)] for h in range(1, 51)]
        for evs in early:
            pub.publish(evs)
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint,
                               encoding=encoding, context=ctx) as sub:
            first_live = wait_live(pub, sub)
            assert first_live > len(early) - 1  # the early batches were missed
            pub.publish([stored(99)])
            live = sub.recv(2.0)
            assert live is not None and live[0] == first_live + 1
            missed = sub.replay(0)
            # The replay covers 0..now, overlapping what arrived live.
            assert [s for s, _ in missed] == list(range(0, first_live + 2))
            assert [b.events for _, b in missed[:len(early)]] == early
            view = RouterView(strict=True)
            for seq, batch in missed + [live]:
                view.apply_batch(seq, batch.events)
    # The probes cleared the view; only the last store followed them.
    assert view.cached("GPU") == {99}
    assert view.next_seq == first_live + 2


def test_replay_from_before_the_buffer_starts_at_the_oldest_kept_batch(ctx):
    cfg = zmq_config(replay_endpoint=LOOP, buffer_steps=5)
    with ZmqEventPublisher(cfg, context=ctx) as pub:
        for h in range(20):
            pub.publish([stored(h)])
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint,
                               context=ctx) as sub:
            deadline = time.monotonic() + 5
            while pub.stats.published_batches < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            got = sub.replay(3)
            assert [s for s, _ in got] == [15, 16, 17, 18, 19]  # 3..14 are gone: the gap shows it
            assert sub.replay(18) and [s for s, _ in sub.replay(18)] == [18, 19]
            assert sub.replay(100) == []


def test_replay_ignores_a_malformed_request_and_serves_the_next(ctx):
    with ZmqEventPublisher(zmq_config(replay_endpoint=LOOP), context=ctx) as pub:
        pub.publish([stored(1)])
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", b"\x00\x01"])  # seq is not 8 bytes
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            assert dealer.poll(2000)
            frames = dealer.recv_multipart()
            assert frames[0] == b"" and frames[1] == (0).to_bytes(8, "big")
            assert decode_batch(frames[2]).events == [stored(1)]
            assert dealer.poll(2000)
            assert dealer.recv_multipart() == [b"", END_SEQ, b""]
        finally:
            dealer.close(linger=0)
        assert pub.stats.bad_replay_requests == 1 and pub.stats.replay_requests == 1


def test_map_encoding_replay_replies_carry_the_topic_frame(ctx):
    cfg = zmq_config(replay_endpoint=LOOP, encoding="map", topic="t")
    with ZmqEventPublisher(cfg, context=ctx) as pub:
        pub.publish([stored(1)])
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            assert dealer.poll(2000)
            frames = dealer.recv_multipart()
            assert frames[:3] == [b"", b"t", (0).to_bytes(8, "big")]
            assert decode_batch(frames[3], "map").events == [stored(1)]
            assert dealer.poll(2000)
            assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
        finally:
            dealer.close(linger=0)


def test_a_subscriber_that_never_reads_never_blocks_publish(ctx):
    cfg = zmq_config(hwm=10)
    n = 5_000
    with ZmqEventPublisher(cfg, context=ctx) as pub, \
            KVEventSubscriber(pub.endpoint, context=ctx, rcvhwm=10) as sub:
        wait_live(pub, sub)
        before = pub.stats.published_batches
        t0 = time.perf_counter()
        results = [pub.publish([stored(i, tokens=range(16))]) for i in range(n)]
        took = time.perf_counter() - t0
        assert all(results)
        deadline = time.monotonic() + 10
        while pub.stats.published_batches < before + n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.stats.published_batches == before + n  # the sender went on past the HWM
    assert took < 5.0, f"{n} publishes took {took:.2f}s"


class _StalledPublisher(ZmqEventPublisher):
    """A publisher whose sender thread waits for ``gate``: a queue nobody drains."""

    def __init__(self, *a, **kw):
        self.gate = threading.Event()
        super().__init__(*a, **kw)

    def _run(self):
        self.gate.wait()
        super()._run()


def test_a_full_queue_drops_the_batch_and_the_next_one_starts_with_a_clear(ctx):
    cfg = zmq_config(replay_endpoint=LOOP, max_queue_size=2)
    pub = _StalledPublisher(cfg, context=ctx)
    try:
        t0 = time.perf_counter()
        assert pub.publish([stored(1)]) is True
        assert pub.publish([stored(2)]) is True
        assert pub.publish([stored(3), stored(4)]) is False  # full: dropped, not waited for
        assert pub.publish([stored(5)]) is False
        assert time.perf_counter() - t0 < 1.0
        assert (pub.stats.dropped_batches, pub.stats.dropped_events) == (2, 3)
        pub.gate.set()
        deadline = time.monotonic() + 5
        while pub.stats.published_batches < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.publish([stored(6)]) is True
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint,
                               context=ctx) as sub:
            deadline = time.monotonic() + 5
            while pub.stats.published_batches < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            got = sub.replay(0)
        assert [s for s, _ in got] == [0, 1, 2]  # sequence numbers stay contiguous
        assert got[2][1].events == [AllBlocksCleared(), stored(6)]
        assert pub.stats.resets == 1
        view = RouterView()
        for s, b in got:
            view.apply_batch(s, b.events)
        assert view.cached("GPU") == {6}  # a subset of what the cache holds, never more
    finally:
        pub.gate.set()
        pub.close()


def test_bad_events_are_refused_and_nothing_is_queued(ctx):
    with ZmqEventPublisher(zmq_config(replay_endpoint=LOOP), context=ctx) as pub:
        with pytest.raises(InvalidInput, match=r"events\[1\]"):
            pub.publish([stored(1), ("BlockStored", [2])])
        with pytest.raises(InvalidInput, match="int64|encode"):
            pub.publish([stored(1 << 63)])
        with pytest.raises(InvalidInput):
            pub.publish([stored(1 << 64)])
        with pytest.raises(InvalidInput):
            pub.publish([BlockStored([1], None, ["a"], 1, None, "GPU")])
        assert pub.publish([]) is True  # an empty step publishes nothing
        pub.publish([stored(9)])
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint,
                               context=ctx) as sub:
            deadline = time.monotonic() + 5
            while pub.stats.published_batches < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            got = sub.replay(0)
        assert [(s, b.events) for s, b in got] == [(0, [stored(9)])]


def test_close_is_clean_and_final(ctx):
    pub = ZmqEventPublisher(zmq_config(replay_endpoint=LOOP), context=ctx)
    for h in range(100):
        pub.publish([stored(h)])
    pub.close()
    pub.close()
    assert not pub._thread.is_alive()
    assert pub.stats.published_batches == 100  # what was queued went out before the sockets closed
    with pytest.raises(InvalidInput, match="closed"):
        pub.publish([stored(1)])


def test_own_context_is_terminated_on_close():
    pub = create_publisher(zmq_config().to_json())
    assert isinstance(pub, ZmqEventPublisher)
    pub.publish([stored(1)])
    pub.close()
    assert pub._ctx.closed


def test_bind_error_is_a_clear_error_and_leaves_nothing_open(ctx):
    with ZmqEventPublisher(zmq_config(), context=ctx) as first:
        with pytest.raises(InvalidInput, match="cannot open"):
            ZmqEventPublisher(zmq_config(endpoint=first.endpoint, bind=True), context=ctx)


def test_dp_rank_is_stamped_on_every_batch(ctx):
    with ZmqEventPublisher(zmq_config(replay_endpoint=LOOP), attn_dp_rank=2, context=ctx) as pub:
        pub.publish([stored(1)])
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint,
                               context=ctx) as sub:
            deadline = time.monotonic() + 5
            while pub.stats.published_batches < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            (seq, batch), = sub.replay(0)
    assert batch.attn_dp_rank == 2


def test_publisher_arguments_are_checked():
    with pytest.raises(InvalidInput, match="attn_dp_rank"):
        ZmqEventPublisher(zmq_config(), attn_dp_rank=-1)
    with pytest.raises(InvalidInput, match="KVEventsConfig"):
        ZmqEventPublisher({"publisher": "zmq"})  # type: ignore[arg-type]
