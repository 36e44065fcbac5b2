"""Program IR: tensors, storages, ops and programs (layer 1 of the flow in DESIGN.md).

A *program* is an ordered list of ops; each op reads and writes named tensors. Every tensor
lives in a *storage*; a view or an in-place result names its base's storage, so it costs
nothing new and keeps the base alive. Memory is accounted per storage by `pipemem.liveness`.

Every source of programs (traced PyTorch steps, transformer templates, Paddle programs,
JSON files) produces this IR, so every estimate goes through the same liveness code.

JSON format (``pipemem.programs/1``)::

    {"format": "pipemem.programs/1",
     "tensors": {"x": {"shape": [4, 1024], "dtype": "bf16", "kind": "activation"},
                 "x_t": {"shape": [1024, 4], "dtype": "bf16", "storage": "x"}},
     "programs": [{"name": "forward", "ops": [
         {"type": "matmul", "inputs": ["x", "w"], "outputs": ["y"]}, ...]}]}

A shape entry that is not a non-negative integer (``null``, ``-1`` or a symbol such as
``"batch"``) is unknown: the tensor needs ``"bytes"`` or the symbol must be bound with
``resolve_dims`` (``--dim batch=4`` on the CLI). Unknown sizes are never taken as 1.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .errors import UserError

FORMAT = "pipemem.programs/1"

# Bytes per element, keyed by every common spelling (ours, torch's, Paddle's, numpy's).
DTYPE_BYTES: dict[str, int] = {}
for _names, _size in [
    (("fp64", "float64", "double", "complex64", "int64", "long", "uint64"), 8),
    (("fp32", "float32", "float", "int32", "int", "uint32", "complex32"), 4),
    (("bf16", "bfloat16", "fp16", "float16", "half", "int16", "short", "uint16"), 2),
    (
        (
            "fp8",
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
            "int8",
            "uint8",
            "bool",
        ),
        1,
    ),
    (("complex128",), 16),
]:
    for _n in _names:
        DTYPE_BYTES[_n] = _size


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of `dtype` (``torch.bfloat16``, ``paddle.float32``, ``bf16``...)."""
    key = str(dtype).lower().rsplit(".", 1)[-1]
    try:
        return DTYPE_BYTES[key]
    except KeyError:
        raise UserError(f"unknown dtype {dtype!r}: use one of {', '.join(sorted(DTYPE_BYTES))}") from None


class TensorKind(str, Enum):
    PARAM = "param"
    BUFFER = "buffer"
    GRAD = "grad"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    TEMP = "temp"
    COMM = "comm_buffer"


# Kinds that exist before and after any program unless a program creates them (params,
# buffers and optimizer states are allocated once per run, not per step).
PERSISTENT_KINDS = frozenset({TensorKind.PARAM, TensorKind.BUFFER, TensorKind.OPTIMIZER_STATE})


