"""Types the gateway's modules share."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TypeAlias

from sanic import Request, Sanic
from sanic.config import Config as SanicConfig

from llmd.auth import Principal

App: TypeAlias = Sanic[SanicConfig, SimpleNamespace]
Authenticate = Callable[[Request], Principal]  # who is calling (raises 401)
RequireAdmin = Callable[[Request], None]  # raises 401/403 unless an admin may call
