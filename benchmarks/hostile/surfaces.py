"""One attack per surface a tenant can store in or hold open, each with the cap that should
hold it (docs/security.md, "Hostile tenants"). A surface says:

- ``config``: its dict merged over the harness's base config (a dict, so a key a newer tree
  has — ``quotas.output_bytes`` — is added only when the settings know it);
- ``attack``: one step of A's flood (``attackers`` loops repeat it) and ``holders``: A's
  long-lived things (sockets, streams, trickling uploads), held until the run stops;
- ``b_iteration``: one round of B's timed calls; what B was told is done is recorded in the
  run and checked afterwards;
- ``a_cap_codes``: problem codes of answers >= 500 that are the cap's documented refusal of
  A (507 ``insufficient_storage`` at the disk floor, 503 ``too_many_connections`` at the
  connection cap); any other answer >= 500 fails the surface.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from benchmarks.hostile.harness import A_ADDR, S3_ENV, Config, Run, auth, merge
from gateway.runtime.settings import QuotaSettings

MiB = 2**20
HOOK = {"adapter": "hook", "operation": "send"}


OUTPUT_QUOTA_MB = 32  # quotas.output_bytes of the outputs surfaces (--outputs-quota-mb)
OUTPUT_OBJECTS = 2000  # quotas.output_objects of the outputs surfaces (--outputs-objects)


def output_quota_keys() -> Config:
    """The per-tenant output quotas when this tree has them (an older tree has none); the
    outputs surfaces pick them up without an edit."""
    keys = {"output_bytes": OUTPUT_QUOTA_MB * MiB, "output_objects": OUTPUT_OBJECTS}
    # 0 is no quota (as in the settings): the floor is then the cap under test
    known = {k: v for k, v in keys.items() if v > 0 and k in QuotaSettings.model_fields}
    return {"quotas": {"tenants": {"a": known}}} if known else {"quotas": {}}


def has_output_quota(key: str = "output_bytes") -> bool:
    """Whether A's outputs are capped per tenant by ``quotas.<key>`` (B keeps the defaults)."""
    return key in output_quota_keys()["quotas"].get("tenants", {}).get("a", {})


async def _raw_answer(reader: asyncio.StreamReader) -> tuple[int, str]:
    """Status and problem code of one answer read off a raw socket (0 at EOF)."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await reader.read(65536)
        if not chunk:
            return 0, ""
        head += chunk
    head, _, body = head.partition(b"\r\n\r\n")
    match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    length = int(match[1]) if match else 0
    while len(body) < length and (chunk := await reader.read(65536)):
        body += chunk
    code = ""
    with contextlib.suppress(ValueError, AttributeError):
        code = str(json.loads(body).get("code", ""))
    return int(head.split()[1]), code


class Surface:
    name = ""
    attack_text = ""  # what A does (the docs table)
    cap_text = ""  # the cap that should hold it
    b_text = "register + synchronous effect"
    group = ""  # surfaces of one group may share a serve (tests)
    attackers = 8
    hold_a = 0.0  # the downstream holds each of A's requests this long
    a_cap_codes: tuple[str, ...] = ()

    async def prepare(self, tmp: Path) -> None:
        """Before the serve starts (a peer it needs)."""

    def config(self, tmp: Path) -> Config:
        return {}

    def cleanup(self) -> None:
        """After the serve stopped."""

    async def setup(self, run: Run) -> None:
        """Once the serve is up, before A attacks."""

    async def attack(self, run: Run) -> None:
        await asyncio.sleep(1)

    def armed(self, run: Run) -> bool:
        """The attack has reached the cap that should hold it: B is timed from then on."""
        return True

    @staticmethod
    def saw(run: Run, *codes: str) -> bool:
        return all(run.tally.a_codes.get(c, 0) for c in codes)

    def holders(self) -> list[Callable[[Run], Awaitable[None]]]:
        return []

    async def b_iteration(self, run: Run, n: int) -> None:
        await run.b_effect(f"b-{self.name}-{n}")

    async def teardown(self, run: Run) -> None:
        """After A stopped, before B's results are checked."""

    # helpers shared by the surfaces

    async def a_register(self, run: Run, job: str, generation: int = 1) -> int:
        status, _ = await run.a_call(
            "POST", f"/v1/jobs/{job}/generations", json={"generation": generation},
            headers=auth("a"),
        )  # fmt: skip
        return status

    async def a_connect(self, run: Run) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", run.gw.port, local_addr=(A_ADDR, 0))

    async def b_checkpoint(self, run: Run, job: str) -> None:
        value = {"job": job, "pad": "c" * 1000}
        status, _ = await run.b_call(
            "checkpoint", "PUT", f"/v1/jobs/{job}/checkpoints/state", (200, 201), json=value,
            headers=auth("b", **{"Fencing-Token": "1"}),
        )  # fmt: skip
        if status in (200, 201):
            run.extra.setdefault("b_checkpoints", []).append((job, value))

    async def b_output(self, run: Run, job: str, size: int = 4096) -> None:
        status, _ = await run.b_call(
            "output", "PUT", f"/v1/jobs/{job}/outputs/b.bin", (201,), data=b"b" * size,
            headers=auth("b", **{"Fencing-Token": "1", "Content-Type": "application/octet-stream"}),
        )  # fmt: skip
        if status == 201:
            run.extra.setdefault("b_outputs", []).append(job)

    async def check_b_stored(self, run: Run) -> list[str]:
        """B's checkpoints read back as written, B's outputs in its job views."""
        out = []
        for job, value in run.extra.get("b_checkpoints", []):
            async with run.b.get(
                f"{run.base}/v1/jobs/{job}/checkpoints/state", headers=auth("b")
            ) as r:
                got = await r.json() if r.status == 200 else {}
            if got.get("value") != value:
                out.append(f"checkpoint of {job}: {r.status}")
        for job in run.extra.get("b_outputs", []):
            async with run.b.get(f"{run.base}/v1/jobs/{job}", headers=auth("b")) as r:
                view = await r.json() if r.status == 200 else {}
            if "b.bin" not in json.dumps(view.get("outputs", {})):
                out.append(f"output of {job} not in its view ({r.status})")
        return out


