"""`pretrain`: DeepSpeed ZeRO 0-3 pretraining of T5 v1.1 / mT5 on span-corruption shards.

    pretrain --zero 2 --model t5-tiny --data shards/demo --out runs/demo --steps 100 --micro-batch 8 --global-batch 32 --nproc 2

Settings come from three layers, later ones winning: the `TrainConfig` defaults, a YAML file given with
`--config` (keys are the flag names, with `-` or `_`), and the flags on the command line. Before any rank
is spawned the preflight checks the shard set against the model and DeepSpeed's memory estimate against
the devices; a refusal is one line on stderr and exit status 2 (`--force` overrides the memory refusal).
"""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.common import UserError, run_cli
from pretrain.config import TrainConfig, add_train_flags, config_from_values, resolve_flags
from pretrain.ds_config import deep_merge

OUTPUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def build_parser() -> argparse.ArgumentParser:
    """The `pretrain` flags, generated from `TrainConfig` (pretrain/config.py)."""
    parser = argparse.ArgumentParser(prog="pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_flags(parser)
    # the `deepspeed` launcher appends --local_rank=N; the rank is read from LOCAL_RANK instead
    parser.add_argument("--local_rank", "--local-rank", dest="launcher_local_rank", type=int,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    # DeepSpeed's autotuner (`deepspeed --autotuning tune ... pretrain.cli --deepspeed --deepspeed_config ds.json`)
    # gives each of its experiments a DeepSpeed config this way: see deepspeed_config_overrides
    parser.add_argument("--deepspeed", dest="launcher_deepspeed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--deepspeed_config", "--deepspeed-config", dest="launcher_ds_config",
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def read_deepspeed_config(text: str) -> dict[str, Any]:
    """A DeepSpeed config as DeepSpeed's launcher passes it: a JSON file's path, or the config itself in
    URL-safe base64 (how the autotuner's scheduler hands one to each experiment)."""
    try:
        is_file = os.path.isfile(text)
    except (OSError, ValueError):       # a base64 config longer than a file name may be
        is_file = False
    try:
        raw = Path(text).read_text() if is_file else base64.urlsafe_b64decode(text.encode()).decode()
        config = json.loads(raw)
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise UserError(f"--deepspeed_config {text[:60]}: neither a readable JSON file nor a base64 DeepSpeed "
                        f"config ({err}); pass a JSON file") from None
    if not isinstance(config, dict):
        raise UserError(f"--deepspeed_config {text[:60]}: a DeepSpeed config is a JSON object")
    return config


def deepspeed_config_overrides(ds: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The TrainConfig settings a DeepSpeed config given by its launcher sets (what `deepspeed --autotuning`
    varies per experiment): `zero_optimization.stage` -> zero, `train_micro_batch_size_per_gpu` -> micro_batch,
    micro batch x `gradient_accumulation_steps` x ranks -> global_batch (where they are numbers, not "auto"); every
    other key is merged into the `deepspeed:` mapping, which pretrain's own DeepSpeed config takes last (the
    autotuner's `autotuning` section with its per-experiment metric path among them), and `out` goes to a `run`
    directory beside that metric path, so that experiments do not share a run directory."""
    ds = copy.deepcopy(ds)
    out: dict[str, Any] = {}
    zero = ds.get("zero_optimization", {})
    if isinstance(zero.get("stage"), int):
        out["zero"] = zero.pop("stage")
    if not zero:
        ds.pop("zero_optimization", None)
    micro = ds.pop("train_micro_batch_size_per_gpu", None)
    accum = ds.pop("gradient_accumulation_steps", None)
    ds.pop("train_batch_size", None)      # pretrain derives it: micro x accumulation x ranks
    if isinstance(micro, int):
        out["micro_batch"] = micro
        if isinstance(accum, int):
            out["global_batch"] = micro * accum * world_size
    autotuning = ds.get("autotuning") or {}
    result = autotuning.get("metric_path") or autotuning.get("model_info_path")
    if result:
        out["out"] = str(Path(result).parent / "run")
    out["deepspeed"] = ds
    return out


def resolve_config(argv: list[str] | None = None) -> TrainConfig:
    """Flags over YAML over defaults -> a validated TrainConfig; a launcher's --deepspeed_config over those."""
    flags = vars(build_parser().parse_args(argv))
    flags.pop("launcher_local_rank", None)
    flags.pop("launcher_deepspeed", None)
    ds_text = flags.pop("launcher_ds_config", None)
    if ds_text is None:
        return resolve_flags(flags)
    overrides = deepspeed_config_overrides(read_deepspeed_config(ds_text), int(os.environ.get("WORLD_SIZE", "1")))
    extra = overrides.pop("deepspeed")
    config = resolve_flags({**flags, **overrides})       # the launcher's stage, batch and run dir over the flags
    return config_from_values({**dataclasses.asdict(config), "deepspeed": deep_merge(config.deepspeed, extra)},
                              where="--deepspeed_config")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pretrain` console script."""
    from pretrain.ranks import rank_env

    code = run_cli(lambda: _main(argv), "pretrain")
    if rank_env().launched:
        # A rank leaves without the interpreter's teardown: gloo's worker threads can still be destroying finished
        # collectives that hold Python tensors while Python finalizes, which aborts the process (SIGABRT, "terminate
        # called without an active exception") after a run that succeeded: ~4% of 2-rank CPU launches.
        # Everything the run writes is closed by now (metrics, TensorBoard, checkpoints, summary.json).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    """Resolve the settings, run the preflight once, then train in this process (launched by torchrun, the
    deepspeed launcher, srun, or spawned by us) or spawn `--nproc` local ranks that run this again.

    The launching process (ours, or global rank 0 of a launched job) holds the run directory's lock for the
    run's life; a launched rank turns SIGTERM / SIGUSR1 / SIGINT into a checkpoint and exit status 75."""
    from pretrain import preflight
    from pretrain.ranks import SPAWNED_ENV, adopt_slurm_ranks, preemption, rank_env
    from pretrain.runlock import BYTES_PER_PARAMETER_SAVED, acquire_run_lock, check_export_dir, check_free_space

    adopt_slurm_ranks()
    env = rank_env()
    if env.launched:
        preemption.install()       # from here on a signal means: save at the next step boundary, exit resumable
    config = resolve_config(argv)
    spawned = os.environ.get(SPAWNED_ENV) == "1"
    launching = not spawned and env.is_main      # our parent, or global rank 0 under torchrun / deepspeed / srun
    if not spawned:
        preflight.check_run_dir(config)
        if config.export_hf:
            check_export_dir(config.export_hf, keep={"--out": config.out, "--data": config.data})
    local_world_size = env.local_world_size if env.launched else config.nproc
    plan = preflight.run_preflight(config, world_size=env.world_size if env.launched else config.nproc,
                                   local_world_size=local_world_size, announce=env.is_main and not spawned)
    lock = None
    if launching:       # a refused preflight leaves nothing behind; from here on one launch per run directory
        lock = acquire_run_lock(config.out)                  # released by the OS when the run's last process ends
        preflight.check_run_dir(config)                      # again: a launch that held it may just have finished
        check_free_space(Path(config.out), plan.memory_estimate["parameters"] * BYTES_PER_PARAMETER_SAVED,
                         what="one checkpoint")
    try:
        if env.launched:
            from pretrain import trainer
            return trainer.run_rank(config, plan, env)
        from pretrain import launch
        return launch.spawn_local(sys.argv[1:] if argv is None else list(argv), config.nproc, Path(config.out),
                                  max_restarts=config.max_restarts, rank_timeout_s=config.rank_timeout,
                                  lock_fd=None if lock is None else lock.fd)
    except OSError as err:
        if err.errno in OUTPUT_ERRNOS and err.filename:   # the run directory filled up or went read-only
            from pipeline.common import describe_os_error
            raise UserError(f"{err.filename}: {describe_os_error(err)}; free space there (or pick another --out) "
                            f"and continue with --resume: complete checkpoints are kept") from None
        raise


if __name__ == "__main__":
    sys.exit(main())
