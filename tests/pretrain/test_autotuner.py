"""DeepSpeed's autotuner (`deepspeed --autotuning tune ... pretrain/cli.py --deepspeed --deepspeed_config ds.json`)
drives `pretrain`: each experiment's DeepSpeed config (a file, or the base64 its scheduler passes) sets the stage,
micro batch, global batch, run directory and the rest of the DeepSpeed config (pretrain.cli
deepspeed_config_overrides); the real autotuner over t5-tiny on CPU is the slow test (~2.5 min).

    .venv/bin/python -m pytest tests/pretrain/test_autotuner.py -q          # -m slow for the real autotuner
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.common import REPO_ROOT, UserError
from pretrain.cli import deepspeed_config_overrides, resolve_config

EXPERIMENT = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 8,
              "zero_optimization": {"stage": 3, "overlap_comm": False},
              "autotuning": {"enabled": True, "metric_path": "autotuning_results/z3_gas2_tmbspg4/metrics.json"}}


def encoded(config: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(config).encode()).decode()


def test_an_experiments_config_sets_stage_batches_run_dir_and_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    overrides = deepspeed_config_overrides(EXPERIMENT, world_size=2)
    assert overrides["zero"] == 3 and overrides["micro_batch"] == 4 and overrides["global_batch"] == 16
    assert overrides["out"] == str(Path("autotuning_results/z3_gas2_tmbspg4/run"))
    assert overrides["deepspeed"] == {"zero_optimization": {"overlap_comm": False},
                                      "autotuning": EXPERIMENT["autotuning"]}
    assert EXPERIMENT["zero_optimization"]["stage"] == 3                    # the caller's dict is left as it was

    # the launcher's values win over the command line's; a --config's deepspeed mapping is merged, not replaced
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(yaml.safe_dump({"deepspeed": {"zero_optimization": {"reduce_bucket_size": 1000},
                                                       "steps_per_print": 7}}))
    common = ["--model", "t5-tiny", "--data", "shards", "--zero", "1", "--micro-batch", "2", "--config", str(yaml_path),
              "--deepspeed"]
    for given in (encoded(EXPERIMENT), str(tmp_path / "ds.json")):
        (tmp_path / "ds.json").write_text(json.dumps(EXPERIMENT))
        config = resolve_config([*common, "--deepspeed_config", given])
        assert (config.zero, config.micro_batch, config.global_batch) == (3, 4, 16)
        assert config.out.endswith("z3_gas2_tmbspg4/run")
        assert config.deepspeed["zero_optimization"] == {"reduce_bucket_size": 1000, "overlap_comm": False}
        assert config.deepspeed["steps_per_print"] == 7 and config.deepspeed["autotuning"]["enabled"] is True

    # "auto" values (the autotuner's own template) leave pretrain's settings alone
    auto = resolve_config(["--model", "t5-tiny", "--data", "shards", "--out", "run", "--micro-batch", "2",
                           "--deepspeed_config", encoded({"train_micro_batch_size_per_gpu": "auto",
                                                          "zero_optimization": {"stage": "all"}})])
    assert auto.micro_batch == 2 and auto.zero == 2 and auto.deepspeed == {"zero_optimization": {"stage": "all"}}


def test_a_bad_deepspeed_config_is_one_line():
    with pytest.raises(UserError, match="neither a readable JSON file nor a base64 DeepSpeed config"):
        resolve_config(["--model", "t5-tiny", "--data", "s", "--out", "o", "--deepspeed_config", "not-a-config"])
    result = subprocess.run([sys.executable, "-m", "pretrain.cli", "--model", "t5-tiny", "--data", "s", "--out", "o",
                             "--deepspeed_config", encoded([1, 2])], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 2 and "a DeepSpeed config is a JSON object" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_deepspeeds_autotuner_tunes_pretrain(tiny_shards, tmp_path):
    launcher = Path(sys.executable).with_name("deepspeed")
    assert _has_tabulate(), "the autotuner needs tabulate: pip install -e '.[test]'"
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "zero_optimization": {"stage": [0, 2]},
        "autotuning": {"enabled": True, "fast": True, "start_profile_step": 3, "end_profile_step": 5,
                       "max_train_batch_size": 8, "num_tuning_micro_batch_sizes": 2}}))
    env = dict(os.environ, PATH=f"{launcher.parent}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    result = subprocess.run([str(launcher), "--autotuning", "tune", "--num_gpus", "1", str(REPO_ROOT / "pretrain" / "cli.py"),
                             "--deepspeed", "--deepspeed_config", "ds.json", "--model", "t5-tiny", "--data",
                             str(tiny_shards), "--steps", "20", "--no-save-final"],
                            capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode == 0 and "not runnable" not in log, log[-3000:]
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] in (0, 2) and optimal["train_micro_batch_size_per_gpu"] >= 1
    measured = list((tmp_path / "autotuning_results").glob("z*/metrics.json"))
    assert len(measured) >= 2                          # each a pretrain run the engine stopped at its profile step
    for metrics in measured:
        assert json.loads(metrics.read_text())["throughput"] > 0
        assert (metrics.parent / "run" / "config.json").is_file()


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True