class Effects(Surface):
    name, group = "effects", "api"
    attack_text = "16 loops of synchronous effect calls, a new job each"
    cap_text = "`quotas.effects_per_window` (A's: 150 per hour)"
    attackers = 16

    def armed(self, run: Run) -> bool:
        return self.saw(run, "429 quota_exceeded")

    def config(self, tmp: Path) -> Config:
        return {"quotas": {"tenants": {"a": {"effects_per_window": 150}}}}

    async def attack(self, run: Run) -> None:
        job = f"a-{self.name}-{run.next('a')}"
        if await self.a_register(run, job) not in (200, 201):
            return
        await run.a_call(
            "POST", f"/v1/jobs/{job}/effects/s", json={**HOOK, "payload": {"j": job}},
            headers=auth("a", **{"Fencing-Token": "1"}),
        )  # fmt: skip


class Payloads(Surface):
    name, group = "payloads", "api"
    attack_text = (
        "8 loops of async calls with ~200 KB payloads to a downstream holding each 5 s, "
        "1,000 idle sockets, 30 bodies that never arrive"
    )
    cap_text = "`quotas.payload_bytes` (4 MiB), bulkheads, `connections.body_timeout_seconds`"
    b_text = "register + synchronous effect + async effect (delivered by the relay)"
    hold_a = 5.0
    idle = 1000
    slow_bodies = 30
    big: ClassVar[dict[str, str]] = {f"part{i}": "x" * 50_000 for i in range(4)}  # ~200 KB

    def armed(self, run: Run) -> bool:
        held = run.tally.notes["a_idle_sockets_peak"] >= self.idle
        timed_out = not self.slow_bodies or self.saw(run, "408 request_timeout")
        return held and timed_out and self.saw(run, "429 quota_exceeded")

    def config(self, tmp: Path) -> Config:
        return {"quotas": {"payload_bytes": 4 * MiB}}

    async def attack(self, run: Run) -> None:
        job = f"a-{self.name}-{run.next('a')}"
        if await self.a_register(run, job) not in (200, 201):
            return
        await run.a_call(
            "POST", f"/v1/jobs/{job}/effects/s", json={**HOOK, "payload": self.big},
            headers=auth("a", **{"Fencing-Token": "1", "Prefer": "respond-async"}),
        )  # fmt: skip

    def holders(self) -> list[Callable[[Run], Awaitable[None]]]:
        return [self.hold_idle] + [self.slow_body] * self.slow_bodies

    async def hold_idle(self, run: Run) -> None:
        sockets: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        try:
            while not run.stop.is_set():
                while len(sockets) < self.idle and not run.stop.is_set():
                    try:
                        sockets.append(await self.a_connect(run))
                    except OSError:
                        run.tally.notes["a_connect_refused"] += 1
                        break
                run.tally.notes["a_idle_sockets_peak"] = max(
                    run.tally.notes["a_idle_sockets_peak"], len(sockets)
                )
                await asyncio.sleep(0.5)
                for pair in list(sockets):  # re-open the ones the gateway closed
                    if pair[0].at_eof():
                        pair[1].close()
                        sockets.remove(pair)
        finally:
            for _, writer in sockets:
                writer.close()

    async def slow_body(self, run: Run) -> None:
        head = (
            f"POST /v1/jobs/a-slow/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {auth('a')['Authorization'][7:]}\r\n"
            "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n{"
        ).encode()
        while not run.stop.is_set():
            try:
                reader, writer = await self.a_connect(run)
            except OSError:
                await asyncio.sleep(0.2)
                continue
            try:
                writer.write(head)
                with contextlib.suppress(TimeoutError, OSError):
                    async with asyncio.timeout(10):
                        status, code = await _raw_answer(reader)
                        if status:
                            run.note_a(status, code)
            finally:
                writer.close()

    async def b_iteration(self, run: Run, n: int) -> None:
        job = f"b-{self.name}-{n}"
        await run.b_effect(job)
        status, _ = await run.b_call(
            "effect async", "POST", f"/v1/jobs/{job}/effects/later", (202,),
            json={**HOOK, "payload": {"later": job}},
            headers=auth("b", **{"Fencing-Token": "1", "Prefer": "respond-async"}),
        )  # fmt: skip
        if status == 202:
            run.b_async.append((job, "later"))