@dataclass(slots=True)
class Tensor:
    """A named tensor. `storage` is the name of the storage it lives in (its own name unless
    it is a view or an in-place result of another tensor). `persistent` tensors are never
    freed by liveness; if no op creates them they are static bytes, outside the programs."""

    name: str
    shape: tuple = ()
    dtype: str = "fp32"
    kind: TensorKind = TensorKind.ACTIVATION
    storage: str = ""
    persistent: bool | None = None
    bytes: int | None = None
    _nbytes: int | None = field(default=None, init=False, repr=False, compare=False)  # cache
    _id: int = field(default=-1, init=False, repr=False, compare=False)  # scratch for liveness

    def __post_init__(self) -> None:
        if not self.storage:
            self.storage = self.name
        if not isinstance(self.kind, TensorKind):
            try:
                self.kind = TensorKind(self.kind)
            except ValueError:
                kinds = ", ".join(k.value for k in TensorKind)
                raise UserError(
                    f"tensor {self.name!r}: unknown kind {self.kind!r}; use one of {kinds}"
                ) from None
        if self.persistent is None:
            self.persistent = self.kind in PERSISTENT_KINDS
        self.shape = tuple(self.shape)
        self._refresh_size()

    def _refresh_size(self) -> None:
        """Cache the byte size when it is known (liveness reads it for millions of tensors)."""
        itemsize = DTYPE_BYTES.get(self.dtype) or dtype_bytes(self.dtype)  # a bad dtype names itself
        if self.bytes is not None:
            self._nbytes = int(self.bytes)
        elif all(type(d) is int and d >= 0 for d in self.shape):
            self._nbytes = math.prod(self.shape) * itemsize
        else:
            self._nbytes = None

    @property
    def nbytes(self) -> int:
        if self.bytes is not None:
            return int(self.bytes)
        if self._nbytes is None:
            for d in self.shape:
                if not _is_known_dim(d):
                    raise UserError(
                        f"tensor {self.name!r} has unknown dimension {d!r} in shape {list(self.shape)}: "
                        'give it "bytes" or bind the dimension (--dim NAME=SIZE)'
                    )
            self._nbytes = math.prod(self.shape) * dtype_bytes(self.dtype)
        return self._nbytes


def _is_known_dim(d) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and d >= 0


@dataclass(slots=True)
class Op:
    """One op. `no_need_buffer` inputs are read for their metadata only (Paddle's
    no_need_buffer): they do not keep their storage alive. `frees` names tensors whose last
    reference is dropped right after this op (traced programs know this exactly); it keeps
    their storage alive until here like a use. `workspace_bytes` is scratch memory the op
    allocates and releases inside itself (cuBLAS / attention workspaces). `retain_reads`
    (a subset of `no_need_buffer`) are metadata reads that still count as this program's
    reads when an *earlier* program decides what to keep for it (Paddle's pipeline
    skip_gc rule lists a vector's parts read as no_need_buffer as required): the earlier
    program keeps them, this one does not free them."""

    type: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    name: str = ""
    no_need_buffer: tuple[str, ...] = ()
    frees: tuple[str, ...] = ()
    workspace_bytes: int = 0
    retain_reads: tuple[str, ...] = ()
    phase: str = ""
    module: str = ""

    @property
    def label(self) -> str:
        return self.name or (f"{self.module}:{self.type}" if self.module else self.type)


@dataclass(slots=True)
class Program:
    """An ordered list of ops over tensors. `type` is the sub-program role (forward,
    backward, backward_b, backward_w, optimizer, ...); tensors may be shared with other
    programs of the same run (matched by storage name)."""

    name: str
    ops: list[Op] = field(default_factory=list)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    type: str = ""
    _compiled: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.type:
            self.type = self.name

    # Building ---------------------------------------------------------------------------
    def add_tensor(self, tensor: Tensor) -> Tensor:
        self.tensors[tensor.name] = tensor
        self._compiled = None
        return tensor

    def add_op(self, op: Op) -> Op:
        self.ops.append(op)
        self._compiled = None
        return op

    # Queries ----------------------------------------------------------------------------
    def storages_touched(self) -> set[str]:
        """Storages whose data some op needs (no_need_buffer reads excluded)."""
        out: set[str] = set()
        t = self.tensors
        for op in self.ops:
            nnb = op.no_need_buffer
            for n in op.inputs:
                if n not in nnb:
                    out.add(t[n].storage)
            for n in op.outputs:
                out.add(t[n].storage)
            for n in op.frees:
                out.add(t[n].storage)
        return out

    def param_bytes(self) -> int:
        """Bytes of the distinct parameter storages this program references."""
        sizes: dict[str, int] = {}
        for t in self.tensors.values():
            if t.kind is TensorKind.PARAM:
                sizes[t.storage] = max(sizes.get(t.storage, 0), t.nbytes)
        return sum(sizes.values())

    def validate(self) -> None:
        """Every name an op uses is a declared tensor; sizes are known."""
        for i, op in enumerate(self.ops):
            for group, names in (
                ("input", op.inputs),
                ("output", op.outputs),
                ("no_need_buffer", op.no_need_buffer),
                ("frees", op.frees),
            ):
                for n in names:
                    if n not in self.tensors:
                        raise UserError(
                            f"program {self.name!r} op #{i} ({op.label}): {group} {n!r} "
                            'is not a declared tensor; add it to "tensors"'
                        )
            for n in op.no_need_buffer:
                if n not in op.inputs:
                    raise UserError(
                        f"program {self.name!r} op #{i} ({op.label}): no_need_buffer {n!r} "
                        "is not one of the op's inputs"
                    )
            for n in op.retain_reads:
                if n not in op.no_need_buffer:
                    raise UserError(
                        f"program {self.name!r} op #{i} ({op.label}): retain_reads {n!r} "
                        "is not one of the op's no_need_buffer inputs"
                    )
        for t in self.tensors.values():
            _ = t.nbytes  # raises on unknown dimensions


