"""Healthy steps through the Checkpointer: every save records each floating tensor's NaN and
Inf counts and sum of squares (rank index), the step's verdict (manifest), the policy on an
unhealthy save, and steps written before health read as "unknown"."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.distributed as dist

from ckptstore import Checkpointer, HealthPolicy, Store, UnhealthyStepError
from ckptstore.catalog import list_steps, load_manifest, read_rank_index
from ckptstore.format import commit_key
from ckptstore.health import RankHealth, status, tiered_verdict, verdict
from tests.helpers.crafted import rewrite, sealed
from tests.helpers.dist import run_ranks


def _model_state(seed: int = 0) -> dict:
    """A model, an Adam optimizer with state, a bf16 tensor and non-floating values."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return {
        "model": model,
        "optim": opt,
        "emb": torch.randn(64, 8).to(torch.bfloat16),
        "ids": torch.arange(10),
        "step": 7,
    }


def _sumsq(state: dict) -> float:
    total = 0.0
    for t in [*state["model"].state_dict().values(), state["emb"]]:
        total += float(t.double().square().sum())
    for s in state["optim"].state.values():
        for v in s.values():
            if torch.is_tensor(v) and v.dtype.is_floating_point:
                total += float(v.double().square().sum())
    return total


def _entries(store: Store, step: int) -> dict:
    """name -> health of each tensor of rank 0's index (by path in the state)."""
    from ckptstore.save.session import tensor_names

    manifest = load_manifest(store, step)
    index = read_rank_index(store, manifest.ranks[0])
    names = tensor_names(index)
    return {names[i]: e.health for i, e in enumerate(index.tensors)}


def test_a_healthy_save_records_each_floating_tensor_and_the_step(tmp_path):
    state = _model_state()
    with Checkpointer(tmp_path) as ck:
        handle = ck.save(1, state)
        handle.wait()
        assert handle.health.status == "healthy" and ck.last_save == handle.health
    store = Store(tmp_path)
    entries = _entries(store, 1)
    assert entries["ids"] is None  # not floating: nothing recorded
    w = state["model"][0].weight.detach()
    nan, inf, sq = entries["model/0.weight"]
    assert (nan, inf) == (0, 0)
    assert sq == pytest.approx(float(w.double().square().sum()), rel=1e-6)
    assert entries["emb"][2] == pytest.approx(float(state["emb"].double().square().sum()), 1e-6)
    health = load_manifest(store, 1).health
    assert health["healthy"] and health["nan"] == 0 and health["inf"] == 0
    assert health["sumsq"] == pytest.approx(_sumsq(state), rel=1e-6)
    assert handle.health.norm == pytest.approx(math.sqrt(_sumsq(state)), rel=1e-6)


def test_ignored_prefixes_never_make_a_step_unhealthy_but_are_recorded(tmp_path):
    """A best score that starts at Inf (Lightning's ModelCheckpoint, EarlyStopping) is no
    blow-up; an Inf anywhere else still is."""
    state = {"model": {"w": torch.ones(4)}, "callbacks": {"best": torch.tensor(math.inf)}}
    policy = HealthPolicy(ignore=("callbacks/",))
    with Checkpointer(tmp_path, health=policy) as ck:
        assert ck.save(1, state).wait() is None and ck.last_save.healthy
        assert ck.last_save.norm == pytest.approx(2.0)  # the sentinel counts in no norm either
        state["model"]["w"][0] = math.inf
        ck.save(2, state).wait()
        assert not ck.last_save.healthy and ck.last_save.inf == 1
        assert ck.last_save.worst == ("rank 0 model/w: 0 NaN, 1 Inf",)
    store = Store(tmp_path)
    assert list(_entries(store, 1)["callbacks/best"][:2]) == [0, 1]  # recorded all the same
    assert load_manifest(store, 1).health["healthy"]
    with pytest.raises(ValueError, match="ignore must be a tuple"):
        HealthPolicy(ignore="callbacks/")