class Checkpoints(Surface):
    name, group = "checkpoints", "api"
    attack_text = "8 loops writing 60 KB checkpoints under new names, a new job at the name cap"
    cap_text = "`quotas.checkpoint_bytes` (8 MiB), `checkpoints.max_per_job` (10)"
    b_text = "register + synchronous effect + a 1 KB checkpoint (read back after)"
    value: ClassVar[dict[str, str]] = {"pad": "k" * 60_000}

    def armed(self, run: Run) -> bool:
        return self.saw(run, "413 too_many_checkpoints", "429 quota_exceeded")

    def config(self, tmp: Path) -> Config:
        return {"quotas": {"checkpoint_bytes": 8 * MiB}, "checkpoints": {"max_per_job": 10}}

    async def attack(self, run: Run) -> None:
        job = f"a-{self.name}-{run.next('a')}"
        if await self.a_register(run, job) not in (200, 201):
            return
        for i in range(60):
            status, _ = await run.a_call(
                "PUT", f"/v1/jobs/{job}/checkpoints/c{i}", json=self.value,
                headers=auth("a", **{"Fencing-Token": "1"}),
            )  # fmt: skip
            if status == 413 or run.stop.is_set():
                return  # the job's names are used up: next job
            if status == 429:
                await asyncio.sleep(0.05)

    async def b_iteration(self, run: Run, n: int) -> None:
        job = f"b-{self.name}-{n}"
        await run.b_effect(job)
        await self.b_checkpoint(run, job)

    async def setup(self, run: Run) -> None:
        run.b_checks.append(lambda: self.check_b_stored(run))


