"""``ckptstore restore``: a step written out as a torch.save file or a DCP directory."""

from __future__ import annotations

import argparse
import os
import warnings

from ckptstore._inspect import load_step_state, step_raw_bytes
from ckptstore.catalog import open_step
from ckptstore.cli.common import UsageError, emit_json, progress
from ckptstore.cli.restore_file import check_target, count_values, write_atomically
from ckptstore.format import KIND_DCP
from ckptstore.render import human_bytes
from ckptstore.store import Store


def cmd_restore(args: argparse.Namespace, store: Store) -> int:
    target = os.path.abspath(os.path.expanduser(args.to))
    if "://" in args.to and not args.to.startswith("file://"):
        raise UsageError(f"--to must be a local path, got {args.to!r}")
    if args.to.startswith("file://"):
        target = os.path.abspath(args.to[len("file://") :])
    check_target(target, args.format, args.force)
    manifest = open_step(store, args.step)
    step = manifest.step
    total = step_raw_bytes(store, manifest) if manifest.kind != KIND_DCP else 0
    with progress(total, f"restore step {step}") as advance, warnings.catch_warnings():
        # DCP warns that it runs without a process group: that is the point here.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        state = load_step_state(store, manifest, on_chunk=advance)
        if args.format == "dcp" and not isinstance(state, dict):
            raise UsageError(
                f"step {step} holds a {type(state).__name__} at the top, not a dict: "
                "--format dcp needs a dict; use --format torch"
            )
        stats = count_values(state)
        write_atomically(target, args.format, args.force, state)
    weights_only = stats["numpy"] == 0 and stats["other"] == 0
    doc = {
        "uri": store.uri,
        "step": step,
        "kind": manifest.kind,
        "world_size": manifest.world_size,
        "format": args.format,
        "path": target,
        "tensors": stats["tensors"],
        "tensor_bytes": stats["bytes"],
        "numpy_arrays": stats["numpy"],
        "weights_only": weights_only,
        "layout": "ranks" if manifest.kind != KIND_DCP and manifest.world_size > 1 else "state",
    }
    if args.json:
        emit_json(doc)
        return 0
    print(
        f"restored step {step} ({manifest.kind}, world size {manifest.world_size}, "
        f"{stats['tensors']} tensors, {human_bytes(stats['bytes'])}) from {store.uri} "
        f"to {target}"
    )
    if doc["layout"] == "ranks":
        print(f'  {manifest.world_size} ranks: the state of rank r is under key "rank<r>"')
    if args.format == "torch":
        hint = "" if weights_only else ", weights_only=False"
        print(f"  load with: torch.load({target!r}{hint})")
        if stats["numpy"]:
            print(f"  note: {stats['numpy']} numpy array(s), so weights_only=True cannot load it")
    else:
        print(
            f"  load with: torch.distributed.checkpoint.load(state, "
            f"storage_reader=FileSystemReader({target!r}))"
        )
    return 0
