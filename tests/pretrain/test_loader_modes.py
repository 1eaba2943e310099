"""`pretrain --loader online`, for real: 2 gloo ranks of t5-tiny read text tokenised in their loader workers, the
host accounting lands in every step record and summary.json, and a stopped run resumes exactly (per-rank states).

    .venv/bin/python -m pytest tests/pretrain/test_loader_modes.py -q        # slow: ~2 min on 2 cores (3 launches)
"""

from __future__ import annotations

import json

import pytest

from launching import ok, pretrain
from pretrain.hostcpu import HOST_KEYS
from pretrain.metrics import read_metrics

ONLINE = ["--model", "t5-tiny", "--steps", "4", "--micro-batch", "4", "--global-batch", "16", "--lr", "3e-3",
          "--seed", "0", "--steady-skip", "1", "--zero", "2", "--nproc", "2", "--loader", "online",
          "--loader-workers", "1"]


@pytest.mark.slow     # three launches of 2 ranks: ~2 min on the shared 2-core machine
def test_online_mode_trains_accounts_host_cpu_and_resumes_exactly(tiny_shards, sample_corpus, tiny_tokenizer,
                                                                   tmp_path):
    whole = tmp_path / "whole"
    ok(pretrain(*ONLINE, "--data", str(tiny_shards), "--out", str(whole)))
    records = read_metrics(whole / "metrics.jsonl")
    assert len(records) == 4 and all(r["loader"] == "online" for r in records)
    assert all(set(HOST_KEYS) <= set(r) for r in records)
    assert all(r["cpu_rank_s"] > 0 and r["loader_rss_gib"] > 0 for r in records)
    assert sum(r["cpu_loader_workers_s"] for r in records) > 0         # tokenising happened in the worker
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["loader"] == "online" and summary["time_to_first_batch_s"] > 0
    assert {"loader_cores", "loader_busy_share", "cpu_optimizer_s"} <= set(summary["median"])

    # the corpus files with the shard set's settings are the same source: the same batches, stopped and resumed
    split = tmp_path / "split"
    files = ["--data", str(sample_corpus), "--tokenizer", str(tiny_tokenizer), "--input-length", "128",
             "--unit-bytes", "100000", "--out", str(split)]
    ok(pretrain(*ONLINE, *files, "--stop-after", "2", "--loader-workers", "0"))
    ok(pretrain(*ONLINE, *files, "--resume"))
    resumed = read_metrics(split / "metrics.jsonl")
    assert [r["batch_checksum"] for r in resumed] == [r["batch_checksum"] for r in records]
    assert [round(r["loss"], 5) for r in resumed] == [round(r["loss"], 5) for r in records]
