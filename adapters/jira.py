"""``jira``: ticketing through the Jira REST API (v2).

Operations ``create_issue`` (``summary``, ``description``, ``issue_type``,
``labels``) and ``add_comment`` (``issue_key``, ``body``). Jira has no
idempotency keys, so the key is carried as a **label**
``fencegate-<sha256(key)[:24]>`` on created issues and as a marker line in
comments; :meth:`JiraAdapter.lookup` finds an earlier attempt's issue with a
JQL search (or the issue's comments), which is how an ``unknown`` step is
reconciled without a second ticket. Comments go only to issues of the configured
project; with several tenants (``tenant_keyed``) issues also carry the label
``fencegate-tenant-<tenant>`` and a comment is sent only to an issue with the
caller's tenant label. Labels starting ``fencegate-`` are reserved. Basic auth
(``user_env`` + ``api_key_env``) or a Bearer token (``api_key_env`` alone), both
from the environment.

==========================================  ============
Jira answered                               outcome
==========================================  ============
2xx                                         Delivered
400, 404                                    Failed
401/403 (fix credentials, retry)            NotDelivered
429 (rate limited, not processed)           NotDelivered
5xx (503 too), timeout, lost after send     Unknown → lookup
connection refused                          NotDelivered
==========================================  ============

A 503 (like a 502 or 504) may come from a proxy in front of Jira after it
forwarded the request, so it is ``Unknown`` and resolved by ``lookup`` on the
next call — not released, which sent a second ticket without looking.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, ValidationError

from adapters import http
from adapters.base import (
    AdapterConfig,
    AdapterContext,
    Capabilities,
    Delivered,
    EffectRequest,
    Failed,
    InvalidPayload,
    NotDelivered,
    Outcome,
    Unknown,
    describe,
)

__all__ = ["JiraAdapter", "JiraConfig", "key_label", "tenant_label"]


class JiraConfig(AdapterConfig):
    type: Literal["jira"] = "jira"
    base_url: AnyHttpUrl
    project: str = Field(pattern=r"^[A-Z][A-Z0-9_]{0,31}$")
    user_env: str = ""  # set: Basic auth with this user; empty: Bearer token
    api_key_env: str
    default_issue_type: str = "Task"
    timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    max_response_bytes: int = Field(default=262_144, ge=1024, le=16 * 1024 * 1024)


class _Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CreateIssue(_Payload):
    summary: str = Field(min_length=1, max_length=255, pattern=r"^[^\r\n]*$")
    description: str = Field(default="", max_length=32_000)
    issue_type: str | None = Field(default=None, max_length=64)
    labels: list[str] = Field(default_factory=list, max_length=20)


class AddComment(_Payload):
    issue_key: str = Field(pattern=r"^[A-Z][A-Z0-9_]{0,31}-[0-9]{1,9}$")
    body: str = Field(min_length=1, max_length=32_000)


_OPERATIONS: dict[str, type[_Payload]] = {"create_issue": CreateIssue, "add_comment": AddComment}


def key_label(key: str) -> str:
    """The label that marks an issue as created for one step (Jira labels: no spaces)."""
    return "fencegate-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def tenant_label(tenant: str) -> str:
    """The label that marks an issue as created by one tenant (tenant names have no spaces)."""
    return f"fencegate-tenant-{tenant}"


class JiraAdapter:
    Config: ClassVar[type[JiraConfig]] = JiraConfig

    def __init__(self, name: str, config: JiraConfig, ctx: AdapterContext) -> None:
        self.name = name
        self._config = config
        self._http = ctx.http
        self._base = str(config.base_url).rstrip("/")
        token = ctx.secret(config.api_key_env, f"adapters.{name}.api_key_env")
        if config.user_env:
            user = ctx.secret(config.user_env, f"adapters.{name}.user_env")
            self._auth = "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()
        else:
            self._auth = f"Bearer {token}"
        self.capabilities = Capabilities(dedupes_by_key=False, lookup=True)

    def validate(self, operation: str, payload: Mapping[str, Any]) -> None:
        model = _OPERATIONS.get(operation)
        if model is None:
            raise InvalidPayload(f"jira operations: {', '.join(_OPERATIONS)}")
        try:
            parsed = model.model_validate(dict(payload))
        except ValidationError as exc:
            raise InvalidPayload(describe(exc)) from exc
        if isinstance(parsed, CreateIssue):
            if any(not re.fullmatch(r"\S{1,255}", x) for x in parsed.labels):
                raise InvalidPayload("labels must be 1 to 255 characters without spaces")
            if any(x.lower().startswith("fencegate-") for x in parsed.labels):
                # they mark an issue as one step's (lookup) and one tenant's (ownership)
                raise InvalidPayload("labels starting with 'fencegate-' are reserved")
        if isinstance(parsed, AddComment) and not parsed.issue_key.startswith(
            self._config.project + "-"
        ):
            raise InvalidPayload(
                f"issue_key {parsed.issue_key!r} is outside this adapter's project "
                f"{self._config.project!r}"
            )

    async def _call(
        self,
        method: str,
        path: str,
        request: EffectRequest,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> http.Response | NotDelivered | Unknown:
        return await http.request(
            self._http,
            method,
            self._base + path,
            budget=min(self._config.timeout_seconds, request.remaining()),
            max_bytes=self._config.max_response_bytes,
            headers={
                "Authorization": self._auth,
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
            data=None if body is None else json.dumps(body),
            params=params,
        )

    async def dispatch(self, request: EffectRequest) -> Outcome:
        key = request.idempotency_key
        marker = f"[fencegate {key} generation {request.generation} {key_label(key)}]"
        if request.operation == "create_issue":
            p = CreateIssue.model_validate(dict(request.payload))
            fields = {
                "project": {"key": self._config.project},
                "summary": p.summary,
                "description": f"{p.description}\n\n{marker}".strip(),
                "issuetype": {"name": p.issue_type or self._config.default_issue_type},
                "labels": [*p.labels, key_label(key)]
                + ([tenant_label(request.tenant)] if self._config.tenant_keyed else []),
            }
            resp = await self._call("POST", "/rest/api/2/issue", request, body={"fields": fields})
        else:
            c = AddComment.model_validate(dict(request.payload))
            if self._config.tenant_keyed:
                refused = await self._check_owner(request, c.issue_key)
                if refused is not None:
                    return refused
            body = {"body": f"{c.body}\n\n{marker}"}
            resp = await self._call(
                "POST", f"/rest/api/2/issue/{c.issue_key}/comment", request, body=body
            )
        if not isinstance(resp, http.Response):
            return resp
        return _classify(resp)

    async def _check_owner(self, request: EffectRequest, issue_key: str) -> Outcome | None:
        """With several tenants on one Jira project, a comment goes only onto an issue that
        carries the tenant's label (created through fencegate by that tenant). None: go
        ahead. Nothing is sent otherwise: a refusal is ``Failed``, no answer ``NotDelivered``."""
        resp = await self._call(
            "GET", f"/rest/api/2/issue/{issue_key}", request, params={"fields": "labels,project"}
        )
        if not isinstance(resp, http.Response):
            return NotDelivered(f"ownership check of {issue_key} got no answer; nothing was sent")
        if resp.status == 200 and isinstance(resp.body, dict):
            fields = resp.body.get("fields") or {}
            labels = fields.get("labels") or []
            project = (fields.get("project") or {}).get("key", self._config.project)
            if tenant_label(request.tenant) in labels and project == self._config.project:
                return None
            return Failed(
                {
                    "code": "foreign_object",
                    "message": f"issue {issue_key} was not created by this tenant through "
                    "fencegate; nothing was sent",
                }
            )
        if resp.status == 404:
            return Failed(resp.summary())
        return NotDelivered(f"ownership check of {issue_key}: jira answered {resp.status}")

    async def lookup(self, request: EffectRequest) -> Delivered | NotDelivered | None:
        label = key_label(request.idempotency_key)
        if request.operation == "create_issue":
            jql = f'project = "{self._config.project}" AND labels = "{label}"'
            resp = await self._call(
                "GET", "/rest/api/2/search", request, params={"jql": jql, "fields": "key"}
            )
            if (
                not isinstance(resp, http.Response)
                or resp.status != 200
                or not isinstance(resp.body, dict)
            ):
                return None
            issues = resp.body.get("issues") or []
            if issues:
                return Delivered({"id": issues[0].get("id"), "key": issues[0].get("key")})
            return NotDelivered("no issue carries this step's label")
        issue_key = AddComment.model_validate(dict(request.payload)).issue_key
        resp = await self._call(
            "GET", f"/rest/api/2/issue/{issue_key}/comment", request, params={"maxResults": "1000"}
        )
        if (
            not isinstance(resp, http.Response)
            or resp.status != 200
            or not isinstance(resp.body, dict)
        ):
            return None
        for comment in resp.body.get("comments") or []:
            if label in str(comment.get("body", "")):
                return Delivered({"id": comment.get("id"), "issue_key": issue_key})
        return NotDelivered("no comment carries this step's marker")

    async def aclose(self) -> None:
        return None


def _classify(resp: http.Response) -> Outcome:
    if 200 <= resp.status < 300:
        body = resp.body if isinstance(resp.body, dict) else {}
        return Delivered({k: body[k] for k in ("id", "key", "self") if k in body})
    if resp.status in (401, 403, 429):
        return NotDelivered(f"jira answered {resp.status}")
    if resp.status >= 500:
        return Unknown(f"jira answered {resp.status}")
    return Failed(resp.summary())
