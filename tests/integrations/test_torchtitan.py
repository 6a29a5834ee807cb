"""ckptstore.integrations.torchtitan with torchtitan 0.3.0's own parts and call order.

Each job is 2 real processes of one gloo group, every part torchtitan's own
(tests/helpers/titan.py): FSDP2 model, ``OptimizersContainer``, ``LRSchedulersContainer``,
``ParallelAwareDataloader``, the manager built by ``Config.build(...)`` with the trainer's
arguments and driven as ``Trainer.train`` drives it. Jobs are killed with SIGKILL after a step
and resumed; a resumed job must match an uninterrupted one bit for bit (every loss, every
parameter, the token count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT
from tests.helpers.dist import free_port

needs_torchtitan = pytest.mark.skipif(
    find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install 'ckptstore[torchtitan]')",
)

STEPS, INTERVAL, KILL_AT = 8, 2, 5
JOB_TIMEOUT_S = 150.0


def run_job(spec: dict, *, world: int = 2) -> list[subprocess.CompletedProcess]:
    """``world`` ranks of tests/helpers/titan.py on one gloo group; every rank's outcome. The
    test fails if a rank is still running after ``JOB_TIMEOUT_S``."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONWARNINGS": "ignore",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.titan", json.dumps(spec)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    done = []
    try:
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=JOB_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} of the torchtitan job still ran after {JOB_TIMEOUT_S} s")
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return done


def finished(job: list[subprocess.CompletedProcess]) -> None:
    for r, rank in enumerate(job):
        assert rank.returncode == 0, f"rank {r} exited {rank.returncode}: {rank.stderr[-3000:]}"


def log_lines(out: Path, rank: int, kind: str) -> list[int]:
    """The steps of the ``<kind> <step>`` lines of a rank's log."""
    lines = (out / f"losses-{rank}.txt").read_text().splitlines()
    return [int(line.split()[1]) for line in lines if line.startswith(f"{kind} ")]


def losses(out: Path, rank: int) -> tuple[list[int], dict[int, str]]:
    """The steps each run of ``out`` started after, and the loss of every step (a step run
    twice, before a kill and after the resume, must have had the same loss)."""
    starts, by_step = log_lines(out, rank, "start"), {}
    for line in (out / f"losses-{rank}.txt").read_text().splitlines():
        key, value = line.split()
        if key in ("start", "staging", "checkpoint_process"):
            continue
        step = int(key)
        assert by_step.setdefault(step, value) == value, f"rank {rank} step {step} differs"
    return starts, by_step


def ckpt(**fields) -> dict:
    return {"enable": True, "interval": INTERVAL, **fields}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """A job that runs all its steps without checkpoints."""
    out = tmp_path_factory.mktemp("titan-reference")
    finished(run_job({"out": str(out), "dump": str(out / "dump"), "steps": STEPS}))
    return out


def assert_same_run(out: Path, reference: Path, *, first_step: int = 1) -> None:
    """Every loss from ``first_step`` on, the final parameters and the token count of the run
    in ``out`` are those of the reference run, bit for bit."""
    for rank in range(2):
        _, got = losses(out, rank)
        _, want = losses(reference, rank)
        assert {s: got[s] for s in range(first_step, STEPS + 1)} == {
            s: want[s] for s in range(first_step, STEPS + 1)
        }
    got = torch.load(out / "params.pt", weights_only=True)
    want = torch.load(reference / "params.pt", weights_only=True)
    assert got["ntokens_seen"] == want["ntokens_seen"]
    assert got["params"].keys() == want["params"].keys()
    for name, tensor in want["params"].items():
        assert torch.equal(got["params"][name], tensor), name


