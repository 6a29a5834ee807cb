"""How a training state maps to a JSON tree plus a list of tensors, and back, in place.

A state is nested dicts, lists and tuples of tensors, numpy arrays, Python scalars, strings,
bytes, and objects with ``state_dict()`` / ``load_state_dict()``. The tree is JSON; tensors become
``{"$t": i}`` (``$np`` for numpy arrays) and other non-JSON values are tagged the same way::

    {"$t": 3}  {"$np": 4}  {"$tuple": [...]}  {"$dict": [[key, value], ...]}
    {"$bytes": "<base64>"}  {"$float": "nan"}  {"$stateful": <tree of its state_dict()>}
    {"$generator": {"device": "cpu", "state": {"$t": 5}}}   (a torch.Generator)

Nothing is pickled: loading a checkpoint never runs code from storage.
"""

from __future__ import annotations

import base64
import copy
import enum
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckptstore.errors import CheckpointCorruptError, UnsupportedStateError, one_line
from ckptstore.tree import (
    MAX_STATE_DEPTH,
    SUB_BYTE_DTYPES,
    decode_scalar,
    path_str,
    shape_text,
    tag_of,
)

_MISSING = object()


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _check_tensor(t: torch.Tensor, path: tuple) -> None:
    if type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor"):
        raise UnsupportedStateError(
            f"{path_str(path)}: DTensor state is saved through ckptstore.dcp (DCP), "
            "not Checkpointer"
        )
    if t.is_nested:
        raise UnsupportedStateError(
            f"{path_str(path)}: a nested tensor can't be saved: save its components "
            "(t.unbind()) instead"
        )
    if (
        t.layout != torch.strided
        or t.is_quantized
        or t.device.type == "meta"
        or str(t.dtype).removeprefix("torch.") in SUB_BYTE_DTYPES
    ):
        raise UnsupportedStateError(
            f"{path_str(path)}: unsupported tensor ({t.layout}, {t.device}, dtype {t.dtype})"
        )


def _numpy_as_tensor(value: np.ndarray, path: tuple) -> torch.Tensor:
    """A tensor of ``value``'s values, in C order and native byte order (what a load gives
    back as an array); UnsupportedStateError for an array torch has no dtype for."""
    if value.dtype.hasobject:
        raise UnsupportedStateError(f"{path_str(path)}: numpy object arrays can't be saved")
    # not np.ascontiguousarray: it makes a 0-d array 1-d
    contiguous = value if value.flags.c_contiguous else value.copy(order="C")
    if not contiguous.dtype.isnative:  # big-endian: saved as the values, in this order
        contiguous = contiguous.astype(contiguous.dtype.newbyteorder("="))
    if contiguous.dtype.kind in "biufc":  # np.ulonglong as the uint64 torch knows
        contiguous = contiguous.view(np.dtype(contiguous.dtype.str))
    try:
        return torch.from_numpy(contiguous)
    except TypeError:  # a dtype torch lacks (strings, dates)
        raise UnsupportedStateError(
            f"{path_str(path)}: a numpy array of {value.dtype!r}, which torch has no dtype for"
        ) from None


