"""``asyncslab.transformers.from_pretrained`` against transformers' own ``from_pretrained``
(real transformers, tiny random models built from configs): every parameter and buffer
bit-identical, identical logits, tied weights sharing storage, eval mode and the same
generation config, on each architecture family the conversion mapping fuses differently;
and bad checkpoints refused naming the tensor, before any payload is read.

The first test fails, and never skips, when transformers changes the API asyncslab uses to
find destinations and to finish a model (``asyncslab/engines/_transformers*.py``)."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import asyncslab.transformers as ast
from asyncslab.errors import (
    CoverageError,
    DtypeMismatchError,
    PayloadSizeError,
    PlanError,
    ShapeMismatchError,
    UnmatchedTensorError,
)
from tests.engines.transformers_models import (
    COMPRESSED,
    MODELS,
    build,
    save,
    write_compressed,
    write_fp8,
)

transformers = pytest.importorskip("transformers")


def test_the_transformers_api_asyncslab_relies_on_is_there() -> None:
    """Not a skip: an upgrade that moves any of these must fail here, loudly."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        build_glob_alternation,
        dot_natural_key,
        rename_source_key,
    )
    from transformers.modeling_utils import LoadStateDictConfig, _is_on_hf_mount
    from transformers.models.auto.auto_factory import _get_model_class
    from transformers.monkey_patching import patch_output_recorders
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
    from transformers.utils.loading_report import LoadStateDictInfo

    assert callable(_get_model_class)
    # The quantizers a refused quantized checkpoint is explained by (_refuse_quantized).
    assert AUTO_QUANTIZER_MAPPING["fp8"].__name__ == "FineGrainedFP8HfQuantizer"
    assert AUTO_QUANTIZER_MAPPING["compressed-tensors"].__name__ == "CompressedTensorsHfQuantizer"
    assert _is_on_hf_mount(Path(__file__)) is False
    assert callable(patch_output_recorders)
    for name in (
        "get_init_context",
        "_get_dtype_plan",
        "_finalize_model_loading",
        "get_parameter_or_buffer",
    ):
        assert hasattr(PreTrainedModel, name), name
    assert {"device_map", "dtype", "dtype_plan", "weight_mapping"} <= set(
        inspect.signature(LoadStateDictConfig).parameters
    )
    assert {"missing_keys", "unexpected_keys", "mismatched_keys", "skipped_pp_keys"} <= set(
        inspect.signature(LoadStateDictInfo).parameters
    )
    assert list(inspect.signature(rename_source_key).parameters)[:5] == [
        "source_key",
        "weight_renamings",
        "weight_converters",
        "base_model_prefix",
        "meta_state_dict",
    ]
    assert dot_natural_key("a.10") > dot_natural_key("a.9")
    assert build_glob_alternation(["x"])[0].search("a.x.weight")
    # The fusion asyncslab places analytically is still spelled this way for MoE models.
    model = build("qwen3_moe")
    fused = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightConverter)]
    ops = {tuple(type(op) for op in c.operations) for c in fused}
    assert (MergeModulelist, Concatenate) in ops
    assert (MergeModulelist,) in ops
    assert any(isinstance(c, WeightRenaming) for c in get_model_conversion_mapping(model))
    assert MergeModulelist(dim=0).get_target_pattern(2, "p", ["t"]) == "p"
    assert Concatenate(dim=1).get_target_pattern(["t"]) == "t"
    generation = inspect.signature(transformers.GenerationMixin.adjust_generation_fn)
    assert list(generation.parameters)[1:5] == [
        "generation_config",
        "from_auto_class",
        "from_pipeline",
        "pretrained_model_name_or_path",
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def assert_same_model(ref: Any, got: Any) -> None:
    """Every parameter and buffer bit-identical, same logits, tying, mode and generation."""
    assert type(got) is type(ref)
    ref_state, got_state = ref.state_dict(), got.state_dict()
    assert list(got_state) == list(ref_state)
    for name, tensor in ref_state.items():
        mine = got_state[name]
        assert (mine.dtype, mine.shape, mine.device) == (
            tensor.dtype,
            tensor.shape,
            tensor.device,
        ), name
        assert torch.equal(_bits(mine), _bits(tensor)), name
    ref_buffers, got_buffers = dict(ref.named_buffers()), dict(got.named_buffers())
    assert list(got_buffers) == list(ref_buffers)
    for name, buffer in ref_buffers.items():
        assert got_buffers[name].dtype == buffer.dtype, name
        assert torch.equal(_bits(got_buffers[name]), _bits(buffer)), name
    ref_tied = ref.all_tied_weights_keys
    assert got.all_tied_weights_keys == ref_tied
    for target, source in ref_tied.items():
        assert got.get_parameter(target) is got.get_parameter(source), target
    assert not got.training
    assert all(not m.training for m in got.modules())
    assert got.generation_config.to_dict() == ref.generation_config.to_dict()
    mine, theirs = got.config.to_dict(), ref.config.to_dict()
    assert mine.pop("_name_or_path") == got.name_or_path  # the source: a path or a URI
    theirs.pop("_name_or_path")
    assert mine == theirs
    ids = torch.randint(
        0, ref.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)
    )
    ids = ids.to(ref.device)
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("fused", [False, True], ids=["original", "fused"])
@pytest.mark.parametrize("name", list(MODELS))
def test_equals_from_pretrained(name: str, fused: bool, tmp_path: Path) -> None:
    """``original``: per-expert tensors, stacked and concatenated by the mapping, each read
    into its slot; ``fused``: ``save_pretrained(save_original_format=False)``, the model's
    own 3-D expert tensors, read whole. Several shards and an index either way."""
    directory = save(build(name), tmp_path / name, fused=fused)
    assert (directory / "model.safetensors.index.json").is_file()
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory)
    model, report = ast.load(directory)
    assert_same_model(ref, model)
    assert report.tensors == report.placed + len(report.converted) + len(report.skipped)
    assert report.files > 1
    if name != "deepseek_v3":  # its float32 router bias is cast, as transformers casts it
        assert not report.converted
    else:
        assert set(report.converted.values()) == {"cast from torch.bfloat16 to torch.float32"}
    if name == "llama_tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_each_expert_lands_in_its_slot_of_the_fused_parameter(tmp_path: Path) -> None:
    """Expert ``e``'s gate fills rows ``[0, I)`` and its up rows ``[I, 2I)`` of
    ``gate_up_proj[e]``, read straight there (no converter runs)."""
    directory = save(build("mixtral"), tmp_path / "m")
    model, report = ast.load(directory)
    tensors: dict[str, torch.Tensor] = {}
    for shard in directory.glob("*.safetensors"):
        tensors.update(load_file(shard))
    size = model.config.intermediate_size
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    for e in range(model.config.num_local_experts):
        prefix = f"model.layers.1.block_sparse_moe.experts.{e}"
        assert torch.equal(fused[e, :size], tensors[f"{prefix}.w1.weight"])
        assert torch.equal(fused[e, size:], tensors[f"{prefix}.w3.weight"])
    assert not report.converted
    assert report.placed == len(tensors)


