"""The ``ckptstore`` command line: one parser, a subparser per command with its help."""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any, NoReturn

from ckptstore.catalog import parse_step
from ckptstore.cli.common import PROG
from ckptstore.store import RetryPolicy


class UsageParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (plus where to find help), exit 2.
    Subcommand parsers inherit it; ``ckptbench`` uses it too."""

    last_error: str | None = None  # the last usage error's line (``--json`` repeats it)

    def error(self, message: str) -> NoReturn:
        UsageParser.last_error = f"{message} (see '{self.prog} --help')"
        self.exit(2, f"{self.prog}: error: {UsageParser.last_error}\n")

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


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    return _int_at_least(text, 0)


def _step(text: str) -> int:
    value = _int_at_least(text, 0)
    try:
        parse_step(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _path(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("is empty")
    return text


def _pos_int(text: str) -> int:
    return _int_at_least(text, 1)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _age_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
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


_COMMON_FLAGS = {"--json", "-v", "--verbose", "--debug"}
_COMMON_WITH_VALUE = {"--storage-option", "-o", "--timeout"}


def common_options_after_command(argv: list[str], commands: set[str]) -> list[str]:
    """``ckptstore --json ls URI`` as ``ckptstore ls --json URI``: the options every command
    takes are accepted before the command too."""
    moved: list[str] = []
    i = 0
    while i < len(argv) and argv[i] not in commands:
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg in _COMMON_FLAGS or (name in _COMMON_WITH_VALUE and "=" in arg):
            moved.append(arg)
            i += 1
        elif arg in _COMMON_WITH_VALUE and i + 1 < len(argv):
            moved += argv[i : i + 2]
            i += 2
        else:
            return argv  # --help, --version, a typo: argparse says what is wrong
    if i == len(argv) or not moved:
        return argv
    return [argv[i], *moved, *argv[i + 1 :]]


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
        metadata of the save. Saves in flight (their save leases) are listed after the steps.
        ls reads manifests only: HEALTH is what the save recorded of its numbers (NaN/Inf), not
        whether every chunk is still there and intact; `ckptstore verify URI --all` checks
        that. With --json, "latest" is the newest step of the store whose manifest reads (one
        that does not is an "error" row of "steps"; a step held only by the local tiers is
        not counted).
        """,
        """
          ckptstore ls /ckpt/run7
          ckptstore ls s3://bucket/run7 --json | jq '.latest'
          ckptstore ls s3://bucket/run7 --local-dir /dev/shm/run7   # which tiers hold each step
        """,
    )
    p.add_argument(
        "--local-dir",
        action="append",
        default=[],
        metavar="PATH",
        help="a node-local tier directory of this job (TierOptions(local_dir=...)); repeat for "
        "several nodes' directories. Adds a TIERS column: durable, and the ranks whose copy of "
        "each step a directory holds (steps held only there are listed too)",
    )
    p.set_defaults(func="ls")

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
    p.add_argument("--step", type=_step, help="the step (default: the latest)")
    p.set_defaults(func="inspect")

    p = add(
        "verify",
        "re-hash every object of a step",
        """
        Verify a step (the latest unless --step, every step with --all): the manifest's own
        checksum, each rank index against the size and xxh3 the manifest records, the DCP
        metadata object when there is one, and every chunk (fetched, decoded and re-hashed with
        xxh3). Every missing or corrupt object is reported by name, with the tensors whose bytes
        it holds; verification goes on past the first one. Exit status 1 if any was found.
        Beside a running job: the latest step (or, with --all, every step) removed meanwhile
        by its keep_last or a gc gives way to the newest again (3 tries); a --step removed
        meanwhile is exit status 1, said to be removed, not damaged.
        """,
        """
          ckptstore verify /ckpt/run7
          ckptstore verify s3://bucket/run7 --all --json
        """,
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=_step, help="the step (default: the latest)")
    which.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument(
        "--read-concurrency",
        type=_pos_int,
        default=8,
        metavar="N",
        help="chunks fetched at once (default: 8)",
    )
    p.set_defaults(func="verify")

    p = add(
        "restore",
        "write a step out as a torch.save file, a plain DCP directory or safetensors",
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

        --format safetensors: a Hugging Face directory (model-00001-of-0000N.safetensors ...
        and model.safetensors.index.json; one model.safetensors when it fits one shard), streamed
        shard by shard in bounded memory. Names are the dotted state paths (model.layer.weight);
        a DCP step's tensors are assembled whole from every rank.

        The result is written under a temporary name and moved into place when complete;
        missing parent directories are made. An existing non-empty PATH is refused unless
        --force. A PATH that is the store, inside it or holds it is always refused.
        """,
        """
          ckptstore restore /ckpt/run7 --to /tmp/run7.pt
          ckptstore restore s3://bucket/run7 --step 1200 --to /tmp/run7-dcp --format dcp
          ckptstore restore /ckpt/run7 --to /tmp/hf --format safetensors --only model. \\
              --dtype bfloat16
        """,
    )
    p.add_argument("--step", type=_step, help="the step (default: the latest)")
    p.add_argument(
        "--healthy",
        action="store_true",
        help="the newest healthy step (no NaN/Inf; docs/FORMAT.md, Health); with --step: "
        "refuse that step unless it is healthy",
    )
    p.add_argument(
        "--to", required=True, type=_path, metavar="PATH", help="local file or directory to write"
    )
    p.add_argument(
        "--format",
        choices=("torch", "dcp", "safetensors"),
        default="torch",
        help="torch: a torch.save file (default); dcp: a DCP FileSystemWriter directory; "
        "safetensors: a Hugging Face safetensors directory",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write over an existing non-empty PATH: torch replaces the file; dcp replaces a "
        "DCP checkpoint directory (one of other files is refused); safetensors replaces its "
        "shards and index in the directory and keeps other files",
    )
    hf = p.add_argument_group("--format safetensors")
    hf.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="largest output shard, e.g. 5GB (default, as Hugging Face) or 500MiB",
    )
    p.add_argument(
        "--only",
        metavar="PREFIX",
        help="restore only the values named PREFIX or under it (model covers model.* and "
        "model/*, not model_ema; names as inspect shows them)",
    )
    hf.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        help="removed from every name with the '.' after it (default: --only's prefix; '' keeps "
        "names whole)",
    )
    hf.add_argument(
        "--dtype", help="cast floating-point tensors to this dtype (bfloat16, float16, ...)"
    )
    hf.add_argument(
        "--rank",
        type=_nonneg_int,
        help="the rank whose state a multi-rank Checkpointer step exports (default: 0)",
    )
    p.set_defaults(func="restore")

    p = add(
        "gc",
        "delete old steps and the chunks no kept step references",
        """
        Keep the newest K committed steps, and the newest healthy step whatever K says (no NaN
        or Inf: a run of unhealthy steps never leaves none to resume from); delete the older ones
        (their manifests first, so each disappears atomically), then the indexes and chunks
        nothing kept references. Without --keep-last every readable step is kept: only what no
        step references goes (and, with --remove-corrupt, the unreadable and quarantined steps).
        While another save is in flight (it holds a lease it renews every 30 s) the sweep of
        chunks is skipped, and the command says so: run it again later. A lease not renewed for
        its ttl (2 min by default) is a dead writer's: its leftovers are removed (an unreferenced
        chunk goes once it is --grace-s old: a step committed just now may be missing from a
        lagging listing). Saves that start during the sweep wait for it. --dry-run lists what would go, deleting nothing.
        Only steps that can be read count towards K: a step whose manifest or rank index does not
        decode, or that references a chunk the store no longer lists, is listed as unreadable and
        kept, and no chunk is swept while it is there (exit 1 while one is kept);
        --remove-corrupt deletes such steps, and the steps a load with fallback quarantined.
        Before a step is deleted, the steps kept in its place are re-hashed, newest first,
        until K check out, and so is the newest healthy step where it is older than those: a
        step with a damaged chunk counts as corrupt (kept, not counted), so a byte flipped in
        the newest step, or in the healthy one kept, never costs the good steps before it (this
        reads the kept steps whole; --no-verify skips it). --verify re-hashes every chunk of every
        step instead (as verify --all does).
        """,
        """
          ckptstore gc /ckpt/run7 --keep-last 3 --dry-run
          ckptstore gc s3://bucket/run7 --keep-last 3
          ckptstore gc /ckpt/run7 --keep-last 3 --remove-corrupt
          ckptstore gc /ckpt/run7 --keep-last 1 --verify --remove-corrupt
          ckptstore gc /ckpt/run7 --remove-corrupt --dry-run
        """,
    )
    p.add_argument(
        "--keep-last",
        type=_pos_int,
        metavar="K",
        help="number of newest steps to keep (>= 1; default: every readable step)",
    )
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted")
    p.add_argument(
        "--remove-corrupt",
        action="store_true",
        help="also delete steps whose manifest or rank index is corrupt (they are kept otherwise)",
    )
    p.add_argument(
        "--grace-s",
        type=_age_s,
        default=120.0,
        metavar="SECONDS",
        help="sweep an unreferenced chunk only once it is this old by "
        "the store's clock (default 120: a step committed that moment may be missing from a "
        "lagging listing, an NFS client's cached directory; beside saves longer than that, "
        "raise it above the longest); 0 sweeps them at once",
    )
    hashing = p.add_mutually_exclusive_group()
    hashing.add_argument(
        "--verify",
        action="store_true",
        help="re-hash every chunk first: a step with a damaged chunk is corrupt, never counted",
    )
    hashing.add_argument(
        "--no-verify",
        action="store_true",
        help="do not re-hash the steps kept before deleting older ones (a damaged newest step "
        "then counts towards K)",
    )
    p.set_defaults(func="gc")
    parser.commands = list(sub.choices)
    return parser
