"""`pretrain`: DeepSpeed ZeRO 0-3 pretraining of T5 v1.1 / mT5 on span-corruption shards.

    pretrain --zero 2 --model t5-tiny --data shards/demo --out runs/demo --steps 100 --micro-batch 8 --global-batch 32 --nproc 2

Settings come from three layers, later ones winning: the `TrainConfig` defaults, a YAML file given with
`--config` (keys are the flag names, with `-` or `_`), and the flags on the command line. Before any rank
is spawned the preflight checks the shard set against the model and DeepSpeed's memory estimate against
the devices; a refusal is one line on stderr and exit status 2 (`--force` overrides the memory refusal).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeline.common import run_cli
from pretrain.config import TrainConfig, add_train_flags, resolve_flags


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
    """Resolve the settings, run the preflight once, then train in this process (launched by torchrun or the
    deepspeed launcher, or spawned by us) or spawn `--nproc` local ranks that run this again."""
    from pretrain import preflight
    from pretrain.ranks import SPAWNED_ENV, rank_env

    config = resolve_config(argv)
    env = rank_env()
    spawned = os.environ.get(SPAWNED_ENV) == "1"
    if not spawned:
        preflight.check_run_dir(config)
    local_world_size = env.local_world_size if env.launched else config.nproc
    plan = preflight.run_preflight(config, world_size=env.world_size if env.launched else config.nproc,
                                   local_world_size=local_world_size, announce=env.is_main and not spawned)
    if env.launched:
        from pretrain import trainer
        return trainer.run_rank(config, plan, env)
    from pretrain import launch
    return launch.spawn_local(sys.argv[1:] if argv is None else list(argv), config.nproc, Path(config.out))


if __name__ == "__main__":
    sys.exit(main())
