"""The OpenAPI 3.1 document of every route llmd serves (GET /openapi.json), free of HTTP:
the route table (operations.py), the shapes of bodies and responses (shapes.py), and the
assembly with the request models' own pydantic schemas (build.py)."""

from llmd.openapi.build import build_document
from llmd.openapi.operations import OPERATIONS, Access, Op

__all__ = ["OPERATIONS", "Access", "Op", "build_document"]
