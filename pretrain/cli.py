"""`pretrain`: DeepSpeed ZeRO 0-3 pretraining of T5 v1.1 / mT5 on span-corruption shards.

    pretrain --zero 2 --model t5-tiny --data shards/demo --out runs/demo --steps 100 --micro-batch 8 --global-batch 32 --nproc 2

Settings come from three layers, later ones winning: the `TrainConfig` defaults, a YAML file given with
`--config` (keys are the flag names, with `-` or `_`), and the flags on the command line. Before any rank
is spawned the preflight checks the shard set against the model and DeepSpeed's memory estimate against
the devices; a refusal is one line on stderr and exit status 2 (`--force` overrides the memory refusal).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from pipeline.common import UserError, run_cli
from pretrain.config import TrainConfig, add_train_flags, resolve_flags

OUTPUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def build_parser() -> argparse.ArgumentParser:
    """The `pretrain` flags, generated from `TrainConfig` (pretrain/config.py)."""
    parser = argparse.ArgumentParser(prog="pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_flags(parser)
    # the `deepspeed` launcher appends --local_rank=N; the rank is read from LOCAL_RANK instead
    parser.add_argument("--local_rank", "--local-rank", dest="launcher_local_rank", type=int,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def resolve_config(argv: list[str] | None = None) -> TrainConfig:
    """Flags over YAML over defaults -> a validated TrainConfig."""
    flags = vars(build_parser().parse_args(argv))
    flags.pop("launcher_local_rank", None)
    return resolve_flags(flags)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pretrain` console script."""
    from pretrain.ranks import rank_env

    code = run_cli(lambda: _main(argv))
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
    from pretrain.runlock import BYTES_PER_PARAMETER_SAVED, acquire_run_lock, check_free_space

    adopt_slurm_ranks()
    env = rank_env()
    if env.launched:
        preemption.install()       # from here on a signal means: save at the next step boundary, exit resumable
    config = resolve_config(argv)
    spawned = os.environ.get(SPAWNED_ENV) == "1"
    launching = not spawned and env.is_main      # our parent, or global rank 0 under torchrun / deepspeed / srun
    if not spawned:
        preflight.check_run_dir(config)
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