@pytest.mark.parametrize("where", ["model", "optim", "bf16"])
def test_nan_and_inf_anywhere_make_the_step_unhealthy_and_name_the_tensor(tmp_path, where, caplog):
    state = _model_state()
    if where == "model":
        with torch.no_grad():
            state["model"][1].weight[0, 0] = float("nan")
            state["model"][1].weight[1, :2] = float("-inf")
        name, nan, inf = "model/1.weight", 1, 2
    elif where == "optim":
        exp_avg = next(iter(state["optim"].state.values()))["exp_avg"]
        exp_avg.view(-1)[:3] = float("nan")
        name, nan, inf = "optim/state/0/exp_avg", 3, 0
    else:
        state["emb"][5, 5] = float("inf")
        name, nan, inf = "emb", 0, 1
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        with Checkpointer(tmp_path) as ck:
            handle = ck.save(3, state)
            handle.wait()
    assert handle.health.status == "unhealthy" and not handle.health.healthy
    assert (handle.health.nan, handle.health.inf) == (nan, inf)
    assert handle.health.worst == (f"rank 0 {name}: {nan} NaN, {inf} Inf",)
    assert list_steps(Store(tmp_path)) == [3]  # committed for forensics
    assert _entries(Store(tmp_path), 3)[name][:2] == [nan, inf]
    lines = [r.getMessage() for r in caplog.records if "unhealthy" in r.getMessage()]
    assert len(lines) == 1 and name in lines[0] and "committed" in lines[0]
    # The sum of squares leaves the non-finite values out, so a norm is still formed.
    assert math.isfinite(load_manifest(Store(tmp_path), 3).health["sumsq"])


def test_device_staged_state_is_scanned_on_the_device(tmp_path, monkeypatch):
    """Device staging (the cpu stands in): the scan runs in the drain, on the device buffer,
    and the host pass takes its result instead of scanning again."""
    import ckptstore.save.session as session_mod
    import ckptstore.staging as staging_mod

    scanned_in_drain = []
    real = staging_mod.health_scan

    def in_drain(views):
        scanned_in_drain.append(views[0].device)
        return real(views)

    monkeypatch.setattr(staging_mod, "health_scan", in_drain)
    monkeypatch.setattr(
        session_mod, "ChunkScan", lambda *args: pytest.fail("host pass scanned again")
    )
    state = {"w": torch.randn(256, 512), "b": torch.randn(300).to(torch.bfloat16)}
    state["b"][7] = float("nan")
    with Checkpointer(tmp_path, staging="device") as ck:
        handle = ck.save(1, state)
        handle.wait()
        assert ck.engine.device_pool is not None  # staged on the device
    assert scanned_in_drain == [torch.device("cpu")]
    assert handle.health.status == "unhealthy" and handle.health.nan == 1
    assert _entries(Store(tmp_path), 1)["b"][0] == 1


def test_on_unhealthy_skip_and_raise_commit_nothing(tmp_path, caplog):
    bad = {"w": torch.tensor([1.0, float("nan")])}
    with Checkpointer(tmp_path, on_unhealthy="skip") as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            handle = ck.save(2, bad)
            handle.wait()
        assert handle.health.status == "unhealthy" and not handle.health.committed
        assert ck.steps() == [1]
    assert any("not committed" in r.getMessage() for r in caplog.records)
    with Checkpointer(tmp_path, health=HealthPolicy(on_unhealthy="raise")) as ck:
        with pytest.raises(UnhealthyStepError, match="step 3 is unhealthy.*rank 0 w: 1 NaN"):
            ck.save(3, bad).wait()
        assert ck.steps() == [1]
        ck.save(4, {"w": torch.ones(2)}).wait()  # the next healthy save goes on
        assert ck.steps() == [1, 4]


def test_norm_jump_marks_a_step_unhealthy_against_the_previous_healthy_one(tmp_path):
    policy = HealthPolicy(norm_jump=4.0, norm_groups={"model": ("model/",)})
    state = {"model": {"w": torch.ones(100)}, "opt": {"m": torch.ones(100)}}
    with Checkpointer(tmp_path, health=policy) as ck:
        ck.save(1, state).wait()
        state["model"]["w"].mul_(2)  # x2: within the factor
        h2 = ck.save(2, state)
        h2.wait()
        assert h2.health.healthy and h2.health.group_norms["model"] == pytest.approx(20.0)
        state["model"]["w"].mul_(100)  # x100 on the model's group only
        h3 = ck.save(3, state)
        h3.wait()
        assert h3.health.status == "unhealthy"
        assert any("model norm" in r and "step 2" in r for r in h3.health.reasons)
        state["model"]["w"].div_(100)  # back near step 2, the previous *healthy* step
        h4 = ck.save(4, state)
        h4.wait()
        assert h4.health.healthy
    with Checkpointer(tmp_path) as ck:  # off by default: the same jump is healthy
        state["model"]["w"].mul_(100)
        h5 = ck.save(5, state)
        h5.wait()
        assert h5.health.healthy