def test_a_cast_asked_for_goes_through_transformers_converter(tmp_path: Path) -> None:
    """``dtype=torch.float32`` on a bfloat16 checkpoint: the stacked and concatenated experts
    are cast by transformers' own converter on the bytes asyncslab read."""
    directory = save(build("qwen2_moe"), tmp_path / "m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model, report = ast.load(directory, dtype=torch.float32)
    assert_same_model(ref, model)
    assert report.converted
    assert report.placed == 0
    assert all(why.startswith("cast from torch.bfloat16") for why in report.converted.values())


def test_load_pretrained_leaves_the_event_loop_free(tmp_path: Path) -> None:
    directory = save(build("qwen3_moe"), tmp_path / "m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory)

    async def main() -> Any:
        ticks = 0
        done = asyncio.Event()

        async def tick() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        try:
            return await ast.load_pretrained(directory), ticks
        finally:
            done.set()
            await ticker

    model, ticks = asyncio.run(main())
    assert_same_model(ref, model)
    assert ticks > 0


def test_an_explicit_model_class_and_config(tmp_path: Path) -> None:
    directory = save(build("llama_tied"), tmp_path / "m")
    config = transformers.AutoConfig.from_pretrained(directory)
    ref = transformers.LlamaForCausalLM.from_pretrained(directory, config=config)
    model = ast.from_pretrained(directory, model_class=transformers.LlamaForCausalLM, config=config)
    assert_same_model(ref, model)
    base = ast.from_pretrained(directory, model_class=transformers.AutoModel)
    assert type(base).__name__ == "LlamaModel"


# --- parameters as views of the files' mappings -------------------------------------------


def _file_mapped_at(tensor: torch.Tensor) -> str | None:
    """What holds ``tensor``'s first byte in ``/proc/self/maps``: a file's path, a name in
    brackets (``[heap]``), or None (anonymous)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def _distinct(model: Any) -> dict[str, torch.Tensor]:
    """The state dict with one name per tensor (a tied weight is one tensor, two names)."""
    by_memory = {(t.data_ptr(), t.nbytes): (k, t) for k, t in model.state_dict().items()}
    return dict(by_memory.values())


needs_proc_maps = pytest.mark.skipif(
    not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)"
)


@needs_proc_maps
@pytest.mark.parametrize("name", ["llama_tied", "mixtral"])
def test_a_parameter_one_tensor_fills_whole_is_a_view_of_its_files_mapping(
    name: str, tmp_path: Path
) -> None:
    """As transformers' own reader on a CPU: every parameter one checkpoint tensor fills whole
    (all of a dense model's; an MoE's but its stacked experts) is a view of a private
    mapping of its file, nothing of it read at the load; the experts are read into their
    fused parameters. Writing into a mapped parameter never reaches the file."""
    directory = save(build(name), tmp_path / name)
    shards = {str(p.resolve()) for p in directory.glob("*.safetensors")}
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory)
    model, report = ast.load(directory)
    assert_same_model(ref, model)
    state = _distinct(model)
    on_file = {k for k, t in state.items() if _file_mapped_at(t) in shards}
    assert on_file, "no parameter is mapped"
    assert report.mapped == len(on_file)
    assert report.mapped_bytes == sum(state[k].nbytes for k in on_file)
    read = {k for k, t in state.items() if k not in on_file and not t.is_meta}
    if name == "llama_tied":
        assert not read
        assert report.bytes == 0
        assert report.mapped == report.placed
    else:
        # Exactly the fused experts are read, every byte of them once.
        assert read == {k for k in state if ".experts." in k}
        assert report.bytes == sum(state[k].nbytes for k in read)
        assert report.placed == report.tensors
    before = {p: p.read_bytes() for p in directory.glob("*.safetensors")}
    with torch.no_grad():
        model.get_parameter(sorted(on_file)[0]).add_(1)
    assert {p: p.read_bytes() for p in before} == before


@needs_proc_maps
def test_disable_mmap_reads_every_byte_into_the_process_memory(tmp_path: Path) -> None:
    directory = save(build("mixtral"), tmp_path / "m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory)
    model, report = ast.load(directory, disable_mmap=True)
    assert_same_model(ref, model)
    assert (report.mapped, report.mapped_bytes) == (0, 0)
    assert report.bytes == sum(t.nbytes for t in _distinct(model).values())
    shards = {str(p.resolve()) for p in directory.glob("*.safetensors")}
    assert not any(_file_mapped_at(t) in shards for t in model.state_dict().values())


def _unaligned(source: Path, target: Path) -> Path:
    """``source``'s checkpoint in one file written byte by byte, its header padded so that
    the payload starts at an odd offset: no bfloat16 tensor in it can be a view of a
    mapping (safetensors' own writer pads to 8)."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(shard))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    payload = bytearray()
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        assert tensor.dtype == torch.bfloat16
        header[name] = {
            "dtype": "BF16",
            "shape": list(tensor.shape),
            "data_offsets": [len(payload), len(payload) + len(data)],
        }
        payload += data
    text = json.dumps(header).encode()
    text += b" " * ((1 - len(text)) % 2)  # 8 + len(text) odd
    target.mkdir()
    (target / "model.safetensors").write_bytes(
        len(text).to_bytes(8, "little") + text + bytes(payload)
    )
    for name in ("config.json", "generation_config.json"):
        shutil.copy(source / name, target / name)
    return target


def test_a_tensor_at_an_odd_offset_is_read_not_mapped(tmp_path: Path) -> None:
    directory = save(build("llama_tied"), tmp_path / "m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory)
    odd = _unaligned(directory, tmp_path / "odd")
    model, report = ast.load(odd)
    assert report.mapped == 0
    assert report.bytes == sum(t.nbytes for t in _distinct(model).values())
    ref_state = ref.state_dict()
    for key, tensor in model.state_dict().items():
        assert torch.equal(_bits(tensor), _bits(ref_state[key])), key


# --- refusals ---------------------------------------------------------------------------


def _rewrite(source: Path, target: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """``source``'s checkpoint as one file, changed by ``change`` (in place)."""
    target.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(shard))
    change(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        shutil.copy(source / name, target / name)
    return target


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build("mixtral"), tmp_path_factory.mktemp("mixtral") / "m")


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    return drop


def _set(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.__setitem__(name, value)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            _drop("model.layers.1.self_attn.o_proj.weight"),
            CoverageError,
            r"'model\.layers\.1\.self_attn\.o_proj\.weight'.*from no checkpoint tensor.*"
            r"expected 'model\.layers\.1\.self_attn\.o_proj\.weight'",
        ),
        (
            _drop("model.layers.0.block_sparse_moe.experts.2.w3.weight"),
            CoverageError,
            r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.2\.w3\.weight'.*stacks 4 "
            r"tensors.*has 3.*missing index \[2\]",
        ),
        (
            _set(
                "model.layers.0.block_sparse_moe.experts.9.w1.weight",
                torch.zeros(16, 32, dtype=torch.bfloat16),
            ),
            CoverageError,
            r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.9\.w1\.weight'.*stacks 4 "
            r"tensors.*has 5.*unexpected index \[9\]",
        ),
        (
            _set("model.layers.0.self_attn.extra.weight", torch.zeros(4, dtype=torch.bfloat16)),
            UnmatchedTensorError,
            r"tensor 'model\.layers\.0\.self_attn\.extra\.weight'.*no place in MixtralForCausalLM",
        ),
        (
            _set(
                "model.layers.1.self_attn.q_proj.weight", torch.zeros(32, 30, dtype=torch.bfloat16)
            ),
            ShapeMismatchError,
            r"tensor 'model\.layers\.1\.self_attn\.q_proj\.weight': shape \[32, 30\], the model "
            r"expects \[32, 32\]",
        ),
        (
            _set(
                "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                torch.zeros(32, 15, dtype=torch.bfloat16),
            ),
            ShapeMismatchError,
            r"tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight': shape "
            r"\[32, 15\], the model expects \[32, 16\] for "
            r"'model\.layers\.1\.mlp\.experts\.down_proj'",
        ),
        (
            _set("model.norm.weight", torch.ones(32, dtype=torch.float32)),
            DtypeMismatchError,
            r"tensor 'model\.norm\.weight': dtype torch\.float32, the model's "
            r"'model\.norm\.weight' is torch\.bfloat16",
        ),
    ],
    ids=["dense", "expert", "extra-expert", "unexpected", "shape", "expert-shape", "dtype"],
)
def test_a_bad_checkpoint_is_refused_naming_the_tensor(
    mixtral_dir: Path,
    tmp_path: Path,
    change: Callable[[dict[str, torch.Tensor]], None],
    error: type[PlanError],
    match: str,
) -> None:
    """Refused while planning (a :class:`PlanError`), before any payload is read: the
    bad checkpoint's payload is replaced by zeros after its header, and nothing initialised
    at random stands in (``from_pretrained`` would load a model missing a tensor)."""
    directory = _rewrite(mixtral_dir, tmp_path / "bad", change)
    shard = directory / "model.safetensors"
    data = bytearray(shard.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = bytes(len(data) - header)  # a read would land zeros, not fail
    shard.write_bytes(bytes(data))
    with pytest.raises(error, match=match):
        ast.from_pretrained(directory)


def test_a_missing_config_is_named(tmp_path: Path, mixtral_dir: Path) -> None:
    from asyncslab.errors import MissingFileError

    directory = tmp_path / "m"
    directory.mkdir()
    for shard in mixtral_dir.glob("*.safetensors*"):
        shutil.copy(shard, directory / shard.name)
    with pytest.raises(MissingFileError, match="no config.json"):
        ast.from_pretrained(directory)
    config = json.loads((mixtral_dir / "config.json").read_text())
    assert config["model_type"] == "mixtral"


# --- quantized checkpoints: refused, naming the method, before any read --------------------


def _quantized(kind: str, directory: Path) -> Path:
    """A checkpoint of ``kind``: ``fp8`` (block-wise, a Qwen3-MoE: attention, dense and
    per-expert weights) or a compressed-tensors scheme of :data:`COMPRESSED` (a Llama,
    written by compressed-tensors' own ``ModelCompressor``)."""
    if kind == "fp8":
        return write_fp8(build("qwen3_moe"), directory)
    pytest.importorskip("compressed_tensors")  # vLLM's dependency: Linux x86-64 and arm64
    return write_compressed(build("llama_tied"), directory, kind)


def _cut(source: Path, target: Path) -> Path:
    """``source``'s checkpoint with each safetensors file cut after its header and half its
    payload: any read of the payload, or the check of its size when the headers are
    opened, fails."""
    shutil.copytree(source, target)
    for shard in target.glob("*.safetensors"):
        data = shard.read_bytes()
        header = 8 + int.from_bytes(data[:8], "little")
        shard.write_bytes(data[: header + (len(data) - header) // 2])
    return target


#: kind -> the method and format its error names.
QUANTIZED = {
    "fp8": ("fp8", None),
    "w8a8": ("compressed-tensors", "int-quantized"),
    "w4a16": ("compressed-tensors", "pack-quantized"),
}


@pytest.mark.parametrize("kind", list(QUANTIZED))
def test_a_quantized_checkpoint_is_refused_naming_its_method_before_any_read(
    kind: str, tmp_path: Path
) -> None:
    """A ``quantization_config`` is refused from the config alone, by a :class:`PlanError`
    naming the method (and compressed-tensors' format), the config's path, and what to do:
    the checkpoint's payload is cut short, so a read, or even the check of the payload's
    size when the headers are opened, would fail otherwise; with ``dtype=`` and from async
    code alike. Without its ``quantization_config`` the same files are refused for their
    payload: the refusal came first."""
    method, fmt = QUANTIZED[kind]
    cut = _cut(_quantized(kind, tmp_path / kind), tmp_path / "cut")
    named = re.escape(repr(method) + (f" (format {fmt!r})" if fmt else ""))
    match = (
        rf"^{re.escape(str(cut / 'config.json'))}: quantization_config with quant_method "
        rf"{named}: asyncslab\.transformers takes unquantized checkpoints only \(expected no "
        r"quantization_config\); .*transformers' .*quantizer.*Load it with transformers' own "
        r"from_pretrained\. No weight was read$"
    )
    calls: list[Callable[[], Any]] = [
        lambda: ast.from_pretrained(cut),
        lambda: ast.load(cut, dtype=torch.float32),
        lambda: asyncio.run(ast.load_pretrained(cut)),
    ]
    for call in calls:
        with pytest.raises(PlanError, match=match) as raised:
            call()
        assert type(raised.value) is PlanError
        assert raised.value.file == str(cut / "config.json")
        assert raised.value.details == {
            "method": method,
            "format": fmt,
            "expected": None,
            "got": method,
        }
    config = json.loads((cut / "config.json").read_text())
    del config["quantization_config"]
    (cut / "config.json").write_text(json.dumps(config))
    with pytest.raises(PayloadSizeError):
        ast.from_pretrained(cut)


@pytest.mark.parametrize("kind", ["w8a8", "w4a16"])
def test_transformers_loads_compressed_tensors_through_its_quantizer(
    kind: str, tmp_path: Path
) -> None:
    """What asyncslab refuses to imitate: transformers' own load of a compressed-tensors
    checkpoint runs its ``CompressedTensorsHfQuantizer``, which gives the quantized layers
    compressed parameters (int8 ``weight`` or ``weight_packed`` and ``weight_shape``, beside
    ``weight_scale``) a model built without it does not have. Its config, passed as
    ``config=`` (a ``CompressedTensorsConfig`` now, no dict), is refused the same way."""
    directory = _quantized(kind, tmp_path / kind)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert type(ref.hf_quantizer).__name__ == "CompressedTensorsHfQuantizer"
    quantized = set(ref.state_dict()) - set(build("llama_tied").state_dict())
    assert "model.layers.0.self_attn.q_proj.weight_scale" in quantized
    q_proj = dict(ref.model.layers[0].self_attn.q_proj.named_parameters())
    if kind == "w8a8":
        assert q_proj["weight"].dtype == torch.int8
    else:
        assert q_proj["weight_packed"].dtype == torch.int32
        assert "weight" not in q_proj
    fmt = COMPRESSED[kind][0]
    with pytest.raises(PlanError, match=rf"'compressed-tensors' \(format '{fmt}'\)") as raised:
        ast.from_pretrained(directory, config=ref.config)
    assert raised.value.file == f"{directory} (config=...)"


def test_transformers_dequantizes_fp8_on_a_cpu_or_refuses_it(tmp_path: Path) -> None:
    """What asyncslab refuses to imitate, on a CPU: transformers' FineGrainedFP8 quantizer
    refuses the checkpoint without accelerate, and with it dequantizes every weight to
    bfloat16 (float8 times its block's scale): a weight transform, not a placement."""
    import importlib.util

    directory = _quantized("fp8", tmp_path / "fp8")
    if importlib.util.find_spec("accelerate") is None:
        with pytest.raises(ImportError, match="requires accelerate"):
            transformers.AutoModelForCausalLM.from_pretrained(directory)
        return
    if torch.cuda.is_available():
        pytest.skip("on a GPU transformers keeps FP8 layers; this checks the CPU's dequantizing")
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert tensors[name].dtype == torch.float8_e4m3fn
    assert tensors[f"{name}_scale_inv"].shape == (1, 1)  # one block: the whole weight
    dequantized = (tensors[name].float() * tensors[f"{name}_scale_inv"]).to(torch.bfloat16)
    assert torch.equal(ref.get_parameter(name), dequantized)


@pytest.mark.parametrize(
    ("quantization", "match"),
    [
        (
            {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"},
            r"quant_method 'awq': .*it needs transformers' AwqQuantizer",
        ),
        ({"load_in_4bit": True}, r"quant_method 'bitsandbytes_4bit': .*Bnb4BitHfQuantizer"),
        (
            {"quant_method": "no-such-method"},
            r"quant_method 'no-such-method': .*transformers has no quantizer for it",
        ),
        ({}, r"names no quant_method, which transformers' from_pretrained refuses too"),
    ],
    ids=["awq", "bitsandbytes", "unknown", "empty"],
)
def test_any_quantization_config_is_refused_before_any_read(
    mixtral_dir: Path, tmp_path: Path, quantization: dict[str, Any], match: str
) -> None:
    """Any method, not only those tested with their checkpoints: transformers' quantizer
    named; a method transformers does not know (it would load the checkpoint as if the
    config were not there) is refused too, and so is an empty config, which transformers
    refuses. The payload is cut short, as above."""
    cut = _cut(mixtral_dir, tmp_path / "cut")
    config = json.loads((cut / "config.json").read_text())
    config["quantization_config"] = quantization
    (cut / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match=match):
        ast.from_pretrained(cut)


def test_the_command_line_loads_a_transformers_model(
    mixtral_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncslab.cli._main import main

    assert main(["load", "--transformers", "--no-progress", str(mixtral_dir)]) == 0
    out = capsys.readouterr().out
    assert f"loaded {mixtral_dir} as MixtralForCausalLM:" in out
    mapped = re.search(r"41 of 41 straight into their parameters \((\d+) read, (\d+) mapped", out)
    assert mapped is not None, out
    assert int(mapped[1]) > 0
    assert int(mapped[2]) > 0
    assert int(mapped[1]) + int(mapped[2]) == 41
    report = tmp_path / "report.json"
    argv = ["load", "--transformers", "--no-progress", "--dtype", "float32"]
    assert main([*argv, "--json", str(report), str(mixtral_dir)]) == 0
    doc = json.loads(report.read_text())
    assert doc["model"] == "MixtralForCausalLM"
    assert doc["dtype"] == "torch.float32"
    assert doc["placed"] == 0
    assert len(doc["converted"]) == doc["tensors"] == 41
    assert main(["load", "--transformers", "--verify", str(mixtral_dir)]) == 2
    assert "--verify does not apply to --transformers" in capsys.readouterr().err
    argv = ["load", "--transformers", "--no-progress", "--disable-mmap", "--json", "-"]
    assert main([*argv, str(mixtral_dir)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["mapped"], doc["mapped_bytes"], doc["placed"]) == (0, 0, 41)
    assert main(["load", "--disable-mmap", str(mixtral_dir)]) == 2
    assert "--disable-mmap applies to --transformers only" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["qwen3_moe", "llama_tied"])
def test_onto_cuda_equals_from_pretrained_with_a_device_map(name: str, tmp_path: Path) -> None:
    """``device="cuda"``: parameters allocated on the GPU, the payload through pinned staging
    and CUDA streams; the same model as ``from_pretrained(device_map="cuda")``."""
    import importlib.util

    directory = save(build(name), tmp_path / name)
    if importlib.util.find_spec("accelerate") is not None:
        ref = transformers.AutoModelForCausalLM.from_pretrained(directory, device_map="cuda")
    else:  # transformers refuses any device_map without accelerate
        ref = transformers.AutoModelForCausalLM.from_pretrained(directory).to("cuda")
    model, report = ast.load(directory, device="cuda")
    assert_same_model(ref, model)
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(b.device.type == "cuda" for b in model.buffers())
    assert report.placed == report.tensors
