"""KV cache events on the wire that cache-aware routers read (SGLang's ``--kv-events-config``).

A router (SGLang's own, Dynamo, llm-d, AIBrix) keeps, per server, the set of cached blocks it
learns from three events: ``BlockStored`` (pages became cached on a medium), ``BlockRemoved``
(pages left a medium) and ``AllBlocksCleared``. This module holds

- the event types, msgspec structs whose encoding is byte-for-byte SGLang 0.5.13.post1's
  (``encoding="array"``: every event a msgpack array whose first item is the class name), and the
  newer releases' map encoding (``encoding="map"``: every event a msgpack map with a ``type`` key);
- :class:`KVEventsConfig`, the ``--kv-events-config`` JSON with every key checked by name;
- :class:`ZmqEventPublisher`: a ZMQ PUB socket sending ``(topic, 8-byte big-endian sequence
  number, msgpack payload)`` frames, an optional ROUTER socket that replays recent batches, and a
  background sender thread behind a bounded queue, so that a slow subscriber never blocks the cache;
- :class:`KVEventSubscriber`: the other end (tests, tools, a router written in Python).

The batch on the wire is always the array ``[ts, events, attn_dp_rank]``. docs/EVENTS.md states
the format, the replay protocol and what happens when the queue is full.

Cost (docs/EVENTS.md has the measured figures): ``publish`` encodes the batch in the caller's
thread (O(total ids in the batch), a few microseconds for a typical step) and puts the bytes on a
``queue.Queue``; sending, the replay buffer and replay requests are the sender thread's work.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import chain
from typing import Annotated, Any, Literal

import msgspec
import zmq

from .errors import InvalidInput

logger = logging.getLogger(__name__)

__all__ = [
    "INT64_MIN", "INT64_MAX", "MEDIUM_GPU", "MEDIUM_CPU", "Encoding",
    "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch",
    "encode_batch", "decode_batch", "KVEventsConfig", "EventPublisher", "NullEventPublisher",
    "ZmqEventPublisher", "PublisherStats", "create_publisher", "KVEventSubscriber",
    "END_SEQ", "offset_endpoint", "events_of",
]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
#: The media the unified cache reports (upstream's ``StorageMedium.GPU`` / ``StorageMedium.CPU``).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU_PINNED"

Encoding = Literal["array", "map"]
_ENCODINGS = ("array", "map")

# A block hash is the first 64 bits of the page's SHA-256 key read as a signed int64; decoding
# refuses anything outside that range.
_Hash = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]

# A page's ``token_ids``: its token ids, or under EAGLE its bigram pairs ``[token, next token]``
# (0.5.13.post1's KV-event mixin exposes bigram pages so; ``block_size`` then counts pairs). The
# type admits both; :func:`decode_batch` refuses an event that mixes the two shapes.
_TokenIds = list[int | tuple[int, int]]

#: The sequence number of the replay reply that ends a replay (-1 as 8 big-endian bytes).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- event types ---------------------------------------------------------------------------------
# array_like + tag: an event is ["BlockStored", field1, field2, ...]; omit_defaults drops a trailing
# medium that is None, as 0.5.13.post1 does.

class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change of the set of cached blocks. The subclasses are the whole vocabulary."""


class BlockStored(KVCacheEvent):
    """Pages that became cached on ``medium``. ``block_hashes[0]``'s parent is
    ``parent_block_hash`` (None: a child of the root), each later hash's parent is the one before
    it; ``token_ids`` are the pages' tokens in order (EAGLE: their bigram pairs ``[a, b]``) and
    ``block_size`` tokens (pairs) make one page."""

    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: _TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    """Pages that are no longer cached on ``medium``."""

    block_hashes: list[_Hash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block on every medium is gone (the cache was reset)."""


_EventUnion = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one scheduler step: ``[ts, events, attn_dp_rank]`` on the wire."""

    ts: float
    events: list[_EventUnion]
    attn_dp_rank: int | None = None


# The map encoding of the newer SGLang releases (and vLLM): each event a map with a "type" key
# naming the class and one key per field, None-valued optional fields left out; the batch stays an
# array and always carries attn_dp_rank.  The tags are given explicitly so they read
# "BlockStored", not the Python class names.

class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type"):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: _TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: str | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


_MapUnion = _MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapUnion]
    attn_dp_rank: int | None = None


_MAP_CLEARED = _MapAllBlocksCleared()


def _to_map(ev: KVCacheEvent) -> _MapUnion:
    if type(ev) is BlockStored:
        return _MapBlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                               ev.block_size, ev.lora_id, ev.medium)
    if type(ev) is BlockRemoved:
        return _MapBlockRemoved(ev.block_hashes, ev.medium)
    return _MAP_CLEARED