class Audit(Surface):
    name, group = "audit", "api"
    attack_text = "16 loops of a stale worker's calls (generation 1 below the fence 2)"
    cap_text = "`quotas.rejections_per_window` (A's: 200 per hour)"
    b_text = "register + synchronous effect + one stale call (its audit entry read back)"
    attackers = 16

    def armed(self, run: Run) -> bool:
        return run.tally.a_codes.get("409 stale_generation", 0) > 200

    def config(self, tmp: Path) -> Config:
        return {"quotas": {"tenants": {"a": {"rejections_per_window": 200}}}}

    async def setup(self, run: Run) -> None:
        for k in range(8):
            await self.a_register(run, f"a-{self.name}-j{k}", generation=2)
        run.b_checks.append(lambda: self.check_b_audited(run))

    async def attack(self, run: Run) -> None:
        n = run.next("a")
        await run.a_call(
            "POST", f"/v1/jobs/a-{self.name}-j{n % 8}/effects/s{n}",
            json={**HOOK, "payload": {"n": n}}, headers=auth("a", **{"Fencing-Token": "1"}),
        )  # fmt: skip

    async def b_iteration(self, run: Run, n: int) -> None:
        job = f"b-{self.name}-{n}"
        await run.b_effect(job)
        await run.b_call(
            "register g2", "POST", f"/v1/jobs/{job}/generations", (201,),
            json={"generation": 2}, headers=auth("b"),
        )  # fmt: skip
        status, _ = await run.b_call(
            "stale effect", "POST", f"/v1/jobs/{job}/effects/late", (409,),
            json={**HOOK, "payload": {}}, headers=auth("b", **{"Fencing-Token": "1"}),
        )  # fmt: skip
        if status == 409:
            run.extra.setdefault("b_stale", []).append(job)

    async def check_b_audited(self, run: Run) -> list[str]:
        seen = await feed_jobs(run, "b")
        a_seen = await feed_jobs(run, "a")
        run.tally.notes["a_feed_entries"] = sum(
            1 for j in a_seen if j.startswith(f"a-{self.name}-")
        )
        return [f"stale call of {j} not audited" for j in run.extra.get("b_stale", [])
                if j not in seen]  # fmt: skip


async def feed_jobs(run: Run, tenant: str) -> list[str]:
    """The job ids of a tenant's whole audit feed (API pages of 1,000)."""
    jobs: list[str] = []
    cursor = ""
    while True:
        query = "?limit=1000" + (f"&cursor={cursor}" if cursor else "")
        async with run.b.get(f"{run.base}/v1/audit/rejections{query}", headers=auth(tenant)) as r:
            page = await r.json()
        jobs += [item["job_id"] for item in page["items"]]
        cursor = page.get("next_cursor") or ""
        if not cursor:
            return jobs


async def console_login(
    run: Run, tenant: str, key_role: str = "auditor", local: str | None = None
) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, local_addr=(local, 0) if local else None)
    session = aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.CookieJar(unsafe=True),
        timeout=aiohttp.ClientTimeout(total=30),
    )  # fmt: skip
    async with session.post(
        f"{run.base}/console/login", data={"key": auth(tenant, key_role)["Authorization"][7:],
                                           "next": "/console/rejections"},
        headers={"Origin": run.base}, allow_redirects=False,
    ) as r:  # fmt: skip
        if r.status != 303:
            await session.close()
            raise RuntimeError(f"console login of {tenant}: {r.status} {await r.text()}")
    return session


class Exports(Surface):
    name, group = "exports", "api"
    attack_text = (
        "8 loops of whole-feed CSV exports, JSON exports whose filter matches nothing and "
        "1,000-entry API pages of a feed of ~2,000 rejections (its stale calls first)"
    )
    cap_text = "exports cut at 10,000 rows, read in pages of 500; API pages of at most 1,000"
    b_text = "register + synchronous effect + an API audit page + a CSV export of its own feed"
    feed = 2000  # A's stale calls before the exports (its feed, audited)

    async def setup(self, run: Run) -> None:
        for k in range(4):
            await self.a_register(run, f"a-{self.name}-j{k}", generation=2)

        async def stale(i: int) -> None:
            for n in range(i, self.feed, 16):
                await run.a_call(
                    "POST", f"/v1/jobs/a-{self.name}-j{n % 4}/effects/s{n}",
                    json={**HOOK, "payload": {}}, headers=auth("a", **{"Fencing-Token": "1"}),
                )  # fmt: skip

        await asyncio.gather(*(stale(i) for i in range(16)))
        run.extra["a_console"] = await console_login(run, "a", local=A_ADDR)
        run.extra["b_console"] = await console_login(run, "b")

    async def attack(self, run: Run) -> None:
        n = run.next("a")
        console = run.extra["a_console"]
        if n % 3 == 0:
            await run.a_call("GET", "/console/rejections.csv", session=console)
        elif n % 3 == 1:
            await run.a_call("GET", "/console/rejections.json?job=nothing-matches", session=console)
        else:
            await run.a_call("GET", "/v1/audit/rejections?limit=1000", headers=auth("a", "auditor"))

    async def b_iteration(self, run: Run, n: int) -> None:
        await run.b_effect(f"b-{self.name}-{n}")
        await run.b_call(
            "audit page", "GET", "/v1/audit/rejections?limit=100", (200,),
            headers=auth("b", "auditor"),
        )  # fmt: skip
        # B's one login exports one at a time, as console.exports_per_session (1) asks of it
        async with run.extra.setdefault("b_export_turn", asyncio.Lock()):
            await run.b_call(
                "export", "GET", "/console/rejections.csv", (200,), session=run.extra["b_console"]
            )

    async def teardown(self, run: Run) -> None:
        for key in ("a_console", "b_console"):
            await run.extra[key].close()


