"""The cluster's Prometheus metrics, read from the node's cluster part at scrape time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmd.policy.homes import BIND_ON_S

if TYPE_CHECKING:
    from llmd.cluster.node import ClusterNode

STATES = ("alive", "suspect", "dead", "left")


class ClusterCollector:
    def __init__(self, cluster: ClusterNode) -> None:
        self.cluster = cluster

    def describe(self) -> Iterable[Metric]:
        return self._families(live=False)

    def collect(self) -> Iterable[Metric]:
        return self._families(live=True)

    def _families(self, live: bool) -> list[Metric]:
        g, c = GaugeMetricFamily, CounterMetricFamily
        members = g("llmd:cluster_members", "Members this node knows, by state (itself not counted).",
                    labels=["state"])
        fwd = c("llmd:cluster_forwarded", "Choices this node sent to another node to run.")
        lost = c("llmd:cluster_peer_lost", "Forwarded choices whose node failed before finishing them.")
        failover = c("llmd:cluster_failovers", "Choices run again or resumed on another node after a node failed.")
        placed = c("llmd:cluster_placed", "Choices this node placed, by the node that ran them.", labels=["node"])
        gossip = c("llmd:gossip_bytes", "Gossip bytes, by direction.", labels=["direction"])
        dropped = c("llmd:cluster_dropped_messages", "Messages from other hosts dropped: unsigned, forged, "
                    "stale or replayed, by channel.", labels=["channel", "reason"])
        blocks = g("llmd:cluster_prefix_blocks", "Prefix blocks in this node's cache summary.")
        queued = g("llmd:cluster_queued_prefill_seconds", "The nodes' mean queued prefill as this ingress "
                   f"smooths it, in seconds of their prefill: with homes_bind = \"congested\", balanced "
                   f"homes bind over {BIND_ON_S} s.")
        bound = g("llmd:cluster_homes_bound", "1 while this ingress keeps repeated prefixes on their balanced homes.")
        fams: list[Metric] = [members, fwd, lost, failover, placed, gossip, dropped, blocks, queued, bound]
        if not live:
            return fams
        cl = self.cluster
        states: Counter[str] = Counter(p.info.state for p in cl.peers.values())
        for s in STATES:
            members.add_metric([s], states.get(s, 0))
        fwd.add_metric([], cl.forwarder.forwarded)
        lost.add_metric([], cl.forwarder.lost)
        failover.add_metric([], cl.router.failovers)
        for node, n in cl.router.placed.items():
            placed.add_metric([node], n)
        st = cl.gossip.stats
        gossip.add_metric(["sent"], st.sent_bytes)
        gossip.add_metric(["received"], st.recv_bytes)
        for channel, counts in (("gossip", st.dropped), ("http", cl.http_signer.dropped)):
            for reason, n in counts.items():
                dropped.add_metric([channel, reason], n)
        blocks.add_metric([], len(cl.prefixes))
        queued.add_metric([], cl.congestion.level)
        bound.add_metric([], 1.0 if cl.homes_bound else 0.0)
        return fams
