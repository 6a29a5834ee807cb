"""ckptstore.export: committed steps as Hugging Face safetensors, loaded back with the
``safetensors`` library and compared bit for bit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

from ckptstore import Checkpointer, EncodingOptions
from ckptstore.catalog import load_manifest, load_rank_index
from ckptstore.dcp import StoreWriter
from ckptstore.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    UnsupportedStateError,
)
from ckptstore.export import export_safetensors, parse_size
from ckptstore.format import chunk_key
from ckptstore.store import Store
from tests.helpers.dist import run_ranks

MiB = 2**20


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(40, 16, generator=g).to(torch.bfloat16),
            "layers": [
                {"weight": torch.randn(16, 16, generator=g), "bias": torch.randn(16, generator=g)},
                {"weight": torch.randn(16, 16, generator=g), "bias": torch.randn(16, generator=g)},
            ],
            "position_ids": torch.arange(40, dtype=torch.int64),
        },
        "optim": {"exp_avg": torch.randn(16, 16, generator=g), "lr": 1e-3},
        "step": 12,
        "run": "demo",
    }


def _flat(state: dict) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` by dotted path, as the export names them."""
    out = {}

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, str(i)))
        elif isinstance(node, torch.Tensor):
            out[".".join(path)] = node

    walk(state, ())
    return out


def _save(uri: str, state: dict, step: int = 5, **kwargs) -> None:
    with Checkpointer(uri, **kwargs) as ckpt:
        ckpt.save(step, state).wait()


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def _load_sharded(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded export, each read from the file its index names."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / name), framework="pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == name
                loaded[key] = f.get_tensor(key)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in loaded.values()
    )
    return loaded


def test_checkpointer_step_exports_every_tensor_bit_for_bit(tmp_path):
    state = _state()
    _save(str(tmp_path / "store"), state)
    result = export_safetensors(str(tmp_path / "store"), tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    assert result.files == ["model.safetensors"] and result.index_file is None
    assert result.step == 5 and result.kind == "state"
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    _assert_bitwise(loaded, _flat(state))
    assert {"model.embed.weight", "model.layers.1.bias", "model.position_ids"} <= set(loaded)
    assert sorted(result.skipped) == ["optim.lr", "run", "step"]
    assert result.total_bytes == sum(t.numel() * t.element_size() for t in loaded.values())
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers checks


def test_small_max_shard_size_writes_an_index_and_numbered_shards(tmp_path):
    state = _state()
    _save(str(tmp_path / "store"), state, encoding=EncodingOptions(chunk_bytes=4096))
    out = tmp_path / "out"
    result = export_safetensors(str(tmp_path / "store"), out, max_shard_size=1500)
    names = sorted(os.listdir(out))
    n = len(result.files)
    assert n > 3
    assert names == sorted([*result.files, "model.safetensors.index.json"])
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{n:05d}\.safetensors", f) for f in result.files)
    loaded = _load_sharded(out)
    _assert_bitwise(loaded, _flat(state))
    for name in result.files:  # a shard over the limit holds a single larger tensor
        with safe_open(str(out / name), framework="pt") as f:
            keys = list(f.keys())
            size = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys)
        assert size <= 1500 or len(keys) == 1, name


def test_only_keeps_a_prefix_and_strips_it_unless_told_otherwise(tmp_path):
    state = _state()
    store = str(tmp_path / "store")
    _save(store, state)
    export_safetensors(store, tmp_path / "a", only="model.")
    loaded = load_file(str(tmp_path / "a" / "model.safetensors"))
    want = {k.removeprefix("model."): v for k, v in _flat(state).items() if k.startswith("model.")}
    _assert_bitwise(loaded, want)

    result = export_safetensors(store, tmp_path / "b", only="model.layers.", strip_prefix="")
    loaded = load_file(str(tmp_path / "b" / "model.safetensors"))
    _assert_bitwise(loaded, {k: v for k, v in _flat(state).items() if k.startswith("model.layers")})
    assert result.skipped == []

    with pytest.raises(ValueError, match="no tensor of step 5 .* matches only='decoder.'"):
        export_safetensors(store, tmp_path / "c", only="decoder.")
    assert not (tmp_path / "c").exists()


def test_dtype_casts_floating_point_tensors_only(tmp_path):
    state = _state()
    _save(str(tmp_path / "store"), state)
    result = export_safetensors(str(tmp_path / "store"), tmp_path / "out", dtype="bfloat16")
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _flat(state).items()
    }
    _assert_bitwise(loaded, want)
    assert loaded["model.position_ids"].dtype == torch.int64
    assert result.total_bytes == sum(t.numel() * t.element_size() for t in want.values())
    with pytest.raises(ValueError, match="bad dtype 'int8'"):
        export_safetensors(str(tmp_path / "store"), tmp_path / "x", dtype="int8")


