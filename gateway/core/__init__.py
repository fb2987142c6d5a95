"""The words every layer and the worker SDK share: errors, records, tokens, intents, JSON.

Nothing here imports the server's dependencies (aiohttp, redis, pydantic): the SDK in
:mod:`gateway.client` and third-party adapters may import it."""