# Symbolic dimensions ------------------------------------------------------------------------


def resolve_dims(programs: Iterable[Program], dims: Mapping[str, int]) -> None:
    """Bind symbolic dimensions (shape entries that are strings) in place."""
    seen: set[int] = set()
    for prog in programs:
        for t in prog.tensors.values():
            if id(t) in seen:
                continue
            seen.add(id(t))
            if any(isinstance(d, str) for d in t.shape):
                t.shape = tuple(dims.get(d, d) if isinstance(d, str) else d for d in t.shape)
                t._refresh_size()
        prog._compiled = None


# JSON ---------------------------------------------------------------------------------------


def _tensor_to_json(t: Tensor) -> dict:
    d: dict = {"shape": list(t.shape), "dtype": t.dtype, "kind": t.kind.value}
    if t.storage != t.name:
        d["storage"] = t.storage
    if t.persistent != (t.kind in PERSISTENT_KINDS):
        d["persistent"] = t.persistent
    if t.bytes is not None:
        d["bytes"] = t.bytes
    return d


def _op_to_json(op: Op) -> dict:
    d: dict = {"type": op.type, "inputs": list(op.inputs), "outputs": list(op.outputs)}
    for key in ("name", "no_need_buffer", "frees", "workspace_bytes", "phase", "module", "retain_reads"):
        v = getattr(op, key)
        if v:
            d[key] = list(v) if isinstance(v, tuple) else v
    return d


def programs_to_json(programs: Sequence[Program]) -> dict:
    tensors: dict[str, dict] = {}
    for p in programs:
        for name, t in p.tensors.items():
            tensors.setdefault(name, _tensor_to_json(t))
    return {
        "format": FORMAT,
        "tensors": tensors,
        "programs": [
            {"name": p.name, "type": p.type, "ops": [_op_to_json(o) for o in p.ops]} for p in programs
        ],
    }


def save_programs(programs: Sequence[Program], path: str | Path) -> None:
    Path(path).write_text(json.dumps(programs_to_json(programs), indent=1) + "\n")


_TENSOR_KEYS = {"shape", "dtype", "kind", "storage", "persistent", "bytes"}
_OP_KEYS = {
    "type",
    "inputs",
    "outputs",
    "name",
    "no_need_buffer",
    "frees",
    "workspace_bytes",
    "phase",
    "module",
    "retain_reads",
}


