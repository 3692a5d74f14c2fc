"""The HTTP layer: OpenAI-compatible routes, SSE framing, admin views, error bodies.

Only this package imports sanic; everything it serves comes from a `Node` (llmd/node.py).
"""

from llmd.gateway.app import PROTOCOL, create_app
from llmd.gateway.connections import tls_protocol

__all__ = ["PROTOCOL", "create_app", "tls_protocol"]
