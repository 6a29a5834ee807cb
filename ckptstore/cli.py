"""The ``ckptstore`` command: list, inspect, verify, restore and garbage-collect checkpoints.

Exit status: 0 success; 1 a checkpoint (or an object of one) is corrupt, missing or unreadable,
or the store does not exist; 2 a usage error (bad arguments, unknown URI scheme). Errors are one
line on stderr (``ckptstore verify: error: ...``); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import stat
import sys
import textwrap
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from ckptstore.errors import CheckpointError, CheckpointNotFoundError, StorageAccessError
from ckptstore.store import RetryPolicy, Store

logger = logging.getLogger(__name__)

PROG = "ckptstore"


class UsageError(ValueError):
    """Bad input on the command line: exit status 2."""


class _Failed(Exception):
    """The command ran and found problems it already reported: exit status 1."""


# -- argument parsing ----------------------------------------------------------------------------


class UsageParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (plus where to find help), exit 2.
    Subcommand parsers inherit it; ``ckptbench`` uses it too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        # argparse reports an unknown option of a subcommand as the top parser's; name the
        # subcommand (`ckptbench plan: error: unrecognized arguments: ...`).
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = None
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):
                    chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            (chosen or self).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=100)


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _pos_int(text: str) -> int:
    value = _nonneg_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)  # true, 3, {"endpoint_url": ...}
    except json.JSONDecodeError:
        parsed = value  # a plain string
    return key.strip(), parsed


_DEFAULT_TIMEOUT = RetryPolicy.total_s
_URI_HELP = "the store: a local path, file://, memory://, s3://bucket/prefix, ..."

_EPILOG_COMMON = """\
Every command: --json prints one JSON object on stdout; --storage-option KEY=VALUE (repeatable,
VALUE parsed as JSON when it is valid JSON) is passed to fsspec; S3 endpoints and credentials
otherwise come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_PROFILE, ...);
--timeout SECONDS bounds each storage request, retries included (default 30; large transfers
get 1 s more per 2 MiB), so an endpoint that never answers fails the command, naming it.
Exit status: 0 ok, 1 corrupt / missing / unreadable checkpoint or store, 2 usage error."""


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    common.add_argument(
        "--storage-option",
        "-o",
        dest="storage_options",
        metavar="KEY=VALUE",
        type=_storage_option,
        action="append",
        default=[],
        help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable)",
    )
    common.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SECONDS",
        help=f"deadline of one storage request, retries included (default: {_DEFAULT_TIMEOUT:g})",
    )
    common.add_argument(
        "-v", "--verbose", action="store_true", help="log progress (INFO) and retried requests"
    )
    common.add_argument(
        "--debug", action="store_true", help="log everything and show tracebacks of errors"
    )

    parser = UsageParser(
        prog=PROG,
        formatter_class=_Formatter,
        description="Inspect, verify, restore and garbage-collect ckptstore checkpoints.",
        epilog=_EPILOG_COMMON
        + """

