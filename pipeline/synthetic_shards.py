"""Synthetic shard sets in the real on-disk format (pipeline.shard_format), for the loader's tests and benchmark.

    manifest = write_shard_set("tmp/shards", shard_rows=[13, 7, 20], input_length=8, target_length=4)

Row i of the set (in manifest order) carries its own global index in column 0 of both `input_ids` and
`labels`, so a test can tell exactly which examples a batch holds; the other positions are seeded random
token ids (non-special, non-sentinel) ending in `</s>`. No tokenizer, corpus or Ray is involved: the
manifest's tokenizer section describes a T5-layout vocabulary of `vocab_size` ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.common import sha256_file, sha256_json
from pipeline.shard_format import DATA_DIR, FORMAT_VERSION, shard_name, write_manifest, write_shard

EOS_ID = 1
NUM_SENTINELS = 100


def synthetic_rows(first_row: int, rows: int, input_length: int, target_length: int, vocab_size: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """[rows, input_length] and [rows, target_length] int32; column 0 = global row index, last = </s>."""
    high = vocab_size - NUM_SENTINELS
    input_ids = rng.integers(3, high, size=(rows, input_length), dtype=np.int32)
    labels = rng.integers(3, high, size=(rows, target_length), dtype=np.int32)
    row_ids = np.arange(first_row, first_row + rows, dtype=np.int32)
    input_ids[:, 0] = row_ids
    labels[:, 0] = row_ids
    input_ids[:, -1] = EOS_ID
    labels[:, -1] = EOS_ID
    return input_ids, labels


def write_shard_set(out_dir: str | Path, *, shard_rows: list[int], input_length: int = 8, target_length: int = 4,
                    seed: int = 0, vocab_size: int = 32128, tokenizer_sha256: str = "0" * 64,
                    batches_per_shard: int = 1) -> dict:
    """Write data/*.arrow and manifest.json (last) under `out_dir`; returns the manifest.

    `batches_per_shard` > 1 writes each shard as several record batches in one stream (a layout any Arrow
    writer may produce), which the loader must index just as well.
    """
    out_dir = Path(out_dir)
    (out_dir / DATA_DIR).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards, first_row = [], 0
    for part, rows in enumerate(shard_rows):
        input_ids, labels = synthetic_rows(first_row, rows, input_length, target_length, vocab_size, rng)
        rel = shard_name(0, part)
        path = out_dir / rel
        tmp = path.with_name(path.name + ".tmp")
        write_shard(tmp, input_ids, labels, record_batches=batches_per_shard)
        tmp.replace(path)
        shards.append({"path": rel, "rows": rows, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
        first_row += rows
    config = {"input_length": input_length, "target_length": target_length, "raw_length": None,
              "noise_density": 0.15, "mean_noise_span_length": 3.0, "seed": seed,
              "shard_rows": max(shard_rows), "text_field": "text", "max_doc_chars": None, "synthetic": True}
    tokenizer = {"path": "synthetic", "sha256": tokenizer_sha256, "vocab_size": vocab_size, "pad_id": 0,
                 "eos_id": EOS_ID, "unk_id": 2, "sentinel_first_id": vocab_size - 1,
                 "sentinel_last_id": vocab_size - NUM_SENTINELS, "num_sentinels": NUM_SENTINELS}
    manifest = {
        "format_version": FORMAT_VERSION, "tool_version": "0.1.0", "config": config, "tokenizer": tokenizer,
        "inputs": [],
        "shards": shards,
        "totals": {"documents": 0, "tokens": 0, "examples": first_row, "dropped_tail_tokens": 0,
                   "shards": len(shards), "bytes": sum(s["bytes"] for s in shards)},
        "rejected": {},
        "fingerprint": sha256_json({"config": config, "tokenizer": tokenizer_sha256, "inputs": []}),
    }
    write_manifest(out_dir, manifest)
    return manifest
