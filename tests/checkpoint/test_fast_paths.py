"""The compact readers: headers and index in the layout writers emit, read by whole-text
operations instead of a Python step per tensor.

They must be exact. Whatever a compact reader accepts, the general parser accepts with the
same result; anything else falls through to the general parser, which alone raises errors.
Each test below holds the two together, on generated layouts and on hostile edits of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import re
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from asyncslab import (
    AsyncSlabError,
    Checkpoint,
    Dense,
    PlanError,
    Stack,
    TensorInfo,
    TieredMoE,
    plan,
)
from asyncslab._heap import frozen_columns
from asyncslab.checkpoint._header_parse import _ITEMSIZE, parse_compact, parse_general
from asyncslab.checkpoint._index import _parse_index, _weight_map_compact
from asyncslab.errors import CoverageError, DtypeMismatchError, IndexFileError
from asyncslab.planning._checks import routes_valid as _valid
from asyncslab.planning._checks import validate_routes as _validate
from asyncslab.planning._vocabulary import Route, make_route, unit_of_layer
from asyncslab.rules import Claim, SlabSpec
from asyncslab.testing import SyntheticSpec, write_synthetic

HERE = Path("<test>")

# Characters that matter to JSON or to the compact reader's separators and markers.
TRICKY = '"\\\x00\x01\x1f :,{}[]\u00a0\u2028é𝔸0-+_'
NAME_CHARS = st.sampled_from("abcxyz.019_-" + TRICKY)


Entry = tuple[str, str, list[int], int, int]


def compact(entries: list[Entry], meta: dict[str, str] | None) -> str:
    """A header as safetensors writes it: no spaces, metadata first."""
    obj: dict[str, object] = {}
    if meta is not None:
        obj["__metadata__"] = meta
    for name, dtype, shape, begin, end in entries:
        obj[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@st.composite
def headers(draw: st.DrawFn) -> str:
    """Compact headers: mostly valid, in or out of payload order, with zero-size tensors."""
    names = draw(st.lists(st.text(NAME_CHARS, max_size=6), min_size=1, max_size=8, unique=True))
    entries = []
    position = 0
    for name in names:
        dtype = draw(st.sampled_from([*sorted(_ITEMSIZE), "F4", "X9"]))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = math.prod(shape) * _ITEMSIZE.get(dtype, 1)
        entries.append((name, dtype, shape, position, position + size))
        position += size
    if draw(st.booleans()):
        entries = draw(st.permutations(entries))
    meta = draw(st.none() | st.dictionaries(st.text(NAME_CHARS, max_size=3), st.text(max_size=3)))
    return compact(entries, meta) + " " * draw(st.integers(0, 7))


def agree(text: str) -> bool:
    """The compact reader declines, or agrees with the general parser; True if it read it."""
    fast = parse_compact(text)
    if fast is None:
        return False
    assert parse_general(text, HERE) == fast
    return True


@settings(max_examples=300, deadline=None, database=None)
@given(text=headers())
def test_property_compact_header_agrees_with_general(text: str) -> None:
    taken = agree(text)
    try:
        parse_general(text, HERE)
    except AsyncSlabError:
        assert not taken
        return
    obj = json.loads(text)
    plain = all(
        name.isprintable() and '"' not in name and "\\" not in name for name in obj
    ) and all(v.isprintable() for v in obj.get("__metadata__", {}).values())
    if plain and "\\" not in text:
        # Valid and free of escapes: the compact reader must take it, or it does not pay.
        assert taken


EDITS = ['"', ",", ":", "{", "}", "[", "]", "0", "1", "-", "+", " ", "\\", "\x01", "]},", '":{"']


@settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(text=headers(), seed=st.integers(0, 2**32 - 1), count=st.integers(1, 3))
def test_property_edited_header_agrees_or_falls_through(text: str, seed: int, count: int) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        at = rng.randrange(len(text) + 1)
        cut = rng.choice([0, 0, 1, 2])
        text = text[:at] + rng.choice(EDITS) + text[at + cut :]
    agree(text)


SEP = ('":{"dtype":"', '","shape":[', '],"data_offsets":[')


@pytest.mark.parametrize(
    "text",
    [
        # The separators of one tensor in the wrong order: each piece alone looks right.
        '{"a' + SEP[2] + "I16" + SEP[1] + "1" + SEP[0] + "0,2]}}",
        '{"a' + SEP[1] + "I16" + SEP[0] + "1" + SEP[2] + "0,2]}}",
        # Numbers JSON does not write, which int() takes.
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[00,2]}}',
        '{"a":{"dtype":"I16","shape":[01],"data_offsets":[0,2]}}',
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,+2]}}',
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2_0]}}',
        '{"a":{"dtype":"I16","shape":[1_0],"data_offsets":[0,20]}}',
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[-0,2]}}',
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,\u0662]}}',
        '{"a":{"dtype":"I16","shape":[-1],"data_offsets":[0,2]}}',
        # One tensor's offsets carry the next one's numbers.
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2,2,4]},'
        '"b":{"dtype":"I16","shape":[1],"data_offsets":[]}}',
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]},2,4]},'
        '"b":{"dtype":"I16","shape":[1],"data_offsets":[]}}',
        # Repeated names, a tensor called __metadata__, metadata not first.
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]},'
        '"a":{"dtype":"I16","shape":[1],"data_offsets":[2,4]}}',
        '{"__metadata__":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}}',
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]},"__metadata__":{"x":"y"}}',
        '{"__metadata__":{"x":"y"},"__metadata__":{"x":"y"},'
        '"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}}',
        '{"__metadata__":{"x":1},"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}}',
        # Control characters, in a name or standing for the reader's own marker.
        '{"a\x01b":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}}',
        '{"a\nb":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}}',
        # Offsets with a gap, an overlap, not from 0; sizes that disagree; unknown dtype.
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[2,4]}}',
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]},'
        '"b":{"dtype":"I16","shape":[1],"data_offsets":[1,3]}}',
        '{"a":{"dtype":"I16","shape":[2],"data_offsets":[0,2]}}',
        '{"a":{"dtype":"Q8","shape":[1],"data_offsets":[0,2]}}',
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,18446744073709551616]}}',
        # Trailing garbage, a missing brace, whitespace that is not a space.
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}}}',
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}',
        '{"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}}\n',
    ],
)
def test_hostile_compact_header_falls_through(text: str) -> None:
    assert parse_compact(text) is None


def test_compact_header_out_of_order_and_zero_size_match_general() -> None:
    text = (
        '{"b":{"dtype":"I16","shape":[1],"data_offsets":[2,4]},'
        '"z":{"dtype":"I16","shape":[0],"data_offsets":[2,2]},'
        '"y":{"dtype":"I16","shape":[0],"data_offsets":[2,2]},'
        '"a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}}'
    )
    assert agree(text)
    assert parse_compact(text).names == ["a", "y", "z", "b"]  # type: ignore[union-attr]


def test_same_checkpoint_compact_and_indented_opens_the_same(tmp_path: Path) -> None:
    """The reference writes the compact layout; the same header re-indented takes the
    general path. Both must give the same tensors at the same payload offsets."""
    tensors = {
        f"layer.{i}.w": torch.arange(i + 3, dtype=torch.float16).reshape(1, -1) for i in range(5)
    }
    tensors["scalar"] = torch.tensor(7, dtype=torch.int64)
    tensors["empty"] = torch.zeros(0, 4)
    save_file(tensors, str(tmp_path / "compact.safetensors"), metadata={"format": "pt"})
    data = (tmp_path / "compact.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    pretty = json.dumps(json.loads(data[8 : 8 + n]), indent=1).encode()
    (tmp_path / "pretty.safetensors").write_bytes(
        struct.pack("<Q", len(pretty)) + pretty + data[8 + n :]
    )
    a = Checkpoint.open(tmp_path / "compact.safetensors")
    b = Checkpoint.open(tmp_path / "pretty.safetensors")

    def relative(ck: Checkpoint) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
        start = ck.files[0].data_start
        return [(t.name, t.dtype, t.shape, t.offset - start, t.nbytes) for t in ck]

    assert relative(a) == relative(b)
    assert dict(a.files[0].metadata) == dict(b.files[0].metadata) == {"format": "pt"}


# --- the index -----------------------------------------------------------------------------


@st.composite
def indexes(draw: st.DrawFn) -> str:
    names = draw(st.lists(st.text(NAME_CHARS, max_size=5), min_size=1, max_size=6))
    file_names = st.sampled_from(["a.safetensors", "b\x01.st", "c d"])
    files = draw(st.lists(file_names, min_size=len(names), max_size=len(names)))
    pairs = ", ".join(
        f"{json.dumps(n, ensure_ascii=False)}: {json.dumps(f, ensure_ascii=False)}"
        for n, f in zip(names, files, strict=True)
    )
    meta = draw(st.sampled_from(['"metadata": {"total_size": 4}, ', "", '"weight_map": {}, ']))
    after = draw(st.sampled_from(["", ', "metadata": {"a": [1, "x"]}']))
    return "{" + meta + '"weight_map": {' + pairs + "}" + after + "}"


def index_agrees(text: str) -> None:
    fast = _weight_map_compact(text)
    if fast is None:
        return
    names, files = fast
    if len(set(names)) != len(names) or any(ord(c) < 0x20 for c in "".join(names)):
        # Left to the comparison with the headers, which fails and asks the general parser.
        with pytest.raises(IndexFileError):
            _parse_index(text, HERE)
        return
    weight_map = _parse_index(text, HERE)
    assert list(weight_map.items()) == list(zip(names, files, strict=True))


@settings(max_examples=300, deadline=None, database=None)
@given(text=indexes(), seed=st.integers(0, 2**32 - 1), count=st.integers(0, 2))
def test_property_compact_index_agrees_with_general(text: str, seed: int, count: int) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        at = rng.randrange(len(text) + 1)
        text = text[:at] + rng.choice(EDITS) + text[at + rng.choice([0, 1]) :]
    index_agrees(text)


@pytest.mark.parametrize(
    "text",
    [
        '{"weight_map": {"x": "a", "y": "b"}, "weight_map": {"z": "a"}}',
        '{"metadata": {"weight_map": {"x": "a"}}, "weight_map": {"x": "a"}}',
        '{"weight_map": {"x": "a", "y": "b",}}',
        '{"weight_map": {"x": "a" "y": "b"}}',
        '{"weight_map": {"x": "a", "y": "b"}',
        '{"weight_map": {"x": "a"}, "metadata": NaN}',
        '{"weight_map": {"x": "a\x01"}}',
        '["weight_map", {"x": "a"}]',
    ],
)
def test_hostile_compact_index_falls_through(text: str) -> None:
    assert _weight_map_compact(text) is None


def test_every_prefix_and_suffix_falls_through_or_agrees() -> None:
    """Truncated files are the commonest malformed input: no cut of a valid header or index
    may make a compact reader raise, or accept what the general parser refuses."""
    header = compact(
        [("a", "F16", [2, 3], 0, 12), ("weight_map", "I8", [], 12, 13)], {"format": "pt"}
    )
    index = (
        '{\n  "metadata": {"total_size": 13},\n  "weight_map": {\n'
        '    "a": "m.safetensors",\n    "weight_map": "m.safetensors"\n  }\n}\n'
    )
    for text in (header, index):
        for cut in range(len(text) + 1):
            for piece in (text[:cut], text[cut:]):
                agree(piece)
                index_agrees(piece)


def test_index_rewritten_while_opening_is_an_error_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compact index disagrees with the headers, so the index is read again to name the
    culprit; if it was rewritten meanwhile (now agreeing), opening still fails cleanly."""
    from asyncslab.checkpoint import _index

    save_file({"a": torch.zeros(2), "b": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    good = json.dumps({"weight_map": {"a": "m.safetensors", "b": "m.safetensors"}})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "m.safetensors", "a2": "m.safetensors"}})
    )
    monkeypatch.setattr(_index, "_index_text", lambda path: good)
    real = _index._weight_map_compact
    calls: list[int] = []

    def first_read_is_stale(text: str) -> tuple[list[str], list[str]] | None:
        calls.append(1)
        return (["a", "a2"], ["m.safetensors"] * 2) if len(calls) == 1 else real(text)

    monkeypatch.setattr(_index, "_weight_map_compact", first_read_is_stale)
    with pytest.raises(IndexFileError, match="index changed while the checkpoint was opened"):
        Checkpoint.open(tmp_path)


