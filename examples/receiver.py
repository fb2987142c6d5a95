"""A tiny webhook receiver that prints what fencegate sends (for the compose stack and demos).

    python examples/receiver.py [--port 9000]

It answers 200 with a JSON body and shows the Idempotency-Key and
Fencing-Token headers of every request, so duplicates are easy to spot.
"""

from __future__ import annotations

import argparse
from collections import Counter

from aiohttp import web

seen: Counter[str] = Counter()


async def hook(request: web.Request) -> web.Response:
    body = await request.text()
    key = request.headers.get("Idempotency-Key", "-")
    seen[key] += 1
    dup = "  <-- DUPLICATE" if seen[key] > 1 else ""
    print(
        f"key={key} fencing-token={request.headers.get('Fencing-Token')} body={body}{dup}",
        flush=True,
    )
    return web.json_response({"received": True, "times_seen": seen[key]})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/{tail:.*}", hook)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