def _from_map(ev: _MapEvent) -> _EventUnion:
    if type(ev) is _MapBlockStored:
        return BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                           ev.lora_id, ev.medium)
    if type(ev) is _MapBlockRemoved:
        return BlockRemoved(ev.block_hashes, ev.medium)
    return AllBlocksCleared()


_ENCODER = msgspec.msgpack.Encoder()
_ARRAY_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_MAP_DECODER = msgspec.msgpack.Decoder(_MapBatch)


def _check_encoding(encoding: str) -> None:
    if encoding not in _ENCODINGS:
        raise InvalidInput(f"encoding must be one of {_ENCODINGS}, got {encoding!r}")


def encode_batch(batch: KVEventBatch, encoding: Encoding = "array") -> bytes:
    """The msgpack payload of ``batch`` in ``encoding``. O(ids in the batch)."""
    _check_encoding(encoding)
    if encoding == "array":
        return _ENCODER.encode(batch)
    return _ENCODER.encode(_MapBatch(batch.ts, [_to_map(e) for e in batch.events],
                                     batch.attn_dp_rank))


def decode_batch(payload: bytes, encoding: Encoding = "array") -> KVEventBatch:
    """Decode and type-check one payload (hashes must be int64, every field of the right type).
    Raises :class:`InvalidInput` naming what is wrong."""
    _check_encoding(encoding)
    try:
        if encoding == "array":
            batch = _ARRAY_DECODER.decode(payload)
            _check_token_shapes((i, e.token_ids) for i, e in enumerate(batch.events)
                                if isinstance(e, BlockStored))
            return batch
        m = _MAP_DECODER.decode(payload)
        _check_token_shapes((i, e.token_ids) for i, e in enumerate(m.events)
                            if isinstance(e, _MapBlockStored))
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise InvalidInput(f"not a {encoding}-encoded KV event batch: {exc}") from None
    return KVEventBatch(m.ts, [_from_map(e) for e in m.events], m.attn_dp_rank)


def _check_token_shapes(stored: Iterable[tuple[int, list[Any]]]) -> None:
    """Each ``(event index, token_ids)`` of ``stored`` holds all token ids or all bigram pairs
    (one C-level pass: an array of int64 refuses a pair, a flattened array refuses a bare
    token)."""
    for i, ids in stored:
        if not ids:
            continue
        pairs = type(ids[0]) is tuple
        try:
            array("q", chain.from_iterable(ids) if pairs else ids)
        except TypeError:
            raise InvalidInput(f"events[{i}]: token_ids mix token ids and bigram pairs") from None
        except OverflowError:  # a token past int64: check the shapes one by one
            if any((type(t) is tuple) != pairs for t in ids):
                raise InvalidInput(f"events[{i}]: token_ids mix token ids and bigram pairs") from None