# --------------------------------------------------------------------------- planning
# Planning builds and checks routes a column at a time (300,000 tensors took 2.4 s a
# tensor at a time). The per-route checker stays the reference: the column checks must
# accept exactly the plans it accepts, and the column-built objects must equal the ones
# the dataclasses' own __init__ makes.

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)


@st.composite
def routed(draw: st.DrawFn) -> tuple[Any, dict[str, SlabSpec], list[Route]]:
    """Slabs, a checkpoint's tensors and routes into the slabs: mostly a valid plan, then
    a few random faults (another dtype, shape or size, a slot taken twice, missing or out
    of range, a slab nobody defined, a slice's shape)."""
    slabs: dict[str, SlabSpec] = {}
    tensors: dict[str, TensorInfo] = {}
    routes: list[Route] = []
    for s in range(draw(st.integers(0, 4))):
        dims = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
        item = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
        spec = SlabSpec(f"s{s}", "u", draw(st.sampled_from(DTYPES)), dims, item)
        slabs[spec.name] = spec
        for slot in itertools.product(*map(range, dims)):
            name = f"t{len(tensors)}"
            info = TensorInfo(name, HERE, spec.dtype, "X", item, 8 * len(tensors), spec.slot_nbytes)
            tensors[name] = info
            routes.append(make_route(info, spec, slot))
    for _ in range(draw(st.integers(0, 2))):
        if not routes:
            break
        k = draw(st.integers(0, len(routes) - 1))
        r = routes[k]
        fault = draw(
            st.sampled_from(
                ["dtype", "shape", "nbytes", "slot", "slab", "drop", "twice", "sliced", "offset"]
            )
        )
        info = tensors[r.tensor]
        if fault == "dtype":
            tensors[r.tensor] = dataclasses.replace(info, dtype=draw(st.sampled_from(DTYPES)))
        elif fault == "shape":
            tensors[r.tensor] = dataclasses.replace(info, shape=(*info.shape, 1))
        elif fault == "offset":
            routes[k] = dataclasses.replace(r, dst_offset=r.dst_offset + draw(st.integers(-8, 8)))
        elif fault == "nbytes":
            routes[k] = dataclasses.replace(r, nbytes=r.nbytes + draw(st.integers(-1, 1)))
        elif fault == "slot":
            routes[k] = dataclasses.replace(
                r, slot=tuple(draw(st.lists(st.integers(-1, 3), max_size=2)))
            )
        elif fault == "slab":
            routes[k] = dataclasses.replace(r, slab=draw(st.sampled_from([*slabs, "nowhere"])))
        elif fault == "drop":
            del routes[k]
        elif fault == "twice":
            name = f"t{len(tensors)}"
            tensors[name] = dataclasses.replace(info, name=name)
            routes.append(dataclasses.replace(r, tensor=name))
        else:
            routes[k] = dataclasses.replace(r, shape=draw(st.sampled_from([info.shape, (7,)])))
    return SimpleNamespace(tensors=tensors), slabs, draw(st.permutations(routes))


