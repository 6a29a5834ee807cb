"""``ckptstore restore``: a step written out as a torch.save file, a DCP directory, or Hugging
Face safetensors."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any

from ckptstore.catalog import LATEST_TRIES, list_steps, load_manifest
from ckptstore.cli.common import UsageError, emit_json, progress
from ckptstore.cli.restore_file import (
    check_target,
    count_values,
    remove_if_empty_dir,
    write_atomically,
)
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    TooLargeForHostError,
    one_line,
)
from ckptstore.export import export_safetensors, name_under
from ckptstore.health import find_healthy, healthy_steps_to_load, why_not_healthy
from ckptstore.render import human_bytes
from ckptstore.steps import StepView
from ckptstore.store import Store
from ckptstore.store.backends import refuse_a_mistyped_scheme


def cmd_restore(args: argparse.Namespace, store: Store) -> int:
    target = _target(args.to, store)
    given = [
        flag
        for flag, value in (
            ("--max-shard-size", args.max_shard_size),
            ("--strip-prefix", args.strip_prefix),
            ("--dtype", args.dtype),
            ("--rank", args.rank),
        )
        if value is not None
    ]
    if given and args.format != "safetensors":
        raise UsageError(f"{', '.join(given)}: only with --format safetensors")
    if args.healthy:
        args.step = _healthy_step(store, args.step)
    if args.format == "safetensors":
        existed = os.path.lexists(target)
        try:
            return _export_safetensors(args, store, target)
        except BaseException:
            if not existed:
                remove_if_empty_dir(target)  # the export made it; nothing went in
            raise
    check_target(target, args.format, args.force)
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group: that is the point here.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        view, state = _load_kept_step(store, args.step)
        manifest, step = view.manifest, view.step
        if args.only:
            state = _only(state, args.only, step)
        if args.format == "dcp" and not isinstance(state, dict):
            raise UsageError(
                f"step {step} holds a {type(state).__name__} at the top, not a dict: "
                "--format dcp needs a dict; use --format torch"
            )
        stats = count_values(state)
        write_atomically(target, args.format, args.force, state)
    _say_if_unhealthy(store, step, manifest.health)
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
        "layout": "ranks" if view.per_rank else "state",
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


def _open_naming_the_step_before(store: Store, step: int | None) -> StepView:
    """The step's view; a manifest or index that does not decode fails naming the step before
    it, as a damaged chunk does (reviewer G: only chunk damage said what to try next)."""
    try:
        return StepView.open(store, step if step is not None else "latest")
    except CheckpointCorruptError as exc:
        failed, before = _before_the_failed(store, step)
        if before is None:
            raise
        raise CheckpointCorruptError(_cannot_restore(failed, exc, store, before)) from exc


def _before_the_failed(store: Store, step: int | None) -> tuple[int | None, int | None]:
    """The step that failed (``step``; None: the newest committed one) and the readable step
    before it, the one to try."""
    listed = list_steps(store) if step is None else []
    failed = step if step is not None else (listed[-1] if listed else None)
    return failed, _readable_step_before(store, failed) if failed is not None else None


def _cannot_restore(failed: int | None, exc: Exception, store: Store, before: int) -> str:
    """The one line of a step that failed to restore: which, why, what to try instead."""
    lead = f"step {failed} cannot be restored: " if failed is not None else ""
    return f"{lead}{exc}{_hint(store, before)}"


HINT_TRIES = 16


def _hint(store: Store, before: int) -> str:
    """What to try next: only its manifest was read (the SeaweedFS operator of stop 79 was
    sent to a step missing a chunk too)."""
    return (
        f"; the step before it: --step {before} (not verified: `ckptstore verify {store.uri} "
        "--all` finds the newest step whose every byte checks)"
    )


def _readable_step_before(store: Store, step: int) -> int | None:
    """The newest step older than ``step`` whose manifest reads (of the ``HINT_TRIES`` newest
    before it): a hint that names an unreadable step sends the user to a second failure."""
    for older in sorted((s for s in list_steps(store) if s < step), reverse=True)[:HINT_TRIES]:
        try:
            load_manifest(store, older)
        except CheckpointError:
            continue
        return older
    return None


def _load_kept_step(store: Store, step: int | None) -> tuple[StepView, Any]:
    """The step's view and state. A step removed while it was read (another process's
    keep_last or gc: its chunks went missing) gives way to the newest step where the newest
    was asked for (``LATEST_TRIES`` times at most), else fails saying so: it is no damage."""
    for tries_left in range(LATEST_TRIES - 1, -1, -1):
        view = _open_naming_the_step_before(store, step)
        try:
            with progress(view.progress_bytes(), f"restore step {view.step}") as advance:
                return view, _load_naming_the_step(view, store, advance)
        except CheckpointError as exc:
            if view.still_committed():
                raise
            if step is not None or not tries_left:
                raise CheckpointNotFoundError(
                    f"step {view.step} of {store.uri} was removed while it was restored "
                    "(keep_last or gc of another process): restore a step still kept "
                    "(ckptstore ls)"
                ) from exc
            print(
                f"step {view.step} was removed while it was restored (keep_last or gc of "
                "another process); restoring the newest step",
                file=sys.stderr,
            )
    raise AssertionError("unreachable")


def _load_naming_the_step(view: StepView, store: Store, advance: Any) -> Any:
    """The step's state; a chunk missing or damaged fails naming the step and the step before
    it (what a user restoring at 3 a.m. tries next)."""
    try:
        return view.load_plain(on_chunk=advance)
    except (CheckpointCorruptError, CheckpointNotFoundError, TooLargeForHostError) as exc:
        before = _readable_step_before(store, view.step)
        hint = _hint(store, before) if before is not None else ""
        raise CheckpointError(f"step {view.step} cannot be restored: {exc}{hint}") from exc


def _target(to: str, store: Store) -> str:
    """``--to`` as an absolute local path, never the store's own directory or one inside or
    above it."""
    if "://" in to and not to.startswith("file://"):
        raise UsageError(f"--to must be a local path, got {to!r}")
    if not os.path.lexists(to.split("/", 1)[0]):  # a directory named "s3:" is a local path
        try:
            refuse_a_mistyped_scheme(to)
        except ValueError:
            raise UsageError(f"--to must be a local path, got {to!r} (a URI's scheme)") from None
    path = to[len("file://") :] if to.startswith("file://") else os.path.expanduser(to)
    target = os.path.abspath(path)
    if store.overlaps(target):
        raise UsageError(
            f"--to {target} is the store {store.uri}, inside it or holds it: restoring there "
            "would replace what it restores from; choose a path outside the store"
        )
    return target


def _only(state: Any, prefix: str, step: int) -> dict:
    """The values of ``state`` named ``prefix`` or under it (``export.name_under``): a name is
    the path of dict keys joined by "/" (``model/0.weight``, as ``inspect`` shows a state step)
    or by "." (``model.0.weight``, a DCP step's keys)."""

    def keep(value: Any, path: tuple) -> Any:
        names = ("/".join(path), ".".join(path))
        if path and any(name_under(name, prefix, "./") for name in names):
            return value
        if not isinstance(value, dict):
            return None
        kept = {k: keep(v, (*path, str(k))) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not None} or None

    chosen = keep(state, ())
    if not chosen:
        top = ", ".join(map(str, list(state)[:8])) if isinstance(state, dict) else "none"
        raise UsageError(
            f"nothing in step {step} is named {prefix!r} or below it (top-level keys: {top})"
        )
    return chosen


def _healthy_step(store: Store, step: int | None) -> int:
    """``--healthy``: the newest healthy step, or ``step`` if it is healthy."""
    good, why = healthy_steps_to_load(store, step)
    for s in sorted(why, reverse=True):
        print(f"skipped {why[s]}", file=sys.stderr)
    return good[0]


def _say_if_unhealthy(store: Store, step: int, health: Any) -> None:
    """A warning (stderr) where the restored ``step``'s save found it unhealthy (NaN or Inf,
    as its manifest records; not for a step of unknown health, None), naming the newest healthy
    step before it: the operator may not know that ``--healthy`` exists. A note only: the step
    is restored, so a read that fails here fails nothing."""
    if health is None or health["healthy"]:
        return
    try:
        older, _ = find_healthy(store, [s for s in list_steps(store) if s < step], limit=1)
        instead = f"--step {older[0]} (or --healthy)" if older else "none before it is healthy"
    except (CheckpointError, OSError) as exc:
        instead = f"unknown: the steps before it could not be read ({one_line(exc)})"
    print(
        f"warning: {why_not_healthy(step, health)}; the newest healthy step: {instead}",
        file=sys.stderr,
    )


def _health_of(store: Store, step: int) -> Any:
    """``step``'s recorded health (None: unknown, or its manifest could not be read again)."""
    try:
        return load_manifest(store, step).health
    except (CheckpointError, OSError):
        return None


def _export_safetensors(args: argparse.Namespace, store: Store, target: str) -> int:
    try:
        result = export_safetensors(
            store.uri,
            target,
            step="latest" if args.step is None else args.step,
            max_shard_size=args.max_shard_size or "5GB",
            only=args.only,
            strip_prefix=args.strip_prefix,
            dtype=args.dtype,
            rank=args.rank or 0,
            overwrite=args.force,
            storage_options=dict(args.storage_options) or None,
            timeout_s=args.timeout or 30.0,
        )
    except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
        failed, before = _before_the_failed(store, args.step)
        if before is None or "the step before it" in str(exc) or "removed while" in str(exc):
            raise
        kind = CheckpointNotFoundError if isinstance(exc, CheckpointNotFoundError) else None
        raise (kind or CheckpointCorruptError)(_cannot_restore(failed, exc, store, before)) from exc
    except CheckpointError:
        raise  # other checkpoint errors (a ValueError too): exit 1, not a usage error
    except (FileExistsError, ValueError) as exc:  # in the words of the command's flags
        message = str(exc).replace("overwrite=True", "--force").replace("only=", "--only ")
        raise UsageError(message) from exc
    _say_if_unhealthy(store, result.step, _health_of(store, result.step))
    if args.json:
        emit_json(result.as_dict())
        return 0
    shards = len(result.files)
    print(
        f"exported step {result.step} ({result.kind}, {result.tensors} tensors, "
        f"{human_bytes(result.total_bytes)}) from {store.uri} to {target} "
        f"in {shards} shard{'s' if shards != 1 else ''}"
    )
    if result.ranks is not None:
        print(
            f"  rank {args.rank or 0}'s state of {result.ranks} ranks (each rank saved its own; "
            "--rank N exports another)"
        )
    if result.skipped:
        more = len(result.skipped) - 5
        print(
            f"  skipped {len(result.skipped)} non-tensor value(s): {', '.join(result.skipped[:5])}"
            + (f" and {more} more" if more > 0 else "")
        )
    print(f"  load with: transformers' from_pretrained({target!r}) or safetensors.safe_open")
    return 0