class Console(Surface):
    name, group = "console", "held"
    attack_text = (
        "an auditor's 10 logins opening 40 SSE streams (re-opened when refused or closed), "
        "2 loops of wrong-key logins from A's peer"
    )
    cap_text = (
        "`console.sse_per_session` (4), `console.sse_per_tenant` (16), "
        "`console.login_failures_per_peer` (10 per 60 s)"
    )
    b_text = "a console login + the rejections page + register + effect; one SSE stream held"
    attackers = 2

    def armed(self, run: Run) -> bool:
        return run.tally.notes["a_streams_peak"] >= 16 and run.tally.a_statuses[429] > 0

    def config(self, tmp: Path) -> Config:
        return {
            "console": {
                "sse_per_session": 4, "sse_per_tenant": 16, "sse_ping_seconds": 0.5,
                "login_failures_per_peer": 10, "login_failures_total": 200,
            }
        }  # fmt: skip

    async def setup(self, run: Run) -> None:
        run.extra["a_logins"] = [await console_login(run, "a", local=A_ADDR) for _ in range(10)]
        b = await console_login(run, "b")
        run.extra["b_login"] = b
        stream = await b.get(f"{run.base}/console/rejections/stream")
        if stream.status != 200:
            raise RuntimeError(f"B's stream: {stream.status}")
        run.extra["b_stream"] = stream
        run.b_checks.append(lambda: self.check_b_stream(run))

    def holders(self) -> list[Callable[[Run], Awaitable[None]]]:
        return [self.hold_stream_of(i) for i in range(40)]

    def hold_stream_of(self, i: int) -> Callable[[Run], Awaitable[None]]:
        async def hold(run: Run) -> None:
            session = run.extra["a_logins"][i % 10]
            while not run.stop.is_set():
                try:
                    async with session.get(
                        f"{run.base}/console/rejections/stream",
                        timeout=aiohttp.ClientTimeout(total=None, sock_read=10),
                    ) as r:
                        run.note_a(r.status, "")
                        if r.status == 200:
                            notes = run.tally.notes
                            notes["a_streams_open"] += 1
                            notes["a_streams_peak"] = max(
                                notes["a_streams_peak"], notes["a_streams_open"]
                            )
                            try:
                                async for _ in r.content.iter_any():
                                    if run.stop.is_set():
                                        break
                            finally:
                                run.tally.notes["a_streams_open"] -= 1
                        else:
                            await r.read()
                            await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                except (aiohttp.ClientError, TimeoutError):
                    run.tally.notes["a_stream_errors"] += 1
                    await asyncio.sleep(0.2)

        return hold

    async def attack(self, run: Run) -> None:
        console = run.extra.setdefault("a_guess", None)
        if console is None:
            connector = aiohttp.TCPConnector(limit=0, local_addr=(A_ADDR, 0))
            console = run.extra["a_guess"] = aiohttp.ClientSession(connector=connector)
        status, _ = await run.a_call(
            "POST", "/console/login", session=console, allow_redirects=False,
            data={"key": f"guess-{uuid.uuid4().hex}", "next": "/console/"},
            headers={"Origin": run.base},
        )  # fmt: skip
        if status == 429:
            await asyncio.sleep(0.1)

    async def b_iteration(self, run: Run, n: int) -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as own:
            status, _ = await run.b_call(
                "console login", "POST", "/console/login", (303,), session=own,
                data={"key": auth("b", "auditor")["Authorization"][7:],
                      "next": "/console/rejections"},
                headers={"Origin": run.base}, allow_redirects=False,
            )  # fmt: skip
            if status == 303:
                await run.b_call("console page", "GET", "/console/rejections", (200,), session=own)
        await run.b_effect(f"b-{self.name}-{n}")

    async def check_b_stream(self, run: Run) -> list[str]:
        stream: aiohttp.ClientResponse = run.extra["b_stream"]
        out = []
        try:
            async with asyncio.timeout(3):  # a ping arrives every 0.5 s on a live stream
                data = await stream.content.readany()
            if not data:
                out.append("B's SSE stream was closed")
        except (TimeoutError, aiohttp.ClientError) as exc:
            out.append(f"B's SSE stream: {type(exc).__name__}")
        stream.close()
        for session in [run.extra["b_login"], *run.extra["a_logins"]]:
            await session.close()
        if run.extra.get("a_guess") is not None:
            await run.extra["a_guess"].close()
        return out