@given(routed())
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_property_plan_column_checks_accept_what_the_route_checker_accepts(
    case: tuple[Any, dict[str, SlabSpec], list[Route]],
) -> None:
    checkpoint, slabs, routes = case
    try:
        _validate(checkpoint, slabs, routes)
    except PlanError:
        valid = False
    else:
        valid = True
    assert _valid(checkpoint, slabs, routes) is valid


def test_a_plan_with_a_fault_still_names_it() -> None:
    """The column checks only decide; the error still names the tensor and expected vs
    got, as the per-route checker words it."""
    spec = SlabSpec("w", "u", torch.float16, (2,), (4,))
    infos = [TensorInfo(f"t{i}", HERE, torch.float16, "F16", (4,), 8 * i, 8) for i in range(2)]
    wrong = dataclasses.replace(infos[1], dtype=torch.float32, st_dtype="F32")
    checkpoint = SimpleNamespace(tensors={"t0": infos[0], "t1": wrong})
    routes = [make_route(infos[0], spec, (0,)), make_route(infos[1], spec, (1,))]
    assert not _valid(checkpoint, {"w": spec}, routes)
    with pytest.raises(DtypeMismatchError, match=r"dtype F32, plan expects F16") as err:
        _validate(checkpoint, {"w": spec}, routes)
    assert err.value.tensor == "t1"


