"""Which weights serve a request: models, their immutable versions (content hashes from the
weight store), the engines loaded for them, and the routing rules between them.

Read in order: `routing.py` (a split, stickiness, pinning: pure), `store.py` (the registry's
state in SQLite), `registry.py` (versions' engines and the live routing view).
"""