def flatten(state: Any) -> tuple[Any, list[torch.Tensor], set[int]]:
    """The JSON tree of ``state``, its tensors (numpy arrays as tensors) in tree order, and
    which of them were numpy arrays."""
    tensors: list[torch.Tensor] = []
    numpy: set[int] = set()
    active: dict[int, tuple] = {}  # id of each container being walked -> its path

    def walk(value: Any, path: tuple) -> Any:
        if not (isinstance(value, (dict, list, tuple)) or is_stateful(value)):
            return convert(value, path)
        if len(path) >= MAX_STATE_DEPTH:
            raise UnsupportedStateError(
                f"{path_str(path[:4])}/...: the state is nested deeper than {MAX_STATE_DEPTH} "
                "levels (dicts, lists, tuples, stateful objects)"
            )
        # A container inside itself would be walked forever (RecursionError): name the cycle.
        seen = active.get(id(value))
        if seen is not None:
            raise UnsupportedStateError(
                f"{path_str(path)}: the state refers to itself (a cycle back to {path_str(seen)})"
            )
        active[id(value)] = path
        try:
            return convert(value, path)
        finally:
            del active[id(value)]

    def convert(value: Any, path: tuple) -> Any:
        if isinstance(value, torch.Tensor):
            _check_tensor(value, path)
            tensors.append(value.detach())
            return {"$t": len(tensors) - 1}
        if isinstance(value, np.ndarray):
            # a masked array's mask, a matrix's product (a memmap's is its data: kept)
            if type(value) not in (np.ndarray, np.memmap):
                raise _lost_type(value, path, "np.asarray(value) (and a masked array's mask)")
            tensors.append(_numpy_as_tensor(value, path))
            numpy.add(len(tensors) - 1)
            return {"$np": len(tensors) - 1}
        # Exact types: a subclass (an IntEnum, a namedtuple, a masked array) would load back
        # as its base, its type and what it does lost, so it is refused.
        if value is None or type(value) in (bool, int, str):
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, np.generic):
            return walk(_numpy_scalar_value(value, path), path)
        if type(value) is bytes:
            return {"$bytes": base64.b64encode(value).decode()}
        if isinstance(value, dict):  # an OrderedDict (a module's state_dict) too
            keys = list(value)
            if all(type(k) is str and not k.startswith("$") for k in keys):
                return {k: walk(value[k], (*path, k)) for k in keys}
            for k in keys:  # a numpy scalar key is saved as its Python value, as a value is
                if not (k is None or type(k) in (bool, int, float, str) or numpy_key(k)):
                    also = "; an enum: its .value" if isinstance(k, enum.Enum) else ""
                    raise UnsupportedStateError(
                        f"{path_str(path)}: dict key {k!r} of type {type(k).__qualname__} "
                        f"(keys must be of exactly str, int, float, bool or None{also})"
                    )
            return {"$dict": [[walk(k, path), walk(value[k], (*path, k))] for k in keys]}
        if type(value) is list:
            return [walk(v, (*path, i)) for i, v in enumerate(value)]
        if type(value) is tuple:
            return {"$tuple": [walk(v, (*path, i)) for i, v in enumerate(value)]}
        if isinstance(value, _PLAIN):
            raise _lost_type(value, path)
        if is_stateful(value):
            return {"$stateful": walk(value.state_dict(), path)}
        if isinstance(value, torch.Generator):
            state = walk(value.get_state(), path)
            return {"$generator": {"device": str(value.device), "state": state}}
        raise UnsupportedStateError(
            f"{path_str(path)}: cannot save a value of type {type(value).__module__}."
            f"{type(value).__qualname__} (supported: tensors, numpy arrays, numbers, str, bytes, "
            "None, dict/list/tuple, torch.Generator, and objects with state_dict()/load_state_dict())"
        )

    return walk(state, ()), tensors, numpy


_PLAIN = (int, str, float, bytes, bytearray, list, tuple)  # bool: int's


def _lost_type(value: Any, path: tuple, hint: str | None = None) -> UnsupportedStateError:
    """The refusal of ``value``, of a subclass of a type a state holds (an enum with a base,
    a namedtuple, ``torch.Size``, a masked array), or a bytearray: a load would give back
    the base (bytes), its type and what it does lost. ``hint``: what to save instead."""
    kind = type(value)
    bases = (*_PLAIN, np.ndarray)
    base = next(b for b in bases if isinstance(value, b))
    if hint is None:
        if isinstance(value, enum.Enum):
            hint = "value.value (and rebuild the enum after load)"
        elif base is bytearray:
            base, hint = bytes, "bytes(value)"
        elif isinstance(value, tuple) and hasattr(value, "_asdict"):
            hint = "value._asdict() or tuple(value)"
        else:
            hint = f"{base.__name__}(value)"
    name = "numpy.ndarray" if base is np.ndarray else base.__name__
    return UnsupportedStateError(
        f"{path_str(path)}: a {kind.__module__}.{kind.__qualname__} would load back as a "
        f"plain {name}, its type lost: save {hint} instead"
    )


def numpy_key(key: Any) -> bool:
    """Whether ``key`` is a numpy scalar a dict key may be (one a state saves as a plain
    bool, number or str)."""
    return isinstance(key, np.generic) and key.dtype.kind in "biufU"