def kill_and_resume(tmp_path: Path, folder: str, checkpoint: dict) -> tuple[Path, int]:
    """A job SIGKILLed after step KILL_AT's save call, then the same job again: its output and
    the newest step committed when it was killed."""
    from ckptstore.catalog import list_steps
    from ckptstore.store import open_store

    out = tmp_path / "out"
    spec = {"out": str(out), "dump": str(tmp_path / "dump"), "steps": STEPS}
    killed = run_job({**spec, "checkpoint": checkpoint, "kill_at": KILL_AT})
    assert [r.returncode for r in killed] == [-9, -9], [r.stderr[-2000:] for r in killed]
    uri = folder if "://" in folder else str(tmp_path / "dump" / folder)
    committed = list_steps(open_store(uri))
    assert committed and committed[-1] in (2, 4), committed
    finished(run_job({**spec, "checkpoint": checkpoint}))
    for rank in range(2):
        starts, _ = losses(out, rank)
        assert starts == [0, committed[-1]], f"rank {rank} started after {starts}"
    return out, committed[-1]


@needs_torchtitan
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_killed_job_resumes_from_the_newest_committed_step(tmp_path, reference, async_mode):
    """Killed after step 5 (saves every 2 steps), the job resumes from the newest step the
    store committed (4, or 2 when step 4's async save was still in flight) and ends exactly
    as the uninterrupted job. The last step keeps torchtitan's semantics: model only, in
    ``export_dtype``; ``keep_latest_k=2`` leaves the newest 2 steps."""
    from ckptstore.catalog import list_steps
    from ckptstore.dcp import load_full_state_dict
    from ckptstore.store import open_store

    checkpoint = ckpt(async_mode=async_mode, keep_latest_k=2, export_dtype="bfloat16")
    out, resumed_from = kill_and_resume(tmp_path, "checkpoint", checkpoint)
    if async_mode == "disabled":
        assert resumed_from == 4  # a synchronous save is committed when save() returns
    for rank in range(2):
        # async_with_pinned_mem: save() returned with the staging still running, every time.
        staged = [2, 4, 4, 6] if resumed_from == 2 else [2, 4, 6]
        assert log_lines(out, rank, "staging") == (
            staged if async_mode == "async_with_pinned_mem" else []
        )
        # async_with_pinned_mem with an untiered writer: the resumed run's async save (step 6)
        # ran in DCP's checkpoint process, as torchtitan's own manager's; "async" in a thread.
        assert log_lines(out, rank, "checkpoint_process") == [
            int(async_mode == "async_with_pinned_mem")
        ]
    assert_same_run(out, reference)

    store = open_store(str(tmp_path / "dump" / "checkpoint"))
    assert list_steps(store) == [6, 8]
    last = load_full_state_dict(store, 8)
    want = torch.load(out / "params.pt", weights_only=True)["params"]
    assert last.keys() == want.keys()  # the model alone: no optimizer, dataloader, train_state
    for name, tensor in want.items():
        assert last[name].dtype == torch.bfloat16
        assert torch.equal(last[name], tensor.to(torch.bfloat16)), name
    step6 = load_full_state_dict(store, 6)
    assert {"optimizer", "lr_scheduler", "dataloader", "train_state"} <= step6.keys()
    assert step6["train_state"] == {"step": 6, "ntokens_seen": 6 * 4 * 16}


@needs_torchtitan
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.s3
def test_killed_job_resumes_from_s3(tmp_path, reference, s3_uri):
    """The same kill and resume with ``folder`` an S3 URI (moto on loopback), async saves;
    the last step saved whole (``last_save_model_only=False``)."""
    from ckptstore.catalog import list_steps
    from ckptstore.dcp import load_full_state_dict
    from ckptstore.store import open_store

    checkpoint = ckpt(
        folder=s3_uri, async_mode="async", keep_latest_k=3, last_save_model_only=False
    )
    out, _ = kill_and_resume(tmp_path, s3_uri, checkpoint)
    assert_same_run(out, reference)
    store = open_store(s3_uri)
    assert list_steps(store) == [4, 6, 8]
    assert load_full_state_dict(store, 8)["train_state"]["step"] == STEPS


