"""The in-process tests of consumption per task and of leases, run again over a shared-memory store: each test's
store is created with `tier="shm"` and the test talks to a second handle, `ExperienceStore.attach(name)`, so every
consume, update, ack and policy version goes through the state in shared memory (tests/test_consume.py,
tests/test_groups.py, tests/test_leases.py, tests/test_admission.py; the cross-process ones are in
tests/test_shm_consume.py).

Left out, with why: declaring a task after creation (a shared store's tasks are fixed when it is created), lineage
and observability (a shared store records none), Flight and Ray (their own files), and tests that take fixtures.
"""

from __future__ import annotations

import inspect

import pytest
import test_admission
import test_consume
import test_groups
import test_leases

import arrowbuf as ab

#: Tests whose subject a shared store does not have (see the module docstring).
SKIP = {
    "test_tasks_declared_later_and_bad_declarations": "tasks are declared when a shared store is created",
    "test_shared_memory_tasks_are_fixed_at_creation": "makes its own shared store",
    "test_assign_groups_cuts_each_key_in_order": "no store",
    "test_group_is_reexported_from_samplers": "no store",
    "test_group_on_a_non_scalar_key_is_a_schema_error": "no store is made (the error comes first)",
    "test_admit_and_waiting_against_a_brute_force_order": "no store",
}


def _cases(module):
    out = []
    for name, fn in vars(module).items():
        if not name.startswith("test_") or not callable(fn) or name in SKIP:
            continue
        if inspect.signature(fn).parameters or hasattr(fn, "pytestmark"):
            continue  # fixtures (Flight, Ray, tmp_path) or marks (slow, parametrized): not rerun here
        out.append(pytest.param(module, name, id=f"{module.__name__}::{name}"))
    return out


class _SharedAb:
    """`arrowbuf` as a test module sees it, except that `ExperienceStore(...)` creates a shared store and returns
    another handle on it, attached as a process other than the creator would."""

    def __init__(self, names, creators: list) -> None:
        self._names, self._creators = names, creators

    def __getattr__(self, attr):
        return getattr(ab, attr)

    def ExperienceStore(self, schema, capacity, *args, **kw):  # noqa: N802 (stands for the class)
        name = self._names()
        self._creators.append(ab.ExperienceStore(schema, capacity, *args, tier="shm", name=name, **kw))
        return ab.ExperienceStore.attach(name)


@pytest.mark.parametrize(("module", "case"), [*_cases(test_consume), *_cases(test_groups), *_cases(test_leases),
                                                *_cases(test_admission)])
def test_the_in_process_case_holds_over_an_attached_shared_store(module, case, monkeypatch, names):
    creators: list = []
    monkeypatch.setattr(module, "ab", _SharedAb(names, creators))
    try:
        getattr(module, case)()
    finally:
        for s in creators:
            s.close()
    assert creators, "the case made no store: it tests nothing shared"
