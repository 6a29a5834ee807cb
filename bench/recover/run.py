"""One run of the benchmark (:func:`run_recover`): the durable store (a directory, S3, or S3 on
a moto server of its own), the save job, the wiped node, the restore job, the report."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

from bench import _ckpt_common as common
from bench.recover.plan import DAMAGES, DEFAULT_BUCKET, FRONTENDS, RecoverPlan, check_layout
from bench.recover.ranks import run_job
from bench.recover.summary import summarize


@contextlib.contextmanager
def durable_store(uri: str | None, *, moto: bool) -> Iterator[tuple[str | None, str]]:
    """``uri`` and what kind of store it is; with ``moto`` a moto S3 server on 127.0.0.1 in
    this process (the ranks, which inherit its endpoint, run in their own), its bucket made."""
    if not moto:
        kind = "s3" if uri and uri.startswith("s3://") else "local"
        yield uri, kind
        return
    uri = uri or f"s3://{DEFAULT_BUCKET}"
    if not uri.startswith("s3://"):
        raise ValueError(f"--moto serves S3: give --durable s3://bucket/prefix, not {uri!r}")
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise ValueError("--moto needs moto's server (pip install 'moto[server]')") from None
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request under -v
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        with mock.patch.dict(os.environ, env):
            import fsspec

            bucket = uri.removeprefix("s3://").split("/", 1)[0]
            fsspec.filesystem("s3", skip_instance_cache=True).mkdir(bucket)
            yield uri, "moto"
    finally:
        server.stop()
        # fsspec keeps S3 clients by their arguments, not by AWS_ENDPOINT_URL: one made here
        # would point at this stopped server for the rest of the process.
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


def _checked(
    *, ranks: int, ranks_per_node: int, size_bytes: int, tensors: int, repeat: int,
    local_root: str | None, background_nice: int, frontend: str, damage: str = "node",
) -> tuple[int, str]:  # fmt: skip
    """The node count and the local root of a run with these settings; ValueError if bad."""
    if frontend not in FRONTENDS:
        raise ValueError(f"bad --frontend {frontend!r}: one of {', '.join(FRONTENDS)}")
    if damage not in DAMAGES:
        raise ValueError(f"bad --damage {damage!r}: one of {', '.join(DAMAGES)}")
    nodes = check_layout(ranks, ranks_per_node, frontend)
    if repeat < 1:
        raise ValueError(f"bad --repeat {repeat}: must be at least 1")
    if tensors < 1 or size_bytes // ranks // tensors < 4:
        raise ValueError(f"bad --size/--tensors: each of {ranks * tensors} tensors needs 4 bytes")
    if local_root is None:
        local_root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    if not 0 <= background_nice <= 19:
        raise ValueError(f"bad --background-nice {background_nice}: must be within 0..19")
    if not os.path.isdir(local_root):
        raise ValueError(f"--local-root {local_root!r} is not a directory")
    return nodes, local_root


def run_recover(
    *,
    ranks: int = 4,
    ranks_per_node: int = 2,
    size_bytes: int = 2**30,
    tensors: int = 4,
    durable: str | None = None,
    moto: bool = False,
    repeat: int = 3,
    peer_budget_bytes: int = 64 * 2**20,
    local_root: str | None = None,
    timeout_s: float = 3600.0,
    seed: int = 0,
    background_nice: int = 0,
    frontend: str = "checkpointer",
    damage: str = "node",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; the report as a JSON-ready dict."""
    nodes, local_root = _checked(
        ranks=ranks, ranks_per_node=ranks_per_node, size_bytes=size_bytes, tensors=tensors,
        repeat=repeat, local_root=local_root, background_nice=background_nice, frontend=frontend,
        damage=damage,
    )  # fmt: skip
    say = progress or (lambda _msg: None)
    date = common.now_iso()
    with (
        durable_store(durable, moto=moto) as (durable_uri, kind),
        common.Workspace(durable_uri, command="recover") as ws,
    ):
        local = tempfile.mkdtemp(prefix="ckptbench-recover-", dir=local_root)
        try:
            plan = RecoverPlan(
                durable_uri=ws.child("durable"),
                plain_uri=ws.child("plain"),
                dcp_path=ws.path("dcp") if ws.is_local else ws.child("dcp"),
                dcp_is_local=ws.is_local,
                local_root=local,
                ranks_per_node=ranks_per_node,
                nodes=nodes,
                bytes_per_rank=size_bytes // ranks,
                tensors=tensors,
                repeat=repeat,
                peer_budget_bytes=peer_budget_bytes,
                seed=seed,
                background_nice=background_nice,
                frontend=frontend,
                damage=damage,
            )
            what = "saves" if frontend == "checkpointer" else "dcp.async_save calls"
            say(f"save job: {ranks} ranks, {repeat} {what} with tiers and without, DCP once")
            saved = run_job(plan, ranks, "save", timeout_s=timeout_s)
            stored = {name: ws.bytes_under(name) for name in ("durable", "plain", "dcp")}
            hit = "wiped" if damage == "node" else "damaged (a bad chunk per copy)"
            say(f"node {plan.wiped_node} {hit} before each of {repeat} restore rounds")
            restored = run_job(plan, ranks, "restore", timeout_s=timeout_s)
        finally:
            shutil.rmtree(local, ignore_errors=True)
    config = _config(plan, ranks, saved[0]["state_bytes"], durable_uri, kind, local_root)
    config["stored_bytes"] = stored
    config["host"] = common.host_info()
    return {
        "bench": "recover",
        "date": date,
        "config": config,
        **summarize(saved, restored, frontend, damage),
    }


def _config(
    plan: RecoverPlan, ranks: int, state_bytes: int, durable_uri: str | None, kind: str,
    local_root: str,
) -> dict[str, Any]:  # fmt: skip
    """The run's settings as its report gives them."""
    return {
        "ranks": ranks,
        "ranks_per_node": plan.ranks_per_node,
        "nodes": plan.nodes,
        "size_bytes": state_bytes * ranks,
        "bytes_per_rank": state_bytes,
        "tensors_per_rank": plan.tensors,
        "repeat": plan.repeat,
        "frontend": plan.frontend,
        "durable": durable_uri or "(a temporary local directory)",
        "store": kind,
        "local_root": local_root,
        "peer_copies": 1,
        "durable_every": 1,
        "peer_budget_bytes": plan.peer_budget_bytes,
        "background_nice": plan.background_nice,
        "damage": plan.damage,
        "wiped_node": plan.wiped_node,
        "wiped_ranks": [r for r in range(ranks) if plan.node_of(r) == plan.wiped_node],
    }