def test_scan_off_and_steps_written_before_health_read_as_unknown(tmp_path):
    store = Store(tmp_path)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.tensor([float("nan")])}).wait()
    # Step 1 rewritten exactly as a writer before health wrote it: no health fields.
    manifest_doc = json.loads(store.get(commit_key(1)))
    manifest = load_manifest(store, 1)
    index_key = manifest.ranks[0].key
    index_doc = json.loads(store.get(index_key))
    for t in index_doc["tensors"]:
        t.pop("health", None)
    index_bytes = sealed(index_doc)
    rewrite(store, index_key, index_bytes)
    import xxhash

    manifest_doc["ranks"][0].update(
        nbytes=len(index_bytes), xxh3=xxhash.xxh3_128_hexdigest(index_bytes)
    )
    manifest_doc.pop("health")
    rewrite(store, commit_key(1), sealed(manifest_doc))
    assert load_manifest(store, 1).health is None
    assert status(load_manifest(store, 1).health) == "unknown"
    with Checkpointer(tmp_path, health=HealthPolicy(scan=False)) as ck:
        handle = ck.save(2, {"w": torch.tensor([float("nan")])})
        handle.wait()
        assert handle.health.status == "unknown"
        target = {"w": torch.zeros(1)}
        assert ck.load(target, step=1) == 1 and torch.isnan(target["w"]).all()
    assert b'"health"' not in store.get(commit_key(2))


def test_a_malformed_health_record_is_refused_as_corrupt(tmp_path):
    from ckptstore.errors import CheckpointCorruptError

    store = Store(tmp_path)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.ones(3)}).wait()
    doc = json.loads(store.get(commit_key(1)))
    doc["health"]["nan"] = -1
    rewrite(store, commit_key(1), sealed(doc))
    with pytest.raises(CheckpointCorruptError, match="health counts"):
        load_manifest(store, 1)


def _one_rank_unhealthy(rank: int, world: int, root: str) -> None:
    state = {
        "w": torch.full((1000,), float(rank + 1)),
        "h": torch.full((10,), 0.5).to(torch.bfloat16),
        "opt": {"m": torch.ones(4)},
    }
    with Checkpointer(root) as ck:
        h1 = ck.save(1, state)
        h1.wait()
        if rank == 1:
            state["opt"]["m"][2] = float("nan")
            state["h"][0] = float("inf")
        h2 = ck.save(2, state)
        h2.wait()
    # Every rank hears the step's verdict, not only its own tensors'.
    assert h1.health.healthy, h1.health
    assert h2.health.status == "unhealthy" and (h2.health.nan, h2.health.inf) == (1, 1)
    assert h2.health.worst == ("rank 1 h: 0 NaN, 1 Inf", "rank 1 opt/m: 1 NaN, 0 Inf")
    expected = sum(1000 * float(r + 1) ** 2 + 10 * 0.25 + 4 for r in range(world))
    assert h1.health.norm == pytest.approx(math.sqrt(expected))
    dist.barrier()


@pytest.mark.dist
def test_nan_and_inf_on_one_rank_make_the_whole_step_unhealthy(tmp_path):
    run_ranks(_one_rank_unhealthy, 2, str(tmp_path))
    health = load_manifest(Store(tmp_path), 2).health
    assert not health["healthy"] and [t["rank"] for t in health["worst"]] == [1, 1]


# -- reading: healthy=True ---------------------------------------------------------------------


def _three_steps(root, caplog=None) -> None:
    """Steps 1 and 2 healthy, 3 unhealthy (NaN), 4 unknown (scan off)."""
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.full((4,), 1.0)}).wait()
        ck.save(2, {"w": torch.full((4,), 2.0)}).wait()
        ck.save(3, {"w": torch.tensor([3.0, float("nan"), 3.0, 3.0])}).wait()
    with Checkpointer(root, health=HealthPolicy(scan=False)) as ck:
        ck.save(4, {"w": torch.full((4,), 4.0)}).wait()


