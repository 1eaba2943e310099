"""Loader benchmark: make_loader vs `datasets.Dataset.from_file` + a plain torch DataLoader on the same shards.

    .venv/bin/python scripts/bench_loader.py --size-gib 1 --micro-batch 32 --workers 0 2

Writes (or reuses) a synthetic shard set of about --size-gib in the real format under .bench/ (git-ignored),
then, in this one run: time-to-first-batch of make_loader (ShardDataset open -> first micro-batch; in this
process and in a fresh interpreter, where the imports are reported apart), and
samples/s and tokens/s of both paths at the same micro-batch size, worker count and random order, after a
few warm-up batches, both paths alternated --repeats times (medians). make_loader runs at each
--global-batch (it only sets the order; its tasks fetch about 4 MiB of micro-batches each); the HF path has
no global batch (a plain DataLoader of micro-batches). The shards are in the page cache for both paths
(just written or read), so this measures the loaders' own cost, not the disk.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.synthetic_shards import write_shard_set
from pretrain.data.dataset import ShardDataset
from pretrain.data.loader import make_loader

REPO_ROOT = Path(__file__).resolve().parents[1]

SHARD_BYTES = 64 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO_ROOT / ".bench"), help="folder for the shard set (.bench)")
    parser.add_argument("--size-gib", type=float, default=1.0, help="shard-set size in GiB (default 1)")
    parser.add_argument("--input-length", type=int, default=512)
    parser.add_argument("--target-length", type=int, default=114)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--global-batch", type=int, nargs="+", default=[256, 32],
                        help="global batch sizes for make_loader (world size 1; micro-batches per step = G/M)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader workers to compare")
    parser.add_argument("--batches", type=int, default=300, help="timed micro-batches per measurement")
    parser.add_argument("--warmup", type=int, default=10, help="untimed micro-batches first")
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating repetitions of both paths per row; the table shows medians")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def ensure_shard_set(args) -> Path:
    row_bytes = 4 * (args.input_length + args.target_length)
    rows_per_shard = max(1, SHARD_BYTES // row_bytes)
    total_rows = int(args.size_gib * (1 << 30)) // row_bytes
    shard_rows = [rows_per_shard] * (total_rows // rows_per_shard) + ([total_rows % rows_per_shard]
                                                                      if total_rows % rows_per_shard else [])
    out = Path(args.out) / f"shards-{args.size_gib:g}gib-{args.input_length}-{args.target_length}"
    if (out / "manifest.json").is_file():
        print(f"reusing {out}", file=sys.stderr)
        return out
    print(f"writing {out}: {total_rows} rows in {len(shard_rows)} shards ...", file=sys.stderr)
    start = time.perf_counter()
    write_shard_set(out, shard_rows=shard_rows, input_length=args.input_length, target_length=args.target_length,
                    seed=args.seed)
    print(f"  written in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out


def time_batches(batches, warmup: int, count: int) -> float:
    """Seconds to draw `count` batches after `warmup` untimed ones; the batches are touched (summed)."""
    iterator = iter(batches)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    checksum = 0
    for _ in range(count):
        batch = next(iterator)
        checksum += int(batch["input_ids"][:, 0].sum()) + int(batch["labels"][:, 0].sum())
    return time.perf_counter() - start


FRESH_PROCESS = """
import json, sys, time
started = time.perf_counter()
from pretrain.data.dataset import ShardDataset
from pretrain.data.loader import make_loader
imported = time.perf_counter()
shard_dir, micro, batch, workers = sys.argv[1], *map(int, sys.argv[2:5])
loader = make_loader(ShardDataset(shard_dir), micro_batch_size=micro, global_batch_size=batch, seed=0,
                     num_workers=workers)
next(iter(loader))
print(json.dumps({"imports_s": imported - started, "first_batch_s": time.perf_counter() - imported}))
loader.close()
"""


def fresh_process_first_batch(shard_dir: Path, args, workers: int, global_batch: int) -> dict:
    """Time to first batch in a new interpreter: imports, then ShardDataset open -> first micro-batch."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(shard_dir), str(args.micro_batch),
                          str(global_batch), str(workers)], check=True, capture_output=True, text=True,
                         cwd=REPO_ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_to_first_batch(shard_dir: Path, args, workers: int, global_batch: int) -> float:
    start = time.perf_counter()
    dataset = ShardDataset(shard_dir)
    loader = make_loader(dataset, micro_batch_size=args.micro_batch, global_batch_size=global_batch,
                         seed=args.seed, num_workers=workers)
    next(iter(loader))
    elapsed = time.perf_counter() - start
    loader.close()
    return elapsed


