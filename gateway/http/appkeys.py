"""Typed ``web.AppKey``s: everything the app holds, named once."""

from __future__ import annotations

from aiohttp import web

from adapters.base import Adapter
from gateway.core.tokens import TokenSigner
from gateway.fencing.completion import CompletionService
from gateway.fencing.quotas import Quotas
from gateway.fencing.service import EffectService
from gateway.fencing.tenancy import Tenancy
from gateway.http.auth import AUTH as AUTH  # declared beside its class (http.auth reads it)
from gateway.objects.space import SpaceFloor
from gateway.runtime.metrics import Metrics
from gateway.runtime.settings import Settings
from gateway.store.jobstate import JobState
from gateway.store.store import Store

SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", Metrics)
STORE = web.AppKey("store", Store)
ADAPTERS = web.AppKey("adapters", dict[str, Adapter])
SERVICE = web.AppKey("service", EffectService)
TENANCY = web.AppKey("tenancy", Tenancy)  # who may use each adapter, the downstream keys
OPENAPI = web.AppKey("openapi", bytes)
SIGNER: web.AppKey[TokenSigner | None] = web.AppKey("signer")
JOBSTATE = web.AppKey("jobstate", JobState)
COMPLETION = web.AppKey("completion", CompletionService)
QUOTAS = web.AppKey("quotas", Quotas)
# the free-space floors /readyz reports (`disk`): the file store's volume, the embedded
# Redis's data dir volume
FLOORS = web.AppKey("floors", list[SpaceFloor])