def test_complex64_and_the_fnuz_float8_kinds_export_as_safetensors_names_them(tmp_path):
    """safetensors stores C64 (a rotary embedding's freqs_cis) and the fnuz float8 kinds:
    exported bit for bit, read back by the safetensors package."""
    g = torch.Generator().manual_seed(3)
    state = {
        "freqs_cis": torch.polar(torch.ones(4, 3), torch.rand(4, 3, generator=g)),
        "e4": torch.randn(5, generator=g).to(torch.float8_e4m3fnuz),
        "e5": torch.randn(5, generator=g).to(torch.float8_e5m2fnuz),
    }
    store = str(tmp_path / "store")
    _save(store, state)
    export_safetensors(store, tmp_path / "out")
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(loaded) == sorted(state)
    for name, want in state.items():
        got = loaded[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def test_refusals_are_one_clear_line(tmp_path):
    store = str(tmp_path / "store")
    _save(store, {"w": torch.ones(3), "z": torch.ones(2, dtype=torch.complex128)})
    with pytest.raises(UnsupportedStateError, match="'z' has dtype complex128") as info:
        export_safetensors(store, tmp_path / "a")
    assert "\n" not in str(info.value)
    export_safetensors(store, tmp_path / "a", only="w", strip_prefix="")  # leaving it out works
    with pytest.raises(CheckpointNotFoundError, match="step 9 is not committed"):
        export_safetensors(store, tmp_path / "b", step=9)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        export_safetensors(str(tmp_path / "empty"), tmp_path / "b")
    with pytest.raises(ValueError, match="bad max_shard_size '5 parsecs'"):
        export_safetensors(store, tmp_path / "b", max_shard_size="5 parsecs")
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * MiB
    # Adversary of stop 79: "tensors 'a.b' and 'a.b' both export as 'a.b'", a usage error
    dotted = str(tmp_path / "dotted")
    _save(dotted, {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}})
    with pytest.raises(UnsupportedStateError, match="two tensors of the step are named 'a.b'"):
        export_safetensors(dotted, tmp_path / "c")
    # Reviewer (exact resume): a tensor named __metadata__ made a file no reader opens
    meta = str(tmp_path / "meta")
    _save(meta, {"__metadata__": torch.ones(2), "w": torch.ones(1)})
    with pytest.raises(UnsupportedStateError, match="'__metadata__' would export as '__meta"):
        export_safetensors(meta, tmp_path / "e")
    assert not (tmp_path / "e").exists() or not any((tmp_path / "e").iterdir())
    with pytest.raises(ValueError, match="tensors 'model.w' and 'w' both export as 'w'"):
        _save(str(tmp_path / "s2"), {"model": {"w": torch.ones(1)}, "w": torch.ones(1)})
        export_safetensors(str(tmp_path / "s2"), tmp_path / "d", strip_prefix="model.")


def test_non_empty_out_dir_is_refused_unless_overwrite(tmp_path):
    store = str(tmp_path / "store")
    state = _state()
    _save(store, state)
    out = tmp_path / "out"
    export_safetensors(store, out, max_shard_size=2000)
    before = sorted(os.listdir(out))
    with pytest.raises(ValueError, match="is not empty"):
        export_safetensors(store, out)
    assert sorted(os.listdir(out)) == before
    (out / "README.md").write_text("mine")
    export_safetensors(store, out, overwrite=True)  # one file now: the old shards go
    assert sorted(os.listdir(out)) == ["README.md", "model.safetensors"]
    _assert_bitwise(load_file(str(out / "model.safetensors")), _flat(state))


@pytest.mark.parametrize("where", [".", "store", "store/hf"])
def test_an_export_into_or_over_its_store_leaves_the_store_as_it_was(tmp_path, where):
    """Allowed in the API (torchtitan exports to ``<folder>/hf/step-N``): with ``overwrite``
    it writes and removes only model files, never a byte of the store."""
    store = tmp_path / "store"
    state = _state()
    _save(str(store), state)
    before = {p.relative_to(store): p.read_bytes() for p in store.rglob("*") if p.is_file()}
    out = tmp_path / where
    export_safetensors(str(store), out, overwrite=True)
    after = {p.relative_to(store): p.read_bytes() for p in store.rglob("*") if p.is_file()}
    assert {k: v for k, v in after.items() if k in before} == before
    _assert_bitwise(load_file(str(out / "model.safetensors")), _flat(state))


def test_a_corrupt_chunk_fails_and_leaves_no_file(tmp_path):
    store_uri = str(tmp_path / "store")
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(4096, generator=g) for i in range(6)}
    _save(store_uri, state, encoding=EncodingOptions(chunk_bytes=16384, compression=None))
    store = Store(store_uri)
    index = load_rank_index(store, load_manifest(store, 5), 0)
    last = index.tensors[-1].segments[-1].chunk  # read last: earlier shards are complete by then
    path = Path(store.path(chunk_key(last)))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(CheckpointCorruptError, match=last):
        export_safetensors(store_uri, out, max_shard_size=20000)
    assert os.listdir(out) == []  # neither final files nor temporaries