def ours(shard_dir: Path, args, workers: int, global_batch: int):
    dataset = ShardDataset(shard_dir)
    return make_loader(dataset, micro_batch_size=args.micro_batch, global_batch_size=global_batch,
                       seed=args.seed, num_workers=workers)


def huggingface(shard_dir: Path, args, workers: int, global_batch: int):
    import datasets

    parts = [datasets.Dataset.from_file(str(p)) for p in sorted((shard_dir / "data").glob("*.arrow"))]
    hf = datasets.concatenate_datasets(parts).with_format("torch")
    return torch.utils.data.DataLoader(hf, batch_size=args.micro_batch, shuffle=True, drop_last=True,
                                       num_workers=workers, persistent_workers=workers > 0,
                                       generator=torch.Generator().manual_seed(args.seed))


def main() -> int:
    args = parse_args()
    shard_dir = ensure_shard_set(args)
    size_gib = sum(p.stat().st_size for p in (shard_dir / "data").glob("*.arrow")) / (1 << 30)
    tokens_per_sample = args.input_length + args.target_length
    print(f"shard set {shard_dir} ({size_gib:.2f} GiB), micro-batch {args.micro_batch}, {args.batches} timed "
          f"batches x {args.repeats} repeats, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
          file=sys.stderr)

    rows = []
    for workers in args.workers:
        for global_batch in args.global_batch:
            ttfb = time_to_first_batch(shard_dir, args, workers, global_batch)
            seconds = {"make_loader": [], "hf_from_file": []}
            for _ in range(args.repeats):  # alternate the two paths so load from other jobs hits both alike
                for name, build in (("make_loader", ours), ("hf_from_file", huggingface)):
                    loader = build(shard_dir, args, workers, global_batch)
                    seconds[name].append(time_batches(loader, args.warmup, args.batches))
                    if hasattr(loader, "close"):
                        loader.close()
                    del loader
            seconds = {name: float(np.median(times)) for name, times in seconds.items()}
            samples = args.batches * args.micro_batch
            ours_sps, hf_sps = samples / seconds["make_loader"], samples / seconds["hf_from_file"]
            rows.append((workers, global_batch, ours_sps, ours_sps * tokens_per_sample, hf_sps,
                         hf_sps * tokens_per_sample, ours_sps / hf_sps, ttfb))
            print(f"  workers={workers} global_batch={global_batch}: {ours_sps:,.0f} vs {hf_sps:,.0f} samples/s",
                  file=sys.stderr)

    print(f"\n| workers | global batch (ours) | make_loader samples/s | make_loader tokens/s | "
          f"HF from_file samples/s | HF tokens/s | ratio | time to first batch ({size_gib:.2f} GiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for workers, global_batch, o_sps, o_tps, h_sps, h_tps, ratio, ttfb in rows:
        print(f"| {workers} | {global_batch} | {o_sps:,.0f} | {o_tps:,.0f} | {h_sps:,.0f} | {h_tps:,.0f} | "
              f"{ratio:.1f}x | {ttfb * 1000:.0f} ms |")
    worst = min(r[6] for r in rows)
    fresh = {workers: fresh_process_first_batch(shard_dir, args, workers, args.global_batch[0])
             for workers in args.workers}
    print(f"\nfresh process, global batch {args.global_batch[0]}: " + "; ".join(
        f"workers={w}: imports {f['imports_s'] * 1000:.0f} ms + first batch {f['first_batch_s'] * 1000:.0f} ms"
        for w, f in fresh.items()))
    slowest_start = max([r[7] for r in rows] + [f["first_batch_s"] for f in fresh.values()])
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"summary: make_loader is {worst:.1f}x the HF path at worst (goal >= 2x: "
          f"{'met' if worst >= 2 else 'NOT met'}); time to first batch {slowest_start * 1000:.0f} ms at worst "
          f"(goal < 1 s: {'met' if slowest_start < 1 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
