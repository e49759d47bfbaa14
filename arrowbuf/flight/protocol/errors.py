"""The error table of the Flight wire format: which arrowbuf exception travels as which Flight error and status code,
and how a client turns a status detail back into the exception.

Part of `arrowbuf.flight.protocol`, which re-exports every name here and writes the status detail
(`protocol.error_info`: `{"v":1,"error":<class>,"code":<status>,"message":<text>}`) and the server's Flight errors
(`protocol.to_flight_error`); this module imports nothing of the protocol. docs/flight-protocol.md lists the table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.flight as flight

from ...errors import (
    ArrowbufError,
    InsertTimeout,
    InvalidArgument,
    LeaseError,
    MissingDependency,
    OutOfSpace,
    QueryTimeout,
    ResourceExhausted,
    SampleTimeout,
    SchemaError,
    ShardsLost,
    StoreClosed,
    StoreNotFound,
    Unauthenticated,
    Unavailable,
)

#: Longest error message sent to a client (messages may quote client values; the rest is cut).
MAX_MESSAGE_CHARS = 1000


@dataclass(frozen=True)
class ErrorMapping:
    """One row of the error table: an exception class, the Flight error carrying it, and a status code name."""

    cls: type[BaseException]
    flight_error: type[flight.FlightError]
    code: str


#: The one error table, most specific class first. The server raises `flight_error` with extra_info naming `cls`;
#: the client re-raises `cls`. `code` names the status for clients in other languages (pyarrow cannot send gRPC
#: INVALID_ARGUMENT with a status detail, so invalid input travels as Flight "Failed" (gRPC UNKNOWN) + this code).
ERRORS: tuple[ErrorMapping, ...] = (
    ErrorMapping(Unauthenticated, flight.FlightUnauthenticatedError, "UNAUTHENTICATED"),
    ErrorMapping(SchemaError, flight.FlightServerError, "INVALID_ARGUMENT"),
    ErrorMapping(LeaseError, flight.FlightServerError, "FAILED_PRECONDITION"),
    ErrorMapping(InvalidArgument, flight.FlightServerError, "INVALID_ARGUMENT"),
    ErrorMapping(SampleTimeout, flight.FlightTimedOutError, "TIMED_OUT"),
    ErrorMapping(InsertTimeout, flight.FlightTimedOutError, "TIMED_OUT"),
    ErrorMapping(QueryTimeout, flight.FlightTimedOutError, "DEADLINE_EXCEEDED"),
    ErrorMapping(ResourceExhausted, flight.FlightServerError, "RESOURCE_EXHAUSTED"),
    ErrorMapping(StoreNotFound, flight.FlightServerError, "NOT_FOUND"),
    ErrorMapping(ShardsLost, flight.FlightUnavailableError, "UNAVAILABLE"),
    ErrorMapping(StoreClosed, flight.FlightUnavailableError, "UNAVAILABLE"),
    ErrorMapping(Unavailable, flight.FlightUnavailableError, "UNAVAILABLE"),
    ErrorMapping(OutOfSpace, flight.FlightServerError, "RESOURCE_EXHAUSTED"),
    ErrorMapping(MissingDependency, flight.FlightServerError, "UNIMPLEMENTED"),
    ErrorMapping(ArrowbufError, flight.FlightServerError, "FAILED"),  # raised on purpose, no finer class
    # builtins the store raises for bad arguments (n < 1, unequal lengths, unknown sampler options)
    ErrorMapping(ValueError, flight.FlightServerError, "INVALID_ARGUMENT"),
    ErrorMapping(TypeError, flight.FlightServerError, "INVALID_ARGUMENT"),
)
_BY_NAME = {m.cls.__name__: m for m in ERRORS}


def error_mapping(exc: BaseException) -> ErrorMapping | None:
    """The row of `ERRORS` for an exception, or None when it is not one the protocol carries."""
    for m in ERRORS:
        if isinstance(exc, m.cls):
            return m
    return None


def error_message(exc: BaseException) -> str:
    """The message of an error as sent to a client: at most `MAX_MESSAGE_CHARS` (messages may quote client values)."""
    text = str(exc)
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[:MAX_MESSAGE_CHARS] + f"... ({len(text) - MAX_MESSAGE_CHARS} more characters)"


def decode_error(info: bytes | pa.Buffer | None) -> BaseException | None:
    """The exception a status detail (or an in-band error message) names, or None if it names none."""
    if info is None:
        return None
    raw = info.to_pybytes() if isinstance(info, pa.Buffer) else bytes(info)
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), str):
        return None
    m = _BY_NAME.get(obj["error"])
    cls = m.cls if m is not None else ArrowbufError
    return cls(str(obj.get("message", "")))


def from_flight_error(exc: flight.FlightError) -> BaseException | None:
    """The arrowbuf exception a Flight error carries; None for transport errors (no arrowbuf status detail)."""
    mapped = decode_error(getattr(exc, "extra_info", None))
    if mapped is None and isinstance(exc, flight.FlightUnauthenticatedError):
        mapped = Unauthenticated(f"the server rejected the call: {exc}")
    return mapped