def _numpy_scalar_value(value: np.generic, path: tuple) -> Any:
    """The plain value a numpy scalar is saved as; ``UnsupportedStateError`` for one with none
    (a longdouble's ``item()`` is itself, a complex64's a complex), saying what to save."""
    kind = value.dtype.kind
    item = value.item()
    # A datetime64/timedelta64 of ns is an int to item(), a void (structured) one bytes:
    # loaded back as that, its type lost
    if isinstance(item, (bool, int, float, str, bytes)) and kind not in "MmV":
        return item
    hint = {
        "f": "float(value)",
        "c": "np.asarray(value) (a 0-d array)",
        "M": "str(value) or value.astype('int64') with its unit",
        "m": "value.astype('int64') with its unit",
        "V": "its fields one by one, or value.tobytes()",
    }.get(kind, "a number")
    if kind == "c" and value.dtype.itemsize > 16:  # torch has no dtype for it
        hint = "np.asarray(value, np.complex128) (a 0-d array)"
    raise UnsupportedStateError(
        f"{path_str(path)}: a numpy {value.dtype} scalar, which no value of a state holds as "
        f"it is: save {hint} instead"
    )


def _items(node: Any) -> list[tuple[Any, Any]]:
    """The (key, value) pairs of a saved tree's dict node (none for anything else)."""
    if tag_of(node) == "$dict":
        return [(decode_scalar(k), v) for k, v in node["$dict"]]
    return list(node.items()) if isinstance(node, dict) and tag_of(node) is None else []


def _is_dict(node: Any) -> bool:
    """Whether a saved tree's ``node`` is a dict."""
    return tag_of(node) == "$dict" or (isinstance(node, dict) and tag_of(node) is None)


