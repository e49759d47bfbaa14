"""What the Flight client's calls share: Flight errors translated into arrowbuf's, and timeout checks.

Used by the client (`client.py`), its writer (`writer.py`) and its learner session (`session.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow.flight as flight

from ..errors import DeadlineExceeded, InvalidArgument
from . import protocol as P

if TYPE_CHECKING:
    import pyarrow as pa

    from ..schema import ExperienceSchema
    from ..schema.inputs import BatchLike


class Unreachable(Exception):
    """A transport failure: the server is down or restarting (no arrowbuf status detail)."""


def check_timeout(value: object, what: str) -> float | None:
    """`value` as seconds (a positive number) or None.

    Raises:
        InvalidArgument: anything else (zero, a negative number, a bool, a string), named by `what`.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value > 0:
        raise InvalidArgument(f"{what} must be a positive number of seconds or None, got {value!r}")
    return float(value)


@contextlib.contextmanager
def translate(unreachable: type[Exception] = Unreachable, seconds: float | None = None) -> Iterator[None]:
    """Flight errors -> arrowbuf exceptions through `protocol.ERRORS`; transport failures -> `unreachable`
    (`Unavailable` for streams); a passed deadline -> `DeadlineExceeded`."""
    try:
        yield
    except flight.FlightError as exc:
        mapped = P.from_flight_error(exc)
        if mapped is not None:
            raise mapped from None
        if isinstance(exc, flight.FlightTimedOutError):
            within = f" of {seconds:g}s" if seconds is not None else ""
            raise DeadlineExceeded(f"the server did not answer within the call's deadline{within}: {exc}; pass a "
                                   "larger rpc_timeout= (or timeout= to ab.connect)") from None
        if isinstance(exc, (flight.FlightUnavailableError, flight.FlightCancelledError)):
            if unreachable is Unreachable:
                raise Unreachable(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
            raise unreachable(f"the connection to the server failed: {exc}") from None
        raise


class StreamSource(Protocol):
    """What a stream (a `RemoteWriter`, a `LearnerSession`) uses of the client that opened it (`RemoteStore`)."""

    name: str
    schema: ExperienceSchema
    sample_meta: str
    stream_options: flight.FlightCallOptions

    def connection(self) -> flight.FlightClient:
        """The client's Flight connection (opened, or re-opened after the server restarted)."""
        ...

    def to_batch(self, batch: BatchLike) -> pa.RecordBatch:
        """`batch` (dict of arrays, RecordBatch or Table) validated and converted to one record batch."""
        ...