def test_columns_make_the_objects_init_makes() -> None:
    infos = [
        TensorInfo(f"t{i}", HERE, torch.float16, "F16", (i, 2), 64 * i, 4 * i) for i in range(5)
    ]
    columns = {f.name: [getattr(i, f.name) for i in infos] for f in dataclasses.fields(TensorInfo)}
    del columns["file"]
    built = frozen_columns(TensorInfo, 5, columns, {"file": HERE})
    assert built == infos
    assert all(type(b) is TensorInfo for b in built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built[0].name = "x"  # type: ignore[misc]
    # Defaults fill what is not given; a short column, an unknown or a missing field is
    # refused rather than leaving a slot unset.
    route = frozen_columns(
        Route,
        1,
        {"tensor": ["a"]},
        {
            "file": HERE,
            "src_offset": 8,
            "nbytes": 4,
            "slab": "a",
            "slot": (),
            "dst_offset": 0,
            "unit": "u",
        },
    )[0]
    assert route == Route("a", HERE, 8, 4, "a", (), 0, "u")
    with pytest.raises(ValueError, match="4 values for 5"):
        frozen_columns(TensorInfo, 5, {**columns, "name": ["a"] * 4}, {"file": HERE})
    with pytest.raises(TypeError, match="no fields"):
        frozen_columns(TensorInfo, 5, columns, {"file": HERE, "colour": 1})
    with pytest.raises(TypeError, match="no default"):
        frozen_columns(TensorInfo, 5, columns, {})


def test_dense_and_stack_claims_match_routes_made_one_at_a_time(tmp_path: Path) -> None:
    tensors = {f"model.layers.{i}.w": torch.full((3, 2), float(i)) for i in range(4)}
    tensors |= {f"model.layers.{i}.b": torch.zeros(5, dtype=torch.int8) for i in range(3)}
    tensors["head"] = torch.ones(2, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    ck = Checkpoint.open(tmp_path)
    pending = ck.tensors

    def dense_reference(dtypes: dict[str, torch.dtype]) -> tuple[list[SlabSpec], list[Route]]:
        specs, routes = [], []
        for name, info in pending.items():
            dtype = next((d for p, d in dtypes.items() if re.fullmatch(p, name)), info.dtype)
            spec = SlabSpec(name, unit_of_layer(name), dtype, (), info.shape, {"kind": "dense"})
            specs.append(spec)
            routes.append(make_route(info, spec, ()))
        return specs, routes

    for dtypes in ({}, {r".*\.b": torch.uint8}):
        claim = Dense(dtypes=dtypes).claim(ck, pending)
        specs, routes = dense_reference(dtypes)
        assert list(claim.slabs) == specs
        assert [s.labels for s in claim.slabs] == [s.labels for s in specs]
        assert list(claim.routes) == routes

    claim = Stack(r"model\.layers\.(?P<index>\d+)\.w").claim(ck, pending)
    (spec,) = claim.slabs
    assert spec == SlabSpec("model.layers.*.w", "model.layers.*.w", torch.float32, (4,), (3, 2))
    assert list(claim.routes) == [
        make_route(pending[f"model.layers.{i}.w"], spec, (i,), layer=i) for i in range(4)
    ]
    # A negative index is refused as before, naming the slot.
    with pytest.raises(PlanError, match=r"slot \(-1,\) is outside slab"):
        Stack(r"w(?P<index>-?\d)").claim(
            ck, {"w-1": dataclasses.replace(pending["head"], name="w-1"), "w0": pending["head"]}
        )


@pytest.mark.parametrize("tp_ranks", [1, 2])
def test_tiered_moe_claims_match_routes_made_one_at_a_time(tmp_path: Path, tp_ranks: int) -> None:
    """TieredMoE builds its routes a column at a time; each must be the route make_route
    makes for that tensor and slot, whatever the layout, fusion, rank or ownership."""
    spec = SyntheticSpec(n_layers=3, n_experts=6, hidden=64, intermediate=64, tp_ranks=tp_ranks)
    ck = Checkpoint.open(write_synthetic(tmp_path, spec).root)
    rules = [
        TieredMoE(rank=0 if tp_ranks > 1 else None, layout=layout, fusion=fusion, owns=owns)
        for layout in ("shard_major", "expert_major")
        for fusion in (
            {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)},
            {"w2": ("down_proj",), "w31": ("up_proj", "gate_proj")},
            {"gate": ("gate_proj",), "up": ("up_proj",), "down": ("down_proj",)},
        )
        for owns in (None, lambda layer, expert: (layer + expert) % 3 != 0)
    ]
    for rule in rules:
        claim = rule.claim(ck, ck.tensors)
        slabs = {s.name: s for s in claim.slabs}
        assert len(claim.routes) > 0
        two_dim = 0
        for route in claim.routes:
            two_dim += len(route.slot) == 2
            expected = make_route(
                ck.tensors[route.tensor],
                slabs[route.slab],
                route.slot,
                layer=route.layer,
                expert=route.expert,
                shard=route.shard,
                suffix=route.suffix,
            )
            assert route == expected, (rule, route)
            # The slot is the expert's place in its group, and its shard's in the fusion.
            projs = rule.fusion[slabs[route.slab].labels["projection"]]
            partition = claim.extras["partitions"][route.layer]
            group, offset = partition.locate(route.expert)
            assert slabs[route.slab].labels["group"] == group
            shard = projs.index(route.shard)
            if len(projs) == 1:
                assert route.slot == (offset,)
            elif rule.layout == "expert_major":
                assert route.slot == (offset, shard)
            else:
                assert route.slot == (shard, offset)
        assert two_dim > 0 or all(len(p) == 1 for p in rule.fusion.values())
        plan(ck, [rule, Dense()], unmatched="ignore")  # and the planner accepts them


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("model.layers.1234567890.mlp.experts.0.gate_proj.trellis", "layer number 1234567890"),
        ("model.layers.1.mlp.experts.1234567890.gate_proj.trellis", "expert number 1234567890"),
        ("model.layers.1.mlp.experts.0.gate_proj.rank1234567890.trellis", "rank number"),
    ],
)
def test_tiered_moe_refuses_absurd_numbers_by_name(tmp_path: Path, name: str, what: str) -> None:
    save_file({name: torch.zeros(2, 16, dtype=torch.int16)}, tmp_path / "model.safetensors")
    ck = Checkpoint.open(tmp_path)
    with pytest.raises(PlanError, match=f"{what}.* is too large") as caught:
        TieredMoE().claim(ck, ck.tensors)
    assert caught.value.tensor == name


