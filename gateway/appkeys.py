"""Typed ``web.AppKey``s: everything the app holds, named once."""

from __future__ import annotations

from aiohttp import web

from adapters.base import Adapter
from gateway.auth import Authenticator
from gateway.completion import CompletionService
from gateway.jobstate import JobState
from gateway.metrics import Metrics
from gateway.service import EffectService
from gateway.settings import Settings
from gateway.store import Store
from gateway.tokens import TokenSigner

SETTINGS = web.AppKey("settings", Settings)
AUTH = web.AppKey("auth", Authenticator)
METRICS = web.AppKey("metrics", Metrics)
STORE = web.AppKey("store", Store)
ADAPTERS = web.AppKey("adapters", dict[str, Adapter])
SERVICE = web.AppKey("service", EffectService)
OPENAPI = web.AppKey("openapi", bytes)
SIGNER: web.AppKey[TokenSigner | None] = web.AppKey("signer")
JOBSTATE = web.AppKey("jobstate", JobState)
COMPLETION = web.AppKey("completion", CompletionService)