# --- configuration -------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVEventsConfig:
    """SGLang's ``--kv-events-config`` JSON. Every key is checked; an unknown key is refused by
    name (upstream silently ignores them, which hides typos such as ``"replay_endpint"``).

    ``publisher``: ``"null"`` (publish nothing) or ``"zmq"``.
    ``endpoint``: PUB address; bound when its host is a wildcard (``*``, ``0.0.0.0``, ``::``), its
    port is ``*`` (an ephemeral port) or it is ``ipc://``/``inproc://``, connected otherwise,
    unless ``bind`` says which.
    ``replay_endpoint``: ROUTER address for replay requests (always bound), or None.
    ``buffer_steps``: how many of the latest batches the replay buffer keeps (0: none).
    ``hwm``: ZMQ send high-water mark of the PUB socket, in messages (0: unlimited); past it ZMQ
    drops messages for the lagging subscriber, which sees a gap in the sequence numbers.
    ``max_queue_size``: batches waiting for the sender thread, at least 1; see ``publish``.
    ``topic``: the first frame of every message (subscribers filter on its prefix).
    ``encoding`` (uniradix): ``"array"`` (0.5.13.post1's wire) or ``"map"`` (the newer releases'
    wire: map-encoded events and replay replies that carry the topic frame).
    ``bind`` (as in the newer releases): force binding (true) or connecting (false) the PUB socket.
    """

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: Encoding = "array"  # checked in __post_init__ (from_dict passes any string)
    bind: bool | None = None

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise InvalidInput(f"kv-events-config: publisher must be 'null' or 'zmq', "
                               f"got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise InvalidInput(f"kv-events-config: {name} must be a string, "
                                   f"got {getattr(self, name)!r}")
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            if not isinstance(self.replay_endpoint, str):
                raise InvalidInput(f"kv-events-config: replay_endpoint must be a string or null, "
                                   f"got {self.replay_endpoint!r}")
            _check_endpoint("replay_endpoint", self.replay_endpoint)
        for name, least in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            v = getattr(self, name)
            if type(v) is not int or v < least:
                raise InvalidInput(f"kv-events-config: {name} must be an integer >= {least}, "
                                   f"got {v!r}")
        if self.encoding not in _ENCODINGS:
            raise InvalidInput(f"kv-events-config: encoding must be one of {_ENCODINGS}, "
                               f"got {self.encoding!r}")
        if self.bind is not None and type(self.bind) is not bool:
            raise InvalidInput(f"kv-events-config: bind must be true, false or null, "
                               f"got {self.bind!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVEventsConfig:
        if not isinstance(data, Mapping):
            raise InvalidInput(f"kv-events-config must be a JSON object, got {data!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidInput(f"kv-events-config: unknown key(s) {', '.join(map(repr, unknown))};"
                               f" known: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the ``--kv-events-config`` value."""
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as exc:
            raise InvalidInput(f"kv-events-config is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


def _check_endpoint(name: str, endpoint: str) -> None:
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise InvalidInput(f"kv-events-config: {name} must start with tcp://, ipc:// or "
                           f"inproc://, got {endpoint!r}")


def offset_endpoint(endpoint: str, attn_dp_rank: int) -> str:
    """The endpoint of attention-DP rank ``attn_dp_rank``: tcp ports move up by the rank,
    inproc/ipc names get a ``_dp<rank>`` suffix (upstream's convention). A ``*`` port is left as
    it is (every rank then gets its own ephemeral port)."""
    if attn_dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if sep and port != "*" and not host.endswith("/"):
            if not port.isdigit():
                raise InvalidInput(f"endpoint {endpoint!r}: port {port!r} is not a number")
            return f"{host}:{int(port) + attn_dp_rank}"
        return endpoint
    return f"{endpoint}_dp{attn_dp_rank}"


def _should_bind(endpoint: str, bind: bool | None) -> bool:
    if bind is not None:
        return bind
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return port == "*" or host in ("*", "0.0.0.0", "::", "[::]")


# --- publishers ----------------------------------------------------------------------------------

@dataclass
class PublisherStats:
    """Counters of a publisher (read them any time; they only grow)."""

    published_batches: int = 0  # batches the sender thread handed to the PUB socket
    dropped_batches: int = 0    # batches refused because the queue was full
    dropped_events: int = 0     # events in those batches
    resets: int = 0             # AllBlocksCleared put in front of a batch after a drop
    replay_requests: int = 0    # well-formed replay requests served
    bad_replay_requests: int = 0
    send_errors: int = 0        # sends that raised (the batch still goes into the replay buffer)


class EventPublisher:
    """What the cache talks to: ``publish`` a step's events, ``close`` at the end."""

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> bool:
        raise NotImplementedError

    def close(self, timeout_s: float = 1.0) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullEventPublisher(EventPublisher):
    """``publisher: "null"``: accepts every batch and sends nothing."""

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> bool:
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        return None


class ZmqEventPublisher(EventPublisher):
    """PUB socket + optional replay ROUTER + a sender thread behind a bounded queue.

    Structures:
    - ``_queue`` (``queue.Queue``, at most ``max_queue_size`` encoded batches): the hand-over from
      the caller to the sender thread; ``publish`` never waits on it.
    - ``_buffer`` (``deque`` of ``(seq, payload)``, at most ``buffer_steps``): the latest batches
      sent, what the ROUTER replays.
    - ``_reset_pending``: set when a batch was dropped; the next batch that gets into the queue
      starts with ``AllBlocksCleared``.
    The sockets are created here (so a bad endpoint raises in the caller) and from then on used only
    by the sender thread, which closes them when it ends.

    Sequence numbers count from 0 and have no gaps: the sender numbers what it takes from the queue.

    ``validate`` decodes every encoded batch back with the typed structs before queueing it (about
    twice the cost of ``publish``; docs/EVENTS.md). ``poll_interval_s`` is how long the idle sender
    waits on the queue before looking at the replay socket again: the longest an idle publisher
    takes to start answering a replay request, and to notice ``close``.
    """

    def __init__(self, config: KVEventsConfig, attn_dp_rank: int = 0,
                 context: zmq.Context | None = None, validate: bool = True,
                 poll_interval_s: float = 0.01) -> None:
        if not isinstance(config, KVEventsConfig):
            raise InvalidInput(f"config must be a KVEventsConfig, got {type(config).__name__}")
        if type(attn_dp_rank) is not int or attn_dp_rank < 0:
            raise InvalidInput(f"attn_dp_rank must be an integer >= 0, got {attn_dp_rank!r}")
        if not poll_interval_s > 0:
            raise InvalidInput(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self.config = config
        self.attn_dp_rank = attn_dp_rank
        self.validate = validate
        self.stats = PublisherStats()
        self._encoding = config.encoding
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()
        self._reset_pending = False
        self._closed = False
        self._stop = threading.Event()
        self._poll_s = poll_interval_s
        self._drain_s = 1.0
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            endpoint = offset_endpoint(config.endpoint, attn_dp_rank)
            if _should_bind(endpoint, config.bind):
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(offset_endpoint(config.replay_endpoint, attn_dp_rank))
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            if self._own_ctx:
                self._ctx.term()
            raise InvalidInput(f"kv events: cannot open {exc}") from None
        self._thread = threading.Thread(target=self._run, name="uniradix-kv-events", daemon=True)
        self._thread.start()

    # -- caller side -------------------------------------------------------------------------------

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> bool:
        """Queue one step's events as a batch ``[ts, events, attn_dp_rank]`` (``ts`` defaults to
        ``time.time()``). An empty ``events`` publishes nothing (as upstream's scheduler).

        Returns False when the queue is full: the batch is dropped and counted, and the next batch
        that gets in starts with ``AllBlocksCleared``, so a router forgets what it cannot trust
        (it may under-report cached blocks until they are stored again, never over-report).
        Raises :class:`InvalidInput` (nothing queued) for an event of another type, or, with
        ``validate``, for a field of the wrong type or a hash outside int64.
        O(ids in the batch); never blocks on the network or the sender thread."""
        if self._closed:
            raise InvalidInput("publish on a closed ZmqEventPublisher")
        if not events:
            return True
        evs: list[_EventUnion] = []
        for i, ev in enumerate(events):
            # exactly these types (a subclass would not round-trip); isinstance narrows the type
            if type(ev) not in _EVENT_TYPES or not isinstance(ev, _EVENT_TYPES):
                raise InvalidInput(f"events[{i}] is a {type(ev).__name__}, not BlockStored, "
                                   f"BlockRemoved or AllBlocksCleared")
            evs.append(ev)
        stamp = time.time() if ts is None else ts
        with self._lock:
            if self._reset_pending:
                evs.insert(0, AllBlocksCleared())
            payload = self._encode(KVEventBatch(stamp, evs, self.attn_dp_rank))
            try:
                self._queue.put_nowait(payload)
            except queue.Full:
                self.stats.dropped_batches += 1
                self.stats.dropped_events += len(events)
                self._reset_pending = True
                return False
            if self._reset_pending:
                self._reset_pending = False
                self.stats.resets += 1
        return True

    def _encode(self, batch: KVEventBatch) -> bytes:
        try:
            payload = encode_batch(batch, self._encoding)
        except (TypeError, OverflowError, msgspec.EncodeError) as exc:
            raise InvalidInput(f"kv events: cannot encode the batch: {exc}") from None
        if self.validate:
            decode_batch(payload, self._encoding)
        return payload

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop accepting batches, let the sender send what is queued for up to ``timeout_s``,
        then close the sockets (and the context, if this publisher made it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._drain_s = max(0.0, timeout_s)
        self._stop.set()
        self._thread.join(timeout_s + 1.0)
        if self._thread.is_alive():  # pragma: no cover - the sender never blocks on a send
            logger.warning("kv events sender thread did not stop within %.1fs", timeout_s + 1.0)
            return
        left = self._queue.qsize()
        if left:
            logger.warning("kv events: %d batch(es) not sent before close", left)
        if self._own_ctx:
            self._ctx.term()

    # -- sender thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        assert self._pub is not None
        pub, replay, q, buf = self._pub, self._replay, self._queue, self._buffer
        topic, seq = self._topic, 0
        deadline: float | None = None
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    payload = q.get(timeout=self._poll_s)
                except queue.Empty:
                    if self._stop.is_set():
                        break
                    continue
                if payload is None:
                    continue
                seq_bytes = seq.to_bytes(8, "big")
                try:
                    pub.send_multipart((topic, seq_bytes, payload), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # PUB at its high-water mark for every peer: ZMQ drops, as documented
                except zmq.ZMQError:
                    self.stats.send_errors += 1
                    logger.exception("kv events: send failed (seq %d)", seq)
                buf.append((seq, payload))
                self.stats.published_batches += 1
                seq += 1
                if self._stop.is_set():
                    if deadline is None:
                        deadline = time.monotonic() + self._drain_s
                    elif time.monotonic() > deadline:
                        break
        finally:
            self._close_sockets()

    def _serve_replay(self, replay: zmq.Socket) -> None:
        """One request: ``[identity, b"", start_seq (8 bytes, big-endian)]`` (a DEALER sends
        ``[b"", start_seq]``). Reply: every buffered batch with ``seq >= start_seq``, in order, then
        the end marker; the frames are those of docs/EVENTS.md for the configured encoding."""
        try:
            frames = replay.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.stats.bad_replay_requests += 1
            logger.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        ident, start = frames[0], int.from_bytes(frames[2], "big")
        self.stats.replay_requests += 1
        with_topic = self._encoding == "map"
        try:
            for seq, payload in list(self._buffer):
                if seq >= start:
                    head = (ident, b"", self._topic) if with_topic else (ident, b"")
                    replay.send_multipart((*head, seq.to_bytes(8, "big"), payload),
                                          flags=zmq.NOBLOCK)
            end = (ident, b"", b"", END_SEQ, b"") if with_topic else (ident, b"", END_SEQ, b"")
            replay.send_multipart(end, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            # The requester went away or its pipe is full; it will time out and ask again.
            self.stats.send_errors += 1

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)


def create_publisher(config: KVEventsConfig | str | None, attn_dp_rank: int = 0,
                     **kwargs: Any) -> EventPublisher:
    """The publisher ``config`` asks for: a :class:`NullEventPublisher` for no config or
    ``publisher: "null"``, else a :class:`ZmqEventPublisher` (``kwargs`` go to it)."""
    if config is None or config == "":
        return NullEventPublisher()
    cfg = KVEventsConfig.from_json(config) if isinstance(config, str) else config
    if not isinstance(cfg, KVEventsConfig):
        raise InvalidInput(f"config must be a KVEventsConfig or its JSON, got {config!r}")
    if cfg.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(cfg, attn_dp_rank, **kwargs)


# --- subscriber ----------------------------------------------------------------------------------

class KVEventSubscriber:
    """The receiving end: a SUB socket on the publisher's endpoint and, when given, a DEALER on its
    replay endpoint. Decodes with the typed structs above (so a malformed batch raises
    :class:`InvalidInput`). Not thread-safe; close it (or use ``with``)."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None,
                 encoding: Encoding = "array", context: zmq.Context | None = None,
                 rcvhwm: int = 100_000) -> None:
        _check_encoding(encoding)
        self.encoding = encoding
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._dealer: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(replay_endpoint)

    def recv(self, timeout_s: float = 1.0) -> tuple[int, KVEventBatch] | None:
        """The next ``(seq, batch)``, or None when nothing came within ``timeout_s``."""
        if not self._sub.poll(int(timeout_s * 1000)):
            return None
        frames = self._sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            raise InvalidInput(f"kv events: expected [topic, seq, payload], got {len(frames)} "
                               f"frame(s)")
        return int.from_bytes(frames[1], "big"), decode_batch(frames[2], self.encoding)

    def replay(self, start_seq: int, timeout_s: float = 2.0) -> list[tuple[int, KVEventBatch]]:
        """Ask the publisher for every buffered batch from ``start_seq`` on. Raises
        :class:`InvalidInput` without a replay endpoint, and TimeoutError when the end marker does
        not come within ``timeout_s``."""
        if self._dealer is None:
            raise InvalidInput("this subscriber has no replay endpoint")
        if type(start_seq) is not int or start_seq < 0:
            raise InvalidInput(f"start_seq must be an integer >= 0, got {start_seq!r}")
        self._dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out: list[tuple[int, KVEventBatch]] = []
        deadline = time.monotonic() + timeout_s
        skip = 2 if self.encoding == "map" else 1  # delimiter (+ topic) before seq
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._dealer.poll(int(left * 1000) + 1):
                raise TimeoutError(f"kv events: replay from {start_seq} got no end marker "
                                   f"within {timeout_s}s")
            frames = self._dealer.recv_multipart()
            if len(frames) != skip + 2:
                raise InvalidInput(f"kv events: malformed replay reply ({len(frames)} frames)")
            seq_bytes, payload = frames[skip], frames[skip + 1]
            if seq_bytes == END_SEQ:
                return out
            out.append((int.from_bytes(seq_bytes, "big"), decode_batch(payload, self.encoding)))

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def events_of(batches: Iterable[tuple[int, KVEventBatch]]) -> list[KVCacheEvent]:
    """All events of ``(seq, batch)`` pairs, in order (a convenience for tests and tools)."""
    return [e for _, b in batches for e in b.events]
