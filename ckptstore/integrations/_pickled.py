"""Values a ckptstore state cannot represent, kept as pickled blobs beside their tensors.

``ckptstore.state`` saves tensors, numbers, strings, bytes and containers of them, and never
pickles. Framework checkpoints (Lightning's hyper-parameters, callbacks' state) may hold other
objects: enums, dataclasses, paths. ``wrap`` replaces each such value by a marker::

    {"__ckptstore_pickled__": <pickle bytes>, "tensors": [<tensor>, ...]}

where every tensor inside the value is pulled out of the pickle (a persistent id) and saved as a
state tensor: chunked, deduplicated and verified like any other. ``unwrap`` rebuilds the values.
Unpickling runs code named in the blob, so by default (``weights_only=True``) only globals that
torch itself treats as safe are resolved (``torch.serialization.add_safe_globals`` adds more);
``weights_only=False`` resolves any, for checkpoints from a trusted source.
"""

from __future__ import annotations

import collections
import io
import math
import pathlib
import pickle
from typing import Any

import numpy as np
import torch

from ckptstore.errors import CheckpointCorruptError, CheckpointError, UnsupportedStateError
from ckptstore.state import flatten, numpy_key
from ckptstore.step_reader import check_torch_save_bytes

MARKER = "__ckptstore_pickled__"

_PLAIN = (type(None), bool, int, float, str, bytes)  # exact types: an IntEnum is pickled
_MAX_ARGS = 256  # dims of a torch.Size, parts of a path: a hostile blob names no more
_LAYOUTS = {f"torch.{name}" for name in ("strided", "sparse_coo", "sparse_csr", "sparse_csc")}


def _size(dims: Any = ()) -> torch.Size:
    if type(dims) not in (tuple, list) or len(dims) > _MAX_ARGS:
        raise UnsupportedStateError("a pickled torch.Size of no tuple of dims")
    if not all(type(d) is int and 0 <= d < 2**63 for d in dims):
        raise UnsupportedStateError("a pickled torch.Size of dims that are not sizes")
    return torch.Size(dims)


def _device(kind: Any, index: Any = None) -> torch.device:
    if type(kind) is not str or len(kind) > 64 or not (index is None or type(index) is int):
        raise UnsupportedStateError("a pickled torch.device of no device name")
    try:
        return torch.device(kind) if index is None else torch.device(kind, index)
    except (RuntimeError, ValueError) as exc:
        raise UnsupportedStateError(f"a pickled torch.device: {exc}") from None


def _layout(name: Any) -> torch.layout:
    if name not in _LAYOUTS:
        raise UnsupportedStateError(f"a pickled torch layout {str(name)[:40]!r}")
    return getattr(torch, name.removeprefix("torch."))


def _counter(counts: Any = None) -> collections.Counter:
    if counts is not None and type(counts) is not dict:  # as Counter pickles: a dict
        raise UnsupportedStateError("a pickled Counter of no dict")
    return collections.Counter(counts or {})


def _posix_path(*parts: Any) -> pathlib.PosixPath:
    if len(parts) > _MAX_ARGS or not all(type(p) is str for p in parts):
        raise UnsupportedStateError("a pickled path of parts that are not strings")
    return pathlib.PosixPath(*parts)


