"""A small GPT trained on CPU that reads its tokens through ``loaders`` and checkpoints with
ckptstore, resuming model and data order exactly.

    python examples/train_gpt.py                         # trains, checkpoints to ./runs/gpt
    python examples/train_gpt.py --crash-at 130          # dies (SIGKILL) at step 130
    python examples/train_gpt.py                         # resumes from the latest healthy
                                                         # commit (an older one if it is
                                                         # corrupt, or holds NaN/Inf)
    python examples/train_gpt.py --nan-at 140            # a NaN blows the model up at 140:
                                                         # saves after it are unhealthy
    python examples/train_gpt.py --data runs/data/a --data runs/data/b   # two replicas
    python examples/train_gpt.py --local-dir /dev/shm/gpt --durable-every 4   # tiers: every
        # save to the node-local directory first, every 4th also to --ckpt in the background;
        # a rerun resumes from the newest save any tier holds (printing which tier)

On first use the toy corpus is written as llm.c-style token files (``loaders.TokenWriter``) to
every ``--data`` replica that lacks it; the job reads them with ``ShardDataset`` (shuffled,
hedged across replicas) through a ``StatefulLoader`` with worker processes. Every step prints
``step N loss L (...) data H``: the loss as an exact hex float and a hash of the batch's tokens, so
two runs can be compared bit for bit, data order included. The checkpoint holds the model, the
optimizer, every RNG, the loader's position and the step.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ckptstore import Checkpointer, PreemptionOptions, RNGState, TierOptions
from ckptstore.store import Store
from loaders import LoaderConfig, ShardDataset, StatefulLoader, TokenFiles, TokenWriter

MANIFEST = "manifest.txt"


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab: int,
        block: int,
        dim: int = 96,
        layers: int = 3,
        heads: int = 4,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        # Derived, not state: left out of the checkpoint (its -inf would read as unhealthy).
        mask = torch.triu(torch.full((block, block), -math.inf), 1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for blk in self.blocks:
            x = blk(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def corpus(n_chars: int = 200_000) -> np.ndarray:
    """A deterministic toy corpus: sentences from a tiny grammar (no download needed)."""
    rng = random.Random(0)
    nouns = ["cat", "model", "rank", "shard", "chunk", "step", "store", "loss", "node", "bucket"]
    verbs = ["saves", "loads", "hashes", "writes", "reads", "hedges", "verifies", "commits"]
    words = []
    while sum(map(len, words)) < n_chars:
        words += ["the", rng.choice(nouns), rng.choice(verbs), "a", rng.choice(nouns) + "."]
    return np.frombuffer(" ".join(words).encode()[:n_chars], np.uint8)


def prepare_data(replicas: list[str]) -> None:
    """Write the corpus as token files (byte-level tokens, llm.c header) to every replica that
    has no complete copy (its manifest is written last)."""
    missing = [uri for uri in replicas if not Store(uri).exists(MANIFEST)]
    if not missing:
        return
    try:
        with TokenWriter(missing, dtype="uint16", header="llmc", file_tokens=2**15) as writer:
            writer.write(corpus())
    except FileExistsError as exc:
        raise SystemExit(
            f"{exc}: a replica holds token files without their {MANIFEST} (a first run was "
            "killed while writing them?); delete them and run again"
        ) from exc
    print(
        f"wrote {writer.num_tokens} tokens in {len(writer.shards)} files to {', '.join(missing)}",
        flush=True,
    )


def make_loader(args: argparse.Namespace) -> StatefulLoader:
    """Samples of block + 1 tokens (inputs and shifted targets), shuffled by the loader."""
    dataset = ShardDataset(
        args.data,
        TokenFiles(
            dtype="uint16",
            sample_tokens=args.block + 1,
            manifest=MANIFEST,
            header="llmc",
            read_bytes=16 * 1024,
        ),
        config=LoaderConfig(seed=args.seed, shuffle_block_units=4),
        rank=0,
        world_size=1,
    )
    return StatefulLoader(
        dataset,
        batch_size=args.batch,
        num_workers=args.workers,
        drop_last=True,  # every step sees a full batch; an epoch's last partial one is skipped
        # Worker seeds come from this generator, not the global RNG that dropout draws from.
        generator=torch.Generator(),
    )


def endless(loader: StatefulLoader):
    """The loader's batches, epoch after epoch (it moves to the next epoch by itself)."""
    while True:
        yield from loader