@needs_torchtitan
@pytest.mark.dist
@pytest.mark.slow
def test_killed_job_resumes_from_local_tiers(tmp_path, reference):
    """With ``tiers=TierOptions(local_dir=...)`` each save is committed to every rank's local
    tier and drained to the store every 2nd save (steps 2, 6, ...): killed after step 5, the
    job resumes from step 4, which only the local tiers hold, bit for bit. The last step is
    saved to the store itself, whichever saves the tiers drain."""
    from ckptstore.catalog import list_steps
    from ckptstore.store import open_store

    out = tmp_path / "out"
    spec = {
        "out": str(out),
        "dump": str(tmp_path / "dump"),
        "steps": STEPS,
        "local_dir": str(tmp_path / "local"),
        "checkpoint": ckpt(keep_latest_k=2),
    }
    killed = run_job({**spec, "kill_at": KILL_AT})
    assert [r.returncode for r in killed] == [-9, -9], [r.stderr[-2000:] for r in killed]
    assert 4 not in list_steps(open_store(str(tmp_path / "dump" / "checkpoint")))
    finished(run_job(spec))
    assert [losses(out, rank)[0] for rank in range(2)] == [[0, 4], [0, 4]]
    assert_same_run(out, reference)
    assert list_steps(open_store(str(tmp_path / "dump" / "checkpoint")))[-1] == STEPS
    # A roll back with tiers is refused up front too (trained an interval, then StepExistsError)
    refused = run_job({**spec, "checkpoint": ckpt(keep_latest_k=2, load_step=4)})
    assert [r.returncode for r in refused] != [0, 0]
    assert f"--checkpoint.load_step=4 is older than step {STEPS}" in refused[0].stderr


@needs_torchtitan
@pytest.mark.dist
@pytest.mark.slow
def test_load_step_initial_load_path_and_exclude(tmp_path, reference):
    """``load_step``, ``exclude_from_loading``, ``load_only``, ``initial_load_path`` naming a
    step, ``last_save_in_hf``, and the refusal of a load that would make saves collide."""
    from safetensors.torch import load_file

    from ckptstore.catalog import list_steps
    from ckptstore.store import open_store

    dump = tmp_path / "dump"
    first = tmp_path / "first"
    finished(
        run_job(
            {
                "out": str(first),
                "dump": str(dump),
                "steps": STEPS,
                "checkpoint": ckpt(keep_latest_k=0, last_save_in_hf=True),
                "hf_adapter": True,
            }
        )
    )
    assert_same_run(first, reference)  # saving does not perturb training
    folder = dump / "checkpoint"
    assert list_steps(open_store(str(folder))) == [2, 4, 6, 8]
    # The last step: the model alone, named by the model's adapter, exported as safetensors.
    exported = load_file(str(folder / "hf" / "step-8" / "model.safetensors"))
    want = torch.load(first / "params.pt", weights_only=True)["params"]
    hf_names = {f"model.{k.replace('tok_embeddings.', 'embed_tokens.')}": k for k in want}
    assert exported.keys() == hf_names.keys()
    assert all(torch.equal(exported[hf], want[k]) for hf, k in hf_names.items())

    # load_step=4 without train_state: the step counter starts at 0, all else is step 4's.
    partial = tmp_path / "partial"
    spec = {"out": str(partial), "dump": str(dump), "steps": STEPS}
    fields = dict(load_step=4, load_only=True, exclude_from_loading=["train_state"])
    finished(run_job({**spec, "checkpoint": ckpt(**fields)}))
    for rank in range(2):
        starts, got = losses(partial, rank)
        _, ref = losses(reference, rank)
        assert starts == [0]
        assert [got[s] for s in (1, 2, 3, 4)] == [ref[s] for s in (5, 6, 7, 8)]

    # Training on from step 4 in the same folder would save step 6 again: refused up front.
    refused = run_job({**spec, "checkpoint": ckpt(load_step=4)})
    assert all(r.returncode != 0 for r in refused)
    assert "--checkpoint.load_step=4 is older than step 8" in refused[0].stderr
    missing = run_job({**spec, "checkpoint": ckpt(load_step=5, load_only=True)})
    assert "--checkpoint.load_step=5 not found" in missing[0].stderr

    # The roll-back: a new folder, starting from step 4 of the first one.
    rolled = tmp_path / "rolled"
    fields = dict(
        folder="rollback",
        initial_load_path=str(folder / "step-4"),
        initial_load_model_only=False,
        last_save_model_only=False,
    )
    finished(
        run_job(
            {"out": str(rolled), "dump": str(dump), "steps": STEPS, "checkpoint": ckpt(**fields)}
        )
    )
    for rank in range(2):
        assert losses(rolled, rank)[0] == [4]
    assert_same_run(rolled, reference, first_step=5)
    assert list_steps(open_store(str(dump / "rollback"))) == [6, 8]