class Uploads(Surface):
    name, group = "uploads", "held"
    attack_text = "40 uploads trickling one byte a second (re-opened when answered)"
    cap_text = (
        "`outputs.uploads_per_tenant` (8), `outputs.min_upload_bytes_per_second` (1,024 over "
        "2 s windows), `connections.max_per_tenant` (half of 64)"
    )
    b_text = "register + synchronous effect + a 4 KB output upload (in its job view after)"
    attackers = 0

    def armed(self, run: Run) -> bool:
        return self.saw(run, "429 too_many_held")

    def config(self, tmp: Path) -> Config:
        return {
            "connections": {"max": 64, "idle_timeout_seconds": 30, "body_timeout_seconds": 30},
            "outputs": {"uploads_per_tenant": 8, "min_upload_bytes_per_second": 1024,
                        "min_upload_window_seconds": 2},
        }  # fmt: skip

    async def setup(self, run: Run) -> None:
        await self.a_register(run, f"a-{self.name}")
        run.b_checks.append(lambda: self.check_b_stored(run))

    def holders(self) -> list[Callable[[Run], Awaitable[None]]]:
        return [self.trickle] * 40

    async def trickle(self, run: Run) -> None:
        while not run.stop.is_set():
            name = f"t{run.next('trickle')}"
            head = (
                f"PUT /v1/jobs/a-{self.name}/outputs/{name} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {auth('a')['Authorization'][7:]}\r\nFencing-Token: 1\r\n"
                "Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n\r\n"
            ).encode()
            try:
                reader, writer = await self.a_connect(run)
            except OSError:
                await asyncio.sleep(0.2)
                continue
            try:
                writer.write(head)
                answer = asyncio.ensure_future(_raw_answer(reader))
                while not run.stop.is_set():
                    done, _ = await asyncio.wait({answer}, timeout=1.0)
                    if done:
                        status, code = answer.result()
                        if status:
                            run.note_a(status, code)
                        if status == 429:
                            await asyncio.sleep(0.5)
                        break
                    writer.write(b"x")
                answer.cancel()
            except OSError:
                run.tally.notes["a_trickle_reset"] += 1
            finally:
                writer.close()

    async def b_iteration(self, run: Run, n: int) -> None:
        job = f"b-{self.name}-{n}"
        await run.b_effect(job)
        await self.b_output(run, job)


class KeepAlive(Surface):
    name, group = "keepalive", "held"
    attack_text = (
        "90 sockets on a cap of 64: 30 idle, 30 after one `GET /healthz`, 30 after one "
        "authenticated request (each re-opened when closed)"
    )
    cap_text = "`connections.max` (64, idle evicted first), `connections.max_per_tenant` (32)"
    attackers = 0
    a_cap_codes = ("too_many_connections",)

    def armed(self, run: Run) -> bool:
        notes = run.tally.notes
        return all(notes[f"a_{k}_closed_by_gateway"] for k in ("idle", "healthz", "keyed"))

    def config(self, tmp: Path) -> Config:
        return {"connections": {"max": 64, "idle_timeout_seconds": 30}}

    def holders(self) -> list[Callable[[Run], Awaitable[None]]]:
        return [self.hold_of(kind) for kind in ("idle", "healthz", "keyed") for _ in range(30)]

    def hold_of(self, kind: str) -> Callable[[Run], Awaitable[None]]:
        request = {
            "idle": b"",
            "healthz": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
            "keyed": (
                "GET /v1/jobs/a-keepalive HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {auth('a')['Authorization'][7:]}\r\n\r\n"
            ).encode(),
        }[kind]

        async def hold(run: Run) -> None:
            while not run.stop.is_set():
                try:
                    reader, writer = await self.a_connect(run)
                except OSError:
                    await asyncio.sleep(0.2)
                    continue
                try:
                    if request:
                        writer.write(request)
                        status, code = await _raw_answer(reader)
                        if status:
                            run.note_a(status, code)
                    await reader.read(1)  # held until the gateway closes it
                    run.tally.notes[f"a_{kind}_closed_by_gateway"] += 1
                except OSError:
                    run.tally.notes[f"a_{kind}_reset"] += 1
                finally:
                    writer.close()
                await asyncio.sleep(0.05)

        return hold