def resume(ckpt: Checkpointer, state: dict, args: argparse.Namespace) -> int | None:
    """Load the newest healthy checkpoint into ``state`` and say where from; None when there
    is none.

    A newer step whose numbers hold NaN or Inf (or whose health is unknown) is skipped, named
    in a warning; so is a step that is corrupt or misses chunks, for the newest healthy one
    that loads. With tiers ``ckpt.latest()`` takes every tier: the newest save may be in the
    local directory alone.
    """
    if ckpt.latest() is None:
        return None
    step = ckpt.load(state, fallback=True, healthy=True)
    if args.local_dir is None:
        print(f"resumed from step {step} ({args.ckpt})", flush=True)
        return step
    report = ckpt.last_load
    read = ", ".join(
        f"{s.bytes / 1e6:.2f} MB in {s.seconds:.3f}s from {tier}"
        for tier, s in report.sources.items()
    )
    where = args.local_dir if report.source == "local" else args.ckpt
    print(
        f"resumed from step {step} (source {report.source}: {where}; read {read}; durable steps "
        f"{ckpt.steps()})",
        flush=True,
    )
    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ckpt", default="runs/gpt", help="checkpoint URI (path, s3://..., memory://)")
    p.add_argument("--steps", type=int, default=200, help="train until this step")
    p.add_argument("--every", type=int, default=25, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--crash-at", type=int, default=None, help="SIGKILL this process at step N")
    p.add_argument(
        "--nan-at",
        type=int,
        default=None,
        help="write a NaN into the model after step N's update (a blow-up, or silent data "
        "corruption): the saves after it are unhealthy, and a rerun resumes from before it",
    )
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--data",
        action="append",
        help="a replica of the token files (path or s3://...); repeat for more replicas "
        "(default: runs/data/corpus)",
    )
    p.add_argument("--workers", type=int, default=2, help="loader worker processes")
    p.add_argument(
        "--local-dir",
        help="tiers: commit every save to this node-local directory first (a RAM disk such as "
        "/dev/shm/... or an NVMe path), drain some to --ckpt in the background, and resume from "
        "the newest save any tier holds",
    )
    p.add_argument(
        "--durable-every",
        type=int,
        default=1,
        help="with --local-dir: also commit the first save and every Nth after it to --ckpt "
        "(default 1: every save)",
    )
    p.add_argument(
        "--peer-copies",
        type=int,
        default=0,
        help="with --local-dir: copy each save to K other nodes' local dirs; needs a "
        "torch.distributed job on K+1 nodes, and this example trains in one process, so only 0 "
        "is accepted here (peers: tests/tiers/test_tiers.py)",
    )
    args = p.parse_args(argv)
    args.data = args.data or ["runs/data/corpus"]
    if args.local_dir is None and (args.durable_every != 1 or args.peer_copies):
        p.error("--durable-every and --peer-copies need --local-dir")
    if args.durable_every < 1:
        p.error(f"--durable-every must be >= 1, got {args.durable_every}")
    if args.peer_copies < 0:
        p.error(f"--peer-copies must be >= 0, got {args.peer_copies}")
    if args.peer_copies and not (dist.is_available() and dist.is_initialized()):
        p.error(
            f"--peer-copies {args.peer_copies} needs torch.distributed on "
            f"{args.peer_copies + 1}+ nodes; this example trains in one process (use 0)"
        )

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(1)  # bit-exact across runs regardless of the machine's core count
    torch.use_deterministic_algorithms(True)

    model = GPT(vocab=256, block=args.block)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    prepare_data(args.data)
    loader = make_loader(args)
    progress = {"step": 0}
    state = {
        "model": model,
        "optim": opt,
        "loader": loader,
        "progress": progress,
        "rng": RNGState(),  # Python, numpy, torch (and CUDA) generators, read at each save
    }

    # On SIGTERM (a scheduler's notice before the kill) ckpt.preempted turns true: the loop
    # saves its step and leaves; pending saves are committed before the process exits (143).
    tiers = TierOptions(
        local_dir=args.local_dir, durable_every=args.durable_every, peer_copies=args.peer_copies
    )
    preemption = PreemptionOptions(handle_sigterm=True)
    ckpt = Checkpointer(args.ckpt, keep_last=args.keep_last, tiers=tiers, preemption=preemption)
    unloadable: list[int] = []
    step = resume(ckpt, state, args)
    if step is not None:
        # Steps are write-once: the ones skipped stay committed and are not saved again.
        unloadable = [s for s in ckpt.steps() if s > step]
        if unloadable:
            print(
                f"steps {unloadable} were not resumed from (unhealthy or damaged) and will not "
                "be saved again",
                flush=True,
            )
    start = time.perf_counter()
    model.train()
    batches = endless(loader)  # after the load: it starts at the loader's restored position
    while progress["step"] < args.steps:
        tokens = next(batches)["tokens"].long()
        x, y = tokens[:, :-1], tokens[:, 1:]
        digest = hashlib.sha1(tokens.numpy().tobytes()).hexdigest()[:12]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        progress["step"] += 1
        step = progress["step"]
        if args.nan_at is not None and step == args.nan_at:
            with torch.no_grad():
                model.ln.weight[0] = float("nan")  # every position goes through it
        print(f"step {step} loss {loss.item().hex()} ({loss.item():.4f}) data {digest}", flush=True)
        if args.crash_at is not None and step == args.crash_at:
            print(f"crashing at step {step} (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        preempted = ckpt.preempted
        last = step == args.steps
        if last:
            ckpt.durable_next()  # the run's result: not left in the local tiers alone
        if (step % args.every == 0 or preempted or last) and step not in unloadable:
            ckpt.save(step, state)  # returns once staged; persists in the background
        if preempted:
            print(f"preempted (SIGTERM) at step {step}: leaving", flush=True)
            break
    ckpt.close()  # waits for the saves, and for their drains to --ckpt with tiers
    committed = "durable steps" if args.local_dir is not None else "committed steps"
    print(
        f"done: {progress['step']} steps in {time.perf_counter() - start:.1f}s, {committed} "
        f"{ckpt.steps()}",
        flush=True,
    )
    m = loader.metrics()
    reads, waited = m["reads"], m["consumer"]
    print(
        f"loader: {reads['reads']} reads in {m['workers']} workers (p50 "
        f"{reads['p50_s'] * 1e3:.2f} ms, p99 {reads['p99_s'] * 1e3:.2f} ms, {reads['hedges']} "
        f"hedged, {reads['failovers']} failed over); the loop waited {waited['wait_s']:.2f}s "
        f"for {waited['batches']} batches",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