def _build(config, base_folder, dataloader=None):
    """A manager of ``config`` with a one-layer model and nothing else to checkpoint but
    ``dataloader``."""
    return config.build(
        dataloader=dataloader,
        model_parts=[torch.nn.Linear(2, 2)],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=str(base_folder),
    )


@needs_torchtitan
def test_config_is_torchtitans_and_checks_its_fields():
    """The Config is a ``BaseCheckpointManager.Config`` (what ``Trainer.Config.checkpoint``
    takes) with every field of torchtitan's own ``CheckpointManager.Config``, checked as
    torchtitan checks them; ``build`` makes our manager; a disabled one does nothing."""
    from dataclasses import fields

    from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager

    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager
    from ckptstore.options import TierOptions

    Config = CkptstoreCheckpointManager.Config
    assert issubclass(Config, BaseCheckpointManager.Config)
    theirs = {f.name for f in fields(CheckpointManager.Config)}
    assert theirs <= {f.name for f in fields(Config)}
    assert Config(async_mode="ASYNC").async_mode == "async"
    assert Config(tiers=TierOptions(local_dir="/tmp/x")).tiers.local_dir == "/tmp/x"
    with pytest.raises(ValueError, match="Invalid async_mode"):
        Config(async_mode="threads")
    with pytest.raises(ValueError, match="at least 2 checkpoint replicas"):
        Config(keep_latest_k=1)
    with pytest.raises(ValueError, match="initial_load_in_hf is not supported"):
        Config(initial_load_path="/ckpt", initial_load_in_hf=True)
    with pytest.raises(TypeError):
        Config("checkpoint")  # keyword-only, as torchtitan's
    manager = _build(Config(enable=False), "/nonexistent")
    assert isinstance(manager, CkptstoreCheckpointManager)
    assert manager.load() is False and manager.save(10, last_step=True) is False
    manager.close()


@needs_torchtitan
def test_a_folder_uri_with_one_slash_is_refused_not_made_a_local_directory(tmp_path):
    """torchtitan joins folder to the dump folder: s3:/bucket/run became the local directory
    <dump>/s3:/bucket/run, and the job 'saved to S3' on the node's disk."""
    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager

    with pytest.raises(ValueError, match=r"did you mean s3://bucket/run\?"):
        _build(CkptstoreCheckpointManager.Config(enable=True, folder="s3:/bucket/run"), tmp_path)
    assert list(tmp_path.iterdir()) == []


