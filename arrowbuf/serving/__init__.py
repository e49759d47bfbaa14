"""What every arrowbuf server shares: its limits, its bind policy, its error codes and, for the HTTP ones, the
bounded HTTP server.

arrowbuf starts four kinds of server: the Flight server (`arrowbuf.flight.server`), the TransferQueue-compatible
`tq.v2` server (`arrowbuf.compat.transfer_queue.server`), the web inspector (`arrowbuf.observe.ui`) and the
Prometheus endpoint (`arrowbuf.observe.metrics`). Each declares, in `limits.SERVERS`, which of the limits here it
uses; docs/security.md lists them with their defaults and the threat model.

- `limits`: `NetLimits` (the common bounds and their defaults), `check_bind` (a token by default beyond loopback),
  `CallGate` (calls, streams, queries and connections running at once), `public_error` (the code and message a
  client sees: never a traceback or a server path), `AllocationRule` (what a request may make a server allocate).
- `http`: `BoundedHTTPServer` (connection cap, idle and total timeouts) and `RequestGuard` (Host and Origin checks
  against DNS rebinding and cross-site requests), for the inspector and the metrics endpoint.

This package imports only the standard library and `arrowbuf.errors`, so every server, whatever its layer, uses it.
"""
