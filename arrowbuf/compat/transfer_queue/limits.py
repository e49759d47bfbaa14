"""The limits of the tq.v2 server (`server.TQServer`) and the checks its handlers make at their entry, before
the state is touched or bulk data is read.

The bounds shared with every arrowbuf server (calls and streams at once, request, upload and reply bytes, JSON
depth, idle and total timeouts) are `arrowbuf.serving.limits.NetLimits`; `TQLimits` adds what is the tq.v2
server's own: partitions, field groups (each an arrowbuf store), consuming tasks, task names, ids per request and
samples per put. docs/security.md lists them with their defaults, and what a request may make the server allocate:
at most `SERVERS["tq.v2"].allocation` (128 x its bytes, plus the stored samples it names, each once, plus 160 bytes
of bookkeeping per sample it stores), which is why a read may not name a sample twice, a put's sample count comes
from the data it carries (never from a length field alone), and a new partition starts with a small store.

Usage loop (what a handler does)::

    body = loads(raw, "tq.v2.get_meta", limits)             # size and depth checked before parsing
    limits.check_task(task)                                 # a bounded name
    with state.lock:
        limits.check_new_task(state, pid, task)             # a cap on what a request may create
        ...
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ...errors import InvalidArgument, ResourceExhausted
from ...serving.limits import NetLimits, check_bytes, check_json_depth

if TYPE_CHECKING:  # pragma: no cover
    from .state import TQState


@dataclass(frozen=True)
class TQLimits(NetLimits):
    """Bounds of every request the tq.v2 server accepts (`TQServer(state, ..., limits=TQLimits(...))`, or single
    limits as keywords). Besides `NetLimits`:

    Attributes:
        max_partitions: partitions the server holds; a request that would create one more is refused.
        max_groups: field groups per partition (each group is an arrowbuf store of the fields written together).
        max_tasks: consuming tasks per partition (each keeps a consumed flag per sample).
        max_task_chars: characters of a task name.
        max_ids: ids, keys or tags one request names.
        max_put_rows: samples one put stores.
    """

    max_concurrent_calls: int = 32
    max_concurrent_streams: int = 8
    idle_timeout: float = 60.0
    request_timeout: float = 600.0
    max_partitions: int = 1024
    max_groups: int = 64
    max_tasks: int = 64
    max_task_chars: int = 256
    max_ids: int = 1 << 20
    max_put_rows: int = 1 << 16

    # ------------------------------------------------------------------ requests
    def loads(self, raw: bytes, what: str) -> dict[str, Any]:
        """A request's JSON object: its size and nesting checked on the bytes, before it is parsed."""
        check_bytes(len(raw), self.max_request_bytes, what)
        check_json_depth(raw, self.max_json_depth, what)
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise InvalidArgument(f"{what}: not JSON ({str(e)[:200]})") from None
        if not isinstance(obj, dict):
            raise InvalidArgument(f"{what}: expected a JSON object")
        return obj

    def check_ids(self, n: int, what: str) -> None:
        if n > self.max_ids:
            raise ResourceExhausted(f"{what}: {n} ids in one request, over this server's max_ids ({self.max_ids})")

    def check_read(self, gidx: np.ndarray, what: str = "read") -> None:
        """A read (or a lookup of keys or tags) names each sample once: a reply is never larger than the samples it
        names."""
        self.check_ids(len(gidx), what)
        if len(np.unique(gidx)) != len(gidx):
            raise InvalidArgument(f"{what}: the request names a sample more than once; a reply holds each sample once "
                                  "(ask for the distinct ids and repeat them on the client)")

    def check_task(self, task: object) -> None:
        if task is not None and (not isinstance(task, str) or not 0 < len(task) <= self.max_task_chars):
            raise InvalidArgument(f"task_name must be a non-empty str of at most {self.max_task_chars} characters")

    def check_reply(self, nbytes: int, what: str) -> None:
        if nbytes > self.max_reply_bytes:
            raise ResourceExhausted(f"{what}: the reply would be {nbytes} bytes, over this server's max_reply_bytes "
                                    f"({self.max_reply_bytes}); ask for fewer samples or fields at a time")

    # ------------------------------------------------------------------ what a request may create (under state.lock)
    def check_new_partition(self, state: TQState, partition_id: str) -> None:
        if partition_id not in state.partitions and len(state.partitions) >= self.max_partitions:
            raise ResourceExhausted(f"this server holds {len(state.partitions)} partitions, its max_partitions; "
                                    "clear one (clear_partition) before creating another")

    def check_new_group(self, state: TQState, partition_id: str, fields: Collection[str]) -> None:
        """A put of `fields` into a partition at `max_groups` goes into a group of the same fields or not at all."""
        p = state.partitions.get(partition_id)
        if p is None or not fields or len(p.groups) < self.max_groups:
            return
        if set(fields) not in [{entry[0] for entry in key} for key in p.groups]:
            raise ResourceExhausted(f"partition {partition_id!r} has {len(p.groups)} field groups, this server's "
                                    "max_groups; write fields together with ones written before")

    def check_new_task(self, state: TQState, partition_id: str, task: str | None) -> None:
        p = state.partitions.get(partition_id)
        if p is not None and task is not None and task not in p.consumed and len(p.consumed) >= self.max_tasks:
            raise ResourceExhausted(f"partition {partition_id!r} has {len(p.consumed)} consuming tasks, this "
                                    "server's max_tasks; reuse a task name")

    def check_put_rows(self, n: int) -> None:
        if n > self.max_put_rows:
            raise ResourceExhausted(f"put: {n} samples in one put, over this server's max_put_rows "
                                    f"({self.max_put_rows}); split it")

    # ------------------------------------------------------------------ a put's data, message by message
    def check_put_message(self, data: pa.RecordBatch, got: dict[str, int], started: float, now: float) -> None:
        """One record batch of a put (`got`: bytes and rows so far, updated): bounded before the next is read."""
        data.validate()  # buffers as long as the batch's length says: no length field without its bytes
        got["bytes"] += int(data.nbytes)
        got["rows"] += int(data.num_rows)
        check_bytes(got["bytes"], self.max_upload_bytes, "put")
        if got["rows"] > self.max_put_rows:
            raise ResourceExhausted(f"put: more than {self.max_put_rows} samples in one put (max_put_rows); split it")
        if now - started > self.request_timeout:
            raise ResourceExhausted(f"put: still sending after {self.request_timeout:g} s (request_timeout); send "
                                    "smaller puts")

    def check_put_total(self, got: dict[str, int]) -> None:
        """Samples cost bytes: a put whose columns carry less than one bit per sample (a shape with a 0 dimension)
        would make the server keep bookkeeping for samples it never received."""
        if got["rows"] > 8 * got["bytes"]:
            raise InvalidArgument(f"put: {got['rows']} samples in {got['bytes']} bytes of values; a sample must "
                                  "carry data (no field of shape [.., 0, ..] alone)")


__all__ = ["TQLimits"]