examples:
  ckptstore ls /ckpt/run7
  ckptstore inspect s3://bucket/run7 --step 1200
  ckptstore verify s3://bucket/run7 --all
  ckptstore restore /ckpt/run7 --to model.pt
  ckptstore gc s3://bucket/run7 --keep-last 3 --dry-run""",
    )
    from ckptstore import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_: str, description: str, examples: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_,
            description=textwrap.dedent(description).strip(),
            epilog=_EPILOG_COMMON
            + "\n\nexamples:\n"
            + textwrap.indent(textwrap.dedent(examples).strip("\n"), "  "),
            formatter_class=_Formatter,
            parents=[common],
        )
        p.add_argument("uri", metavar="URI", help=_URI_HELP)
        return p

    p = add(
        "ls",
        "list committed steps",
        """
        List the committed steps of a store, oldest first: kind (state = ckptstore.Checkpointer,
        dcp = torch.distributed.checkpoint), world size, creation time (UTC), raw and stored
        bytes of the chunks the step references, compression ratio (raw / stored) and the user
        metadata of the save. Saves in flight (pending markers) are listed after the steps.
        """,
        """
          ckptstore ls /ckpt/run7
          ckptstore ls s3://bucket/run7 --json | jq '.latest'
        """,
    )
    p.set_defaults(func=cmd_ls)

    p = add(
        "inspect",
        "show the tensors of a step",
        """
        Show a step (the latest unless --step): kind, world size, creation time, user metadata,
        bytes and compression ratio, and every tensor with its name, rank, dtype, shape, raw
        bytes, stored bytes and chunks. Names of a state step are paths in the saved state
        (model/0.weight, optim/state/0/exp_avg); those of a dcp step are DCP storage keys
        (fqn, or fqn@offsets for a shard not at the origin; "pickled object" marks a non-tensor
        value DCP stored as bytes). Stored bytes of tensors packed into a shared chunk
        are their proportional share of that chunk.
        """,
        """
          ckptstore inspect /ckpt/run7
          ckptstore inspect s3://bucket/run7 --step 1200 --json
        """,
    )
    p.add_argument("--step", type=_nonneg_int, help="the step (default: the latest)")
    p.set_defaults(func=cmd_inspect)

    p = add(
        "verify",
        "re-hash every object of a step",
        """
        Verify a step (the latest unless --step, every step with --all): the manifest's own
        checksum, each rank index against the size and xxh3 the manifest records, the DCP
        metadata object when there is one, and every chunk (fetched, decoded and re-hashed with
        xxh3). Every missing or corrupt object is reported by name, with the tensors whose bytes
        it holds; verification goes on past the first one. Exit status 1 if any was found.
        """,
        """
          ckptstore verify /ckpt/run7
          ckptstore verify s3://bucket/run7 --all --json
        """,
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=_nonneg_int, help="the step (default: the latest)")
    which.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument(
        "--read-concurrency",
        type=_pos_int,
        default=8,
        metavar="N",
        help="chunks fetched at once (default: 8)",
    )
    p.set_defaults(func=cmd_verify)

    p = add(
        "restore",
        "write a step out as a torch.save file or a plain DCP directory",
        """
        Restore a step (the latest unless --step) to a local PATH, verifying every chunk.

        --format torch (default): one file for torch.load(PATH). A Checkpointer step becomes
        the saved state as plain objects (modules and optimizers as their state dicts); with
        a world size of 1 that is the state itself, with N ranks {"rank0": ..., "rank1": ...}.
        A DCP step becomes its full (unsharded) state dict. Loads with weights_only=True unless
        the state holds numpy arrays (the command says so).

        --format dcp: a directory that stock torch.distributed.checkpoint reads:
        dcp.load(state, storage_reader=FileSystemReader(PATH)). The top of the state must be a
        dict (it is for DCP steps and for the rank0/rank1 layout of multi-rank steps).

        The result is written under a temporary name and moved into place when complete. An
        existing non-empty PATH is refused unless --force (which replaces it).
        """,
        """
          ckptstore restore /ckpt/run7 --to /tmp/run7.pt
          ckptstore restore s3://bucket/run7 --step 1200 --to /tmp/run7-dcp --format dcp
        """,
    )
    p.add_argument("--step", type=_nonneg_int, help="the step (default: the latest)")
    p.add_argument("--to", required=True, metavar="PATH", help="local file or directory to write")
    p.add_argument(
        "--format",
        choices=("torch", "dcp"),
        default="torch",
        help="torch: a torch.save file (default); dcp: a DCP FileSystemWriter directory",
    )
    p.add_argument("--force", action="store_true", help="replace an existing non-empty PATH")
    p.set_defaults(func=cmd_restore)

    p = add(
        "gc",
        "delete old steps and the chunks no kept step references",
        """
        Keep the newest K committed steps; delete the older ones (their manifests first, so
        each disappears atomically), then the indexes and chunks nothing kept references.
        While another save is in flight (it holds a lease it renews every 30 s) the sweep of
        chunks is skipped, and the command says so: run it again later. A lease not renewed for
        its ttl (2 min by default) is a dead writer's: its leftovers are removed. Saves that start
        during the sweep wait for it. --dry-run lists what would go, deleting nothing.
        """,
        """
          ckptstore gc /ckpt/run7 --keep-last 3 --dry-run
          ckptstore gc s3://bucket/run7 --keep-last 3
        """,
    )
    p.add_argument(
        "--keep-last",
        type=_pos_int,
        required=True,
        metavar="K",
        help="number of newest steps to keep (>= 1)",
    )
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted")
    p.set_defaults(func=cmd_gc)
    return parser


