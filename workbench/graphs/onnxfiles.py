"""Load, check, count and save ONNX graphs; every save lands complete or not at all."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from workbench.core.atomic import temporary_dir
from workbench.graphs.errors import OnnxModelError
from workbench.models.batches import Feed

if TYPE_CHECKING:
    from google.protobuf.message import Message
    from onnx import ModelProto, TensorProto, ValueInfoProto

M = TypeVar("M", bound="Message")

EXTERNAL_DATA_THRESHOLD = 2 * 1024**3  # protobuf's 2 GB limit
REEXPORT = "re-export, or report the exporter bug"
# Metadata entry: the ONNX Runtime graph optimizers every session of the file leaves out, comma-separated.
DISABLED_OPTIMIZERS_KEY = "workbench.disabled_optimizers"
RUNTIME_KEY = "workbench.runtime"  # the runtime a variant is run by: ONNX Runtime unless it says "openvino"
# OpenVINO's inference precision for the ops a variant leaves in float: "f32" unless it says "bf16".
OPENVINO_PRECISION_KEY = "workbench.openvino_precision"
CORRUPT = "re-run the optimize step (or the step that wrote it); the file is truncated or corrupt"
COPY_CHUNK = 2**26  # bytes of a weight copied at a time
INLINE_BELOW = 1024  # bytes: a smaller tensor goes into the graph (onnx's own threshold for external data)
FIXED_WIDTHS = {1: 8, 5: 4}  # protobuf wire types of fixed width: 64 and 32 bits
DYNAMIC_QUANTIZATION = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeMatMul"})  # one activation scale per batch


@contextmanager
def onnx_destination(dest: Path | str) -> Iterator[Path]:
    """Yield a path in a temp folder beside `dest`; on success move its files (data first, graph last). The files
    keep the modes their writer gave them (ordinary files: 0o666 less the umask)."""
    dest = Path(dest)
    tmp_dir = temporary_dir(dest)
    tmp = tmp_dir / dest.name
    try:
        yield tmp
        if not tmp.is_file():
            raise OnnxModelError(f"nothing was written for {dest}", "see the error above")
        for extra in sorted(p for p in tmp_dir.iterdir() if p != tmp):
            os.replace(extra, dest.parent / extra.name)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _existing(path: Path | str) -> Path:
    """`path` as a Path; OnnxModelError where no such file exists."""
    path = Path(path)
    if not path.is_file():
        raise OnnxModelError(f"ONNX file {path} does not exist", "run the export step, or pass an existing .onnx file")
    return path


def load(path: Path | str, load_external_data: bool = True) -> Any:
    """Read an ONNX file; a missing, truncated or non-ONNX file is an OnnxModelError."""
    import onnx
    from google.protobuf.message import DecodeError

    path = _existing(path)
    try:
        model = onnx.load(str(path), load_external_data=load_external_data)
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        raise OnnxModelError(f"{path} is not a readable ONNX model: {exc}",
                             "re-run the export step to write it again") from None
    if not model.graph.node:
        raise OnnxModelError(f"{path} holds no graph nodes (empty or corrupt file)",
                             "re-run the export step to write it again")
    return model


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# Operators ONNX Runtime's transformer optimizer writes in the default domain that ONNX itself does not define (an
# RMSNorm fused, in LLaMA- and Qwen-style models): onnx.checker does not know them, ONNX Runtime loads them.
ONNXRUNTIME_DEFAULT_DOMAIN_OPS = ("SimplifiedLayerNormalization",)


def check(path: Path | str, fix: str = REEXPORT) -> None:
    """onnx.checker on the file (path form, so models over 2 GB work); `fix` goes into the OnnxModelError. Its one
    complaint let through: an operator of ONNXRUNTIME_DEFAULT_DOMAIN_OPS (a session load checks those)."""
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=False)
    except (onnx.checker.ValidationError, ValueError) as exc:
        known = (f"No Op registered for {op} with domain_version" for op in ONNXRUNTIME_DEFAULT_DOMAIN_OPS)
        if not any(message in str(exc) for message in known):
            raise OnnxModelError(f"{path} fails onnx.checker: {_first_line(exc)}", fix) from None


def verify(path: Path | str) -> None:
    """`check`, then an ONNX Runtime CPU session on the file (graph optimizations off: it checks that the file,
    its external data and every kernel load, not speed); for files about to be published."""
    import onnxruntime as ort

    check(path, CORRUPT)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime's error classes share no narrower base
        raise OnnxModelError(f"{path} does not load in ONNX Runtime: {_first_line(exc)}", CORRUPT) from None


def tensor_values(model: ModelProto | Path, outputs: list[str] | str, feeds: list[Feed]) -> Iterator[Feed]:
    """Per feed, the values of `outputs` (tensor names, or Polygraphy's `constants.MARK_ALL`) when the graph runs in
    ONNX Runtime on the CPU; feed entries the graph does not take are left out. Given a `model`, its outputs are
    marked on a copy; given a file, on the graph read from it, which is dropped once the session holds it (a
    base-size graph is 0.4 GB)."""
    import onnxruntime as ort
    from polygraphy.backend.onnx import modify_outputs

    owned = isinstance(model, Path)
    marked = modify_outputs(load(model) if owned else model, outputs=outputs, copy=not owned)
    with tempfile.TemporaryDirectory(dir=model.parent if owned else None) as folder:
        save(marked, Path(folder) / "marked.onnx")  # written weight by weight: no serialized copy in memory
        del marked
        session = ort.InferenceSession(str(Path(folder) / "marked.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    for feed in feeds:
        yield dict(zip(names, session.run(names, {k: v for k, v in feed.items() if k in wanted})))


def save(model: ModelProto, dest: Path | str, external: bool = False) -> Path:
    """Save a ModelProto atomically, its weights in one external-data file beside it (`<name>.data`) when it would
    exceed 2 GB, or `external`: a reader may then load the graph without them."""
    import onnx

    head, weights, size = _wire_parts(model)  # not ModelProto.ByteSize(): upb serializes the whole model to count
    external = external or size > EXTERNAL_DATA_THRESHOLD
    with onnx_destination(dest) as tmp:
        if external:
            onnx.save_model(model, str(tmp), save_as_external_data=True, location=f"{Path(dest).name}.data")
        else:
            with tmp.open("wb") as out:
                out.write(head)
                for prefix, tensor in weights:
                    out.write(prefix)
                    out.write(tensor.SerializeToString())
    return Path(dest)


def one_data_file(path: Path) -> None:
    """Gather the weights `path` keeps in external files of their own (torch.onnx's layout for a graph over 2 GB:
    one file per tensor) into one `<name>.data` beside it, copied a chunk at a time, and remove the loose files; a
    graph with its weights inside, or in that one file already, is left as it is. A Constant node's value, and any
    tensor under 1 KB, goes into the graph: shape inference reads them (`variants.infer_shapes`)."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = load(path, load_external_data=False)
    constants = [a.t for node in model.graph.node for a in node.attribute if a.HasField("t")]
    tensors = [tensor for tensor in [*model.graph.initializer, *constants] if uses_external_data(tensor)]
    target = f"{path.name}.data"
    loose = {ExternalDataInfo(tensor).location for tensor in tensors} - {target}
    if not loose:
        return
    gathered = path.parent / f".{target}.partial"
    with gathered.open("wb") as out:
        for tensor in tensors:
            info = ExternalDataInfo(tensor)
            offset = out.tell()
            with (path.parent / info.location).open("rb") as source:
                source.seek(info.offset or 0)
                left = info.length or os.fstat(source.fileno()).st_size - (info.offset or 0)
                if left < INLINE_BELOW or any(tensor is constant for constant in constants):
                    tensor.raw_data = source.read(left)
                    del tensor.external_data[:]
                    tensor.data_location = tensor.DEFAULT
                    continue
                while left > 0:
                    chunk = source.read(min(left, COPY_CHUNK))
                    if not chunk:
                        raise OnnxModelError(f"{path}'s weight file {info.location} ends early", REEXPORT)
                    out.write(chunk)
                    left -= len(chunk)
            del tensor.external_data[:]
            for key, value in (("location", target), ("offset", offset), ("length", out.tell() - offset)):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
    os.replace(gathered, path.parent / target)
    save(model, path)  # the graph alone: its weights are in the one file now
    for name in loose:
        (path.parent / name).unlink(missing_ok=True)


def save_beside_weights(model: ModelProto, dest: Path, source: Path) -> Path:
    """Save `model`, read from `source` without its external weights (`load(..., load_external_data=False)`) and
    changed in anything but them, as `dest`: the external weights are `source`'s one data file copied beside `dest`
    (a file copy: never in memory), each initializer pointed at the copy. A graph without external weights is saved
    as `save` does."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    tensors = [tensor for tensor in model.graph.initializer if uses_external_data(tensor)]
    if not tensors:
        return save(model, dest)
    locations = {ExternalDataInfo(tensor).location for tensor in tensors}
    if locations != {f"{source.name}.data"}:
        raise OnnxModelError(f"{source} keeps its weights in {len(locations)} files ({sorted(locations)[0]}, ...), "
                             f"not in one {source.name}.data beside it", "re-run the export step: it gathers them")
    target = f"{dest.name}.data"
    for tensor in tensors:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = target
    with onnx_destination(dest) as tmp:
        shutil.copyfile(source.parent / f"{source.name}.data", tmp.parent / target)
        save(model, tmp)
    return dest


def without_weights(model: ModelProto) -> ModelProto:
    """A copy of `model` whose initializers keep their names, types and dims but not their values (what shape
    inference reads), made without copying the weights."""
    from onnx import GraphProto, ModelProto, TensorProto

    head, graph = _copy_but(model, ModelProto(), "graph"), _copy_but(model.graph, GraphProto(), "initializer")
    graph.initializer.extend(TensorProto(name=t.name, data_type=t.data_type, dims=t.dims)
                             for t in model.graph.initializer)
    head.graph.CopyFrom(graph)
    return head


def _wire_parts(model: ModelProto) -> tuple[bytes, list[tuple[bytes, TensorProto]], int]:
    """`model` in protobuf's wire format, to be written one weight at a time: the bytes of everything but the
    graph's initializers, then each initializer with its field's tag and length; and the bytes of it all. Parsed,
    the file is the model
    (a parser reads fields in any order); serializing the whole message at once holds 2.4x the model (upb's
    buffer, then the bytes: a 436 MB graph's save peaked 1 GB higher)."""
    from onnx import GraphProto, ModelProto

    graph_field = ModelProto.DESCRIPTOR.fields_by_name["graph"]
    weights_field = GraphProto.DESCRIPTOR.fields_by_name["initializer"]
    head, graph_head = _copy_but(model, ModelProto(), "graph"), _copy_but(model.graph, GraphProto(), "initializer")
    weights = [(_length_prefix(weights_field.number, tensor.ByteSize()), tensor) for tensor in model.graph.initializer]
    graph_bytes = graph_head.SerializeToString()
    size = len(graph_bytes) + sum(len(prefix) + tensor.ByteSize() for prefix, tensor in weights)
    head_bytes = head.SerializeToString() + _length_prefix(graph_field.number, size) + graph_bytes
    return head_bytes, weights, len(head_bytes) + size - len(graph_bytes)


def _copy_but(message: Message, copy: M, skipped: str) -> M:
    """`copy` (an empty message of `message`'s type) given every field of `message` but `skipped`."""
    for field, value in message.ListFields():
        if field.name == skipped:
            continue
        if field.is_repeated:
            getattr(copy, field.name).extend(value)
        elif field.message_type is not None:
            getattr(copy, field.name).CopyFrom(value)
        else:
            setattr(copy, field.name, value)
    return copy


def _length_prefix(field_number: int, size: int) -> bytes:
    """A length-delimited field's tag and length, as varints."""
    return _varint(field_number << 3 | 2) + _varint(size)


def _varint(value: int) -> bytes:
    encoded = bytearray()
    while value > 0x7F:
        encoded.append(value & 0x7F | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


def fix_output_dims(path: Path | str, sizes: dict[str, dict[int, int]]) -> None:
    """Write the known sizes of output axes the exporter left symbolic (e.g. an embedding after Normalize, whose
    width shape inference loses) into the graph's declared outputs, in place (external data untouched)."""

    model = load(path, load_external_data=False)
    changed = False
    for output in model.graph.output:
        dims = output.type.tensor_type.shape.dim
        for axis, size in sizes.get(output.name, {}).items():
            if axis < len(dims) and dims[axis].dim_value != size:
                dims[axis].dim_value = size  # clears dim_param: the two are a oneof
                changed = True
    if changed:
        save(model, path)


def skeleton(path: Path | str) -> ModelProto:
    """The model in `path` without its weights' values (initializers keep their names, types and dims): its nodes,
    inputs, outputs and metadata, read by skipping the weights' bytes in the file instead of parsing them (a
    base-size graph: 0.4 GB not read into memory)."""
    from onnx import GraphProto, ModelProto, TensorProto

    path = _existing(path)
    values = {field.number for field in TensorProto.DESCRIPTOR.fields if field.name.endswith("_data")}
    tensor = dict.fromkeys(values)
    skipped = {ModelProto.DESCRIPTOR.fields_by_name["graph"].number: {
        GraphProto.DESCRIPTOR.fields_by_name["initializer"].number: tensor}}
    try:
        with path.open("rb") as file:
            return ModelProto.FromString(_kept_fields(file, path.stat().st_size, skipped))
    except (ValueError, EOFError) as exc:
        raise OnnxModelError(f"{path} is not a readable ONNX model: {exc}", "re-run the export step to write it again"
                             ) from None


Skipped = dict[int, "Skipped | None"]


def _kept_fields(file: BinaryIO, end: int, skipped: Skipped) -> bytes:
    """The wire-format fields from `file`'s position up to `end`, less those `skipped` names (None: the field is
    left out; a dict: its message is kept with those of its own fields left out)."""
    kept = bytearray()
    while file.tell() < end:
        start = file.tell()
        tag = _read_varint(file)
        number, wire = tag >> 3, tag & 7
        if wire == 2:
            size = _read_varint(file)
            if number in skipped and skipped[number] is None:
                file.seek(size, os.SEEK_CUR)
                continue
            if number in skipped:
                body = _kept_fields(file, file.tell() + size, skipped[number] or {})
                kept += _varint(tag) + _varint(len(body)) + body
                continue
            file.seek(size, os.SEEK_CUR)
        elif wire == 0:
            _read_varint(file)
        elif wire in FIXED_WIDTHS:
            file.seek(FIXED_WIDTHS[wire], os.SEEK_CUR)
        else:
            raise ValueError(f"wire type {wire} at byte {start}")
        width = file.tell() - start
        file.seek(start)
        field = file.read(width)
        if len(field) < width:
            raise EOFError(f"the file ends inside a field at byte {start}")
        kept += field
    return bytes(kept)


def _read_varint(file: BinaryIO) -> int:
    value = shift = 0
    while True:
        byte = file.read(1)
        if not byte:
            raise EOFError("the file ends inside a varint")
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7


def _metadata(path: Path | str, key: str) -> str:
    model = skeleton(path)
    return next((p.value for p in model.metadata_props if p.key == key), "")


def disabled_optimizers(path: Path | str) -> list[str]:
    """The ONNX Runtime graph optimizers a session of this file must leave out, from its metadata (a graph in the
    separate layer-norm form, see `variants.GRAPH_FORMS`); none for other files."""
    return [name for name in _metadata(path, DISABLED_OPTIMIZERS_KEY).split(",") if name]


def runtime(path: Path | str) -> str:
    """The runtime the variant in this file is run by, from its metadata: "openvino" for the OpenVINO variant
    (`runners.openvino`), else "onnxruntime"."""
    return _metadata(path, RUNTIME_KEY) or "onnxruntime"


def openvino_precision(path: Path | str) -> str:
    """The precision OpenVINO computes this file's float ops in, from its metadata: "bf16" where the optimize step
    measured it faster (`steps.optimize.choose_openvino_precision`), else "f32"."""
    return _metadata(path, OPENVINO_PRECISION_KEY) or "f32"


def set_metadata(path: Path, entries: dict[str, str]) -> None:
    """Rewrite the file with `entries` in its metadata (others kept)."""
    from onnx import helper

    model = load(path)
    kept = {p.key: p.value for p in model.metadata_props if p.key not in entries}
    helper.set_model_props(model, {**kept, **entries})
    save(model, path)


def total_bytes(path: Path | str) -> int:
    """The bytes of an ONNX file and its external-data file, if there (0 for a path that is not a file: an engine's
    folder)."""
    found = [Path(path), Path(f"{path}.data")]
    return sum(p.stat().st_size for p in found if p.is_file())


def remove(path: Path) -> None:
    """Delete an ONNX file and its external-data file, if there."""
    path.unlink(missing_ok=True)
    Path(f"{path}.data").unlink(missing_ok=True)


def batch_dependent(path: Path | str) -> bool:
    """Whether a text's outputs from this file depend on the texts batched with it: the graph quantizes activations
    dynamically, one scale over every row of the batch (ONNX Runtime's dynamic int8)."""
    return any(node.op_type in DYNAMIC_QUANTIZATION for node in skeleton(path).graph.node)


def op_counts(model: ModelProto) -> dict[str, int]:
    """Node count per op type in the main graph."""
    return dict(sorted(Counter(node.op_type for node in model.graph.node).items()))


def io_shapes(model: ModelProto) -> dict[str, dict[str, list[int | str]]]:
    """Input and output names with their (symbolic) shapes."""
    def shape(value: ValueInfoProto) -> list[int | str]:
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]

    return {
        "inputs": {v.name: shape(v) for v in model.graph.input},
        "outputs": {v.name: shape(v) for v in model.graph.output},
    }
