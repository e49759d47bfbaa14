"""The one codec of sampler and rate-limiter specs (arrowbuf.samplers.spec): checkpoints and shared-memory manifests."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.samplers.spec import REGISTRY, from_spec, spec_class_name, to_spec

OBJECTS = [
    ab.samplers.Uniform(), ab.samplers.Fifo(), ab.samplers.Lifo(),
    ab.samplers.Prioritized(alpha=0.7, beta=0.5, eps=1e-3),
    ab.samplers.Sequence(length=4, stride=2, priority=ab.samplers.Prioritized(alpha=0.5)),
    ab.samplers.Group(key="prompt_id", size=4, drop_zero_variance="reward"),
    ab.rate_limiters.MinSize(10), ab.rate_limiters.SampleToInsertRatio(4.0, min_size=2, error_buffer=10.0),
]


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: type(o).__name__)
def test_every_registered_class_round_trips_through_json(obj):
    spec = json.loads(json.dumps(to_spec(obj)))
    assert spec["kind"] == type(obj).spec_name
    again = from_spec(spec, "test")
    assert type(again) is type(obj) and to_spec(again) == to_spec(obj)
    assert spec_class_name(spec) == type(obj).__name__


def test_the_registry_holds_every_sampler_family_and_limiter():
    assert {c.__name__ for c in REGISTRY.values()} == {type(o).__name__ for o in OBJECTS}


def test_checkpoints_written_with_module_keyed_specs_still_read():
    legacy = {"module": "arrowbuf.samplers", "class": "SequenceSampler",
              "args": {"length": 3, "priority": {"spec": {"module": "arrowbuf.samplers", "class": "PrioritizedSampler",
                                                          "args": {"alpha": 0.5}}}}}
    s = from_spec(legacy, "old checkpoint")
    assert isinstance(s, ab.samplers.Sequence) and s.length == 3 and s.priority.alpha == 0.5
    limiter = from_spec({"module": "arrowbuf.rate_limiters", "class": "MinSize", "args": {"min_size": 7}}, "old")
    assert isinstance(limiter, ab.rate_limiters.MinSize) and limiter.min_size == 7


def test_a_class_of_the_user_cannot_be_recorded():
    class Mine(ab.samplers.Uniform):
        pass

    with pytest.raises(ab.InvalidArgument, match="cannot be recorded"):
        to_spec(Mine())


@pytest.mark.parametrize("spec", [
    {"kind": "nope", "args": {}},
    {"module": "os", "class": "system", "args": {}},
    {"module": "arrowbuf.samplers", "class": "Sampler", "args": {}},
    {"kind": "prioritized", "args": {"alpha": "x"}},
    {"kind": "prioritized", "args": {"bogus": 1}},
    {"kind": "prioritized"},
    "arrowbuf.samplers:FifoSampler()",
])
def test_a_bad_spec_is_store_corrupt_naming_where_it_came_from(spec):
    with pytest.raises(ab.StoreCorrupt, match="the/file.json"):
        from_spec(spec, "the/file.json")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                    max_leaves=30)
KINDS = st.sampled_from([*REGISTRY, "x", ""])


@settings(max_examples=300, deadline=None)
@given(st.one_of(JSON, st.fixed_dictionaries({"kind": KINDS, "args": st.dictionaries(st.text(max_size=12), JSON,
                                                                                     max_size=4)})))
def test_any_json_value_builds_a_registered_object_or_raises_store_corrupt(spec):
    try:
        obj = from_spec(spec, "fuzz")
    except ab.StoreCorrupt:
        return
    assert obj is None or type(obj) in REGISTRY.values()
