"""The columnar checkpoint and plan give what the object paths give.

``Checkpoint.open`` keeps its tensors as columns (``TensorTable``) and the built-in rules
claim with route tables (``RouteTable``); the general paths, which build a ``TensorInfo`` per
tensor and a ``Route`` per route, stay for hand-built mappings, custom rules and every error.
Each test here plans or reads the same checkpoint both ways and compares the results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncslab import Checkpoint, plan
from asyncslab.checkpoint._format import TensorInfo, TensorTable, read_header
from asyncslab.planning._moe import TieredMoE
from asyncslab.planning._plan import Plan
from asyncslab.planning._routes import RouteTable, route_column, unravel
from asyncslab.planning._rules import Dense
from asyncslab.planning._vocabulary import Claim, Route, linear_index
from asyncslab.testing import SyntheticCheckpoint, SyntheticSpec, write_synthetic


def _hand_built(tmp_path: Path) -> Path:
    """Two files: several dtypes and shapes, a scalar, zero-size tensors sharing offsets."""
    save_file(
        {
            "a": torch.zeros(3, 4, dtype=torch.float16),
            "b.empty": torch.zeros(0, 5, dtype=torch.int32),
            "c": torch.arange(6, dtype=torch.int64),
            "d.scalar": torch.tensor(7, dtype=torch.int32),
        },
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {
            "e": torch.ones(2, 2, dtype=torch.bfloat16),
            "a.empty": torch.zeros(0, dtype=torch.float32),
            "f": torch.ones(4, dtype=torch.float16),
        },
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    return tmp_path


def test_the_table_gives_the_tensor_infos_the_headers_give(tmp_path: Path) -> None:
    root = _hand_built(tmp_path)
    ck = Checkpoint.open(root)
    assert isinstance(ck.tensors, TensorTable)
    expected: dict[str, TensorInfo] = {}
    for path in sorted(root.glob("*.safetensors")):
        shard, infos = read_header(path)
        assert [i.name for i in infos] == list(shard.tensors)
        expected.update((i.name, i) for i in infos)
    assert list(ck.tensors) == list(expected)  # file order, then payload order
    assert dict(ck.tensors.items()) == expected
    assert len(ck.tensors) == len(expected)
    assert "a" in ck.tensors
    assert "zz" not in ck.tensors
    assert ck.tensors.get("zz") is None
    with pytest.raises(KeyError):
        ck.tensors["zz"]
    # The files are the shard files' own path objects, as a load compares them.
    assert {ck.tensors[n].file for n in ck.tensors} == {f.path for f in ck.files}
    assert all(any(ck.tensors[n].file is f.path for f in ck.files) for n in ck.tensors)


def test_a_checkpoint_of_a_hand_built_mapping_plans_as_the_opened_one(tmp_path: Path) -> None:
    ck = Checkpoint.open(_hand_built(tmp_path))
    by_hand = Checkpoint(ck.root, ck.files, dict(ck.tensors.items()), ck.index)
    assert by_hand.table[("c")] == ck.tensors["c"]
    assert plan(by_hand) == plan(ck)
    assert plan(by_hand).routes == tuple(plan(ck).routes)


def test_route_tables_read_as_sequences_of_routes(tmp_path: Path) -> None:
    ck = Checkpoint.open(_hand_built(tmp_path))
    p = plan(ck)
    routes = p.routes
    assert isinstance(routes, RouteTable)
    objects = tuple(routes)
    assert len(objects) == len(routes) == len(ck.tensors)
    assert routes[-1] == objects[-1]
    assert routes[1:3] == objects[1:3]
    with pytest.raises(IndexError):
        routes[len(routes)]
    for field in ("tensor", "file", "src_offset", "nbytes", "dst_offset", "slab", "unit"):
        assert route_column(routes, field) == [getattr(r, field) for r in objects]
    for r in objects:
        assert p.route(r.tensor) == r
        info = ck.tensors[r.tensor]
        assert (r.src_offset, r.nbytes, r.file) == (info.offset, info.nbytes, info.file)
    # Payload order: file, then offset, then name.
    order = {f.path: i for i, f in enumerate(ck.files)}
    keys = [(order[r.file], r.src_offset, r.tensor) for r in objects]
    assert keys == sorted(keys)


@pytest.mark.parametrize("dims", [(), (5,), (2, 3), (2, 3, 4)])
def test_unravel_inverts_linear_index(dims: tuple[int, ...]) -> None:
    n = 1
    for d in dims:
        n *= d
    for linear in range(n):
        assert linear_index(unravel(linear, dims), dims) == linear


def _general(rule: TieredMoE | Dense, ck: Checkpoint) -> Claim:
    """The rule's general path: pending tensors as a plain mapping of objects."""
    pending: Mapping[str, TensorInfo] = dict(ck.tensors.items())
    return rule.claim(ck, pending)


