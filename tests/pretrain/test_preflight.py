"""Preflight refusals happen before any rank is spawned: shard set vs model (tokenizer, vocab, lengths), memory.

    .venv/bin/python -m pytest tests/pretrain/test_preflight.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.common import REPO_ROOT, UserError
from pretrain.cli import main, resolve_config
from pretrain.model.t5 import load_config
from pretrain.preflight import estimate_memory, resolve_vocab_size, run_preflight

from pipeline.synthetic_shards import write_shard_set


def config_for(shards, out, *extra):
    return resolve_config(["--model", "t5-tiny", "--data", str(shards), "--out", str(out), "--zero", "2",
                           "--micro-batch", "4", "--global-batch", "16", *extra])


def refused(capsys, shards, out, *extra) -> str:
    """Run the real CLI entry point in-process; it must exit 2 with one line and spawn nothing."""
    code = main(["--model", "t5-tiny", "--data", str(shards), "--out", str(out), "--nproc", "2", "--micro-batch", "4",
                 "--global-batch", "16", *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (Path(out) / "logs").exists()          # no rank was started
    return err


@pytest.fixture(scope="module")
def other_tokenizer(sample_corpus, tmp_path_factory) -> Path:
    """A second real tokenizer (vocab 512) trained on the same text: same layout, different file."""
    from pipeline.readers import iter_corpus_texts
    from tokenizer.t5 import train_tokenizer

    return train_tokenizer(iter_corpus_texts([str(sample_corpus)]), 512, tmp_path_factory.mktemp("other_tok"),
                           show_progress=False)


def test_shards_of_another_tokenizer_are_refused_before_launch(tiny_shards, tiny_tokenizer, other_tokenizer,
                                                               tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "pretrain.cli", "--model", "t5-tiny", "--data", str(tiny_shards),
                             "--out", str(out), "--nproc", "2", "--tokenizer", str(other_tokenizer)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "tokenizer sha256" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()
    plan = run_preflight(config_for(tiny_shards, out, "--tokenizer", str(tiny_tokenizer)), world_size=2,
                         local_world_size=2, announce=False)
    assert plan.tokenizer_sha256 == json.loads((Path(tiny_shards) / "manifest.json").read_text())["tokenizer"]["sha256"]


def test_lengths_the_run_cannot_take_are_refused(tiny_shards, tmp_path, capsys):
    err = refused(capsys, tiny_shards, tmp_path / "a", "--input-length", "512")
    assert "input_length 128" in err and "512" in err
    err = refused(capsys, tiny_shards, tmp_path / "b", "--target-length", "114")
    assert "target_length 29" in err


def test_vocabulary_follows_the_tokenizer_unless_pinned(tmp_path, capsys):
    big = tmp_path / "big_vocab"
    write_shard_set(big, shard_rows=[40], input_length=16, target_length=6, vocab_size=40_000)
    err = refused(capsys, big, tmp_path / "pinned", "--vocab-size", "1024")
    assert "--vocab-size 1024 is smaller than the shard set's tokenizer (40000 ids)" in err
    plan = run_preflight(config_for(big, tmp_path / "follow"), world_size=2, local_world_size=2, announce=False)
    assert plan.model_config.vocab_size == 40_064                       # rounded up to a multiple of 128
    plan = run_preflight(config_for(big, tmp_path / "mt5", "--model", "mt5-small"), world_size=2, local_world_size=2,
                         announce=False)
    assert plan.model_config.vocab_size == 250_112                      # the published size holds it: kept
    assert resolve_vocab_size(32_128, 32_000, None)[0] == 32_128
    assert resolve_vocab_size(1024, 1000, 2048)[0] == 2048


def test_a_manifest_whose_special_ids_differ_from_t5_is_refused(tiny_shards, tmp_path, capsys):
    odd = tmp_path / "odd"
    shutil.copytree(tiny_shards, odd)
    manifest = json.loads((odd / "manifest.json").read_text())
    manifest["tokenizer"]["eos_id"] = 3
    (odd / "manifest.json").write_text(json.dumps(manifest))
    assert "eos_id is 3" in refused(capsys, odd, tmp_path / "run")


def test_a_model_that_cannot_fit_is_refused_unless_forced(tiny_shards, tmp_path, capsys):
    err = refused(capsys, tiny_shards, tmp_path / "xxl", "--model", "mt5-xxl", "--zero", "0")
    assert "mt5-xxl at ZeRO 0" in err and "will not fit" in err and "--force" in err
    plan = run_preflight(config_for(tiny_shards, tmp_path / "xxl", "--model", "mt5-xxl", "--force"), world_size=2,
                         local_world_size=2, announce=False)
    assert plan.warnings and "host memory" in plan.warnings[0]
    assert plan.memory_estimate["parameters"] > 12e9


def test_more_cpu_ranks_than_cores_are_refused_unless_forced(tiny_shards, tmp_path, capsys):
    cores = len(os.sched_getaffinity(0))
    ranks = ["--nproc", str(cores + 1), "--global-batch", str(4 * (cores + 1))]
    err = refused(capsys, tiny_shards, tmp_path / "crowded", *ranks)
    assert f"{cores + 1} CPU ranks on this node but {cores} core(s)" in err and f"--nproc {cores}" in err
    plan = run_preflight(config_for(tiny_shards, tmp_path / "crowded", *ranks, "--force"), world_size=cores + 1,
                         local_world_size=cores + 1, announce=False)
    assert any("CPU ranks on this node" in warning for warning in plan.warnings)


def test_memory_estimate_shrinks_with_the_stage_and_with_offload():
    config = load_config("mt5-large")
    per_gpu = {}
    for zero in (0, 1, 2, 3):
        estimate = estimate_memory(config, zero=zero, offload="none", precision="bf16", world_size=2,
                                   local_world_size=2, micro_batch=8, input_length=512, target_length=114,
                                   activation_checkpointing=False)
        per_gpu[zero] = estimate["model_states_gib"]
    assert per_gpu[0] > per_gpu[1] > per_gpu[2] > per_gpu[3]
    assert per_gpu[0] == pytest.approx(20 * 1.23e9 / 2**30, rel=0.05)      # 20 bytes per parameter
    offloaded = estimate_memory(config, zero=2, offload="cpu", precision="bf16", world_size=2, local_world_size=2,
                                micro_batch=8, input_length=512, target_length=114, activation_checkpointing=False)
    assert offloaded["model_states_gib"] < per_gpu[2] and offloaded["per_cpu_gib"] > 0
    assert "estimate_zero2" in offloaded["method"]
    recompute = estimate_memory(config, zero=2, offload="none", precision="bf16", world_size=2, local_world_size=2,
                                micro_batch=8, input_length=512, target_length=114, activation_checkpointing=True)
    plain = estimate_memory(config, zero=2, offload="none", precision="bf16", world_size=2, local_world_size=2,
                            micro_batch=8, input_length=512, target_length=114, activation_checkpointing=False)
    assert recompute["activations_gib"] < plain["activations_gib"]


def test_activation_estimate_matches_the_measured_h200_peaks():
    """Fused attention keeps no probabilities. Against peaks measured on 2 H200s (docs/study/h200x2-pretrain/):
    compiled mt5-large, bf16, 512/114, grew by 35.0 GiB from micro batch 64 to 128 at ZeRO 0-2; the eager
    model's 64 examples peaked at 63.2 GiB beside 9.2 GiB of bf16 weights, gradients and AdamW state."""
    config = load_config("mt5-large")

    def activations(micro_batch, fused=True):
        return estimate_memory(config, zero=2, offload="none", precision="bf16", world_size=2, local_world_size=2,
                               micro_batch=micro_batch, input_length=512, target_length=114,
                               activation_checkpointing=False, fused_attention=fused)["activations_gib"]

    unfused_extra = 16 * (24 * 512**2 + 24 * (114**2 + 114 * 512)) * 2 / 2**30   # probabilities, bf16, per example
    assert (activations(64, fused=False) - activations(64)) / 64 == pytest.approx(unfused_extra, rel=1e-3)
    per_example = (activations(128) - activations(64)) / 64
    assert 35.0 / 64 < per_example < 1.4 * 35.0 / 64            # errs high for compiled runs, not by much
    assert activations(64) + 9.2 == pytest.approx(63.2, rel=0.05)   # the eager model