class OutputObjects(Surface):
    name, group = "outputs-objects", "outputs"
    attack_text = "8 loops uploading 16-byte outputs under new names, 200 per job"
    b_text = "register + synchronous effect + a 4 KB output upload (in its job view after)"

    @property
    def cap_text(self) -> str:  # type: ignore[override]
        quota = "`quotas.output_objects`" if has_output_quota("output_objects") else "none"
        return f"{quota}; `outputs.uploads_per_tenant` (8) bounds the rate"

    def config(self, tmp: Path) -> Config:
        return output_quota_keys()

    def armed(self, run: Run) -> bool:
        return not has_output_quota("output_objects") or self.saw(run, "429 quota_exceeded")

    async def setup(self, run: Run) -> None:
        run.b_checks.append(lambda: self.check_b_stored(run))

    async def attack(self, run: Run) -> None:
        job = f"a-{self.name}-{run.next('a')}"
        if await self.a_register(run, job) not in (200, 201):
            return
        for i in range(200):
            if run.stop.is_set():
                return
            status, _ = await run.a_call(
                "PUT", f"/v1/jobs/{job}/outputs/o{i}", data=b"o" * 16,
                headers=auth("a", **{"Fencing-Token": "1",
                                     "Content-Type": "application/octet-stream"}),
            )  # fmt: skip
            if status == 429:
                await asyncio.sleep(0.05)

    async def b_iteration(self, run: Run, n: int) -> None:
        job = f"b-{self.name}-{n}"
        await run.b_effect(job)
        await self.b_output(run, job)