# -- DCP, 4 gloo ranks ---------------------------------------------------------------------------


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "rows": torch.randn(7, 6, generator=g),  # 7 rows over 4 ranks: uneven shards
        "cols": torch.randn(5, 10, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-1000, 1000, (9,), generator=g),
    }


def _dcp_save_worker(rank: int, world: int, uri: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dims = {"rows": 0, "cols": 1, "ids": 0}
    state = {
        "model": {k: distribute_tensor(v, mesh, [Shard(dims[k])]) for k, v in _full().items()},
        "replicated": torch.arange(5.0),
        "rank_count": world,
    }
    dcp.save(state, storage_writer=StoreWriter(uri, encoding=EncodingOptions(chunk_bytes=4096)))


@pytest.mark.dist
def test_dcp_step_of_four_ranks_exports_full_tensors(tmp_path):
    uri = str(tmp_path / "store")
    run_ranks(_dcp_save_worker, 4, uri)
    store = Store(uri)
    manifest = load_manifest(store, 0)
    assert manifest.world_size == 4 and len(manifest.ranks) == 4  # the shards are spread out
    result = export_safetensors(uri, tmp_path / "out")
    assert result.kind == "dcp" and result.skipped == ["rank_count"]
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = {f"model.{k}": v for k, v in _full().items()}
    _assert_bitwise(loaded, {**want, "replicated": torch.arange(5.0)})

    export_safetensors(uri, tmp_path / "sharded", only="model.", max_shard_size=100, dtype="fp16")
    loaded = _load_sharded(tmp_path / "sharded")
    want = {k: v.half() if v.is_floating_point() else v for k, v in _full().items()}
    _assert_bitwise(loaded, want)


# -- memory --------------------------------------------------------------------------------------

_MEASURE = """
import json, sys
from ckptstore.export import export_safetensors
from ckptstore.pipeline import release_free_memory

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

release_free_memory()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark starts again from the current RSS
before = status("VmRSS")
export_safetensors(sys.argv[1], sys.argv[2], max_shard_size=int(sys.argv[3]))
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_export_memory_is_bounded_by_a_shard_not_the_state(tmp_path):
    state_bytes = 160 * MiB
    max_shard = 8 * MiB
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i:02d}.weight": torch.randn(MiB, generator=g) for i in range(40)}
    assert sum(t.numel() * t.element_size() for t in state.values()) == state_bytes
    store = str(tmp_path / "store")
    _save(store, state, encoding=EncodingOptions(chunk_bytes=MiB, compression=None))
    del state
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, store, str(out), str(max_shard)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = measured["peak"] - measured["before"]
    assert len(os.listdir(out)) == state_bytes // max_shard + 1  # shards + index
    # A load-everything export grows by the whole state (160 MiB) at least.
    assert grew < 3 * max_shard + 24 * MiB, f"peak RSS grew by {grew / MiB:.0f} MiB"
    assert grew < state_bytes / 4


def test_the_restore_command_exports_safetensors(tmp_path, capsys):
    from ckptstore.cli import main

    g = torch.Generator().manual_seed(5)
    state = {
        "model": {"emb": torch.randn(300, 16, generator=g), "head": torch.randn(16, 4)},
        "optim": {"lr": 0.1, "m": torch.zeros(8)},
    }
    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri) as ckpt:
        ckpt.save(3, state).wait()
    out = tmp_path / "hf"
    argv = ["restore", uri, "--to", str(out), "--format", "safetensors", "--only", "model."]
    assert main([*argv, "--dtype", "bfloat16", "--max-shard-size", "4KB"]) == 0
    printed = capsys.readouterr().out
    assert "exported step 3 (state, 2 tensors" in printed
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for name, file in index["weight_map"].items():
        with safe_open(str(out / file), "pt") as f:
            got[name] = f.get_tensor(name)
    assert set(got) == {"emb", "head"}
    for name in got:
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], state["model"][name].to(torch.bfloat16))
    # a second export into the same directory is refused in the command's own words
    assert main(argv) == 2
    assert "pass --force" in capsys.readouterr().err


def test_only_matches_whole_name_segments(tmp_path):
    """``only="model"`` covers ``model.*`` and strips ``model.``; ``model_ema`` is not under it
    (it was exported as ``_ema.w``, and every name began with ``.``)."""
    state = {"model": {"w": torch.ones(2)}, "model_ema": {"w": torch.zeros(2)}}
    store = str(tmp_path / "store")
    _save(store, state)
    export_safetensors(store, tmp_path / "a", only="model")
    assert set(load_file(str(tmp_path / "a" / "model.safetensors"))) == {"w"}
    export_safetensors(store, tmp_path / "b", only="model_ema", strip_prefix="")
    assert set(load_file(str(tmp_path / "b" / "model.safetensors"))) == {"model_ema.w"}