# -- helpers ---------------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def _table(rows: list[list[str]], header: list[str], right: set[int] = frozenset()) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _emit_json(doc: dict[str, Any]) -> None:
    print(json.dumps(doc, indent=2, default=str))


def open_store(args: argparse.Namespace) -> Store:
    """The store of ``args.uri``; an error unless it exists (a missing local directory or
    bucket is "no checkpoints there", never an empty listing)."""
    options = dict(args.storage_options)
    timeout = getattr(args, "timeout", None)
    retry = RetryPolicy.within(timeout) if timeout else None
    try:
        store = Store(args.uri, storage_options=options or None, retry=retry)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    except ImportError as exc:  # an fsspec backend whose package is not installed
        raise UsageError(f"cannot open store {args.uri!r}: {exc}") from exc
    if store.is_local:
        try:
            is_dir = stat.S_ISDIR(os.stat(store.root).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(
                f"no ckptstore checkpoints at {args.uri} (no such path)"
            ) from None
        except PermissionError as exc:
            raise StorageAccessError(
                f"cannot open store {args.uri}: permission denied on {exc.filename or store.root}"
            ) from exc
        if not is_dir:
            raise CheckpointNotFoundError(
                f"no ckptstore checkpoints at {args.uri} (a file, not a store directory)"
            )
    # A missing bucket, bad credentials, an unreadable directory or an endpoint that does not
    # answer fail here, clearly (listing only commits/: the whole prefix may hold millions of
    # chunks).
    store.list("commits")
    return store


def _looks_like_store(store: Store) -> bool:
    """True unless the location holds objects but none of a ckptstore store's."""
    keys = store.list("")
    if not keys:
        return True
    return any(
        k.split("/", 1)[0] in ("commits", "chunks", "steps", "leases", "pending") for k in keys
    )


@contextmanager
def _progress(total: int, desc: str) -> Iterator[Callable[[int], Any]]:
    """A byte progress bar on stderr when it is a terminal; otherwise a no-op callback."""
    if total > 0 and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(
            total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
        )
        try:
            yield bar.update
        finally:
            bar.close()
    else:
        yield lambda n: None


def _resolve(store: Store, step: int | None) -> int:
    from ckptstore.format import list_steps

    steps = list_steps(store)
    if step is None:
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {store.uri}")
        return steps[-1]
    if step not in steps:
        near = ", ".join(map(str, steps[-5:])) or "none"
        raise CheckpointNotFoundError(
            f"step {step} is not committed in {store.uri} (latest steps: {near})"
        )
    return step


# -- commands --------------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace, store: Store) -> int:
    from ckptstore._inspect import manifest_summary, message
    from ckptstore.format import list_steps, load_manifest

    steps = list_steps(store)

    def one(step: int) -> dict[str, Any]:
        try:
            return manifest_summary(store, load_manifest(store, step))
        except (CheckpointError, OSError) as exc:
            return {"step": step, "error": message(exc)}

    rows = list(store.map(one, steps))
    pending = _pending(store)
    bad = [r for r in rows if "error" in r]
    if args.json:
        _emit_json(
            {
                "uri": store.uri,
                "steps": rows,
                "latest": steps[-1] if steps else None,
                "pending": pending,
            }
        )
    else:
        if not rows:
            note = "" if _looks_like_store(store) else " (this location holds no ckptstore data)"
            print(f"no committed steps in {store.uri}{note}")
        else:
            table = [
                [
                    str(r["step"]),
                    r["kind"],
                    str(r["world_size"]),
                    r["created"],
                    human_bytes(r["raw_bytes"]),
                    human_bytes(r["stored_bytes"]),
                    _ratio(r["compression_ratio"]),
                    json.dumps(r["user"]) if r["user"] else "",
                ]
                if "error" not in r
                else [str(r["step"]), "ERROR", "", "", "", "", "", r["error"]]
                for r in rows
            ]
            print(
                _table(
                    table,
                    ["STEP", "KIND", "RANKS", "CREATED (UTC)", "RAW", "STORED", "RATIO", "USER"],
                    right={0, 2, 4, 5, 6},
                )
            )
        for p in pending:
            if p["kind"] == "gc":
                what = "gc"
            else:
                what = f"step {p['step']} rank {p['rank']} attempt {p['attempt']}: save"
            state = "stale (dead writer; the next gc removes it)" if p["stale"] else "in flight"
            age = f"renewed {p['age_s']:.0f}s ago" if p["age_s"] is not None else "unreadable"
            print(f"pending: {what} {state}, {age} ({p['key']})")
    if bad:
        raise _Failed(f"{len(bad)} step(s) have an unreadable manifest (see the listing)")
    return 0


def _pending(store: Store) -> list[dict[str, Any]]:
    """Saves and gcs in flight (live leases) and dead ones (stale leases)."""
    import time

    from ckptstore.leases import find_leases
    from ckptstore.retention import LEGACY_PENDING_GRACE_S

    out = []
    for lease in sorted(find_leases(store), key=lambda lease: lease.key):
        age = lease.age_s
        out.append(
            {
                "key": lease.key,
                "kind": lease.kind,
                "step": lease.doc.get("step"),
                "attempt": lease.doc.get("attempt"),
                "rank": lease.doc.get("rank"),
                "host": lease.doc.get("host"),
                "renewed_at": lease.doc.get("renewed_at"),
                "age_s": round(age, 1) if age is not None else None,
                "stale": not lease.live,
            }
        )
    for key in store.list("pending"):  # markers of ckptstore versions before leases
        info: Any = {}
        try:
            info = json.loads(store.get(key))
        except (CheckpointError, OSError, ValueError):
            pass
        info = info if isinstance(info, dict) else {}
        created = info.get("created_at")
        age = time.time() - float(created) if isinstance(created, (int, float)) else None
        out.append(
            {
                "key": key,
                "kind": "save",
                "step": info.get("step"),
                "attempt": info.get("attempt"),
                "rank": info.get("rank"),
                "host": info.get("host"),
                "renewed_at": created,
                "age_s": round(age, 1) if age is not None else None,
                "stale": age is None or age >= LEGACY_PENDING_GRACE_S,
            }
        )
    return out


def cmd_inspect(args: argparse.Namespace, store: Store) -> int:
    from ckptstore._inspect import load_indexes, summarize
    from ckptstore.format import load_manifest

    step = _resolve(store, args.step)
    manifest = load_manifest(store, step)
    doc = {"uri": store.uri, **summarize(store, manifest, load_indexes(store, manifest))}
    if args.json:
        _emit_json(doc)
        return 0
    print(f"step {doc['step']} of {store.uri}")
    fields = [
        ("kind", f"{doc['kind']}"),
        ("world size", str(doc["world_size"])),
        ("created", f"{doc['created']} (UTC)"),
        ("attempt", doc["attempt"]),
        ("tensors", f"{doc['num_tensors']} ({human_bytes(doc['tensor_bytes'])})"),
        (
            "chunks",
            f"{doc['num_chunks']}: {human_bytes(doc['raw_bytes'])} raw, "
            f"{human_bytes(doc['stored_bytes'])} stored, ratio {_ratio(doc['compression_ratio'])}",
        ),
        ("user metadata", json.dumps(doc["user"]) if doc["user"] else "-"),
    ]
    if doc["dcp_metadata"]:
        fields.append(("dcp metadata", doc["dcp_metadata"]))
    for name, value in fields:
        print(f"  {name + ':':15}{value}")
    multi = doc["world_size"] > 1
    header = ["NAME", *(["RANK"] if multi else []), "DTYPE", "SHAPE", "RAW", "STORED", "CHUNKS"]
    rows = [
        [
            t["name"] + (" (numpy)" if t["numpy"] else " (pickled object)" if t["object"] else ""),
            *([str(t["rank"])] if multi else []),
            t["dtype"],
            "[" + ", ".join(map(str, t["shape"])) + "]",
            human_bytes(t["raw_bytes"]),
            human_bytes(t["stored_bytes"]),
            str(len(t["chunks"])),
        ]
        for t in doc["tensors"]
    ]
    if rows:
        print()
        offset = 1 if multi else 0
        print(_table(rows, header, right={offset + 3, offset + 4, offset + 5}))
    return 0


def cmd_verify(args: argparse.Namespace, store: Store) -> int:
    from ckptstore._inspect import check_all_chunks, check_step_objects, chunks_to_check
    from ckptstore.format import list_steps

    if args.all:
        steps = list_steps(store)
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {store.uri}")
    else:
        steps = [_resolve(store, args.step)]
    checks = [check_step_objects(store, step) for step in steps]
    chunks = chunks_to_check(checks)
    total = sum(info.raw for info in chunks.values() if info is not None)
    with _progress(total, "verify") as advance:
        check_all_chunks(store, checks, read_concurrency=args.read_concurrency, on_chunk=advance)
    problems = [p for c in checks for p in c.problems]
    if args.json:
        _emit_json(
            {
                "uri": store.uri,
                "ok": not problems,
                "steps": [c.as_dict() for c in checks],
                "problems": [p.as_dict() for p in problems],
                "chunks_checked": len(chunks),
                "bytes_checked": total,
            }
        )
    else:
        for c in checks:
            shape = (
                f"{c.kind}, {c.ranks}/{c.world_size} rank(s), {c.tensors} tensors, "
                f"{c.chunks} chunks, {human_bytes(c.raw_bytes)}"
                if c.kind
                else "manifest unreadable"
            )
            status = "OK" if c.ok else f"FAILED ({len(c.problems)} problem(s))"
            print(f"step {c.step}: {status}  [{shape}]")
            for p in c.problems:
                used = ""
                if p.tensors:
                    shown = ", ".join(p.tensors[:5])
                    more = f" and {len(p.tensors) - 5} more" if len(p.tensors) > 5 else ""
                    used = f"\n      holds bytes of: {shown}{more}"
                print(f"  {p.problem.upper():10} {p.what} {p.object}\n      {p.error}{used}")
        bad_steps = sum(1 for c in checks if not c.ok)
        print(
            f"verified {len(checks)} step(s), {len(chunks)} chunk(s), {human_bytes(total)}: "
            + ("all OK" if not problems else f"{bad_steps} step(s) FAILED")
        )
    if problems:
        objects = list(dict.fromkeys(p.object for p in problems))
        kinds = "/".join(sorted({p.problem for p in problems}))
        failed = ", ".join(str(c.step) for c in checks if not c.ok)
        raise _Failed(
            f"{len(objects)} {kinds} object(s) (first: {objects[0]}) in step(s) {failed} "
            f"of {store.uri}"
        )
    return 0


def cmd_restore(args: argparse.Namespace, store: Store) -> int:
    from ckptstore._inspect import load_step_state, step_raw_bytes
    from ckptstore.format import KIND_DCP, load_manifest

    target = os.path.abspath(os.path.expanduser(args.to))
    if "://" in args.to and not args.to.startswith("file://"):
        raise UsageError(f"--to must be a local path, got {args.to!r}")
    if args.to.startswith("file://"):
        target = os.path.abspath(args.to[len("file://") :])
    _check_target(target, args.format, args.force)
    step = _resolve(store, args.step)
    manifest = load_manifest(store, step)
    total = step_raw_bytes(store, manifest) if manifest.kind != KIND_DCP else 0
    with _progress(total, f"restore step {step}") as advance, warnings.catch_warnings():
        # DCP warns that it runs without a process group: that is the point here.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        state = load_step_state(store, manifest, on_chunk=advance)
        if args.format == "dcp" and not isinstance(state, dict):
            raise UsageError(
                f"step {step} holds a {type(state).__name__} at the top, not a dict: "
                "--format dcp needs a dict; use --format torch"
            )
        stats = _count(state)
        _write_atomically(target, args.format, args.force, state)
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
        _emit_json(doc)
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


def _count(state: Any) -> dict[str, int]:
    import numpy as np
    import torch

    stats = {"tensors": 0, "bytes": 0, "numpy": 0, "other": 0}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            stats["tensors"] += 1
            stats["bytes"] += value.numel() * value.element_size()
        elif isinstance(value, np.ndarray):
            stats["tensors"] += 1
            stats["numpy"] += 1
            stats["bytes"] += value.nbytes
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif not (value is None or isinstance(value, (bool, int, float, str, bytes))):
            stats["other"] += 1  # e.g. an object DCP unpickled: weights_only may refuse it

    walk(state)
    return stats


def _check_target(target: str, fmt: str, force: bool) -> None:
    if not os.path.lexists(target):
        parent = os.path.dirname(target)
        if not os.path.isdir(parent):
            raise UsageError(f"--to {target}: the directory {parent} does not exist")
        return
    if fmt == "torch" and os.path.isdir(target):
        raise UsageError(
            f"--to {target} is a directory; --format torch writes a file (give a file name)"
        )
    if fmt == "dcp" and not os.path.isdir(target):
        raise UsageError(f"--to {target} exists and is not a directory (--format dcp)")
    empty = not os.listdir(target) if os.path.isdir(target) else os.path.getsize(target) == 0
    if not empty and not force:
        raise UsageError(f"--to {target} exists and is not empty; pass --force to replace it")


def _write_atomically(target: str, fmt: str, force: bool, state: Any) -> None:
    """Write ``state`` to a temporary sibling of ``target``, then move it into place; a crash
    or error never leaves a partial file under the target's name."""
    import torch

    tmp = os.path.join(
        os.path.dirname(target), f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex[:8]}"
    )
    try:
        if fmt == "torch":
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            if force or os.path.lexists(target):  # --force, or an empty file (checked)
                os.replace(tmp, target)
            else:
                try:
                    os.link(tmp, target)  # fails if something appeared there meanwhile
                except FileExistsError:
                    raise UsageError(
                        f"--to {target} appeared during the restore; pass --force to replace it"
                    ) from None
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter

            dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
            if os.path.isdir(target):
                if os.listdir(target):
                    assert force  # checked by _check_target
                    shutil.rmtree(target)
                else:
                    os.rmdir(target)
            os.rename(tmp, target)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.unlink(tmp)