def test_a_directory_left_by_a_launch_that_failed_before_its_first_step_is_taken_again(tiny_shards, tmp_path):
    """No step logged and no checkpoint (the ranks failed at start-up): a fresh launch may use the directory, and a
    --resume with other settings than the failed launch's config.json is not refused, there being nothing to
    resume (the run starts at step 0)."""
    from pretrain.preflight import check_run_dir

    left = tmp_path / "left"
    left.mkdir()
    (left / "metrics.jsonl").write_text("")
    (left / "config.json").write_text(json.dumps({"train": {"lr": 0.25, "seed": 7}, "global_batch": 8}))
    check_run_dir(config_for(tiny_shards, left))
    for extra in ([], ["--resume"]):
        run_preflight(config_for(tiny_shards, left, *extra), world_size=2, local_world_size=2, announce=False)


def test_run_dir_and_batch_checks(tiny_shards, tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text("{}\n")
    assert "already holds a run" in refused(capsys, tiny_shards, used)
    for out in (tiny_shards, tiny_shards / "run"):
        assert "--out is or lies inside --data" in refused(capsys, tiny_shards, out)
    other_set = tmp_path / "other-set"
    other_set.mkdir()
    (other_set / "manifest.json").write_text("{}\n")
    assert "holds a manifest.json" in refused(capsys, tiny_shards, other_set)
    assert "fewer than one global batch" in refused(capsys, tiny_shards, tmp_path / "big", "--global-batch", "4096",
                                                    "--micro-batch", "2048")
    with pytest.raises(UserError, match="not a multiple"):
        run_preflight(config_for(tiny_shards, tmp_path / "odd", "--global-batch", "12"), world_size=2,
                      local_world_size=2, announce=False)



def test_the_summary_says_cuda_graphs_pools_come_on_top_of_the_estimate():
    """On a GPU, `--cudagraphs` runs (given, or auto) are told the estimate leaves the graphs' pools out (they showed as
    33 GiB more reserved in the model benchmark); elsewhere (CPU runs the same code without graphs) nothing is said."""
    from pretrain.config import TrainConfig
    from pretrain.preflight import Plan, describe

    estimate = {"per_gpu_gib": 40.0, "model_states_gib": 20.0, "activations_gib": 20.0, "per_cpu_gib": 1.0,
                "parameters": 1.2e9}
    gpu = {"kind": "cuda", "count": 1, "name": "NVIDIA H200", "per_device_gib": 139.8}
    cpu = {"kind": "cpu", "host_available_gib": 20.0, "host_total_gib": 24.0}
    plans = {kind: Plan(model_config=load_config("t5-tiny"), vocab_note="1024", input_length=128, target_length=29,
                        num_examples=100, world_size=1, grad_accum=2, global_batch=8, shard_fingerprint="f" * 16,
                        tokenizer_sha256="0" * 64, device=device, memory_estimate=estimate)
             for kind, device in (("gpu", gpu), ("cpu", cpu))}
    graphed = TrainConfig(data="shards", out="run", compile=True, cudagraphs=True)
    auto = TrainConfig(data="shards", out="run", compile=True)
    plain = TrainConfig(data="shards", out="run", compile=True, cudagraphs=False)
    assert "cudagraphs: the graphs' private pools come on top" in describe(plans["gpu"], graphed, "bf16")
    assert "cudagraphs (auto; --no-cudagraphs: off): the graphs' private pools" in describe(plans["gpu"], auto, "bf16")
    assert "cudagraphs" not in describe(plans["gpu"], plain, "bf16")
    assert "cudagraphs" not in describe(plans["gpu"], auto.replace(compile=False), "bf16")
    assert "cudagraphs" not in describe(plans["cpu"], graphed, "fp32")
    assert "cudagraphs" not in describe(plans["cpu"], auto, "fp32")
    # auto near the device's memory (mt5-xl ZeRO 2 at micro 32: ~121 of an H200's 139.8 GiB): off, said with why;
    # asked for, graphs stay on there
    full = dataclasses.replace(plans["gpu"], memory_estimate={**estimate, "per_gpu_gib": 120.9})
    assert plans["gpu"].memory_share() == pytest.approx(40.0 / 139.8) and plans["cpu"].memory_share() is None
    assert "cudagraphs (auto): off, the estimate fills 86% of a GPU (auto takes graphs up to 75%" in describe(
        full, auto, "bf16")
    assert "cudagraphs: the graphs' private pools come on top" in describe(full, graphed, "bf16")
    assert "cudagraphs" not in describe(full, plain, "bf16")
