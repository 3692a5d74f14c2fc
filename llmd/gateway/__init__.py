"""The HTTP layer: OpenAI-compatible routes, SSE framing, admin views, error bodies.

Only this package imports sanic; everything it serves comes from a `Node` (llmd/node.py).
"""

from llmd.gateway.app import create_app

__all__ = ["create_app"]