def test_steps_latest_and_load_take_healthy(tmp_path, caplog):
    _three_steps(tmp_path)
    with Checkpointer(tmp_path) as ck:
        assert ck.steps() == [1, 2, 3, 4] and ck.latest() == 4
        assert ck.steps(healthy=True) == [1, 2] and ck.latest(healthy=True) == 2
        target = {"w": torch.zeros(4)}
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            assert ck.load(target, healthy=True) == 2
        assert torch.equal(target["w"], torch.full((4,), 2.0))
        skipped = [r.getMessage() for r in caplog.records if "skipped by healthy=True" in r.message]
        assert len(skipped) == 2, skipped  # each newer step named once, with why
        assert "step 4: health unknown" in skipped[0]
        assert "step 3: unhealthy (1 NaN" in skipped[1] and "rank 0 w: 1 NaN" in skipped[1]
        with pytest.raises(UnhealthyStepError, match="step 3: unhealthy"):
            ck.load(target, step=3, healthy=True)
        assert ck.load(target, step=1, healthy=True) == 1
        assert ck.load(target) == 4  # without healthy: the newest step, as before


def test_healthy_with_fallback_skips_a_healthy_step_that_does_not_load(tmp_path, caplog):
    _three_steps(tmp_path)
    store = Store(tmp_path)
    manifest = load_manifest(store, 2)
    index = read_rank_index(store, manifest.ranks[0])
    for digest in index.chunks:  # step 2 (healthy) loses its chunks: it cannot load
        store.delete(f"chunks/{digest[:2]}/{digest}")
    with Checkpointer(tmp_path) as ck:
        target = {"w": torch.zeros(4)}
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            assert ck.load(target, healthy=True, fallback=True) == 1
        assert torch.equal(target["w"], torch.full((4,), 1.0))
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert text.count("step 3: unhealthy") == 1 and text.count("step 4: health unknown") == 1
        assert "step 2 in" in text and "trying an older step" in text


def test_no_healthy_step_is_not_found_naming_each_step(tmp_path):
    from ckptstore.errors import CheckpointNotFoundError, NoHealthyStepError

    with Checkpointer(tmp_path) as ck:
        ck.save(5, {"w": torch.tensor([float("inf")])}).wait()
        assert ck.steps(healthy=True) == []
        with pytest.raises(NoHealthyStepError, match="no healthy .*step 5: unhealthy"):
            ck.latest(healthy=True)  # not None: a job that started over would save over it
        with pytest.raises(CheckpointNotFoundError, match="no healthy .*step 5: unhealthy"):
            ck.load({"w": torch.zeros(1)}, healthy=True)


# -- retention never leaves a job without a healthy step --------------------------------------


def test_keep_last_1_keeps_the_newest_healthy_step_behind_unhealthy_ones(tmp_path):
    nan = {"w": torch.tensor([float("nan"), 1.0])}
    with Checkpointer(tmp_path, keep_last=1) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
        ck.save(2, nan).wait()
        ck.save(3, nan).wait()
        assert ck.steps() == [1, 3]  # 2 went; 1 stays, the newest healthy step
        target = {"w": torch.zeros(2)}
        assert ck.load(target, healthy=True) == 1 and torch.equal(target["w"], torch.ones(2))
        ck.save(4, {"w": torch.full((2,), 4.0)}).wait()
        assert ck.steps() == [4]  # a newer healthy step: the old one may go


