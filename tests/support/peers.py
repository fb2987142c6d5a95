"""Protocol peers for adapter tests: small Stripe- and Jira-compatible servers on loopback, an
SMTP sink (aiosmtpd's handler), and :func:`serving` to run an HTTP peer on a loopback port.

They implement the parts of the real APIs the adapters use — Stripe's
form-encoded bodies, Bearer keys, Idempotency-Key replay and conflict, the
Search API; Jira's issue creation, JQL search by label and comments — and
record every object they create, so a test can count downstream effects.
``mode`` makes them misbehave the way real services do.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.test_utils import TestServer


def _drop(request: web.Request) -> None:
    assert request.transport is not None
    request.transport.close()


@dataclass
class StripePeer:
    api_key: str = "sk_test_fencegate"
    # ok | 500 | 429 | drop_after_create | drop_once_after_create (then ok) | search_lag
    mode: str = "ok"
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    idem: dict[str, tuple[list[tuple[str, str]], int, dict[str, Any]]] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/payment_intents", self.create_intent)
        app.router.add_get("/v1/payment_intents/search", self.search)
        app.router.add_get("/v1/payment_intents/{id}", self.retrieve_intent)
        app.router.add_post("/v1/refunds", self.create_refund)
        app.router.add_get("/v1/refunds", self.list_refunds)
        return app

    def _auth(self, request: web.Request) -> web.Response | None:
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response(
                {"error": {"type": "invalid_request_error", "message": "Invalid API Key"}},
                status=401,
            )
        return None

    @staticmethod
    def _unflatten(form: list[tuple[str, str]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in form:
            parts = re.findall(r"[^\[\]]+", key)
            node = out
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = value
        return out

    async def _create(self, request: web.Request, kind: str, build: Any) -> web.StreamResponse:
        if (denied := self._auth(request)) is not None:
            return denied
        form = [(k, v) for k, v in (await request.post()).items() if isinstance(v, str)]
        self.requests.append((request.path, request.headers.get("Idempotency-Key", ""), dict(form)))
        key = request.headers.get("Idempotency-Key")
        if key and key in self.idem:
            params, status, body = self.idem[key]
            if params != form:
                return web.json_response(
                    {
                        "error": {
                            "type": "idempotency_error",
                            "message": "Keys for idempotent requests can only be used "
                            "with the same parameters",
                        }
                    },
                    status=400,
                )
            return web.json_response(body, status=status, headers={"Idempotent-Replayed": "true"})
        if self.mode == "500":
            return web.json_response(
                {"error": {"type": "api_error", "message": "boom"}}, status=500
            )
        if self.mode == "429":
            return web.json_response(
                {"error": {"type": "rate_limit_error", "message": "slow down"}}, status=429
            )
        data = self._unflatten(form)
        status, body = build(data)
        if status == 200:
            self.objects[body["id"]] = body
        if key:
            self.idem[key] = (form, status, body)
        if self.mode in ("drop_after_create", "drop_once_after_create"):
            if self.mode == "drop_once_after_create":
                self.mode = "ok"
            _drop(request)
            await asyncio.sleep(5)
        return web.json_response(body, status=status)

    async def create_intent(self, request: web.Request) -> web.StreamResponse:
        def build(d: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            if d.get("amount") == "402":
                return 402, {
                    "error": {
                        "type": "card_error",
                        "code": "card_declined",
                        "message": "Your card was declined.",
                    }
                }
            if "currency" not in d:
                return 400, {
                    "error": {
                        "type": "invalid_request_error",
                        "message": "Missing required param: currency.",
                    }
                }
            pi = {
                "id": f"pi_{len(self.objects) + 1}",
                "object": "payment_intent",
                "amount": int(d["amount"]),
                "currency": d["currency"],
                "status": "requires_payment_method",
                "metadata": d.get("metadata", {}),
            }
            return 200, pi

        return await self._create(request, "payment_intent", build)

    async def create_refund(self, request: web.Request) -> web.StreamResponse:
        def build(d: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            if d.get("payment_intent") not in self.objects:
                return 404, {
                    "error": {"type": "invalid_request_error", "message": "No such payment_intent"}
                }
            return 200, {
                "id": f"re_{len(self.objects) + 1}",
                "object": "refund",
                "payment_intent": d["payment_intent"],
                "amount": int(d.get("amount", 0)),
                "status": "succeeded",
                "metadata": d.get("metadata", {}),
            }

        return await self._create(request, "refund", build)

    async def search(self, request: web.Request) -> web.Response:
        if (denied := self._auth(request)) is not None:
            return denied
        m = re.fullmatch(r"metadata\['fencegate_key'\]:'([^']*)'", request.query.get("query", ""))
        assert m, request.query
        found = [
            o
            for o in self.created("payment_intent")
            if o["metadata"].get("fencegate_key") == m.group(1) and self.mode != "search_lag"
        ]
        return web.json_response({"object": "search_result", "data": found})

    async def retrieve_intent(self, request: web.Request) -> web.Response:
        if (denied := self._auth(request)) is not None:
            return denied
        pi = self.objects.get(request.match_info["id"])
        if pi is None or pi["object"] != "payment_intent":
            return web.json_response(
                {"error": {"type": "invalid_request_error", "message": "No such payment_intent"}},
                status=404,
            )
        return web.json_response(pi)

    async def list_refunds(self, request: web.Request) -> web.Response:
        pi = request.query.get("payment_intent")
        found = [
            o
            for o in self.objects.values()
            if o["object"] == "refund" and o["payment_intent"] == pi
        ]
        return web.json_response({"object": "list", "data": found})

    def created(self, kind: str = "payment_intent") -> list[dict[str, Any]]:
        return [o for o in self.objects.values() if o["object"] == kind]


@dataclass
class JiraPeer:
    user: str = "bot@example.com"
    token: str = "jira-token"
    mode: str = "ok"  # ok | 500 | 503 | 503_after_create | drop_after_create
    issues: dict[str, dict[str, Any]] = field(default_factory=dict)
    comments: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/rest/api/2/issue", self.create_issue)
        app.router.add_get("/rest/api/2/search", self.search)
        app.router.add_get("/rest/api/2/issue/{key}", self.get_issue)
        app.router.add_post("/rest/api/2/issue/{key}/comment", self.add_comment)
        app.router.add_get("/rest/api/2/issue/{key}/comment", self.list_comments)
        return app

    def _auth(self, request: web.Request) -> bool:
        expected = "Basic " + base64.b64encode(f"{self.user}:{self.token}".encode()).decode()
        return request.headers.get("Authorization") == expected

    async def _misbehave(self, request: web.Request, created: bool) -> web.StreamResponse | None:
        if self.mode == "500" and not created:
            return web.json_response({"errorMessages": ["boom"]}, status=500)
        if self.mode == "503" and not created:
            return web.json_response({"errorMessages": ["maintenance"]}, status=503)
        if self.mode == "503_after_create" and created:  # a proxy's 503 after Jira did it
            return web.json_response({"errorMessages": ["upstream reset"]}, status=503)
        if self.mode == "drop_after_create" and created:
            _drop(request)
            await asyncio.sleep(5)
        return None

    async def create_issue(self, request: web.Request) -> web.StreamResponse:
        if not self._auth(request):
            return web.json_response({"errorMessages": ["unauthorized"]}, status=401)
        if (bad := await self._misbehave(request, created=False)) is not None:
            return bad
        fields = (await request.json())["fields"]
        if not fields.get("summary"):
            return web.json_response({"errors": {"summary": "required"}}, status=400)
        key = f"{fields['project']['key']}-{len(self.issues) + 1}"
        self.issues[key] = {"id": str(10000 + len(self.issues)), "key": key, "fields": fields}
        if (bad := await self._misbehave(request, created=True)) is not None:
            return bad
        return web.json_response(
            {
                "id": self.issues[key]["id"],
                "key": key,
                "self": f"{self.url}/rest/api/2/issue/{key}",
            },
            status=201,
        )

    async def search(self, request: web.Request) -> web.Response:
        m = re.search(r'labels = "([^"]+)"', request.query["jql"])
        assert m, request.query
        found = [
            {"id": i["id"], "key": k}
            for k, i in self.issues.items()
            if m.group(1) in i["fields"]["labels"]
        ]
        return web.json_response({"total": len(found), "issues": found})

    async def get_issue(self, request: web.Request) -> web.Response:
        if not self._auth(request):
            return web.json_response({"errorMessages": ["unauthorized"]}, status=401)
        issue = self.issues.get(request.match_info["key"])
        if issue is None:
            return web.json_response({"errorMessages": ["Issue does not exist"]}, status=404)
        fields = issue["fields"]
        return web.json_response(
            {
                "id": issue["id"],
                "key": issue["key"],
                "fields": {"labels": fields["labels"], "project": fields["project"]},
            }
        )

    async def add_comment(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        if key not in self.issues:
            return web.json_response({"errorMessages": ["Issue does not exist"]}, status=404)
        if (bad := await self._misbehave(request, created=False)) is not None:
            return bad
        body = (await request.json())["body"]
        comment = {"id": str(len(self.comments.get(key, [])) + 1), "body": body}
        self.comments.setdefault(key, []).append(comment)
        await self._misbehave(request, created=True)
        return web.json_response(comment, status=201)

    async def list_comments(self, request: web.Request) -> web.Response:
        return web.json_response({"comments": self.comments.get(request.match_info["key"], [])})


P = TypeVar("P", StripePeer, JiraPeer)


@contextlib.asynccontextmanager
async def serving(peer: P) -> AsyncIterator[P]:
    """Run a protocol peer on a loopback port; its ``url`` is set while it runs."""
    server = TestServer(peer.app(), host="127.0.0.1", port=0)
    await server.start_server()
    peer.url = str(server.make_url("")).rstrip("/")
    try:
        yield peer
    finally:
        await server.close()


@dataclass
class Sink:
    """Records every message; ``mode`` picks how the server answers."""

    mode: str = "accept"
    messages: list[email.message.Message] = field(default_factory=list)
    envelopes: list[Any] = field(default_factory=list)
    port: int = 0

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: Any
    ) -> str:
        if self.mode == "rcpt550":
            return "550 5.1.1 no such user"
        if self.mode == "rcpt450":
            return "450 4.2.1 mailbox busy, try later"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.envelopes.append(envelope)
        self.messages.append(email.message_from_bytes(envelope.content))
        if self.mode == "data554":
            return "554 5.7.1 rejected as spam"
        if self.mode == "data451":
            return "451 4.3.0 try again later"
        if self.mode == "drop":
            server.transport.close()
            await asyncio.sleep(5)
        return "250 2.0.0 queued"