def test_slabs_of_one_slot_each_need_one_route_each(tmp_path: Path) -> None:
    """In a plan of one-slot slabs (a dense checkpoint's), as many routes as slabs is not
    enough: two into one slab leave another empty."""
    save_file({f"w.{i}": torch.full((4,), float(i)) for i in range(3)}, tmp_path / "m.safetensors")
    ck = Checkpoint.open(tmp_path)

    class Crossed:
        def claim(self, checkpoint: Checkpoint, pending: Any) -> Claim:
            specs = [SlabSpec(f"s.{i}", "u", torch.float32, (), (4,)) for i in range(3)]
            targets = [specs[0], specs[0], specs[2]]  # s.1 gets none, s.0 two
            routes = tuple(
                make_route(pending[f"w.{i}"], spec, ()) for i, spec in enumerate(targets)
            )
            return Claim(slabs=tuple(specs), routes=routes)

    with pytest.raises(CoverageError, match=r"already taken by 'w\.0'") as info:
        plan(ck, [Crossed()])
    assert info.value.tensor == "w.1"


def test_a_custom_rule_with_list_dims_is_judged_by_the_route_checker(tmp_path: Path) -> None:
    """Rules are user code: a slab spec whose dims are lists (unhashable) must plan as it
    did before column checks, not fail with a TypeError from hashing them."""
    save_file({f"w.{i}": torch.full((4,), float(i)) for i in range(2)}, tmp_path / "m.safetensors")
    ck = Checkpoint.open(tmp_path)

    class ListDims:
        def claim(self, checkpoint: Checkpoint, pending: Any) -> Claim:
            spec = SlabSpec("w", "u", torch.float32, [2], [4])  # type: ignore[arg-type]
            routes = tuple(
                dataclasses.replace(make_route(pending[f"w.{i}"], spec, (i,)), shape=[4])  # type: ignore[arg-type]
                for i in range(2)
            )
            return Claim(slabs=(spec,), routes=routes)

    p = plan(ck, [ListDims()])
    assert [p.where(f"w.{i}") for i in range(2)] == [("w", (0,)), ("w", (1,))]