def _same_claims(fast: Claim, general: Claim) -> None:
    assert isinstance(fast.routes, RouteTable)
    assert not isinstance(general.routes, RouteTable)
    assert fast.slabs == general.slabs
    assert [s.labels for s in fast.slabs] == [s.labels for s in general.slabs]
    assert sorted(fast.routes, key=_key) == sorted(general.routes, key=_key)
    assert fast.checked == general.checked
    assert fast.skipped == general.skipped
    assert dict(fast.extras["partitions"]) == dict(general.extras["partitions"])
    assert fast.extras["tiers"] == general.extras["tiers"]


def _key(route: Route) -> str:
    return route.tensor


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCheckpoint:
    spec = SyntheticSpec(n_layers=4, n_experts=6, hidden=64, intermediate=32, vocab=64)
    return write_synthetic(tmp_path_factory.mktemp("columnar"), spec)


@pytest.mark.parametrize("layout", ["shard_major", "expert_major"])
@pytest.mark.parametrize("declared", [False, True])
def test_columnar_moe_plans_what_the_general_path_plans(
    moe: SyntheticCheckpoint, layout: str, declared: bool
) -> None:
    ck = Checkpoint.open(moe.root)
    rule = TieredMoE(
        tier_map=moe.tier_map_path if declared else None,
        layout=layout,  # type: ignore[arg-type]
    )
    fast = plan(ck, [rule, Dense()])
    assert isinstance(fast.routes, RouteTable)
    # The general path, through a rule that hides the planner's pending tensors.
    general = plan(ck, [_Objects(rule), _Objects(Dense())])
    assert not isinstance(general.routes, RouteTable)
    assert fast == general
    assert fast.fingerprint == general.fingerprint
    assert fast.summary() == general.summary()
    claim = rule.claim(ck, plan_pending(ck))
    _same_claims(claim, _general(rule, ck))


@dataclasses.dataclass(frozen=True)
class _Objects:
    """A built-in rule given its pending tensors as a plain dict: its general path."""

    rule: TieredMoE | Dense

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        return self.rule.claim(checkpoint, {n: pending[n] for n in pending})


def plan_pending(ck: Checkpoint) -> Mapping[str, TensorInfo]:
    """Every tensor pending, as the planner hands them to its first rule."""
    from asyncslab.planning._routes import Pending

    return Pending(ck.table, dict(ck.table.numbers()))


def test_a_plan_of_tables_equals_itself_and_its_objects(moe: SyntheticCheckpoint) -> None:
    ck = Checkpoint.open(moe.root)
    a, b = plan(ck, tier_map=moe.tier_map_path), plan(ck, tier_map=moe.tier_map_path)
    assert a == b
    assert a.routes == b.routes
    frozen = dataclasses.replace(a, routes=tuple(a.routes))
    assert isinstance(frozen, Plan)
    assert frozen == a


@pytest.mark.parametrize(
    "columns",
    [[[0, 2, 5, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [1, 8]], [[3, 4], [0, 9, 10, 11]]],
)
def test_merged_runs_list_sorted_columns_in_order(columns: list[list[int]]) -> None:
    from asyncslab.planning._plan import _merge_runs

    flat = [t for c in columns for t in c]
    runs = _merge_runs(columns)
    if runs is None:  # more than one large column: the caller sorts
        assert 8 * (len(flat) - max(map(len, columns))) > len(flat)
        return
    assert [flat[i] for a, b in runs for i in range(a, b)] == sorted(flat)


def test_names_matched_in_chunks_plan_as_at_once(
    moe: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncslab.planning import _moe_columnar

    ck = Checkpoint.open(moe.root)
    whole = plan(ck, tier_map=moe.tier_map_path)
    monkeypatch.setattr(_moe_columnar, "_CHUNK", 7)  # chunks that cut experts and layers apart
    chunked = plan(ck, tier_map=moe.tier_map_path)
    assert isinstance(chunked.routes, RouteTable)
    assert chunked == whole
    assert chunked.checked == whole.checked