def cmd_gc(args: argparse.Namespace, store: Store) -> int:
    from ckptstore.retention import collect

    report = collect(store, keep_last=args.keep_last, dry_run=args.dry_run)
    doc = {
        "uri": store.uri,
        "dry_run": report.dry_run,
        "keep_last": args.keep_last,
        "kept_steps": report.kept_steps,
        "deleted_steps": report.deleted_steps,
        "deleted_chunks": report.deleted_chunks,
        "deleted_chunk_bytes": report.deleted_chunk_bytes,
        "deleted_other": report.deleted_other,
        "swept": report.swept,
        "blocked_by": report.blocked_by,
    }
    if args.json:
        _emit_json(doc)
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    kept = ", ".join(map(str, report.kept_steps)) or "none"
    gone = ", ".join(map(str, report.deleted_steps)) or "none"
    print(f"{'dry run: ' if args.dry_run else ''}kept steps: {kept}")
    print(f"{verb} steps: {gone}")
    if report.blocked_by:
        print(
            f"chunk sweep skipped: {len(report.blocked_by)} save(s) in flight "
            f"({', '.join(report.blocked_by)}); unreferenced chunks stay until a later gc"
        )
    elif report.swept:
        print(
            f"{verb} {report.deleted_chunks} unreferenced chunk(s) "
            f"({human_bytes(report.deleted_chunk_bytes)}) and {report.deleted_other} other "
            "object(s) (indexes of old or failed saves, dead writers' leases and temporaries)"
        )
    return 0


