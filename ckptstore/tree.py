"""The saved state tree of a Checkpointer step, without torch: its tags, the checks a decoder
runs on it, and walks that name its tensors (docs/FORMAT.md, "State tree"). ``state`` builds and
loads trees; this is what reading one for names and checks needs (the CLI's ``ls`` and
``inspect`` run without importing torch)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from typing import Any

TREE_TAGS = ("$t", "$np", "$tuple", "$dict", "$bytes", "$float", "$stateful", "$generator")
_FLOATS = ("nan", "inf", "-inf")
# How deep a state may nest: a save refuses a state nested deeper than MAX_STATE_DEPTH values
# (dicts, lists, tuples, stateful objects); a reader refuses a tree deeper than MAX_TREE_DEPTH
# nodes (a level is up to 3 nodes: ``$dict``, its pair, the value), before any walk recurses.
MAX_STATE_DEPTH = 64
MAX_TREE_DEPTH = 256


# The dtypes of the tensors a numpy array is saved as (numpy has none for bfloat16, float8).
NUMPY_DTYPES = frozenset({
    "float64", "float32", "float16", "complex128", "complex64", "int64", "int32", "int16",
    "int8", "uint64", "uint32", "uint16", "uint8", "bool",
})  # fmt: skip


# Sub-byte integer dtypes: torch names them but can neither copy nor torch.save one.
SUB_BYTE_DTYPES = frozenset(
    {"bit", *(f"{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8))}
)


def check_tree(tree: Any, dtypes: Sequence[str], bad) -> None:
    """Raise ``bad(why)`` unless ``tree`` is a state tree whose tags are well formed and whose
    tensor references name tensors of ``dtypes`` (the index's, in order) that fit them: a
    numpy array's one of ``NUMPY_DTYPES``, a generator's state one tensor of bytes."""
    ntensors = len(dtypes)
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise bad(f"state tree: nested deeper than {MAX_TREE_DEPTH} nodes")
        below = depth + 1
        if isinstance(node, list):
            stack.extend((n, below) for n in node)
            continue
        if not isinstance(node, dict):
            if not (node is None or isinstance(node, (bool, int, float, str))):
                raise bad(f"state tree holds {type(node).__name__}")
            continue
        tag = next(iter(node)) if len(node) == 1 else None
        if tag not in TREE_TAGS:
            odd = [k for k in node if not isinstance(k, str) or k.startswith("$")]
            if odd:  # such keys are saved under $dict: a plain node never has them
                raise bad(f"state tree: unknown tag {str(odd[0])[:40]!r}")
            stack.extend((n, below) for n in node.values())
            continue
        value = node[tag]
        if tag in ("$t", "$np"):
            ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < ntensors
            if ok and tag == "$np" and dtypes[value] not in NUMPY_DTYPES:
                raise bad(f"state tree: a numpy array of {dtypes[value]}, which numpy lacks")
        elif tag == "$tuple":
            ok = isinstance(value, list)
            stack.extend((n, below) for n in (value if ok else []))
        elif tag == "$dict":
            ok = isinstance(value, list) and all(
                isinstance(p, list) and len(p) == 2 and _is_key(p[0]) for p in value
            )
            stack.extend((n, below) for p in (value if ok else []) for n in p)
        elif tag == "$bytes":
            ok = isinstance(value, str) and _is_base64(value)
        elif tag == "$float":
            ok = value in _FLOATS
        elif tag == "$stateful":
            ok = True
            stack.append((value, below))
        else:  # $generator
            ok = isinstance(value, dict) and set(value) == {"device", "state"}
            ok = ok and isinstance(value["device"], str) and tag_of(value["state"]) == "$t"
            ok = ok and _refers(value["state"]["$t"], dtypes, "uint8")
        if not ok:
            raise bad(f"state tree: malformed {tag} node {json.dumps(node)[:80]}")


def _refers(value: Any, dtypes: Sequence[str], dtype: str) -> bool:
    """Whether ``value`` names a tensor of ``dtypes`` whose dtype is ``dtype``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(dtypes)
    return ok and dtypes[value] == dtype


def _is_key(node: Any) -> bool:
    """Whether ``node`` is a dict key as saves write them: str, int, float (``$float`` for
    NaN and the infinities), bool or None."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return True
    return isinstance(node, dict) and len(node) == 1 and next(iter(node)) == "$float"


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error
        return False
    return True


def path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def shape_text(shape: Any, shown: int = 8) -> str:
    """A shape as one short line: ``(2, 3)``; one of more than ``shown`` dims (a hostile
    index's may have thousands) as its first and last dims and its count."""
    dims = list(shape)
    if len(dims) <= shown:
        return str(tuple(dims))
    head = ", ".join(map(str, dims[: shown // 2]))
    tail = ", ".join(map(str, dims[-(shown // 2) :]))
    return f"({head}, ..., {tail}) [{len(dims)} dims]"


def tag_of(node: Any) -> str | None:
    """The ``$`` tag of a tree node, or None for plain JSON."""
    if isinstance(node, dict) and len(node) == 1:
        (key,) = node
        if key in TREE_TAGS:
            return key
    return None


def decode_scalar(node: Any) -> Any:
    """A leaf of the tree as its Python value (``$float``, ``$bytes`` decoded)."""
    tag = tag_of(node)
    if tag == "$float":
        return float(node["$float"])
    if tag == "$bytes":
        return base64.b64decode(node["$bytes"])
    return node


def leaves(tree: Any) -> Iterator[tuple[tuple, Any]]:
    """Every leaf of a saved state, in order, as ``(path, node)``: a tensor or numpy array
    (``$t`` / ``$np`` node), a generator (``$generator``), bytes, a float tag or a JSON scalar.
    Containers are walked into; an empty one is no leaf."""
    stack: list[tuple[tuple, Any]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        tag = tag_of(node)
        if tag == "$stateful":
            stack.append((path, node["$stateful"]))
        elif tag == "$tuple" or (isinstance(node, list) and tag is None):
            items = node["$tuple"] if tag else node
            stack.extend(((*path, i), item) for i, item in reversed(list(enumerate(items))))
        elif tag == "$dict" or (isinstance(node, dict) and tag is None):
            pairs = [(decode_scalar(k), v) for k, v in node["$dict"]] if tag else node.items()
            stack.extend(((*path, key), value) for key, value in reversed(list(pairs)))
        else:
            yield path, node


def tensor_of(node: Any) -> int | None:
    """The tensor index of a ``$t`` / ``$np`` leaf (None for any other)."""
    tag = tag_of(node)
    return int(node[tag]) if tag in ("$t", "$np") else None


def tensor_paths(tree: Any) -> dict[int, str]:
    """Tensor index -> where it is in the saved state (``model/0.weight``; ``<root>`` for a
    bare tensor); a tensor referenced twice is named by its first place, a generator's state
    by the generator's."""
    paths: dict[int, str] = {}
    for path, node in leaves(tree):
        if tag_of(node) == "$generator":
            node = node["$generator"]["state"]
        tensor = tensor_of(node)
        if tensor is not None:
            paths.setdefault(tensor, path_str(path))
    return paths


def tensor_indexes(tree: Any) -> dict[int, bool]:
    """Every tensor index in ``tree`` and whether it was a numpy array."""
    found: dict[int, bool] = {}

    def walk(node: Any) -> None:
        tag = tag_of(node)
        if tag in ("$t", "$np"):
            found[node[tag]] = tag == "$np"
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(tree)
    return found
