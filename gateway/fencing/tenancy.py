"""Adapters belong to tenants: who may use each adapter, and what key its downstream sees.

A deployment's tenants are the tenants of its ``[[auth.keys]]`` (``default`` when it has
none). Two rules, checked before anything starts:

- ``adapters.<name>.tenants`` (``["a", "b"]`` or ``"*"``, the default) lists the tenants
  whose workers may use the adapter. Any other tenant gets ``422 unknown_adapter``, the
  same answer as for a name that is not configured: a tenant cannot probe another
  tenant's adapters. A tenant named there must be carried by some auth key.
- With more than one tenant, every downstream key is ``<tenant>/<job>:<step>`` (and so
  the Stripe metadata, the Jira label, the SMTP Message-ID and the webhook's
  ``Idempotency-Key``): two tenants' job ``r`` are different jobs, and the downstream
  must never see them as one. ``tenant_in_key = false`` is then refused at start. With
  exactly one tenant the key stays ``<job>:<step>`` (invariant 4, docs/contract.md) unless
  ``tenant_in_key = true``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.core.records import downstream_key, proxied_key
from gateway.runtime.settings import ConfigError, Settings

__all__ = ["Tenancy", "resolve_tenancy"]


@dataclass(frozen=True, slots=True)
class Tenancy:
    tenants: frozenset[str]
    # adapter name -> the tenants that may use it; None: every tenant
    allowed: Mapping[str, frozenset[str] | None]
    # adapters whose downstream key is "<tenant>/<job>:<step>"
    keyed: frozenset[str]

    def key(self, tenant: str, job_id: str, step: str, adapter: str) -> str:
        """The downstream key of a step sent through ``adapter`` (:func:`downstream_key`; a
        proxied step's, adapter ``proxy:<upstream>``: :func:`proxied_key`)."""
        if adapter.startswith("proxy:"):
            return proxied_key(tenant, job_id, step)
        return downstream_key(tenant, job_id, step, tenant_keyed=adapter in self.keyed)

    def sections(self, adapters: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """The adapter sections with ``tenant_in_key`` resolved, as the adapters are built."""
        return {n: {**s, "tenant_in_key": n in self.keyed} for n, s in adapters.items()}


def _listed(value: Any) -> frozenset[str] | None:
    names = (value,) if isinstance(value, str) else tuple(value)
    return None if "*" in names else frozenset(str(n) for n in names)


def resolve_tenancy(settings: Settings) -> Tenancy:
    """The deployment's tenancy; :class:`ConfigError` (naming the key and why) if unsafe."""
    tenants = frozenset(k.tenant for k in settings.auth.keys) or frozenset({"default"})
    shown = ", ".join(sorted(tenants))
    allowed: dict[str, frozenset[str] | None] = {}
    keyed: set[str] = set()
    for name, section in settings.adapters.items():
        listed = _listed(section.get("tenants", "*"))
        if listed is not None:
            for t in sorted(listed - tenants):
                raise ConfigError(
                    f"adapters.{name}.tenants names {t!r}, which no [[auth.keys]] entry "
                    f"carries (this deployment's tenants: {shown})"
                )
        allowed[name] = listed
        in_key = section.get("tenant_in_key")
        if len(tenants) > 1:
            if in_key is False:
                who = (
                    "every tenant may use this adapter"
                    if listed is None
                    else f"tenants {', '.join(sorted(listed))} may use this adapter"
                    if len(listed) > 1
                    else "another adapter section may reach the same downstream account"
                )
                raise ConfigError(
                    f"adapters.{name}.tenant_in_key = false, but this deployment has "
                    f"{len(tenants)} tenants ({shown}) and {who}: two tenants' job 'r' "
                    "step 's' would reach the downstream under the same key 'r:s', so one "
                    "tenant could be handed (or block) the other's payment, ticket or "
                    "email. Remove the key: with several tenants the key is always "
                    "'<tenant>/<job>:<step>'."
                )
            keyed.add(name)
        elif in_key:
            keyed.add(name)
    return Tenancy(tenants=tenants, allowed=allowed, keyed=frozenset(keyed))