def test_gc_cli_keeps_the_newest_healthy_step(tmp_path, capsys):
    from ckptstore.cli import main

    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
        ck.save(2, {"w": torch.full((2,), 2.0)}).wait()
        ck.save(3, {"w": torch.tensor([float("inf"), 1.0])}).wait()
    assert main(["gc", str(tmp_path), "--keep-last", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["deleted_steps"] == [1] and doc["kept_healthy"] == 2
    assert list_steps(Store(tmp_path)) == [2, 3]
    assert main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    assert (
        "newest healthy step of those listed when gc began (always kept): 2"
        in capsys.readouterr().out
    )


def _healthy_then_nan(root) -> None:
    """Steps 1-3 healthy (each its own chunk), 4-5 with a NaN; a byte of step 3's chunk flipped."""
    with Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((1000,), float(step))}).wait()
        for step in (4, 5):
            ck.save(step, {"w": torch.tensor([float("nan")] + [float(step)] * 999)}).wait()
    store = Store(root)
    older = set(read_rank_index(store, load_manifest(store, 2).ranks[0]).chunks)
    (digest,) = set(read_rank_index(store, load_manifest(store, 3).ranks[0]).chunks) - older
    path = root / "chunks" / digest[:2] / digest
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_gc_re_hashes_the_healthy_step_it_keeps_and_a_damaged_one_never_costs_the_one_before(
    tmp_path, capsys
):
    """Reviewer G: ``gc --keep-last 1`` re-hashed the newest step it kept (5, NaN) but not the
    newest healthy one kept for its health (3, a flipped byte): it deleted healthy steps 1 and 2
    and left no healthy step that loads."""
    from ckptstore.cli import main

    _healthy_then_nan(tmp_path)
    assert main(["gc", str(tmp_path), "--keep-last", "1", "--json"]) == 1  # 3 kept, damaged
    doc = json.loads(capsys.readouterr().out)
    assert doc["kept_healthy"] == 2 and doc["deleted_steps"] == [1, 4]
    assert [u["step"] for u in doc["unreadable_steps"]] == [3]
    assert list_steps(Store(tmp_path)) == [2, 3, 5]
    with Checkpointer(tmp_path) as ck:
        target = {"w": torch.zeros(1000)}
        assert ck.load(target, healthy=True, fallback=True) == 2
        assert torch.equal(target["w"], torch.full((1000,), 2.0))


def test_keep_last_re_hashes_an_old_healthy_step_it_keeps_once(tmp_path, monkeypatch):
    """Reviewer G: a saver's ``keep_last=1`` after a run of NaN saves kept the newest healthy
    step (damaged) and deleted the healthy ones before it. It re-hashes that step before it
    deletes an older one; one that checks out once per save of it (not at every save of the
    NaN run), a damaged one at each (reviewer I: a later save may repair it)."""
    from ckptstore import retention

    _healthy_then_nan(tmp_path)
    checked: list[list[int]] = []
    verify = retention._verify_chunks

    def counted(store, readable, report, steps):
        checked.append(sorted(steps))
        return verify(store, readable, report, steps)

    monkeypatch.setattr(retention, "_verify_chunks", counted)
    nan = {"w": torch.tensor([float("nan")] + [6.0] * 999)}
    with Checkpointer(tmp_path, keep_last=1) as ck:
        ck.save(6, nan).wait()
        assert ck.steps() == [2, 3, 6]  # 3 damaged: kept, not counted; 2 the healthy one kept
        ck.save(7, nan).wait()
        ck.save(8, nan).wait()
        assert ck.steps() == [2, 3, 8]
    assert checked == [[3], [2], [3], [3]]  # good step 2 read once; damaged 3 at each save
    with Checkpointer(tmp_path) as ck:
        target = {"w": torch.zeros(1000)}
        assert ck.load(target, healthy=True, fallback=True) == 2


def test_local_tier_retention_keeps_the_newest_healthy_copy(tmp_path):
    from ckptstore import TierOptions

    tiers = TierOptions(local_dir=tmp_path / "local", durable_every=100, local_keep_last=1)
    with Checkpointer(tmp_path / "durable", tiers=tiers) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()  # the first save is also drained
        ck.save(2, {"w": torch.full((2,), 2.0)}).wait()
        ck.save(3, {"w": torch.tensor([float("nan"), 1.0])}).wait()
        ck.save(4, {"w": torch.tensor([float("nan"), 2.0])}).wait()
        ck.wait()
        local = ck._local.store(0)
    assert list_steps(local) == [2, 4]
    assert load_manifest(local, 2).health["healthy"]


def test_tiers_load_healthy_takes_the_newest_healthy_copy(tmp_path, caplog):
    from ckptstore import TierOptions

    tiers = TierOptions(local_dir=tmp_path / "local", durable_every=2, local_keep_last=5)
    with Checkpointer(tmp_path / "durable", tiers=tiers) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()  # durable and local
        ck.save(2, {"w": torch.full((2,), 2.0)}).wait()  # local only
        h3 = ck.save(3, {"w": torch.tensor([float("nan"), 3.0])})  # durable and local
        h3.wait()
        assert h3.health.status == "unhealthy" and h3.health.nan == 1  # the local commit's
        ck.wait()
    with Checkpointer(tmp_path / "durable", tiers=tiers) as ck:
        target = {"w": torch.zeros(2)}
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            assert ck.load(target, healthy=True) == 2
        assert torch.equal(target["w"], torch.full((2,), 2.0))
        assert ck.last_load.source == "local"
        assert sum("step 3: unhealthy" in r.getMessage() for r in caplog.records) == 1
        with pytest.raises(UnhealthyStepError):
            ck.load(target, step=3, healthy=True)
        assert ck.load(target) == 3  # without healthy, as before


