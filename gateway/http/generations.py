"""The generation a request presents: its ``Fencing-Token`` read, verified when signing is on
(:data:`gateway.http.appkeys.SIGNER`), and a token that does not verify audited in the job's
chain as a rejection before it is answered 400 ``bad_token``."""

from __future__ import annotations

from aiohttp import web

from gateway.core.errors import BadToken
from gateway.core.tokens import parse_unsigned_token
from gateway.http import appkeys as K
from gateway.runtime.logging import bind
from gateway.store.keys import JobKeys

__all__ = ["generation_of"]


async def generation_of(
    request: web.Request,
    keys: JobKeys,
    *,
    step: str = "",
    worker_id: str | None = None,
    adapter: str = "",
) -> int:
    """The presented generation; with signing on, the token must verify (else audited 400)."""
    raw = request.headers.get("Fencing-Token")
    signer = request.app[K.SIGNER]
    if signer is None:
        gen = parse_unsigned_token(raw)
    else:
        try:
            gen = signer.verify(raw, keys.tenant, keys.job_id)
        except BadToken as err:
            raise await request.app[K.STORE].reject(
                keys, err, step=step, worker_id=worker_id or "", adapter=adapter
            ) from None
    bind(generation=gen)
    return gen