@needs_torchtitan
def test_config_parses_from_torchtitans_command_line():
    """torchtitan's launcher (``ConfigManager.parse_args``: tyro over the config a registry
    function returned) keeps our Config, ckptstore's options in it, and applies
    ``--checkpoint.*`` flags to it."""
    from dataclasses import field, make_dataclass

    import tyro
    from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
    from torchtitan.config import Configurable
    from torchtitan.config.manager import ConfigManager, custom_registry

    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager
    from ckptstore.options import StorageOptions, TierOptions

    # Trainer.Config's checkpoint field, as the trainer declares it.
    JobConfig = make_dataclass(
        "JobConfig",
        [
            (
                "checkpoint",
                BaseCheckpointManager.Config,
                field(default_factory=CheckpointManager.Config),
            )
        ],
        bases=(Configurable.Config,),
        kw_only=True,
        slots=True,
    )
    ConfigManager()  # registers torchtitan's tyro rules
    tiers = TierOptions(local_dir="/nvme/ckpt")
    loaded = JobConfig(
        checkpoint=CkptstoreCheckpointManager.Config(
            enable=True, tiers=tiers, storage=StorageOptions(timeout_s=5.0)
        )
    )
    args = ["--checkpoint.interval", "7", "--checkpoint.async_mode", "async"]
    args += ["--checkpoint.exclude_from_loading", "dataloader,lr_scheduler"]
    parsed = tyro.cli(JobConfig, args=args, default=loaded, registry=custom_registry).checkpoint
    assert type(parsed) is CkptstoreCheckpointManager.Config
    assert (parsed.enable, parsed.interval, parsed.async_mode) == (True, 7, "async")
    assert parsed.exclude_from_loading == ["dataloader", "lr_scheduler"]
    assert parsed.tiers == tiers and parsed.storage.timeout_s == 5.0
    # ckptstore's options take torchtitan's flat flags too, also where the config set none
    args = ["--checkpoint.tiers.local-dir", "/ssd", "--checkpoint.tiers.durable-every", "4"]
    args += ["--checkpoint.storage.timeout-s", "60"]
    for default in (loaded, JobConfig(checkpoint=CkptstoreCheckpointManager.Config(enable=True))):
        parsed = tyro.cli(JobConfig, args=args, default=default, registry=custom_registry)
        assert parsed.checkpoint.tiers == TierOptions(local_dir="/ssd", durable_every=4)
        assert parsed.checkpoint.storage.timeout_s == 60.0


def test_ckptstore_imports_without_torchtitan():
    """ckptstore, its DCP backend and its integrations package import without torchtitan; the
    torchtitan door says what to install."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torchtitan"] = None  # as if it were not installed
        import ckptstore, ckptstore.dcp, ckptstore.integrations
        try:
            import ckptstore.integrations.torchtitan
        except ImportError as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pip install 'ckptstore[torchtitan]'" in done.stdout


@needs_torchtitan
def test_an_initial_load_path_naming_a_plain_dcp_folder_says_what_it_is(tmp_path):
    """Users moving from torchtitan's own manager point initial_load_path at its step folders."""
    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager

    folder = tmp_path / "outputs" / "checkpoint" / "step-4"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"DCP metadata")
    config = CkptstoreCheckpointManager.Config(enable=True, initial_load_path=str(folder))
    manager = _build(config, tmp_path / "dump")
    try:
        with pytest.raises(ValueError, match=r"names no committed .* it is a plain DCP checkpoint"):
            manager.load()
    finally:
        manager.close()


@needs_torchtitan
def test_an_initial_load_path_naming_a_checkpointer_step_is_one_line(tmp_path):
    """Reviewer of stop 61: a store written by Checkpointer failed inside DCP's load as an
    11-line CheckpointException whose advice did not fit a torchtitan user."""
    from ckptstore import Checkpointer
    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager

    store = tmp_path / "byckpt"
    with Checkpointer(store) as ckpt:
        ckpt.save(3, {"w": torch.ones(4)}).wait()
    config = CkptstoreCheckpointManager.Config(enable=True, initial_load_path=str(store))
    manager = _build(config, tmp_path / "dump")
    try:
        with pytest.raises(
            ValueError, match=r"step 3 of .* was saved by ckptstore.Checkpointer"
        ) as e:
            manager.load()
        assert "\n" not in str(e.value)
    finally:
        manager.close()