def _broadcasts(shape: list[int], to: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(tuple(shape), tuple(to)) == tuple(to)
    except RuntimeError:
        return False


def _module_or_dict(target: Any) -> bool:
    return isinstance(target, dict) or is_stateful(target)


class _Loader:
    """Two passes over (target, saved tree): ``match`` finds, before any I/O, which saved
    tensor lands in which existing tensor (checking shapes and dtypes); ``build`` then puts
    the loaded values in place and calls ``load_state_dict`` on stateful objects."""

    def __init__(
        self, describe: Callable[[int], tuple[torch.dtype, list[int]]], *, strict: bool = True
    ) -> None:
        self.describe = describe
        self.strict = strict
        self.dests: dict[int, torch.Tensor] = {}
        self.paths: dict[int, str] = {}  # of each index in dests: where it is in the state
        self.templates: dict[tuple, Any] = {}
        self.needed: set[int] = set()  # saved tensors the state takes (strict: all of them)
        self.left_out: list[str] = []  # strict=False: saved values the state has no place for
        self.not_saved: list[str] = []  # strict=False: state keys the checkpoint does not hold
        self._in_stateful = 0
        self._lenient: set[int] = set()  # strict=False: state dicts of modules (ids)

    def skips(self, target: Any, key: Any) -> bool:
        """strict=False: a saved key that a dict of the state does not have is left out. Not
        inside a stateful object: its ``load_state_dict`` gets all it saved (an optimizer's
        state dict grows from empty)."""
        lenient = self.loose() or id(target) in self._lenient
        return lenient and isinstance(target, dict) and key not in target

    def loose(self) -> bool:
        return not self.strict and self._in_stateful == 0

    def match(self, target: Any, node: Any, path: tuple) -> None:
        node = _saved_for(target, node)
        tag = tag_of(node)
        if tag in ("$t", "$np"):
            self.needed.add(node[tag])
        if tag == "$t":
            self._match_tensor(target, node, path)
        elif tag == "$np":
            self._match_numpy(target, node, path)
        elif tag == "$stateful":
            self._match_stateful(target, node, path)
        elif tag == "$generator":
            self._match_generator(target, node, path)
        elif tag == "$tuple" or isinstance(node, list):
            items = node["$tuple"] if tag else node
            saved = "a list" if tag is None else "a tuple"
            self._refuse_replacing(target, saved, path, sequences=False)
            seq = target if isinstance(target, (list, tuple)) else None
            if seq is not None and len(seq) != len(items):
                seq = None  # rebuilt from the checkpoint (e.g. a list that grew)
            for i, item in enumerate(items):
                self.match(seq[i] if seq is not None else _MISSING, item, (*path, i))
        elif tag == "$dict" or (isinstance(node, dict) and tag is None):
            self._match_dict(target, node, path)
        elif tag in ("$float", "$bytes") or not isinstance(node, (dict, list)):
            self._match_value(target, node, path)

    def _refuse_replacing(self, target: Any, saved: str, path: tuple, *, sequences: bool) -> None:
        """With ``strict``, ``saved`` (a value or a sequence of the step) does not replace a
        tensor, an array, a generator, a dict, a stateful object or (``sequences``) a list or
        tuple of the state: other references to it would keep their old values unseen, and a
        container of the state is another schema (inside a stateful object its
        ``load_state_dict`` decides)."""
        live = (torch.Tensor, np.ndarray, torch.Generator, dict)
        live += (list, tuple) if sequences else ()
        if not self.strict or self._in_stateful or target is _MISSING or target is None:
            return
        if isinstance(target, live) or is_stateful(target):
            raise UnsupportedStateError(
                f"{path_str(path)}: checkpoint has {saved}, state has "
                f"{type(target).__name__} (load(..., strict=False) replaces it)"
            )

    def _match_value(self, target: Any, node: Any, path: tuple) -> None:
        """A number, string or bytes of the step replaces what the state holds, unless
        ``_refuse_replacing`` says otherwise. A None saved (a value not set yet then, a best
        score say) replaces it too, but with ``strict`` not a stateful object or a dict: a
        model or an optimizer left as it was, its entry set to None, would load nothing
        without a word."""
        if node is None:
            if self.strict and not self._in_stateful and _module_or_dict(target):
                raise UnsupportedStateError(
                    f"{path_str(path)}: checkpoint has None (saved before it was set?), state "
                    f"has {type(target).__name__}: to keep it as it is, leave it out of the "
                    "state for this load (strict=False sets the entry to None)"
                )
        else:
            saved = f"a {type(decode_scalar(node)).__name__}"
            self._refuse_replacing(target, saved, path, sequences=True)

    def _match_tensor(self, target: Any, node: Any, path: tuple) -> None:
        if target is _MISSING or target is None:
            return
        if not isinstance(target, torch.Tensor):
            raise UnsupportedStateError(
                f"{path_str(path)}: checkpoint has a tensor, state has {type(target).__name__}"
            )
        dtype, shape = self.describe(node["$t"])
        if list(target.shape) != shape or target.dtype != dtype:
            raise UnsupportedStateError(
                f"{path_str(path)}: checkpoint has {dtype} {shape_text(shape)}, state has "
                f"{target.dtype} {shape_text(target.shape)}"
            )
        if target.device.type == "meta":
            raise UnsupportedStateError(
                f"{path_str(path)}: state has a tensor on the meta device, which holds no "
                "data to load into: materialize it first (module.to_empty(device=...))"
            )
        if all(st or sz <= 1 for st, sz in zip(target.stride(), target.shape)):
            self.dests[node["$t"]] = target  # else (expanded) it is replaced, not written
            self.paths[node["$t"]] = path_str(path)

    def _match_numpy(self, target: Any, node: Any, path: tuple) -> None:
        # Loaded as a new array, never in place; but an array of another shape or dtype
        # is refused as a tensor is (any other target, None say, is simply replaced).
        dtype, shape = self.describe(node["$np"])
        saved = _numpy_dtype(dtype)
        if saved is None:  # no save makes one: the step is damaged
            raise CheckpointCorruptError(
                f"{path_str(path)}: a numpy array of {dtype}, which numpy has no dtype for"
            )
        if isinstance(target, np.ndarray):
            # saved as its values, in native byte order: either order is the same dtype
            if list(target.shape) != shape or target.dtype.newbyteorder("=") != saved:
                raise UnsupportedStateError(
                    f"{path_str(path)}: checkpoint has a numpy array of "
                    f"{saved if saved is not None else dtype} {shape_text(shape)}, state has "
                    f"{target.dtype} {shape_text(target.shape)}"
                )

    def _match_stateful(self, target: Any, node: Any, path: tuple) -> None:
        if target is _MISSING:
            raise UnsupportedStateError(
                f"{path_str(path)}: checkpoint has a stateful object the state does not hold "
                "(pass one with load_state_dict() there, or load with strict=False to leave "
                "it out)"
            )
        if not is_stateful(target):
            raise UnsupportedStateError(
                f"{path_str(path)}: checkpoint has a stateful object; pass an object with "
                "load_state_dict() to load it into"
            )
        try:
            template = target.state_dict()
        except Exception:  # noqa: BLE001 (ZeRO's before consolidate_state_dict(), say)
            template = _MISSING  # the step's tree is built as saved, as torch.load builds it
        self.templates[path] = template
        if isinstance(target, torch.optim.Optimizer):
            self._check_optimizer_shapes(target, node["$stateful"], path)
        if isinstance(target, torch.nn.Module) and template is not _MISSING:
            if self.strict:
                self._check_module_keys(template, node["$stateful"], path)
            else:
                self._lenient.add(id(template))  # a module's state dict is flat
        self._in_stateful += 1
        try:
            self.match(template, node["$stateful"], path)
        finally:
            self._in_stateful -= 1

    def _match_generator(self, target: Any, node: Any, path: tuple) -> None:
        target = _MISSING if target is None else target
        if target is not _MISSING and not isinstance(target, torch.Generator):
            raise UnsupportedStateError(
                f"{path_str(path)}: checkpoint has a torch.Generator, state has "
                f"{type(target).__name__}"
            )
        if target is _MISSING:  # made on load: its device must be one torch knows
            device = node["$generator"]["device"]
            try:
                torch.device(device)
            except (RuntimeError, ValueError) as exc:
                raise CheckpointCorruptError(
                    f"{path_str(path)}: a generator on device {device[:40]!r}: {exc}"
                ) from None
            try:
                torch.Generator(device=device)
            except RuntimeError as exc:  # saved on a machine with that device, this one lacks it
                why = one_line(exc).split(". ", 1)[0]  # torch goes on for a paragraph
                raise UnsupportedStateError(
                    f"{path_str(path)}: a generator on device {device!r}, which this process "
                    f"cannot make ({why}): load it where there is one, or leave the key out "
                    "of the state and load with strict=False"
                ) from None
        template = target.get_state() if target is not _MISSING else _MISSING
        self.templates[path] = template
        self.match(template, node["$generator"]["state"], path)

    def _match_dict(self, target: Any, node: Any, path: tuple) -> None:
        pairs = _items(node)
        if target is not _MISSING and target is not None and not isinstance(target, dict):
            raise UnsupportedStateError(
                f"{path_str(path)}: checkpoint has a dict, state has {type(target).__name__}"
            )
        container = target if isinstance(target, dict) else None
        if container is not None:
            extra = sorted(path_str((*path, k)) for k in set(container) - {k for k, _ in pairs})
            if extra and not self.strict:
                self.not_saved += extra
            elif extra and self._in_stateful == 0:  # a stateful object's own loader judges
                raise UnsupportedStateError(
                    f"state keys not in the checkpoint: {extra} (load(..., strict=False) "
                    "loads what the checkpoint holds and leaves them alone)"
                )
        for key, value in pairs:
            if self.skips(container, key):
                self.left_out.append(path_str((*path, key)))
                continue
            sub = container.get(key, _MISSING) if container is not None else _MISSING
            self.match(sub, value, (*path, key))

    def _check_optimizer_shapes(self, optim: torch.optim.Optimizer, saved: Any, path: tuple):
        """What torch's own optimizers would take and fail on only later, refused before any
        I/O: groups ``Optimizer.load_state_dict`` refuses, and for its elementwise optimizers a
        per-parameter tensor (an Adam moment, say) that does not broadcast to its parameter.
        An optimizer that loads its own way, or whose pre-hook may adapt the saved state, is
        not checked; nor is any other optimizer's state (LBFGS's flat vectors, a factored
        second moment)."""
        kind = type(optim)
        if (
            kind.state_dict is not torch.optim.Optimizer.state_dict
            or kind.load_state_dict is not torch.optim.Optimizer.load_state_dict
            or getattr(optim, "_optimizer_load_state_dict_pre_hooks", None)
        ):
            return
        self._check_optimizer_groups(optim, saved, path)
        if kind.__module__.split(".")[:2] != ["torch", "optim"] or kind is torch.optim.LBFGS:
            return
        params = [p for group in optim.param_groups for p in group["params"]]
        for index, per_param in _items(dict(_items(saved)).get("state")):
            if not isinstance(index, int) or not 0 <= index < len(params):
                continue  # load_state_dict says what is wrong with the groups
            for name, value in _items(per_param):
                if tag_of(value) != "$t":
                    continue
                shape = self.describe(value["$t"])[1]
                if shape and not _broadcasts(shape, params[index].shape):
                    raise UnsupportedStateError(
                        f"{path_str((*path, 'state', index, name))}: checkpoint has "
                        f"{shape_text(shape)}, this optimizer's parameter {index} is "
                        f"{shape_text(params[index].shape)}"
                    )

    @staticmethod
    def _check_optimizer_groups(optim: torch.optim.Optimizer, saved: Any, path: tuple) -> None:
        """What ``Optimizer.load_state_dict`` would refuse once the other objects of the state
        are loaded (a dict of per-parameter states, groups as many and as long as this
        optimizer's), refused before any I/O."""
        fields = dict(_items(saved))
        state, groups = fields.get("state"), fields.get("param_groups")
        if not _is_dict(state):
            why = "its 'state' is not a dict"
        elif not isinstance(groups, list) or not all(
            _is_dict(g) and isinstance(dict(_items(g)).get("params"), list) for g in groups
        ):
            why = "its 'param_groups' is not a list of groups with 'params' lists"
        else:
            saved_sizes = [len(dict(_items(g))["params"]) for g in groups]
            sizes = [len(g["params"]) for g in optim.param_groups]
            if saved_sizes == sizes:
                return
            why = f"parameter groups of {saved_sizes} parameters, this optimizer's of {sizes}"
        raise UnsupportedStateError(
            f"{path_str(path)}: the checkpoint's optimizer state does not fit this "
            f"{type(optim).__name__}: {why}"
        )

    def _check_module_keys(self, template: dict, saved: Any, path: tuple) -> None:
        """A module whose parameters or buffers the step lacks would keep their current
        values: refused before any I/O, as ``Module.load_state_dict`` refuses it."""
        if tag_of(saved) == "$dict":
            keys = {decode_scalar(k) for k, _ in saved["$dict"]}
        else:
            keys = set(saved) if isinstance(saved, dict) else set()
        for names, what in (
            (set(template) - keys, "the checkpoint lacks {} of this module"),
            (keys - set(template), "the checkpoint has {}, which this module lacks"),
        ):
            odd = sorted(map(str, names))
            if odd:
                more = f" and {len(odd) - 5} more" if len(odd) > 5 else ""
                raise UnsupportedStateError(
                    f"{path_str(path)}: {what.format(', '.join(odd[:5]) + more)} (load(..., "
                    "strict=False) loads the keys both have and lists the others)"
                )

    def build(self, target: Any, node: Any, path: tuple, tensors: dict[int, Any]) -> Any:
        node = _saved_for(target, node)
        tag = tag_of(node)
        if tag in ("$t", "$np"):
            return tensors[node[tag]]
        if tag == "$stateful":
            template = self.templates[path]
            self._in_stateful += 1
            try:
                saved = self.build(template, node["$stateful"], path, tensors)
            finally:
                self._in_stateful -= 1
            target.load_state_dict(saved)
            return target
        if tag == "$generator":
            saved = self.build(self.templates[path], node["$generator"]["state"], path, tensors)
            if not isinstance(target, torch.Generator):
                target = torch.Generator(device=node["$generator"]["device"])
            target.set_state(saved)
            return target
        if tag == "$tuple":
            seq = target if isinstance(target, (list, tuple)) else ()
            return tuple(
                self.build(seq[i] if i < len(seq) else _MISSING, v, (*path, i), tensors)
                for i, v in enumerate(node["$tuple"])
            )
        if isinstance(node, list):
            seq = target if isinstance(target, (list, tuple)) and len(target) == len(node) else None
            values = [
                self.build(seq[i] if seq is not None else _MISSING, v, (*path, i), tensors)
                for i, v in enumerate(node)
            ]
            if isinstance(target, list) and not self._in_stateful:
                target[:] = values
                return target
            return values
        if tag == "$dict" or (isinstance(node, dict) and tag is None):
            pairs = _items(node)
            out = target if isinstance(target, dict) else {}
            if self._in_stateful and isinstance(target, dict):
                out = self._fresh(target)
            for key, value in pairs:
                if self.skips(target, key):
                    continue
                sub = target.get(key, _MISSING) if isinstance(target, dict) else _MISSING
                out[key] = self.build(sub, value, (*path, key), tensors)
            return out
        return decode_scalar(node)

    def _fresh(self, template: dict) -> dict:
        """A dict of a stateful object's ``state_dict()`` built anew for its ``load_state_dict``:
        the object may share the template's containers with another entry (SequentialLR's
        ``_last_lr``), and keys only the live state has (a parameter's optimizer state that
        the step predates) must not pass for saved ones. A shallow copy, emptied, keeps the
        dict's type and a module's ``_metadata`` versions; a module loaded with strict=False
        keeps the keys the step lacks, as they are."""
        try:
            out = copy.copy(template)
        except Exception:  # noqa: BLE001 - a dict subclass that refuses copying
            return {} if id(template) not in self._lenient else dict(template)
        if id(template) not in self._lenient:
            out.clear()
        return out


def _saved_for(target: Any, node: Any) -> Any:
    """``node`` as the saved state of ``target``: a dict saved from a ``state_dict()`` (say
    ``{"model": model.state_dict()}``) loads into a stateful object through its
    ``load_state_dict``, as a saved stateful object would."""
    if _is_dict(node) and not isinstance(target, dict) and is_stateful(target):
        return {"$stateful": node}
    return node


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """The numpy dtype a saved tensor of ``dtype`` loads as (None: numpy has none)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


def plan_load(
    target: Any,
    tree: Any,
    describe: Callable[[int], tuple[torch.dtype, list[int]]],
    *,
    strict: bool = True,
) -> _Loader:
    """Check ``target`` against the saved ``tree``; the result's ``dests`` maps saved tensor
    indexes to the tensors of ``target`` they are loaded into (in place), ``paths`` the same
    indexes to where those tensors are in ``target`` (``model/0.weight``), ``needed`` every
    saved tensor the load uses.

    ``strict=False``: a saved key that a dict of ``target`` lacks is left out (``left_out``),
    and keys of ``target`` the checkpoint lacks are left alone (``not_saved``); a stateful
    object still gets its whole saved state dict. With ``strict`` (the default) every key of
    ``target``'s dicts must be saved, at every level (a stateful object's ``load_state_dict``
    judges its own; a module's keys must match), and saved values under keys the state lacks
    are added to it (a stateful object's are an error: there is nothing to call
    ``load_state_dict`` on). A dict saved from a ``state_dict()`` loads into a stateful object
    of the state through its ``load_state_dict``; a value of another kind is refused."""
    loader = _Loader(describe, strict=strict)
    if strict and tree is None and target is not None:  # nothing would be loaded in place
        raise UnsupportedStateError(
            f"the checkpoint holds None, the state a {type(target).__name__}"
        )
    loader.match(target, tree, ())
    return loader


def finish_load(loader: _Loader, target: Any, tree: Any, tensors: dict[int, Any]) -> Any:
    """Put loaded values into ``target`` (in place where it can) and return it."""
    return loader.build(target, tree, (), tensors)


def to_plain(tree: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """The saved state as plain Python objects, without a state to load into: tensor refs
    replaced by ``tensors``, numpy refs by numpy arrays, stateful objects by their state dicts."""
    tag = tag_of(tree)
    if tag == "$t":
        return tensors[int(tree["$t"])]
    if tag == "$np":
        return tensors[int(tree["$np"])].numpy()
    if tag == "$stateful":
        return to_plain(tree["$stateful"], tensors)
    if tag == "$generator":  # its state, as torch.Generator.get_state() gives it
        return to_plain(tree["$generator"]["state"], tensors)
    if tag == "$tuple":
        return tuple(to_plain(v, tensors) for v in tree["$tuple"])
    if tag == "$dict":
        return {decode_scalar(k): to_plain(v, tensors) for k, v in tree["$dict"]}
    if tag in ("$bytes", "$float"):
        return decode_scalar(tree)
    if isinstance(tree, dict):
        return {k: to_plain(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_plain(v, tensors) for v in tree]
    return tree