class OutputBytes(Surface):
    name, group = "outputs", "outputs"
    a_cap_codes = ("insufficient_storage",)

    @property
    def attack_text(self) -> str:  # type: ignore[override]
        until = "its quota" if has_output_quota() else "the volume reaches its floor"
        return f"8 loops uploading 1 MiB outputs under new names (every 8th 2 MiB) until {until}"

    room_mb = 128  # --outputs-budget-mb

    def room(self, free_mb: int) -> int:
        """What may be written before the floor (the floor is set that far below the free
        space at start). Without an output quota the floor is the cap under test, and A must
        reach it: ``room_mb``. With one, the quota holds A and the floor is only the backstop:
        at least 8 times A's quota and three quarters of the free space, because the volume
        may be shared (a CI machine's disk is thin-provisioned: other machines' writes take
        its free space, seen at 287 MiB) and the floor, which is every tenant's, must not come
        into B's run by anyone else's writes."""
        if has_output_quota():
            return max(self.room_mb, 8 * OUTPUT_QUOTA_MB, free_mb * 3 // 4)
        return self.room_mb

    def armed(self, run: Run) -> bool:
        if has_output_quota():
            return self.saw(run, "429 quota_exceeded")
        return self.saw(run, "413 payload_too_large", "507 insufficient_storage")

    @property
    def cap_text(self) -> str:  # type: ignore[override]
        quota = "`quotas.output_bytes`, " if has_output_quota() else ""
        room = "3/4 of" if has_output_quota() else f"{self.room_mb} MiB below"
        return (
            f"{quota}`outputs.min_free_mb` + `redis.min_free_mb` ({room} the free space at "
            "start), `outputs.max_bytes` (1 MiB)"
        )

    @property
    def b_text(self) -> str:  # type: ignore[override]
        if has_output_quota():
            return "register + effect + 1 KB checkpoint + a 4 KB output upload"
        return "register + effect + 1 KB checkpoint (no output: the floor is every tenant's)"

    def config(self, tmp: Path) -> Config:
        free_mb = shutil.disk_usage(tmp).free // MiB
        floor = max(0, free_mb - self.room(free_mb))
        # the embedded Redis's floor is added to the file store's on the same volume: split
        # the floor between them so that a small free space does not put it above `free_mb`
        redis_floor = min(256, floor)
        return merge(
            {"outputs": {"min_free_mb": floor - redis_floor, "max_bytes": MiB},
             "redis": {"min_free_mb": redis_floor}},
            output_quota_keys(),
        )  # fmt: skip

    async def setup(self, run: Run) -> None:
        run.b_checks.append(lambda: self.check_b_stored(run))

    async def attack(self, run: Run) -> None:
        job = f"a-{self.name}-{run.next('a')}"
        if await self.a_register(run, job) not in (200, 201):
            return
        for i in range(16):
            if run.stop.is_set():
                return
            size = 2 * MiB if i % 8 == 7 else MiB
            status, _ = await run.a_call(
                "PUT", f"/v1/jobs/{job}/outputs/o{i}", data=b"O" * size,
                headers=auth("a", **{"Fencing-Token": "1",
                                     "Content-Type": "application/octet-stream"}),
            )  # fmt: skip
            if status in (429, 507):
                await asyncio.sleep(0.1)

    async def b_iteration(self, run: Run, n: int) -> None:
        job = f"b-{self.name}-{n}"
        await run.b_effect(job)
        await self.b_checkpoint(run, job)
        if has_output_quota():
            await self.b_output(run, job)


class Presigned(Surface):
    name, group = "presigned", "s3"
    attack_text = (
        "4 loops: a signed URL, a 2 MiB PUT to it, the completion that names it; "
        "4 loops asking for signed URLs only"
    )
    cap_text = "`outputs.max_bytes` (1 MiB, checked before the completion records it)"
    b_text = "register + synchronous effect + a 4 KB upload through the gateway (S3)"
    moto: Any = None
    bucket = "fg-hostile"

    def armed(self, run: Run) -> bool:
        return self.saw(run, "413 payload_too_large")

    async def prepare(self, tmp: Path) -> None:
        from tests.support.s3peer import MotoServer  # moto: the dev extra

        self.moto = MotoServer()
        await asyncio.to_thread(self.moto.start)
        await asyncio.to_thread(self.moto.create_bucket, self.bucket)

    def cleanup(self) -> None:
        if self.moto is not None:
            self.moto.stop()

    def config(self, tmp: Path) -> Config:
        assert self.moto is not None
        key_env, secret_env = list(S3_ENV)
        return {
            "outputs": {
                "store": "s3", "path": "", "bucket": self.bucket, "prefix": "outputs/",
                "endpoint": self.moto.endpoint, "allow_http": True, "max_bytes": MiB,
                "access_key_id_env": key_env, "secret_access_key_env": secret_env,
            }
        }  # fmt: skip

    async def setup(self, run: Run) -> None:
        run.b_checks.append(lambda: self.check_b_stored(run))

    async def attack(self, run: Run) -> None:
        n = run.next("a")
        job = f"a-{self.name}-{n}"
        if await self.a_register(run, job) not in (200, 201):
            return
        status, body = await run.a_call(
            "POST", f"/v1/jobs/{job}/outputs/big/upload-url", json={},
            headers=auth("a", **{"Fencing-Token": "1"}),
        )  # fmt: skip
        if status != 201 or n % 2:
            return  # (half of the loops only ask for URLs)
        url = json.loads(body)["url"]
        try:
            async with run.a.put(
                url, data=b"P" * (2 * MiB), headers={"Content-Type": "application/octet-stream"}
            ) as put:
                run.tally.notes[f"a_s3_put_{put.status}"] += 1
        except aiohttp.ClientError:
            run.tally.notes["a_s3_put_error"] += 1
        await run.a_call(
            "POST", f"/v1/jobs/{job}/complete", json={"outputs": ["big"], "result": {}},
            headers=auth("a", **{"Fencing-Token": "1"}),
        )  # fmt: skip

    async def b_iteration(self, run: Run, n: int) -> None:
        job = f"b-{self.name}-{n}"
        await run.b_effect(job)
        await self.b_output(run, job)


SURFACES: dict[str, type[Surface]] = {
    s.name: s
    for s in (
        Effects,
        Payloads,
        Checkpoints,
        OutputBytes,
        OutputObjects,
        Presigned,
        Audit,
        Console,
        Uploads,
        KeepAlive,
        Exports,
    )
}