def test_a_sum_of_squares_that_overflows_float64_is_recorded_as_null(tmp_path, capsys):
    from ckptstore.cli import main

    with Checkpointer(tmp_path) as ck:
        handle = ck.save(1, {"w": torch.full((4,), 1e200, dtype=torch.float64)})
        handle.wait()
    # Finite values: healthy, its norm beyond float64 (JSON holds no inf: null).
    assert handle.health.healthy and handle.health.norm == math.inf
    assert load_manifest(Store(tmp_path), 1).health["sumsq"] is None
    assert _entries(Store(tmp_path), 1)["w"] == [0, 0, None]
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"][0]["norm"] is None
    assert main(["inspect", str(tmp_path)]) == 0
    assert "overflow" in capsys.readouterr().out


def _tiers_one_rank_nan(rank: int, world: int, root: str, local: str) -> None:
    from ckptstore import TierOptions

    tiers = TierOptions(local_dir=local, durable_every=100, local_keep_last=5)
    state = {"w": torch.full((8,), float(rank + 1))}
    with Checkpointer(root, tiers=tiers) as ck:
        ck.save(1, state).wait()  # durable and local
        state["w"].add_(1)
        ck.save(2, state).wait()  # local only
        if rank == 1:
            state["w"][0] = float("nan")
        h3 = ck.save(3, state)  # local only, NaN on rank 1
        h3.wait()
        ck.wait()
    assert h3.health.status == "unhealthy" and h3.health.worst == ("rank 1 w: 1 NaN, 0 Inf",)
    with Checkpointer(root, tiers=tiers) as ck:
        target = {"w": torch.zeros(8)}
        assert ck.load(target, healthy=True) == 2  # every rank goes back together
        assert torch.equal(target["w"], torch.full((8,), float(rank + 2)))


@pytest.mark.dist
def test_tiers_nan_on_one_rank_sends_every_rank_back_to_the_healthy_local_copy(tmp_path):
    run_ranks(_tiers_one_rank_nan, 2, str(tmp_path / "durable"), str(tmp_path / "local"))


def test_gc_names_a_kept_healthy_step_not_one_removed_while_it_ran(tmp_path, capsys, monkeypatch):
    """Adversary: a gc beside savers' own retention printed "newest healthy step (always
    kept): 1" for a step those savers had removed after gc's first listing (the kept steps
    came from its second). It names the newest healthy step of those it keeps."""
    from ckptstore import retention
    from ckptstore.cli import main

    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
        ck.save(2, {"w": torch.tensor([float("inf"), 1.0])}).wait()
    doomed = retention._doomed
    calls: list[int] = []

    def then_the_savers_go_on(*args, **kwargs):
        found = doomed(*args, **kwargs)
        calls.append(len(calls))
        if len(calls) == 1:  # the gc's own call; the savers' retention runs plainly
            with Checkpointer(tmp_path, keep_last=2) as ck:
                ck.save(3, {"w": torch.full((2,), 3.0)}).wait()
                ck.save(4, {"w": torch.full((2,), 4.0)}).wait()
        return found

    monkeypatch.setattr(retention, "_doomed", then_the_savers_go_on)
    assert main(["gc", str(tmp_path), "--keep-last", "5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list_steps(Store(tmp_path)) == [3, 4] and doc["kept_steps"] == [3, 4]
    assert doc["kept_healthy"] == 4


def test_an_unhealthy_tier_copy_is_named_by_the_rank_that_holds_it():
    """A rank's tier copy is rank 0 of a one-rank step, so its manifest names its bad tensors
    as rank 0's: the verdict over every rank's copy names them as the holder's."""
    sick = RankHealth(nan=2, worst=[{"rank": 0, "tensor": "w", "nan": 2, "inf": 0}])
    well = verdict([RankHealth()])
    copy_of_rank_1 = verdict([sick])  # as rank 1's copy records it
    reason = tiered_verdict(7, [well, copy_of_rank_1], "absent")
    assert reason is not None and "rank 1 w: 2 NaN" in reason, reason
    assert "rank 0" not in reason, reason
