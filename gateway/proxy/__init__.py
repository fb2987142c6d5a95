"""The reverse-proxy tier: unmodified HTTP clients and SDKs fenced per step.

``/proxy/<upstream>/<rest>`` reaches a configured upstream's ``base_url`` + ``/<rest>``.
The package is cut by concept, each module below the HTTP layer and above
:mod:`gateway.fencing`:

- :mod:`~gateway.proxy.config`: ``[upstreams.<name>]``, validated before anything starts;
- :mod:`~gateway.proxy.routing`: the path (no escape from the base), the route allow-list,
  the addresses an upstream may resolve to (SSRF);
- :mod:`~gateway.proxy.intent`: the request's intent digest (method, normalised path, sorted
  query, canonical body by media type);
- :mod:`~gateway.proxy.forward`: the upstream call as an adapter (``proxy:<upstream>``), its
  outcome and the recorded response;
- :mod:`~gateway.proxy.answer`: fencegate's own refusals in the client's dialect.
"""
