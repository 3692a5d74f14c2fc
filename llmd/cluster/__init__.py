"""The cluster: nodes that find each other by gossip, tell each other their load in tokens and
what their caches hold, route each request to the node that will start it soonest, and take
over each other's work when one dies. docs/cluster.md has the design and the failure semantics."""
