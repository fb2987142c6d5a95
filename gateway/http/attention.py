"""``GET /v1/attention``: the tenant's steps that need an operator's decision.

The same data as the console's "needs a decision" page (:meth:`Store.attention`), as JSON:
steps whose outcome is ``unknown`` and steps still ``dispatching`` past their deadline,
oldest first, paged by ``cursor``.
"""

from __future__ import annotations

import re

from aiohttp import web

from gateway.core.errors import InvalidRequest
from gateway.http import appkeys as K
from gateway.http.auth import caller_as
from gateway.http.models import AttentionItemOut, AttentionPageOut, iso_ms

__all__ = ["get_attention"]

_LIMIT = re.compile(r"[0-9]{1,4}")
_CURSOR = re.compile(r"[A-Za-z0-9_-]{1,1200}")


async def get_attention(request: web.Request) -> web.Response:
    principal = caller_as(request, "auditor")
    q = request.query
    raw_limit = q.get("limit", "100")
    if not _LIMIT.fullmatch(raw_limit) or not 1 <= int(raw_limit) <= 1000:
        raise InvalidRequest("limit must be an integer from 1 to 1000")
    limit = int(raw_limit)
    cursor = q.get("cursor")
    if cursor is not None and not _CURSOR.fullmatch(cursor):
        raise InvalidRequest("cursor must be a value returned as next_cursor")
    try:
        # one more than asked: whether there is a next page
        rows = await request.app[K.STORE].attention(principal.tenant, limit=limit + 1, after=cursor)
    except ValueError as exc:
        raise InvalidRequest("cursor must be a value returned as next_cursor") from exc
    items = [
        AttentionItemOut(
            job_id=r["job_id"],
            step=r["step"],
            state=r["state"],
            since=iso_ms(r["since_ms"]),
            age_ms=r["age_ms"],
            deadline=iso_ms(r["deadline_ms"]),
            generation=r["generation"],
            adapter=r["adapter"],
            operation=r["operation"],
            attempts=r["attempts"],
            worker_id=r["worker_id"],
            last_error=r["last_error"],
        )
        for r in rows[:limit]
    ]
    next_cursor = rows[limit - 1]["cursor"] if len(rows) > limit else None
    page = AttentionPageOut(items=items, next_cursor=next_cursor)
    return web.Response(body=page.model_dump_json().encode(), content_type="application/json")