def test_make_route_takes_any_integers_and_refuses_the_rest(tmp_path: Path) -> None:
    """Custom rules' slots from NumPy or an IntEnum planned before slots had to be ints;
    make_route stores them as ints. A bool or a float is no slot index."""
    import enum

    import numpy as np

    class Row(enum.IntEnum):
        FIRST = 0
        SECOND = 1

    save_file({f"w.{i}": torch.full((4,), float(i)) for i in range(2)}, tmp_path / "m.safetensors")
    ck = Checkpoint.open(tmp_path)
    spec = SlabSpec("w", "u", torch.float32, (2,), (4,))
    for index in (np.int64(1), np.int32(1), Row.SECOND):
        route = make_route(ck.tensors["w.1"], spec, (index,))
        assert route.slot == (1,)
        assert type(route.slot[0]) is int
        assert route.dst_offset == 16

    class Rule:
        def claim(self, checkpoint: Checkpoint, pending: Any) -> Claim:
            routes = (
                make_route(pending["w.0"], spec, (Row.FIRST,)),
                make_route(pending["w.1"], spec, (np.int64(1),)),
            )
            return Claim(slabs=(spec,), routes=routes)

    assert plan(ck, [Rule()]).where("w.1") == ("w", (1,))
    for bad in ((True,), (1.0,), (0.5,)):
        with pytest.raises(PlanError, match=r"'w\.1': a slot is a tuple of ints") as info:
            make_route(ck.tensors["w.1"], spec, bad)  # type: ignore[arg-type]
        assert info.value.tensor == "w.1"
    hint = r"is outside slab 'w' \(2,\) \(a slot is a tuple of ints\)"
    with pytest.raises(PlanError, match=hint):
        spec.slot_offset((1.0,))  # type: ignore[arg-type]


