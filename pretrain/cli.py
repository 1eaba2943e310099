"""`pretrain`: DeepSpeed ZeRO 0-3 pretraining of T5 v1.1 / mT5 on span-corruption shards.

    pretrain --zero 2 --model t5-tiny --data shards/demo --out runs/demo --steps 100 --micro-batch 8 --global-batch 32 --nproc 2

Settings come from three layers, later ones winning: the `TrainConfig` defaults, a YAML file given with
`--config` (keys are the flag names, with `-` or `_`), and the flags on the command line. Before any rank
is spawned the preflight checks the shard set against the model and DeepSpeed's memory estimate against
the devices; a refusal is one line on stderr and exit status 2 (`--force` overrides the memory refusal).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import UserError, run_cli

SCHEDULES = ("constant", "linear", "cosine", "inverse_sqrt")
OFFLOADS = ("none", "cpu", "nvme")
GATHER_UNITS = ("block", "stack")   # pretrain.model.GATHER_UNITS' names (this module does not import torch)
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class TrainConfig:
    """Everything one `pretrain` run needs; saved resolved as RUN_DIR/config.json["train"]."""

    model: str = "t5-tiny"               # preset name in configs/models/
    data: str = ""                       # shard-set directory (or URL) holding manifest.json
    out: str = ""                        # run directory
    zero: int = 2                        # ZeRO stage 0..3
    offload: str = "none"                # none | cpu | nvme (optimizer state; and params at stage 3)
    nvme_path: str | None = None         # directory for --offload nvme
    steps: int = 100                     # optimizer steps in total (the schedule is laid out over these)
    stop_after: int | None = None        # stop (with a checkpoint) after this many steps of this launch
    micro_batch: int = 8                 # examples per rank per forward/backward
    global_batch: int | None = None      # examples per optimizer step (default micro_batch * world size)
    lr: float = 1e-3                     # peak learning rate
    warmup_steps: int = 0                # linear warmup from lr/warmup_steps to lr
    schedule: str = "cosine"             # constant | linear | cosine | inverse_sqrt (after warmup)
    min_lr_ratio: float = 0.1            # floor of linear/cosine decay, as a fraction of lr
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0               # global gradient-norm clip (0 disables)
    precision: str = "auto"              # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    activation_checkpointing: bool = False
    compile: bool = False                # torch.compile each block's forward and the loss chunk
    loader_workers: int = 0              # torch DataLoader worker processes per rank
    prefetch_factor: int = 2
    save_every: int = 0                  # checkpoint every N steps (0: only at the end / at --stop-after)
    resume: bool = False                 # continue from the newest complete checkpoint in RUN_DIR/checkpoints
    seed: int = 0
    nproc: int = 1                       # local ranks to spawn (ignored under torchrun / the deepspeed launcher)
    vocab_size: int | None = None        # pin the model vocabulary (default: follows the shard set's tokenizer)
    tokenizer: str | None = None         # tokenizer.json whose sha256 the shard set must have been built with
    input_length: int | None = None      # expected input length (default: the shard set's)
    target_length: int | None = None     # expected target length (default: the shard set's)
    verify: bool = False                 # sha256 every shard before training
    cache_dir: str | None = None         # local cache for remote shard sets
    export_hf: str | None = None         # write the final model here in HF transformers format
    force: bool = False                  # run even when the memory estimate says it will not fit
    log_every: int = 1                   # console progress line every N steps
    steady_skip: int = 2                 # steps excluded from summary medians (compile, allocator warm-up)
    profile_steps: int = 0               # torch.profiler over the last N steps on rank 0 -> RUN_DIR/profile/
    peak_tflops: float | None = None     # per-device peak for MFU (default: by device; none on CPU)
    stage3_prefetch_bucket_size: int | None = None
    stage3_param_persistence_threshold: int | None = None
    stage3_max_live_parameters: int | None = None
    stage3_max_reuse_distance: int | None = None
    stage3_gather_unit: str = "block"    # ZeRO-3 unit of gathering: each block, or each whole stack (a trial)
    deepspeed: dict[str, Any] = field(default_factory=dict)   # raw DeepSpeed keys merged last (YAML only)
    model_overrides: dict[str, Any] = field(default_factory=dict)  # T5Config fields (YAML only)

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise UserError(message)

        need(self.zero in (0, 1, 2, 3), f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        need(self.offload in OFFLOADS, f"--offload must be one of {OFFLOADS}, got {self.offload!r}")
        need(self.offload == "none" or self.zero >= 1,
             "--offload needs ZeRO stage 1 or higher (stage 0 keeps everything on the device); use --zero 2 or 3")
        need(self.offload != "nvme" or self.zero == 3,
             "--offload nvme needs --zero 3 (ZeRO-Infinity); use --offload cpu at stages 1-2")
        need(self.offload != "nvme" or bool(self.nvme_path),
             "--offload nvme needs --nvme-path DIR (a directory on a fast local NVMe drive)")
        need(self.stage3_gather_unit in GATHER_UNITS,
             f"--stage3-gather-unit must be one of {GATHER_UNITS}, got {self.stage3_gather_unit!r}")
        need(self.schedule in SCHEDULES, f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        need(self.precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        for name in ("steps", "micro_batch", "nproc", "log_every", "prefetch_factor"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "save_every", "loader_workers", "steady_skip", "profile_steps", "grad_clip",
                     "weight_decay"):
            need(getattr(self, name) >= 0, f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        need(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        need(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(self.stop_after is None or 1 <= self.stop_after,
             f"--stop-after must be >= 1, got {self.stop_after}")
        need(self.global_batch is None or self.global_batch >= 1, "--global-batch must be >= 1")
        need(bool(self.data), "--data SHARDS is required (a shard set written by `prep corpus`)")
        need(bool(self.out), "--out RUN_DIR is required")

    def grad_accum(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step: global / (micro * world); refuses a remainder."""
        global_batch = self.global_batch or self.micro_batch * world_size
        per_step = self.micro_batch * world_size
        if global_batch % per_step:
            raise UserError(f"--global-batch {global_batch} is not a multiple of --micro-batch {self.micro_batch} "
                            f"x {world_size} ranks = {per_step}; pick a global batch that is")
        return global_batch // per_step

    def resolved_global_batch(self, world_size: int) -> int:
        return self.micro_batch * world_size * self.grad_accum(world_size)


