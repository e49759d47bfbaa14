"""The consume verbs of the Flight wire format (protocol version 2): DoGet kind "consume" and the actions
"set_policy_version", "policy_version", "add_task" and the lease actions "ack" / "nack".

Part of `arrowbuf.flight.protocol`, which re-exports every name here and is the module to import: it owns the
shared request parsing (the JSON bounds, the typed field reader) and the version gate (these verbs need "v": 2,
checked there before the functions here run). This module imports none of it: the protocol passes its field reader
in (anything shaped as `RequestFields`), and gets plain values back, so the two form no import cycle.
docs/flight-protocol.md documents the verbs; tests/flight/test_fuzz_protocol.py fuzzes them through the protocol.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import SchemaError
from ...samplers.admission import ADMISSIONS

#: Longest `where` predicate a consume request may carry (characters); the store checks it against the same limit.
MAX_WHERE_CHARS = 4096
#: Largest token budget a consume request may carry.
MAX_TOKENS = 1 << 40
#: Longest task name.
MAX_TASK_CHARS = 256
#: The actions `decode_consume_action` reads.
CONSUME_ACTIONS = ("set_policy_version", "policy_version", "add_task", "ack", "nack")
#: Longest lease a consume ticket may ask for (seconds), as `arrowbuf.engine.leases.MAX_LEASE_S`.
MAX_LEASE_S = 86400.0
#: What a lease id is on the wire (as `arrowbuf.engine.leases.check_lease_id`): short, plain characters.
LEASE_ID: re.Pattern[str] = re.compile(r"[A-Za-z0-9._:/+-]{1,128}")


class RequestFields(Protocol):
    """What the consume decoders need of the protocol's field reader: typed, bounded access to a request object."""

    obj: dict[str, Any]

    def get(self, key: str, kind: str, default: Any = None, required: bool = False) -> Any: ...

    def done(self) -> None: ...


@dataclass(frozen=True)
class ConsumeRequest:
    """DoGet kind "consume": up to `n` rows `task` has not consumed (see `ExperienceStore.consume`)."""

    task: str
    n: int
    store: str | None = None
    require: list[str] | None = None
    timeout: float | None = None
    max_staleness: int | None = None
    where: str | None = None
    max_tokens: int | None = None
    lease: float | None = None
    kind: str = "consume"
    admission: str | None = None  # "oldest" (arrowbuf.samplers.admission); checked by the store


def encode_consume(req: ConsumeRequest) -> dict[str, Any]:
    """The fields of a consume ticket after its "v" (the protocol puts the version first), in wire order."""
    obj: dict[str, Any] = {"kind": "consume", "task": req.task, "n": req.n}
    if req.store is not None:
        obj["store"] = req.store
    for key in ("require", "timeout", "max_staleness", "where", "max_tokens", "lease", "admission"):
        if getattr(req, key) is not None:
            obj[key] = getattr(req, key)
    return obj


def decode_consume(f: RequestFields, store: str | None) -> ConsumeRequest:
    """A consume ticket, every field typed and bounded before the store sees it (the version already checked)."""
    task = f.get("task", "a string", required=True)
    if not 0 < len(task) <= MAX_TASK_CHARS:
        raise SchemaError(f"ticket: 'task' must have 1 to {MAX_TASK_CHARS} characters, got {len(task)}")
    where = f.get("where", "a string")
    if where is not None and len(where) > MAX_WHERE_CHARS:
        raise SchemaError(f"ticket: 'where' has {len(where)} characters, over the limit of {MAX_WHERE_CHARS}")
    max_tokens = f.get("max_tokens", "a positive integer")
    if max_tokens is not None and max_tokens > MAX_TOKENS:
        raise SchemaError(f"ticket: 'max_tokens' {max_tokens} is over the limit of {MAX_TOKENS}")
    if (admission := f.get("admission", "a string")) is not None and admission not in ADMISSIONS:
        raise SchemaError(f"ticket: 'admission' must be one of {list(ADMISSIONS)}, got {admission!r:.80}")
    return ConsumeRequest(task=task, n=f.get("n", "a positive integer", required=True), store=store,
                          require=f.get("require", "a list of column names"),
                          timeout=f.get("timeout", "a number of seconds in [0, 1e6]"),
                          max_staleness=f.get("max_staleness", "a non-negative integer"), where=where,
                          max_tokens=max_tokens, lease=f.get("lease", "a number of seconds in (0, 86400]"),
                          admission=admission)


def decode_consume_action(type_: str, f: RequestFields) -> dict[str, Any]:
    """The body of one of `CONSUME_ACTIONS` (the version already checked): the `ActionRequest` fields it sets,
    every other key of the body refused."""
    body: dict[str, Any]
    if type_ == "set_policy_version":
        body = {"policy_version": f.get("policy_version", "a non-negative integer", required=True)}
    elif type_ == "add_task":
        task = f.get("task", "a string", required=True)
        if not 0 < len(task) <= MAX_TASK_CHARS:
            raise SchemaError(f"action add_task: 'task' must have 1 to {MAX_TASK_CHARS} characters")
        body = {"task": task}
    elif type_ in ("ack", "nack"):
        body = {"lease": f.get("lease", "a lease id", required=True)}
    else:
        body = {}
    f.done()
    return body