# -- entry point -----------------------------------------------------------------------------------


def _setup_logging(args: argparse.Namespace) -> tuple[logging.Handler, int]:
    """Warnings (e.g. storage retries) on stderr; ``-v`` adds ckptstore's INFO, ``--debug``
    everything."""
    debug, verbose = getattr(args, "debug", False), getattr(args, "verbose", False)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(name)s: %(message)s"))
    handler.setLevel(logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING)
    if not debug:
        handler.addFilter(
            lambda r: r.levelno >= logging.WARNING or r.name.split(".")[0] == "ckptstore"
        )
    if not (debug or verbose):
        # Each failed attempt of a retried request: the command's error, if it comes to that,
        # says how many were made (one line), and a request that succeeded needs no warning.
        handler.addFilter(lambda r: not getattr(r, "ckptstore_retry", False))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(min(handler.level, old_level or logging.WARNING))
    return handler, old_level


def _teardown_logging(handler: logging.Handler, old_level: int) -> None:
    root = logging.getLogger()
    root.removeHandler(handler)
    root.setLevel(old_level)
    flush_stdout()


def stdout_gone() -> None:
    """The reader of stdout went away (EPIPE: ``ckptstore ls ... | head -1``): a normal end.
    Point stdout at /dev/null so that the interpreter's final flush of what is still buffered
    does not fail again (it would print "Exception ignored ... BrokenPipeError" and exit 120)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def flush_stdout() -> None:
    """Flush stdout now; a reader that went away is :func:`stdout_gone`, not an error."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_gone()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 1 checkpoint problem, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    prog = f"{PROG} {args.command}"
    handler, old_level = _setup_logging(args)
    func: Callable[[argparse.Namespace, Store], int] = args.func

    def fail(status: int, message: str) -> int:
        first = message.strip().splitlines()[0] if message.strip() else "failed"
        print(f"{prog}: error: {first}", file=sys.stderr)
        return status

    if args.debug:  # tracebacks for developers
        try:
            return func(args, open_store(args))
        except _Failed as exc:
            return fail(1, str(exc))
        except BrokenPipeError:  # `ckptstore ls URI | head`: the reader went away
            stdout_gone()
            return 0
        finally:
            _teardown_logging(handler, old_level)
    try:
        return func(args, open_store(args))
    except _Failed as exc:
        return fail(1, str(exc))
    except UsageError as exc:
        return fail(2, str(exc))
    except CheckpointError as exc:  # before ValueError: corrupt / version errors are ValueErrors
        return fail(1, str(exc))
    except BrokenPipeError:  # `ckptstore ls URI | head`: the reader went away; a normal end
        stdout_gone()
        return 0
    except FileNotFoundError as exc:
        return fail(1, f"not found: {exc}")
    except OSError as exc:
        return fail(1, str(exc) or type(exc).__name__)
    except ValueError as exc:
        return fail(1, str(exc))
    except KeyboardInterrupt:
        return fail(130, "interrupted")
    except Exception as exc:  # noqa: BLE001 - a bug: still one line, --debug shows the traceback
        return fail(1, f"unexpected {type(exc).__name__}: {exc} (rerun with --debug for details)")
    finally:
        _teardown_logging(handler, old_level)


if __name__ == "__main__":
    sys.exit(main())
