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

from ...errors import ArrowbufError, Unauthenticated
from ...serving.limits import CODES, bounded_message
from ...serving.limits import MAX_MESSAGE_CHARS as MAX_MESSAGE_CHARS


@dataclass(frozen=True)
class ErrorMapping:
    """One row of the error table: an exception class, the Flight error carrying it, and a status code name."""

    cls: type[BaseException]
    flight_error: type[flight.FlightError]
    code: str


#: The Flight error each status travels as (any other: FlightServerError). pyarrow cannot send gRPC INVALID_ARGUMENT
#: with a status detail, so invalid input travels as Flight "Failed" (gRPC UNKNOWN) + the code in the detail.
_FLIGHT_ERROR: dict[str, type[flight.FlightError]] = {
    "UNAUTHENTICATED": flight.FlightUnauthenticatedError, "TIMED_OUT": flight.FlightTimedOutError,
    "DEADLINE_EXCEEDED": flight.FlightTimedOutError, "UNAVAILABLE": flight.FlightUnavailableError}

#: The one error table, most specific class first: the classes and codes of every server's table
#: (`arrowbuf.serving.limits.CODES`) less KeyError, which the Flight protocol does not carry (a store raises
#: StoreNotFound or InvalidArgument). The server raises `flight_error` with extra_info naming `cls`; the client
#: re-raises `cls`. `code` names the status for clients in other languages.
ERRORS: tuple[ErrorMapping, ...] = tuple(
    ErrorMapping(cls, _FLIGHT_ERROR.get(code, flight.FlightServerError), code) for cls, code in CODES
    if cls is not KeyError)
_BY_NAME = {m.cls.__name__: m for m in ERRORS}


def error_mapping(exc: BaseException) -> ErrorMapping | None:
    """The row of `ERRORS` for an exception, or None when it is not one the protocol carries."""
    for m in ERRORS:
        if isinstance(exc, m.cls):
            return m
    return None


def error_message(exc: BaseException) -> str:
    """The message of an error as sent to a client: at most `MAX_MESSAGE_CHARS` (messages may quote client values)."""
    return bounded_message(str(exc))


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
