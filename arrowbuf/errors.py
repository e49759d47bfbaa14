"""The arrowbuf exception hierarchy.

```
ArrowbufError                       every error arrowbuf raises on purpose
├── InvalidArgument(ValueError)     a bad request: an argument out of range, an unknown name, a wrong combination
│   ├── SchemaError                 bad schema or bad input: names the field, what was expected, what came
│   └── LeaseError                  an ack/nack of a lease that is not open (acked, nacked, expired, unknown)
├── SampleTimeout(TimeoutError)     a sample could not be served in time (empty store, rate limiter)
├── InsertTimeout(TimeoutError)     an insert was held back by the rate limiter past its timeout
├── QueryTimeout(TimeoutError)      a SQL query ran past its deadline (or its caller went away) and was stopped
├── ResourceExhausted(RuntimeError) a request needs more than a server limit allows (query memory, result size,
│                                   concurrent calls)
├── StoreClosed(RuntimeError)       the store, tier, server or client was closed
│   └── ShardsLost                  every shard of a sharded store is dead or unreachable
├── Unavailable(ConnectionError)    a server cannot be reached (refused, unreachable)
│   ├── DeadlineExceeded(TimeoutError) a call's deadline passed before the server answered
│   └── OutcomeUnknown              a write whose shard died before acknowledging it, then refused where it was
│                                   re-sent: stored once by the dead shard, or not at all
├── StoreNotFound(LookupError)      no store of that name (attach, remote store names)
├── StoreExists(FileExistsError)    a live shared store already has that name
├── OutOfSpace(MemoryError)         a tier has not enough room (/dev/shm, a byte budget)
├── StoreCorrupt(RuntimeError)      a shared store's files are malformed or were tampered with; names the file
├── StoreNotTrusted(PermissionError) a shared store belongs to another user or others can write it (attach refuses)
├── BroadcastRefused(PermissionError) a broadcast file or bucket was refused: a planted link or foreign file at a path
│                                   it uses, a file that is not the relay's own, or a bucket whose digest differs
├── MissingDependency(ImportError)  an optional extra is not installed; names the extra
└── Unauthenticated(PermissionError) a wrong or missing token
```
Every exception also inherits the matching builtin, so `except ValueError` keeps working. Callers branch on the type,
never on the message.
"""

from __future__ import annotations

from typing import Any


class ArrowbufError(Exception):
    """Base class of every error arrowbuf raises on purpose."""


class InvalidArgument(ArrowbufError, ValueError):
    """A request is malformed: an argument is out of range, names something unknown, or combines badly."""


class SchemaError(InvalidArgument):
    """A schema is malformed, or input does not match the schema."""


class LeaseError(InvalidArgument):
    """An ack or nack of a lease that is not open: already acked or nacked, expired (its rows went back to the task's
    queue), or never issued by this store. The message says which."""


class SampleTimeout(ArrowbufError, TimeoutError):
    """A sample could not be served within its timeout."""


class InsertTimeout(ArrowbufError, TimeoutError):
    """An insert was blocked by the rate limiter past its timeout."""


class QueryTimeout(ArrowbufError, TimeoutError):
    """A SQL query ran past the sandbox's deadline, or its caller went away, and was stopped."""


class ResourceExhausted(ArrowbufError, RuntimeError):
    """A request needs more than a limit allows: a query's memory or result size, or too many calls at once.

    Retrying the same request fails again unless it asks for less (or, for concurrency limits, later)."""


class StoreClosed(ArrowbufError, RuntimeError):
    """The object was closed and cannot serve the call."""


class ShardsLost(StoreClosed):
    """Every shard of a sharded store is dead or unreachable (and none came back in time)."""


class Unavailable(ArrowbufError, ConnectionError):
    """A server cannot be reached: connection refused, host unreachable, or the call's deadline passed."""


class DeadlineExceeded(Unavailable, TimeoutError):
    """A remote call's deadline (`rpc_timeout=`, or `timeout=` of `ab.connect`) passed before the server answered.

    Not retried: the server may have acted on the call (a batch may or may not be stored).
    """


class OutcomeUnknown(Unavailable):
    """A write was sent to a shard that died before it acknowledged the write, and re-sending it to the shard that
    took over was refused (`InsertTimeout`, ...: the cause is chained). The dead shard may have stored it (a durable
    shard that journaled it brings it back, under ids never returned) or not: unlike `InsertTimeout`, this does not
    mean nothing was written. A writer that needs exactly-once keeps its own keys in the rows."""


class StoreNotFound(ArrowbufError, LookupError):
    """No store of the given name exists."""


class StoreExists(ArrowbufError, FileExistsError):
    """A store of the given name already exists (shared memory: its owner is alive)."""


class OutOfSpace(ArrowbufError, MemoryError):
    """A memory tier has not enough room for what was asked."""


class StoreCorrupt(ArrowbufError, RuntimeError):
    """A shared store's files (manifest, arenas, locks) are malformed or were tampered with; the message names the
    file. The store cannot be used safely: recreate it."""


class StoreNotTrusted(ArrowbufError, PermissionError):
    """A shared store belongs to another user, or users other than its owner can write its files: attaching would
    let them feed this process rows. `attach(name, allow_other_owner=True)` accepts another owner explicitly."""


class BroadcastRefused(ArrowbufError, PermissionError):
    """A broadcast (`arrowbuf.ray.Broadcast`) refused a file or a bucket: a symlink, a file of another user, a file
    others can read or write, or a file other than the relay's own at a path it uses, or a bucket whose digest
    differs from the producer's (tampered or corrupted). Nothing of the refused bytes reaches a consumer."""


class MissingDependency(ArrowbufError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""


class Unauthenticated(ArrowbufError, PermissionError):
    """A call came with a wrong or missing token."""


def require(module: str, extra: str) -> Any:
    """Import an optional dependency, or raise `MissingDependency` naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency(
            f"{module} is needed for this feature but is not installed: pip install 'arrowbuf[{extra}]'"
        ) from exc


__all__ = [
    "ArrowbufError",
    "InvalidArgument",
    "SchemaError",
    "LeaseError",
    "SampleTimeout",
    "InsertTimeout",
    "QueryTimeout",
    "ResourceExhausted",
    "StoreClosed",
    "ShardsLost",
    "Unavailable",
    "DeadlineExceeded",
    "OutcomeUnknown",
    "StoreNotFound",
    "StoreExists",
    "OutOfSpace",
    "StoreCorrupt",
    "StoreNotTrusted",
    "BroadcastRefused",
    "MissingDependency",
    "Unauthenticated",
    "require",
]


class ArrowbufWarning(UserWarning):
    """Base class of the warnings arrowbuf issues."""


class PickleWarning(ArrowbufWarning):
    """A broadcast moved an arbitrary Python object by pickle (`allow_pickle=True`): whoever can write the bytes can
    run code in the process that loads them. Tensors, arrays, Arrow tables and JSON values need no pickle."""


class FinalObsWarning(ArrowbufWarning):
    """Terminal transitions stopped being sampleable: their final observation's slot was reused (give the store more
    final-observation slots: `ab.StoreOptions`; `stats()["final_obs_dropped"]` counts them)."""


class AppendSlowPathWarning(ArrowbufWarning):
    """`append` stored a step through the general (batch) path, about 10x slower per step: a value needed a
    conversion the fast path does not make (see `arrowbuf.engine.stepcheck`). Warned once per store;
    `stats()["append_slow_path"]` counts such steps."""
