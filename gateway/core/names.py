"""Names: the pattern of a tenant, job, step, adapter, upstream, output or operation name,
and the ``tenants`` list an adapter or upstream section names (``"*"`` or tenant names).

``NAME`` is the one definition: code fullmatches it; ``NAME_PATTERN`` is the same pattern
anchored, for whatever searches instead of matching whole (pydantic's ``pattern``, the
OpenAPI document) and for people (``NAME_RULE``, the end of every refusal of a name)."""

from __future__ import annotations

import re
from typing import Any

from gateway.core.errors import InvalidRequest

__all__ = ["NAME", "NAME_PATTERN", "NAME_RULE", "checked_name", "tenant_list"]

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch it: no trailing "\n"
NAME_PATTERN = f"^{NAME.pattern}$"  # pydantic and JSON Schema search: anchored both ends
NAME_RULE = f"must match {NAME_PATTERN}"  # "<what> must match ^...$"


def checked_name(value: str, what: str) -> str:
    """``value`` if it is a name, else :class:`InvalidRequest` (400) "<what> must match …"."""
    if not NAME.fullmatch(value):
        raise InvalidRequest(f"{what} {NAME_RULE}")
    return value


def tenant_list(v: Any) -> Any:
    """A ``tenants`` value before validation: ``"*"`` becomes ``("*",)``; a list must name
    at least one tenant, each a name or ``"*"`` alone. Raises ValueError saying which."""
    if v == "*":
        return ("*",)
    if isinstance(v, (list, tuple)):
        if not v:
            raise ValueError('name at least one tenant, or "*" for every tenant')
        for t in v:
            if not isinstance(t, str) or not (t == "*" or NAME.fullmatch(t)):
                raise ValueError(f'{t!r} is not a tenant name (or "*")')
        if "*" in v and len(v) > 1:
            raise ValueError('"*" (every tenant) cannot be combined with tenant names')
    return v
