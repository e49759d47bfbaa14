"""Arrow Flight service: serve stores to remote actors and learners, in any language.

`serve(store)` runs a server; `connect(location)` returns a `RemoteStore` with the local store's surface.
The wire format lives in `arrowbuf.flight.protocol` and is documented in docs/flight-protocol.md.

Modules: `protocol/` (the versioned wire format: requests and tickets in its `__init__`, `consume` verbs, the
`errors` table, sampled batches' `meta` columns), `server/` (the service in its `__init__`, what it is built from in
`config`; its limits in `limits`, bounded DoPut and table streams in `streams`, its socket guards in `sockets`,
session prefetch in `prefetch`, received buffers in `heap`, what it sends in `wire`, idle streams in `idle`),
`parts` (a batch or sample larger than one Flight message, sent in parts), `client` (`RemoteStore`, `connect`),
`writer` (`RemoteWriter`, one DoPut stream), `session` (`LearnerSession`, one DoExchange), `messages` (batches to
and from Flight messages), `calls` (what the client's calls share: error translation, timeouts), `location`.
"""

from . import protocol
from .client import RemoteStore, connect
from .limits import ServerLimits
from .server import StoreServer, serve
from .session import LearnerSession
from .writer import RemoteWriter

__all__ = ["LearnerSession", "RemoteStore", "RemoteWriter", "ServerLimits", "StoreServer", "connect", "protocol",
           "serve"]