class _RunsCode:
    """Pickles as a call of ``open(path, "w")``: unpickling it creates the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


@needs_torchtitan
def test_a_hostile_dataloader_state_is_refused_before_torchtitan_unpickles_it(tmp_path):
    """Reviewer: torchtitan's ParallelAwareDataloader.load_state_dict runs pickle.loads on the
    bytes a step holds for it, so a hostile store ran code through load(). Those bytes are
    unpickled first with plain values and tensors alone; a sampler's generator state (a
    tensor) still resumes the loader exactly."""
    import pickle

    from torchtitan.components.dataloader import ParallelAwareDataloader

    from ckptstore.errors import UnsupportedStateError
    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager

    config = CkptstoreCheckpointManager.Config(enable=True, interval=1)
    marker = tmp_path / "code-ran"

    class Hostile:
        def state_dict(self):
            return {"dp_rank_0": pickle.dumps(_RunsCode(str(marker))), "world_size": 1}

        def load_state_dict(self, state):
            raise AssertionError("not reached")

    def loader():
        return ParallelAwareDataloader(
            _Samples(), dp_rank=0, dp_world_size=1, batch_size=4, shuffle=True
        )

    manager = _build(config, tmp_path / "hostile", Hostile())
    manager.save(1)
    manager.close()
    manager = _build(config, tmp_path / "hostile", loader())
    try:
        with pytest.raises(UnsupportedStateError, match=r"'dp_rank_0' holds a pickled .*open"):
            manager.load()
    finally:
        manager.close()
    assert not marker.exists()

    torch.manual_seed(0)
    first = loader()
    batches = iter(first)
    for _ in range(3):
        next(batches)
    manager = _build(config, tmp_path / "own", first)
    manager.save(1)
    expected = [next(batches) for _ in range(2)]
    manager.close()
    resumed = loader()
    manager = _build(config, tmp_path / "own", resumed)
    try:
        assert manager.load()
    finally:
        manager.close()
    got = iter(resumed)
    assert all(torch.equal(next(got), batch) for batch in expected)


@needs_torchtitan
def test_a_model_only_final_step_and_a_missing_load_step_are_one_line(tmp_path):
    """Reviewer: a finished run relaunched with more steps resumed from its model-only final
    save and failed as a 17-line CheckpointException ("Missing key ... dataloader.dp_rank_0");
    with tiers a load_step no tier holds was an 11-line one (a FileNotFoundError without)."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager
    from ckptstore.options import TierOptions

    def loader():
        return ParallelAwareDataloader(_Samples(), dp_rank=0, dp_world_size=1, batch_size=4)

    config = CkptstoreCheckpointManager.Config(enable=True, interval=1)
    manager = _build(config, tmp_path, loader())
    manager.save(1)
    manager.save(2, last_step=True)  # last_save_model_only: torchtitan's default
    manager.close()
    manager = _build(config, tmp_path, loader())
    try:
        with pytest.raises(ValueError, match=r"step 2 of .* holds the model alone") as e:
            manager.load()
        assert "\n" not in str(e.value) and "initial_load_path=" in str(e.value)
    finally:
        manager.close()
    # A reviewer (stop 82): a whole step loaded at another data-parallel degree lacks the
    # dataloader state of a rank, and was said to hold the model alone.
    other_degree = ParallelAwareDataloader(_Samples(), dp_rank=1, dp_world_size=2, batch_size=4)
    load_only = CkptstoreCheckpointManager.Config(enable=True, load_only=True)
    manager = _build(load_only, tmp_path, other_degree)
    try:
        with pytest.raises(ValueError, match="another data-parallel degree") as e:
            manager.load(step=1)
        assert "dataloader.dp_rank_1" in str(e.value) and "model alone" not in str(e.value)
        assert "exclude_from_loading=['dataloader']" in str(e.value)
    finally:
        manager.close()
    tiered = CkptstoreCheckpointManager.Config(
        enable=True, load_only=True, tiers=TierOptions(local_dir=str(tmp_path / "local"))
    )
    manager = _build(tiered, tmp_path, loader())
    try:
        with pytest.raises(FileNotFoundError, match=r"load_step=5 not found in .*no tier holds"):
            manager.load(step=5)
    finally:
        manager.close()


@needs_torchtitan
def test_a_dataloader_state_in_any_buffer_is_checked_before_torchtitan_unpickles_it(tmp_path):
    """Reviewer: the check took bytes alone; torchtitan's pickle.loads takes any buffer, so a
    numpy array holding a hostile pickle (a value DCP loads once numpy's globals are allowed)
    was unpickled unchecked."""
    import pickle

    import numpy as np
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from ckptstore.errors import UnsupportedStateError
    from ckptstore.integrations.torchtitan import _CheckedDataloader

    marker = tmp_path / "code-ran"
    hostile = np.frombuffer(pickle.dumps(_RunsCode(str(marker))), dtype=np.uint8)
    loader = ParallelAwareDataloader(_Samples(), dp_rank=0, dp_world_size=1, batch_size=4)
    with pytest.raises(UnsupportedStateError, match=r"'dp_rank_0' holds a pickled .*open"):
        _CheckedDataloader(loader).load_state_dict({"dp_rank_0": hostile, "world_size": 1})
    assert not marker.exists()


