"""``ckptstore inspect``: one step and its tensors."""

from __future__ import annotations

import argparse
import json

from ckptstore._inspect import summarize, worst_first
from ckptstore.cli.common import emit_json
from ckptstore.health import norm
from ckptstore.render import format_ratio, human_bytes, printable, table
from ckptstore.steps import StepView
from ckptstore.store import Store


def cmd_inspect(args: argparse.Namespace, store: Store) -> int:
    doc = {"uri": store.uri, **summarize(StepView.open(store, args.step))}
    if args.json:
        emit_json(doc)
        return 0
    print(f"step {doc['step']} of {store.uri}")
    fields = [
        ("kind", f"{doc['kind']}"),
        ("world size", str(doc["world_size"])),
        ("created", f"{doc['created']} (UTC)"),
        ("attempt", doc["attempt"]),
        (
            "tensors",
            f"{doc['num_tensors']} ({human_bytes(doc['tensor_bytes'])})"
            + (", each rank's shard counted" if doc["world_size"] > 1 else ""),
        ),
        (
            "chunks",
            f"{doc['num_chunks']}: {human_bytes(doc['raw_bytes'])} raw, "
            f"{human_bytes(doc['stored_bytes'])} stored, ratio {format_ratio(doc['compression_ratio'])}",
        ),
        ("user metadata", json.dumps(doc["user"]) if doc["user"] else "-"),
        ("health", _health_line(doc)),
    ]
    if doc["dcp_metadata"]:
        fields.append(("dcp metadata", doc["dcp_metadata"]))
    for name, value in fields:
        print(f"  {name + ':':15}{value}")
    multi = doc["world_size"] > 1
    header = [
        "NAME", *(["RANK"] if multi else []), "DTYPE", "SHAPE", "RAW", "STORED", "CHUNKS",
        "NAN", "INF", "NORM",
    ]  # fmt: skip
    rows = [
        [
            t["name"] + (" (numpy)" if t["numpy"] else " (pickled object)" if t["object"] else ""),
            *([str(t["rank"])] if multi else []),
            t["dtype"],
            "[" + ", ".join(map(str, t["shape"])) + "]",
            human_bytes(t["raw_bytes"]),
            human_bytes(t["stored_bytes"]),
            str(len(t["chunks"])),
            *(["-", "-", "-"] if t["nan"] is None else [
                str(t["nan"]), str(t["inf"]),
                "overflow" if t["norm"] is None else f"{t['norm']:.6g}",
            ]),
        ]
        for t in worst_first(doc["tensors"])
    ]  # fmt: skip
    if rows:
        print()
        offset = 1 if multi else 0
        right = {offset + i for i in (3, 4, 5, 6, 7, 8)}
        print(table(header, rows, right=right))
    return 0


def _health_line(doc: dict) -> str:
    """The step's health in one line: its status, counts, norm and why."""
    record = doc["health_record"]
    if record is None:
        return "unknown (saved without a health record)"
    line = f"{doc['health']}: {record.get('nan', '?')} NaN, {record.get('inf', '?')} Inf"
    if isinstance(record.get("sumsq"), (int, float)):
        line += f", norm {norm(record['sumsq']):.6g}"
    groups = record.get("groups") or {}
    if groups:
        line += " (" + ", ".join(f"{g} {norm(v):.6g}" for g, v in groups.items()) + ")"
    reasons = record.get("reasons") or []
    return printable(line + (f"; {'; '.join(reasons)}" if reasons else ""))  # read from a step