def _field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainConfig)}


def load_yaml_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a `--config` YAML file into TrainConfig keys ('-' or '_' accepted); unknown keys are refused."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such config file; pass an existing YAML file to --config")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML ({str(err).splitlines()[0]}); fix the file")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of flag names to values, got {type(raw).__name__}")
    values = {str(key).replace("-", "_"): value for key, value in raw.items()}
    unknown = sorted(set(values) - _field_names() - {"config"})
    if unknown:
        raise UserError(f"{path}: unknown keys {unknown}; use the flag names of `pretrain --help`")
    values.pop("config", None)
    if "bf16" in raw or "fp32" in raw:
        raise UserError(f"{path}: write `precision: bf16` or `precision: fp32` instead of bf16/fp32 keys")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     argument_default=argparse.SUPPRESS)
    add = parser.add_argument
    add("--config", help="YAML file with the same keys as these flags (flags win)")
    add("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default 2)")
    add("--offload", choices=OFFLOADS, help="offload optimizer state (and params at stage 3) to cpu or nvme")
    add("--nvme-path", help="directory for --offload nvme")
    add("--model", help="model preset (configs/models/*.yaml), e.g. t5-tiny, mt5-base")
    add("--data", help="shard set written by `prep corpus` (directory or URL)")
    add("--out", help="run directory (config.json, metrics.jsonl, checkpoints/, tb/, summary.json)")
    add("--steps", type=int, help="total optimizer steps (default 100)")
    add("--stop-after", type=int, help="stop after this many steps of this launch, with a checkpoint")
    add("--micro-batch", type=int, help="examples per rank per forward/backward (default 8)")
    add("--global-batch", type=int, help="examples per optimizer step; grad accumulation = global/(micro*ranks)")
    add("--lr", type=float, help="peak learning rate (default 1e-3)")
    add("--warmup-steps", type=int, help="linear warmup steps (default 0)")
    add("--schedule", choices=SCHEDULES, help="decay after warmup (default cosine)")
    add("--min-lr-ratio", type=float, help="floor of linear/cosine decay as a fraction of --lr (default 0.1)")
    add("--weight-decay", type=float, help="AdamW weight decay (default 0)")
    add("--grad-clip", type=float, help="gradient-norm clip, 0 disables (default 1.0)")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                           help="bf16 mixed precision (default on GPU)")
    precision.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                           help="full fp32 (default on CPU)")
    add("--activation-checkpointing", action="store_true", help="recompute activations in backward")
    add("--compile", action="store_true",
        help="torch.compile each block's forward and the loss chunk (every stage; ~10-30 s on the first step)")
    add("--loader-workers", type=int, help="DataLoader workers per rank (default 0)")
    add("--prefetch-factor", type=int, help="batches prefetched per loader worker (default 2)")
    add("--save-every", type=int, help="checkpoint every N steps (default 0: only at the end)")
    add("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    add("--seed", type=int, help="seed for model init and data order (default 0)")
    add("--nproc", type=int, help="local ranks to spawn (default 1); ignored under torchrun/deepspeed")
    add("--vocab-size", type=int, help="pin the model vocabulary (default: follows the shard set's tokenizer)")
    add("--tokenizer", help="tokenizer.json the shard set must have been built with (sha256 checked)")
    add("--input-length", type=int, help="expected input length; a shard set with another one is refused")
    add("--target-length", type=int, help="expected target length; a shard set with another one is refused")
    add("--verify", action="store_true", help="sha256 every shard before training")
    add("--cache-dir", help="local cache for a remote shard set")
    add("--export-hf", help="write the final model to this directory in HF transformers format")
    add("--force", action="store_true", help="run even if the memory estimate says it does not fit")
    add("--log-every", type=int, help="console progress line every N steps (default 1)")
    add("--steady-skip", type=int, help="first steps left out of the summary medians (default 2)")
    add("--profile-steps", type=int,
        help="profile the last N steps on rank 0 (torch.profiler): RUN_DIR/profile/ gets the trace, op tables and "
             "device-busy / host-sync shares; the summary's medians leave those steps out (default 0: off)")
    add("--peak-tflops", type=float, help="device peak TFLOP/s for MFU (default: by device; none on CPU)")
    add("--stage3-prefetch-bucket-size", type=int, help="ZeRO-3 prefetch bucket (elements)")
    add("--stage3-param-persistence-threshold", type=int, help="ZeRO-3: params smaller than this stay gathered")
    add("--stage3-max-live-parameters", type=int, help="ZeRO-3: max gathered params at once")
    add("--stage3-max-reuse-distance", type=int, help="ZeRO-3: keep a param gathered if reused within this")
    add("--stage3-gather-unit", choices=GATHER_UNITS,
        help="ZeRO-3: gather each T5 block (default) or each whole encoder/decoder stack at once")
    # the `deepspeed` launcher appends --local_rank=N; the rank is read from LOCAL_RANK instead
    add("--local_rank", "--local-rank", dest="launcher_local_rank", type=int, help=argparse.SUPPRESS)
    return parser


def resolve_config(argv: list[str] | None = None) -> TrainConfig:
    """Flags over YAML over defaults -> a validated TrainConfig."""
    flags = vars(build_parser().parse_args(argv))
    flags.pop("launcher_local_rank", None)
    values: dict[str, Any] = {}
    if "config" in flags:
        values.update(load_yaml_config(flags.pop("config")))
    values.update(flags)
    return TrainConfig(**values)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pretrain` console script."""
    from pretrain.launch import rank_env

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
    from pretrain import launch

    config = resolve_config(argv)
    return launch.launch(config, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
