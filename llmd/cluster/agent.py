"""A gossip agent on its own, for benches and fault tests: it joins, optionally publishes a
state, and prints every member change as a JSON line with the wall time, so a test can kill -9
or SIGSTOP it and read when the others noticed. SIGTERM/SIGINT leave gracefully.

    LLMD_CLUSTER_SECRET=... python -m llmd.cluster.agent --name n1 --bind 127.0.0.1:0 \\
        --seeds 127.0.0.1:7946 --secret-env LLMD_CLUSTER_SECRET

The first line is {"event": "ready", "port": N}; then {"event": "member", ...} per change and,
every --stats-s, {"event": "stats", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from llmd.cluster.gossip import Gossip, MemberInfo
from llmd.cluster.signing import Signer
from llmd.config.cluster import ClusterConfig


def _addr(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)


def _line(obj: dict[str, Any]) -> None:
    try:
        sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (a bench that was stopped): keep gossiping
        pass


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m llmd.cluster.agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", default="127.0.0.1:0", help="host:port (port 0: any)")
    ap.add_argument("--seeds", default="", help="comma-separated host:port")
    ap.add_argument("--secret-env", default="LLMD_CLUSTER_SECRET", help="the environment variable holding the secret")
    ap.add_argument("--probe-interval-s", type=float, default=0.5)
    ap.add_argument("--probe-timeout-s", type=float, default=0.25)
    ap.add_argument("--suspicion-s", type=float, default=1.5)
    ap.add_argument("--publish-bytes", type=int, default=0, help="publish a changing state of this size")
    ap.add_argument("--stats-s", type=float, default=0.0, help="print stats this often (0: never)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    secret = os.environ.get(a.secret_env, "").encode()
    if not secret:
        print(f"${a.secret_env} is empty: a cluster needs a shared secret", file=sys.stderr)
        return 2
    cfg = ClusterConfig(probe_interval_s=a.probe_interval_s, probe_timeout_s=a.probe_timeout_s,
                        suspicion_s=a.suspicion_s)
    seeds = [_addr(s) for s in a.seeds.split(",") if s]
    bind = _addr(a.bind)
    g = Gossip(a.name, bind, f"http://{bind[0]}/{a.name}", seeds, Signer(a.name, [secret], time.time), cfg)

    def changed(m: MemberInfo) -> None:
        _line({"event": "member", "t": time.time(), "name": m.name, "state": m.state, "inc": m.incarnation})

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    _line({"event": "ready", "t": time.time(), "name": a.name, "port": g.bound_port})
    g.start(changed)
    n, next_stats = 0, time.monotonic() + a.stats_s
    while not done.wait(0.25):
        if a.publish_bytes:
            n += 1
            g.publish((f"{a.name} {n} " * a.publish_bytes).encode()[:a.publish_bytes])
        if a.stats_s and time.monotonic() >= next_stats:
            next_stats += a.stats_s
            s = g.stats
            _line({"event": "stats", "t": time.time(), "sent_bytes": s.sent_bytes, "recv_bytes": s.recv_bytes,
                   "health": g.health, "dropped": dict(s.dropped)})
    g.stop(leave=True)
    _line({"event": "stopped", "t": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
