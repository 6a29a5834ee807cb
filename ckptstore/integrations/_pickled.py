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

import io
import math
import pickle
from typing import Any

import numpy as np
import torch

from ckptstore.errors import CheckpointCorruptError, UnsupportedStateError
from ckptstore.step_reader import check_torch_save_bytes

MARKER = "__ckptstore_pickled__"

_PLAIN = (type(None), bool, int, float, str, bytes, bytearray)  # exact types: an IntEnum is pickled
# Sets and bytearrays have opcodes of their own at the protocol ``wrap`` writes: their
# constructors are not resolved (``bytearray(2**40)`` in a crafted blob allocates a TiB).
_SAFE_BUILTINS = (
    {("builtins", name) for name in ("complex", "slice", "range")}
    | {
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("collections", "Counter"),
        ("pathlib", "PosixPath"),
        # what torch.load(weights_only=True) resolves of torch's own plain values (a dtype in a
        # model's hyper-parameters): each is a lookup or a constructor of a value, no code
        ("torch", "Size"),
        ("torch", "device"),
        ("torch.serialization", "_get_layout"),
    }
    | {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
)


def wrap(value: Any) -> Any:
    """``value`` with every part ``ckptstore.state`` refuses replaced by a pickled marker."""
    if isinstance(value, (torch.Tensor, np.generic)) or type(value) in _PLAIN:
        return value
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
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
    if isinstance(key, str):
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
        if self.weights_only and (module, name) not in _SAFE_BUILTINS:
            if (module, name) not in _torch_safe_globals():
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
    return _TensorUnpickler(bytes(data), list(tensors), weights_only=weights_only).load()


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
            return _load_storage_weights_only
        if (module, name) in _SAFE_BUILTINS | _LOADER_STATE_GLOBALS | _torch_safe_globals():
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
