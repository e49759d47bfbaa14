"""arrowbuf: an Apache Arrow experience store for distributed reinforcement learning.

`import arrowbuf` needs only pyarrow and numpy; torch, ray, duckdb, polars and cudf are imported when used.
"""

from . import config, placement, rate_limiters, samplers
from .delivery.batch import SampleBatch
from .delivery.loader import Loader, LoaderMetrics, TorchBatch
from .errors import (
    AppendSlowPathWarning,
    ArrowbufError,
    ArrowbufWarning,
    DeadlineExceeded,
    FinalObsWarning,
    InsertTimeout,
    InvalidArgument,
    LeaseError,
    MissingDependency,
    OutcomeUnknown,
    OutOfSpace,
    QueryTimeout,
    ResourceExhausted,
    SampleTimeout,
    SchemaError,
    ShardsLost,
    StoreClosed,
    StoreCorrupt,
    StoreExists,
    StoreNotFound,
    StoreNotTrusted,
    Unauthenticated,
    Unavailable,
)
from .flight import ServerLimits, connect, serve
from .flight.client import RemoteStore
from .flight.server import StoreServer
from .observe.identity import acting_as
from .options import StoreOptions
from .persist import CheckpointHandle, ExperienceDataset, open_dataset
from .query.sql import SqlLimits
from .schema import ExperienceSchema, FieldSpec, load_schema
from .store.facade import ExperienceStore
from .store.pending import PendingWrite
from .surface import (
    Bounded,
    ExtendSink,
    LineageSource,
    Observable,
    PieceSink,
    StoreSurface,
    TableStream,
    WriterSurface,
)

__version__ = "0.1.0"

__all__ = [
    "TableStream",
    "PieceSink",
    "Observable",
    "LineageSource",
    "ExtendSink",
    "Bounded",
    "AppendSlowPathWarning",
    "ArrowbufError",
    "ArrowbufWarning",
    "CheckpointHandle",
    "DeadlineExceeded",
    "OutcomeUnknown",
    "ExperienceDataset",
    "ExperienceSchema",
    "ExperienceStore",
    "PendingWrite",
    "FieldSpec",
    "FinalObsWarning",
    "InsertTimeout",
    "InvalidArgument",
    "LeaseError",
    "Loader",
    "LoaderMetrics",
    "MissingDependency",
    "OutOfSpace",
    "QueryTimeout",
    "RemoteStore",
    "ResourceExhausted",
    "SampleBatch",
    "SampleTimeout",
    "SchemaError",
    "ServerLimits",
    "ShardsLost",
    "SqlLimits",
    "StoreClosed",
    "StoreCorrupt",
    "StoreExists",
    "StoreNotFound",
    "StoreNotTrusted",
    "StoreOptions",
    "StoreServer",
    "StoreSurface",
    "TorchBatch",
    "Unauthenticated",
    "Unavailable",
    "WriterSurface",
    "acting_as",
    "connect",
    "load_schema",
    "open_dataset",
    "config",
    "placement",
    "rate_limiters",
    "samplers",
    "serve",
]
