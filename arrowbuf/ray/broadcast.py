"""One `ray.put`, many actors: send a large object (policy weights) through Ray's object store once."""

from __future__ import annotations

from typing import Any, Iterable

from ..errors import InvalidArgument
from ._common import _ray


def broadcast(obj: Any, actors: Iterable[Any] | None = None, method: str | None = None, *args: Any,
              **kwargs: Any) -> Any:
    """Send `obj` to many actors through Ray's object store: one `ray.put`, then every actor gets the same object.

    Without `actors`: returns the `ObjectRef` (pass it to tasks and actors; each node fetches it once, then its
    processes read it from that node's shared memory). With `actors` and `method`: calls
    `actor.<method>(obj, *args, **kwargs)` on each, all with the one ref (Ray resolves it to the object in each
    actor), and returns their result refs. Sending `obj` by value to each instead serialises and stores it once per
    actor (see benchmarks/bench_ray.py).
    """
    ray = _ray()
    ref = obj if isinstance(obj, ray.ObjectRef) else ray.put(obj)
    if actors is None:
        return ref
    if method is None:
        raise InvalidArgument("broadcast to actors needs the name of the method that receives the object")
    return [getattr(a, method).remote(ref, *args, **kwargs) for a in actors]