def programs_from_json(
    doc: object, source: str = "<json>", dims: Mapping[str, int] | None = None
) -> list[Program]:
    """Build programs from a parsed ``pipemem.programs/1`` document, checking every field;
    `dims` binds symbolic dimensions before sizes are checked."""
    if not isinstance(doc, dict) or not isinstance(doc.get("programs"), list):
        raise UserError(f'{source}: not a pipemem programs file (expected an object with a "programs" list)')
    fmt = doc.get("format", FORMAT)
    if fmt != FORMAT:
        raise UserError(f"{source}: format {fmt!r} is not supported; expected {FORMAT!r}")
    shared = doc.get("tensors", {})
    if not isinstance(shared, dict):
        raise UserError(f'{source}: "tensors" must be an object of name -> tensor')
    table = {name: _tensor_from_json(name, spec, source) for name, spec in shared.items()}
    programs = []
    for i, pd in enumerate(doc["programs"]):
        if not isinstance(pd, dict) or not isinstance(pd.get("ops"), list):
            raise UserError(f'{source}: programs[{i}] must be an object with an "ops" list')
        name = str(pd.get("name") or f"program{i}")
        local = {n: _tensor_from_json(n, s, source) for n, s in (pd.get("tensors") or {}).items()}
        prog = Program(name=name, type=str(pd.get("type") or name))
        for j, od in enumerate(pd["ops"]):
            op = _op_from_json(od, f"{source}: program {name!r} op #{j}")
            for n in (*op.inputs, *op.outputs, *op.frees):
                t = local.get(n) or table.get(n)
                if t is None:
                    raise UserError(
                        f"{source}: program {name!r} op #{j} ({op.label}) references tensor {n!r}, "
                        'which is not declared in "tensors"'
                    )
                prog.tensors[n] = t
            prog.ops.append(op)
        programs.append(prog)
    if dims:
        resolve_dims(programs, dims)
    for prog in programs:
        prog.validate()
    return programs


def _tensor_from_json(name: str, spec: object, source: str) -> Tensor:
    if not isinstance(spec, dict):
        raise UserError(f"{source}: tensor {name!r} must be an object")
    extra = set(spec) - _TENSOR_KEYS
    if extra:
        raise UserError(
            f"{source}: tensor {name!r} has unknown field(s) {sorted(extra)}; allowed: {sorted(_TENSOR_KEYS)}"
        )
    shape = spec.get("shape", [])
    if not isinstance(shape, list):
        raise UserError(f'{source}: tensor {name!r}: "shape" must be a list')
    if "dtype" in spec and not isinstance(spec["dtype"], str):
        raise UserError(f'{source}: tensor {name!r}: "dtype" must be a string')
    try:
        dtype_bytes(spec.get("dtype", "fp32"))
    except UserError as e:
        raise UserError(f"{source}: tensor {name!r}: {e}") from None
    nbytes = spec.get("bytes")
    if nbytes is not None and (not isinstance(nbytes, int) or nbytes < 0):
        raise UserError(f'{source}: tensor {name!r}: "bytes" must be a non-negative integer')
    return Tensor(
        name=name,
        shape=tuple(None if d == -1 else d for d in shape),
        dtype=spec.get("dtype", "fp32"),
        kind=spec.get("kind", "activation"),
        storage=str(spec.get("storage") or name),
        persistent=spec.get("persistent"),
        bytes=nbytes,
    )


def _op_from_json(od: object, where: str) -> Op:
    if not isinstance(od, dict) or "type" not in od:
        raise UserError(f'{where}: an op must be an object with a "type"')
    extra = set(od) - _OP_KEYS
    if extra:
        raise UserError(f"{where}: unknown field(s) {sorted(extra)}; allowed: {sorted(_OP_KEYS)}")
    lists = {}
    for key in ("inputs", "outputs", "no_need_buffer", "frees", "retain_reads"):
        v = od.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise UserError(f'{where}: "{key}" must be a list of tensor names')
        lists[key] = tuple(v)
    ws = od.get("workspace_bytes", 0)
    if not isinstance(ws, int) or ws < 0:
        raise UserError(f'{where}: "workspace_bytes" must be a non-negative integer')
    return Op(
        type=str(od["type"]),
        name=str(od.get("name", "")),
        workspace_bytes=ws,
        phase=str(od.get("phase", "")),
        module=str(od.get("module", "")),
        **lists,
    )


def load_programs(path: str | Path, dims: Mapping[str, int] | None = None) -> list[Program]:
    """Read a ``pipemem.programs/1`` JSON file; every problem is one `UserError` line."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return programs_from_json(doc, str(path), dims)
