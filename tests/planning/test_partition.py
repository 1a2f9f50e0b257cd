"""ExpertPartition: an exact, deterministic expert -> (group, offset) map (CONTEXT rule 1)."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncslab import PlanError
from asyncslab.errors import PartitionError
from asyncslab.rules import ExpertPartition

# No example database: the property tests must not leave a .hypothesis/ folder behind.
PROPERTY = settings(
    database=None, deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)


def offsets(p: ExpertPartition) -> dict[int, tuple[str, int]]:
    return {e: p.locate(e) for e in p.experts}


# --------------------------------------------------------------------------- determinism


def test_offset_is_rank_of_id_inside_its_group() -> None:
    p = ExpertPartition({"K3": [7, 0, 4, 2], "K4": [5, 1, 6, 3]}, range(8))
    assert p.groups == {"K3": (0, 2, 4, 7), "K4": (1, 3, 5, 6)}
    assert offsets(p) == {
        0: ("K3", 0),
        2: ("K3", 1),
        4: ("K3", 2),
        7: ("K3", 3),
        1: ("K4", 0),
        3: ("K4", 1),
        5: ("K4", 2),
        6: ("K4", 3),
    }
    assert p.experts == tuple(range(8))
    assert p.sizes() == {"K3": 4, "K4": 4}


def test_input_order_does_not_matter() -> None:
    a = ExpertPartition({"K3": [0, 2, 4, 7], "K4": [1, 3, 5, 6]}, range(8))
    b = ExpertPartition({"K3": (7, 4, 2, 0), "K4": iter([6, 1, 5, 3])}, [7, 6, 5, 4, 3, 2, 1, 0])
    assert a == b
    assert offsets(a) == offsets(b)


def test_from_assignment_matches_groups_and_ignores_insertion_order() -> None:
    assignment = {0: "K3", 1: "K4", 2: "K3", 3: "K4", 4: "K3", 5: "K4", 6: "K4", 7: "K3"}
    shuffled = dict(sorted(assignment.items(), key=lambda kv: (kv[0] * 5) % 8))
    assert list(shuffled) != list(assignment)
    a = ExpertPartition.from_assignment(assignment, range(8))
    b = ExpertPartition.from_assignment(shuffled, range(8))
    direct = ExpertPartition({"K3": [0, 2, 4, 7], "K4": [1, 3, 5, 6]}, range(8))
    assert a == b == direct
    assert offsets(a) == offsets(b) == offsets(direct)
    # Default group order is sorted by name; an explicit order is kept.
    assert list(a.groups) == ["K3", "K4"]
    c = ExpertPartition.from_assignment(assignment, range(8), order=["K4", "K3"])
    assert list(c.groups) == ["K4", "K3"]
    assert offsets(c) == offsets(a)


def test_from_assignment_rejects_a_group_missing_from_order() -> None:
    with pytest.raises(PartitionError, match=r"groups \['K5'\] are not in the given order"):
        ExpertPartition.from_assignment({0: "K3", 1: "K5"}, range(2), order=["K3", "K4"])


def test_from_assignment_keeps_empty_groups_named_in_order() -> None:
    p = ExpertPartition.from_assignment({0: "K3", 1: "K3"}, range(2), order=["K3", "K4"])
    assert p.sizes() == {"K3": 2, "K4": 0}


def test_without_a_universe_only_duplicates_are_checked() -> None:
    p = ExpertPartition({"a": [10, 3], "b": [7]})
    assert offsets(p) == {3: ("a", 0), 10: ("a", 1), 7: ("b", 0)}
    with pytest.raises(PartitionError, match=r"more than one place: 3 \(a, b\)"):
        ExpertPartition({"a": [10, 3], "b": [3]})


# --------------------------------------------------------------------------- rejections


def test_missing_expert_is_listed() -> None:
    with pytest.raises(PartitionError, match=r"experts in no group: 2, 5\b") as info:
        ExpertPartition({"K3": [0, 3], "K4": [1, 4]}, range(6))
    assert isinstance(info.value, PlanError)
    assert isinstance(info.value, ValueError)


def test_expert_in_two_groups_is_listed_with_both_groups() -> None:
    with pytest.raises(PartitionError, match=r"experts in more than one place: 1 \(K3, K4\)"):
        ExpertPartition({"K3": [0, 1], "K4": [1, 2]}, range(3))


def test_expert_twice_in_one_group_is_rejected() -> None:
    with pytest.raises(PartitionError, match=r"experts in more than one place: 1 \(K3\)"):
        ExpertPartition({"K3": [0, 1, 1], "K4": [2]}, range(3))


def test_unknown_expert_is_listed() -> None:
    with pytest.raises(PartitionError, match=r"unknown experts: 9\b"):
        ExpertPartition({"K3": [0, 9], "K4": [1, 2]}, range(3))


def test_all_problems_are_reported_together() -> None:
    with pytest.raises(PartitionError) as info:
        ExpertPartition({"K3": [0, 1, 9], "K4": [1]}, range(4))
    message = str(info.value)
    assert "more than one place: 1 (K3, K4)" in message
    assert "experts in no group: 2, 3" in message
    assert "unknown experts: 9" in message


def test_locate_of_an_unknown_expert_raises_partition_error() -> None:
    p = ExpertPartition({"K3": [0], "K4": [1]}, range(2))
    with pytest.raises(PartitionError, match=r"expert 5 is in no group"):
        p.locate(5)


# --------------------------------------------------------------------------- properties

GROUP_NAMES = ("K2", "K3", "K4", "K5", "K8")


@st.composite
def assignments(draw: st.DrawFn) -> dict[int, str]:
    n = draw(st.integers(min_value=1, max_value=48))
    names = draw(st.lists(st.sampled_from(GROUP_NAMES), min_size=1, max_size=4, unique=True))
    ids = draw(st.permutations(range(n)))  # insertion order is random too
    return {e: draw(st.sampled_from(names)) for e in ids}


@PROPERTY
@given(assignments())
def test_locate_is_a_bijection_onto_group_slots(assignment: dict[int, str]) -> None:
    n = len(assignment)
    p = ExpertPartition.from_assignment(assignment, range(n))
    located = {e: p.locate(e) for e in range(n)}
    # Onto exactly {(g, o): o < len(group g)}, each slot hit once.
    slots = sorted(located.values())
    expected = sorted((g, o) for g, ids in p.groups.items() for o in range(len(ids)))
    assert slots == expected
    assert len(set(slots)) == n
    for e, (g, o) in located.items():
        assert assignment[e] == g
        assert p.groups[g][o] == e
    # Offsets follow id order inside each group.
    for g, ids in p.groups.items():
        assert list(ids) == sorted(e for e, grp in assignment.items() if grp == g)
    # The same partition given as groups, in reversed id order, agrees.
    reversed_groups = {g: list(reversed(ids)) for g, ids in p.groups.items()}
    assert offsets(ExpertPartition(reversed_groups, reversed(range(n)))) == located


@PROPERTY
@given(assignments(), st.data())
def test_dropping_an_id_is_rejected(assignment: dict[int, str], data: st.DataObject) -> None:
    n = len(assignment)
    victim = data.draw(st.sampled_from(sorted(assignment)))
    rest = {e: g for e, g in assignment.items() if e != victim}
    with pytest.raises(PartitionError, match=rf"experts in no group: {victim}(?!\d)"):
        ExpertPartition.from_assignment(rest, range(n))


@PROPERTY
@given(assignments(), st.data())
def test_duplicating_an_id_is_rejected(assignment: dict[int, str], data: st.DataObject) -> None:
    n = len(assignment)
    groups: dict[str, list[int]] = {}
    for e, g in assignment.items():
        groups.setdefault(g, []).append(e)
    victim = data.draw(st.sampled_from(sorted(assignment)))
    target = data.draw(st.sampled_from([*GROUP_NAMES]))
    groups.setdefault(target, []).append(victim)
    with pytest.raises(PartitionError, match=rf"more than one place: {victim} \("):
        ExpertPartition(groups, range(n))


@PROPERTY
@given(assignments(), st.data())
def test_adding_an_unknown_id_is_rejected(assignment: dict[int, str], data: st.DataObject) -> None:
    n = len(assignment)
    extra = data.draw(st.one_of(st.integers(n, n + 100), st.integers(-100, -1)))
    group = data.draw(st.sampled_from(sorted(set(assignment.values()))))
    with pytest.raises(PartitionError, match=rf"unknown experts: {re.escape(str(extra))}(?!\d)"):
        ExpertPartition.from_assignment({**assignment, extra: group}, range(n))
