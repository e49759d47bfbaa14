"""The Flight server's limits: request bounds (`ServerLimits`) and how many calls may run at once (`CallGate`, shared
by every arrowbuf server: `arrowbuf.serving.limits`, which also holds the bind policy and the error codes).

Every number a remote client sends is bounded here before the store sees it: batch rows and bytes, n_step, how
long a request may wait, how many calls, queries and table streams run at once, and the SQL sandbox's limits. The
server states its limits in the `describe` action (`"limits"`), so a client can size its requests.

gRPC gives every call its own thread and pyarrow exposes no cap on them, so the server counts the calls its
handlers are running and refuses one more past a limit at once, with `ResourceExhausted` (RESOURCE_EXHAUSTED on the
wire), instead of letting threads and their buffers pile up. Nothing is queued: a refused client retries later.

Usage loop (what a handler does)::

    gate = CallGate({"call": 64, "sql": 2})
    with gate.enter("call"), gate.enter("sql"):
        ...                                  # the work
    gate.wait_idle(timeout=5.0)              # True once no call runs (tests, shutdown)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..errors import InvalidArgument, ResourceExhausted, SchemaError
from ..query.sql import DEFAULT_LIMITS, SqlLimits
from ..serving.limits import KINDS, CallGate


@dataclass(frozen=True)
class ServerLimits:
    """Bounds of every request a Flight server accepts; `ab.serve(store, limits=..., **overrides)`.

    Attributes:
        max_batch_rows: the largest batch DoPut accepts and the largest sample served.
        max_batch_bytes: the largest DoPut batch (one Flight message) in bytes (ragged and string columns have no
            row size); a client cuts a larger extend into parts of at most this size (protocol 3).
        max_extend_bytes: the largest extend sent in parts, in bytes: the server holds it whole (assembled) before
            it commits it as one, unless `parts_into_ring`.
        parts_into_ring: write each part of an extend sent in parts straight into ring rows reserved at its first
            part (one copy instead of two, no assembled copy held; stores of plain columns, and host stores with
            ragged fields; others assemble). A client then sends any batch over 2 x `parts.PIPELINE_PART_BYTES`
            in parts of that size (`describe` says so), so the server copies each part while the next one travels.
            False by default: until the last part arrives, the reservation holds back the commits of every later
            writer of the store (a store with ragged fields holds its write lock for the whole batch: also other
            writers' reservations, `update` and checkpoints wait), so a client that stalls mid-batch stalls the
            store's ingest until its stream is cut (`stream_idle_timeout`, a cancelled call). Turn it on where the
            clients are trusted (your own actors).
        max_prefetch_bytes: bytes of prefetched batches one learner session may hold on the server.
        max_n_step: the largest `n_step` a sample may ask for (its cost grows with n * n_step).
        max_timeout: the longest wait, in seconds, any request may ask for (sample, session and insert timeouts).
        max_concurrent_calls: calls of any verb running at once (open sessions and DoPut streams count).
        max_concurrent_streams: DoPut uploads and DoExchange sessions open at once (`stream_slots`: also at least a
            quarter of `max_concurrent_calls` fewer): a client that opens streams and then sends nothing holds its
            slots, so the rest stay free for short calls (sample, len, stats, actions) whatever idle streams are open.
        stream_idle_timeout: when every stream slot is taken, a new upload or session cuts the connections of
            streams that have not sent or received a message for this many seconds, and waits a moment for their
            slots (`arrowbuf.flight.idle`); streams are never cut while slots are free.
        max_concurrent_sql: `sql` queries running at once.
        max_table_streams: `table` streams being sent at once.
        shutdown_timeout: seconds `close()` waits for calls in progress.
        sql_limits: deadline, memory and result-size limits of each `sql` query (`ab.SqlLimits`).
        max_tasks: consuming tasks a store may have for the `add_task` action to add one more (each task keeps a
            record of consumed rows as large as the ring, and eviction waits for every task).
        monotonic_policy_version: the `set_policy_version` action refuses a version lower than the store's (True,
            the default: a client moving it back, or far ahead, would starve every consumer with `max_staleness`);
            False allows any non-negative version (a trainer that restarts from an older checkpoint, trusted).
        max_policy_version_step: with `monotonic_policy_version`, the most one `set_policy_version` may raise the
            version by (a jump to 2**63 - 1 could never be undone).
        max_leases_per_client: open leases (`consume` with `lease=`) one client connection may hold on a store;
            past it a consume with a lease is refused (`ResourceExhausted`), so no client holds every row in flight.
    """

    max_batch_rows: int = 65_536
    max_batch_bytes: int = 256 << 20
    max_extend_bytes: int = 4 << 30
    parts_into_ring: bool = False
    max_prefetch_bytes: int = 512 << 20
    max_n_step: int = 1_000
    max_timeout: float = 3_600.0
    max_concurrent_calls: int = 64
    max_concurrent_streams: int = 48
    stream_idle_timeout: float = 60.0
    max_concurrent_sql: int = 2
    max_table_streams: int = 4
    shutdown_timeout: float = 2.0
    sql_limits: SqlLimits = field(default_factory=lambda: DEFAULT_LIMITS)
    max_tasks: int = 32
    monotonic_policy_version: bool = True
    max_policy_version_step: int = 1_000_000
    max_leases_per_client: int = 1_024

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise InvalidArgument(f"{f.name} must be True or False, got {value!r}")
            elif f.name == "sql_limits":
                if not isinstance(value, SqlLimits):
                    raise InvalidArgument(f"sql_limits must be an ab.SqlLimits, got {type(value).__name__}")
            elif f.type in ("float", float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e6:
                    raise InvalidArgument(f"{f.name} must be a number of seconds in (0, 1e6], got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{f.name} must be a positive integer, got {value!r}")

    @property
    def stream_slots(self) -> int:
        """Uploads and sessions open at once: `max_concurrent_streams`, and always a quarter of the calls (at least
        one) fewer than `max_concurrent_calls`, which stay free for short calls."""
        calls = self.max_concurrent_calls
        return max(1, min(self.max_concurrent_streams, calls - max(1, calls // 4)))

    def with_overrides(self, **overrides: Any) -> ServerLimits:
        """A copy with some limits changed (`serve(store, max_batch_rows=...)`); unknown names are an error."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InvalidArgument(f"unknown server limit(s) {unknown}; expected some of {sorted(known)}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def describe(self) -> dict[str, Any]:
        """The limits as JSON-ready values (the `describe` action's `"limits"`)."""
        out = asdict(self)
        out["sql_limits"] = self.sql_limits.describe()
        out.update(protocol_limits())
        return out

    # ---------------------------------------------------------------- request checks
    def check_rows(self, n: int, what: str) -> None:
        if n > self.max_batch_rows:
            raise SchemaError(f"{what} of {n} rows is over this server's max_batch_rows {self.max_batch_rows}; "
                              "split it into smaller batches")

    def check_timeout(self, timeout: float | None, what: str) -> None:
        if timeout is not None and timeout > self.max_timeout:
            raise InvalidArgument(f"{what}: timeout {timeout:g} s is over this server's max_timeout "
                                  f"{self.max_timeout:g} s; wait in several shorter calls")

    def check_options(self, options: dict[str, Any], what: str) -> None:
        n_step = options.get("n_step")
        if n_step is not None and n_step > self.max_n_step:
            raise InvalidArgument(f"{what}: n_step {n_step} is over this server's max_n_step {self.max_n_step}")

    def check_policy_version(self, current: int, new: int, what: str) -> None:
        """A `set_policy_version` from `current` to `new` (with `monotonic_policy_version`: never down, bounded up)."""
        if not self.monotonic_policy_version:
            return
        if new < current:
            raise InvalidArgument(f"{what}: policy_version {new} is below the store's {current}; this server keeps "
                                  "it monotonic (ServerLimits.monotonic_policy_version) so consumers with "
                                  "max_staleness are not starved; set a version >= the current one")
        if new - current > self.max_policy_version_step:
            raise InvalidArgument(f"{what}: policy_version {new} is more than max_policy_version_step "
                                  f"({self.max_policy_version_step}) above the store's {current}; raise it in steps")

    def check_add_task(self, tasks: int, what: str) -> None:
        """One more consuming task on a store that has `tasks` (the `add_task` action)."""
        if tasks >= self.max_tasks:
            raise ResourceExhausted(f"{what}: the store has {tasks} tasks, this server's max_tasks; a remote client "
                                    "cannot add more (declare them with ExperienceStore(..., tasks=[...]))")

    def check_sample(self, n: int, timeout: float | None, options: dict[str, Any], what: str) -> None:
        """Bounds of a sample request (DoGet ticket or session descriptor)."""
        self.check_rows(n, f"{what} n")
        self.check_timeout(timeout, what)
        self.check_options(options, what)

def protocol_limits() -> dict[str, int]:
    """The bounds fixed by the protocol module (the same on every server), as `describe` states them."""
    from . import protocol as P

    return {"max_json_bytes": P.MAX_JSON_BYTES, "max_message_chars": P.MAX_MESSAGE_CHARS,
            "max_request_count": P.MAX_REQUEST_COUNT, "max_prefetch": P.MAX_PREFETCH,
            "max_task_chars": P.MAX_TASK_CHARS, "max_where_chars": P.MAX_WHERE_CHARS, "max_tokens": P.MAX_TOKENS,
            "max_policy_version": 2**63 - 1}


__all__ = ["CallGate", "KINDS", "ServerLimits", "protocol_limits"]
