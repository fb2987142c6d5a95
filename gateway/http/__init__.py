"""The HTTP API: the app factory, views, middleware (auth, browser safety, connections), problem
documents and the OpenAPI document. Imports point down: fencing, store, runtime, core."""