def test_a_route_that_would_write_outside_its_slot_is_refused(tmp_path: Path) -> None:
    """The loader writes at a route's byte offset: a custom rule's route whose offset is
    not its slot's, or whose slot lies outside the slab, would write over another slot or
    outside the slabs. Planning refuses both, naming the tensor."""
    save_file({f"w.{i}": torch.full((4,), float(i)) for i in range(2)}, tmp_path / "m.safetensors")
    ck = Checkpoint.open(tmp_path)

    class Shifted:
        def __init__(self, slot: tuple[int, ...], offset: int) -> None:
            self.slot, self.offset = slot, offset

        def claim(self, checkpoint: Checkpoint, pending: Any) -> Claim:
            spec = SlabSpec("w", "u", torch.float32, (2,), (4,))
            first = make_route(pending["w.0"], spec, (0,))
            last = dataclasses.replace(
                make_route(pending["w.1"], spec, (1,)), slot=self.slot, dst_offset=self.offset
            )
            return Claim(slabs=iter([spec]), routes=(first, last))  # type: ignore[arg-type]

    assert plan(ck, [Shifted((1,), 16)]).where("w.1") == ("w", (1,))  # an iterator is read once
    with pytest.raises(
        PlanError, match=r"lands at byte 1024 of its slab, but .* starts at byte 16"
    ) as err:
        plan(ck, [Shifted((1,), 1024)])
    assert err.value.tensor == "w.1"
    with pytest.raises(
        CoverageError, match=r"lands in slot \(5,\), outside slab 'w' of slots \(2,\)"
    ):
        plan(ck, [Shifted((5,), 80)])
    # Only ints index a slot: 0.5 passed 0 <= 0.5 < 2 and made offset 8, half-way into
    # slot 0 (slot 1 left empty, yet the plan complete); True and 1.0 equal 1 as keys.
    import numpy as np

    for slot, offset in (((0.5,), 8), ((1.0,), 16), ((True,), 16), ((np.int64(1),), 16)):
        with pytest.raises(CoverageError, match=r"outside slab 'w' .*a slot is a tuple of ints"):
            plan(ck, [Shifted(slot, offset)])  # type: ignore[arg-type]