# The globals a pickled value may name (torch.load(weights_only=True) resolves these too), each
# as a checked constructor. Sets and bytearrays have opcodes of their own at the protocol
# ``wrap`` writes: their constructors are not resolved (``bytearray(2**40)`` allocates a TiB).
_SAFE_CALLS: dict[tuple[str, str], Any] = {
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "range"): range,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("collections", "Counter"): _counter,
    ("pathlib", "PosixPath"): _posix_path,
    ("torch", "Size"): _size,
    ("torch", "device"): _device,
    ("torch.serialization", "_get_layout"): _layout,
}
_DTYPES = {("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}


class _Resolved:
    """A global a pickled value names, handed to the unpickler in place of the class or
    function itself: a call goes to the checked constructor, and a BUILD on it (which would set
    attributes of a class or function the whole process shares: torch's layout table, say) is
    refused. NEWOBJ needs a class: refused too."""

    __slots__ = ("name", "call")

    def __init__(self, name: str, call: Any) -> None:
        self.name, self.call = name, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.call(*args, **kwargs)
        except (CheckpointError, MemoryError, RecursionError):
            raise
        except Exception as exc:  # arguments no save writes: complex(range(...)), say
            raise _crafted(exc) from exc

    def __setstate__(self, state: Any) -> None:
        raise UnsupportedStateError(f"a pickled value sets attributes of {self.name}: refused")


def _safe_global(module: str, name: str) -> Any:
    """What a safe global resolves to (None: not one of them)."""
    if (module, name) in _DTYPES:
        return _DTYPES[module, name]  # an instance with no attributes to set
    call = _SAFE_CALLS.get((module, name))
    return None if call is None else _Resolved(f"{module}.{name}", call)


def wrap(value: Any) -> Any:
    """``value`` with every part ``ckptstore.state`` refuses replaced by a pickled marker."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return value
    if type(value) is np.ndarray and not value.dtype.hasobject:
        return value
    if isinstance(value, np.generic):  # those a state holds as a Python value, else pickled
        try:
            flatten(value)
        except UnsupportedStateError:
            return _pickle(value)
        return value
    if isinstance(value, dict) and all(_plain_key(k) for k in value):
        return {k: wrap(v) for k, v in value.items()}
    if type(value) is list:
        return [wrap(v) for v in value]
    if type(value) is tuple:
        return tuple(wrap(v) for v in value)
    return _pickle(value)


def unwrap(value: Any, *, weights_only: bool) -> Any:
    """The values ``wrap`` pickled, rebuilt around their loaded tensors."""
    if isinstance(value, dict):
        if MARKER in value and set(value) == {MARKER, "tensors"}:
            return _unpickle(value[MARKER], value["tensors"], weights_only=weights_only)
        return {k: unwrap(v, weights_only=weights_only) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap(v, weights_only=weights_only) for v in value]
    if isinstance(value, tuple):
        return tuple(unwrap(v, weights_only=weights_only) for v in value)
    return value


def _plain_key(key: Any) -> bool:
    if numpy_key(key):  # saved as its Python value, as the state takes it
        key = key.item()
    if type(key) is str:
        return not key.startswith("$") and key != MARKER
    return key is None or type(key) in (bool, int) or (type(key) is float and math.isfinite(key))


class _TensorPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj.detach())
            return len(self.tensors) - 1
        return None


def _pickle(value: Any) -> dict:
    buffer = io.BytesIO()
    pickler = _TensorPickler(buffer)
    try:
        pickler.dump(value)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise UnsupportedStateError(
            f"cannot save a value of type {type(value).__qualname__}: it is neither a state "
            f"value nor picklable ({exc})"
        ) from exc
    return {MARKER: buffer.getvalue(), "tensors": pickler.tensors}


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list, *, weights_only: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.tensors = tensors
        self.weights_only = weights_only

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if type(pid) is not int or not 0 <= pid < len(self.tensors):
            raise CheckpointCorruptError(
                f"a pickled value names tensor {pid!r} of the {len(self.tensors)} saved with it"
            )
        return self.tensors[pid]

    def find_class(self, module: str, name: str) -> Any:
        if not self.weights_only:
            return super().find_class(module, name)
        safe = _safe_global(module, name)
        if safe is not None:
            return safe
        if (module, name) not in _torch_safe_globals():  # the user's own: resolved as they are
            raise UnsupportedStateError(
                f"the checkpoint holds a pickled {module}.{name}, which weights_only=True "
                "does not load: pass weights_only=False (trusted checkpoints only) or "
                f"torch.serialization.add_safe_globals([{name}])"
            )
        return super().find_class(module, name)


def _torch_safe_globals() -> set[tuple[str, str]]:
    safe = set()
    for entry in torch.serialization.get_safe_globals():
        obj, qualname = entry if isinstance(entry, tuple) else (entry, None)
        module, _, name = (qualname or "").rpartition(".")
        if isinstance(obj, torch.dtype):  # add_safe_globals([torch.bfloat16]): no __qualname__
            module, name = "torch", str(obj).removeprefix("torch.")
        elif qualname is None:
            module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if not (isinstance(module, str) and isinstance(name, str)):
                continue  # nothing a pickle names
        safe.add((module, name))
    return safe


def _unpickle(data: bytes, tensors: list, *, weights_only: bool) -> Any:
    try:
        return _TensorUnpickler(bytes(data), list(tensors), weights_only=weights_only).load()
    except (CheckpointError, MemoryError, RecursionError):
        raise
    except Exception as exc:
        # Raised by the unpickler itself (a stream cut short, a call of a number): the bytes
        # are no pickle this version wrote. Raised in code it called (a user's own class
        # added with add_safe_globals, say): that code's error, as it is.
        if not weights_only or _innermost_code(exc) is not _unpickle.__code__:
            raise
        raise _crafted(exc) from exc


def _crafted(exc: BaseException) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"a pickled value in the checkpoint does not load with weights_only=True "
        f"({type(exc).__name__}: {str(exc)[:200]})"
    )


def _innermost_code(exc: BaseException) -> Any:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return None if tb is None else tb.tb_frame.f_code


# What a torch.utils.data / torchdata loader's pickled state_dict names beside plain values: a
# sampler's generator state, a tensor (pickled whole, its storage as torch.save bytes).
_LOADER_STATE_GLOBALS = {("torch._utils", "_rebuild_tensor_v2")}


def check_pickled_state(data: bytes, what: str) -> None:
    """:class:`UnsupportedStateError` naming ``what`` unless unpickling ``data`` (bytes some
    framework will ``pickle.loads`` itself, such as torchtitan's dataloader state) resolves
    only plain values, tensors and the globals ``torch.serialization.add_safe_globals`` added:
    a hostile checkpoint's pickle then runs no code when the framework loads it. The check
    unpickles ``data`` once with those globals alone (a tensor's storage bytes with
    ``weights_only=True``)."""
    try:
        _CheckingUnpickler(io.BytesIO(bytes(data)), what).load()
    except UnsupportedStateError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a crafted pickle is refused
        raise UnsupportedStateError(
            f"{what}: not a pickled state this version loads ({exc})"
        ) from exc


class _CheckingUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, what: str) -> None:
        super().__init__(file)
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _Resolved(f"{module}.{name}", _load_storage_weights_only)
        if (module, name) in _LOADER_STATE_GLOBALS:
            return _Resolved(f"{module}.{name}", super().find_class(module, name))
        safe = _safe_global(module, name)
        if safe is not None:
            return safe
        if (module, name) in _torch_safe_globals():
            return super().find_class(module, name)
        raise UnsupportedStateError(
            f"{self.what} holds a pickled {module}.{name}, which ckptstore does not let be "
            "unpickled (it could run code from the checkpoint); for a type of yours in a "
            f"checkpoint you trust: torch.serialization.add_safe_globals([{name}])"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsupportedStateError(f"{self.what}: a pickled reference {pid!r} to nothing saved")


def _load_storage_weights_only(data: bytes) -> Any:
    check_torch_save_bytes(data, "a pickled tensor's storage", legacy=True)
    return torch.load(io.BytesIO(data), weights_only=True)