def _flip_a_chunk_of(store, step: int, *, older: int) -> None:
    """Flip a byte of a chunk of ``step`` that step ``older`` does not share."""
    from ckptstore.catalog import load_manifest, load_rank_index

    def chunks(s):
        return set(load_rank_index(store, load_manifest(store, s), 0).chunks)

    digest = sorted(chunks(step) - chunks(older))[0]
    path = Path(store.root) / "chunks" / digest[:2] / digest
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@needs_torchtitan
def test_a_corrupt_newest_step_is_skipped_and_quarantined_not_a_crash_at_every_restart(
    tmp_path, caplog
):
    """Reviewer: the torchtitan door loaded the newest step with a plain dcp.load, so a step
    with a damaged chunk failed every restart of the job. It resumes through
    ``ckptstore.dcp.resume``: the step before is loaded, the damaged one named and
    quarantined."""
    import logging

    from ckptstore import Store
    from ckptstore.catalog import list_steps, quarantined
    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager

    config = CkptstoreCheckpointManager.Config(enable=True, interval=1)
    manager = _build(config, tmp_path)
    model = manager.states["model"].model[0]
    saved = {}
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        saved[step] = model.weight.detach().clone()
        manager.save(step)
    manager.close()

    store = Store(str(tmp_path / "checkpoint"))
    assert list_steps(store) == [1, 2]
    _flip_a_chunk_of(store, 2, older=1)

    manager = _build(config, tmp_path)
    model = manager.states["model"].model[0]
    try:
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            assert manager.load() is True
    finally:
        manager.close()
    assert torch.equal(model.weight, saved[1])
    said = [r.getMessage() for r in caplog.records if "trying an older step" in r.getMessage()]
    assert len(said) == 1 and "step 2" in said[0], said
    assert 2 in quarantined(store).values()
    assert list_steps(store) == [1]


@needs_torchtitan
def test_a_corrupt_step_above_a_model_only_seed_falls_back_to_the_seed(tmp_path):
    """Reviewer: with a seed checkpoint (step 0, the model alone, as torchtitan's
    create_seed_checkpoint writes it) under a corrupt step 5, the resume tried step 0 with the
    whole training state and failed 'step 0 holds the model alone', step 5 left in place to
    fail every restart. Step 0 loads into the model alone, as a plain load of it does."""
    import torch.distributed.checkpoint as dcp

    from ckptstore import Store
    from ckptstore.catalog import list_steps, quarantined
    from ckptstore.dcp import StoreWriter
    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager

    config = CkptstoreCheckpointManager.Config(enable=True, interval=1)
    manager = _build(config, tmp_path)
    model = manager.states["model"].model[0]
    with torch.no_grad():
        model.weight.fill_(0.5)
    seed = model.weight.detach().clone()
    writer = StoreWriter(str(tmp_path / "checkpoint"))  # the seed: the model alone, at step 0
    dcp.save(manager.states["model"].state_dict(), storage_writer=writer, checkpoint_id=0)
    writer.close()
    with torch.no_grad():
        model.weight.fill_(5.0)
    manager.save(5)
    manager.close()
    store = Store(str(tmp_path / "checkpoint"))
    assert list_steps(store) == [0, 5]
    _flip_a_chunk_of(store, 5, older=0)

    manager = _build(config, tmp_path)
    model = manager.states["model"].model[0]
    try:
        assert manager.load() is True
    finally:
        manager.close()
    assert torch.equal(model.weight, seed)
    assert 5 in quarantined(store).values() and list_steps(store) == [0]
