"""`TrainConfig`: every setting of one `pretrain` run in one place (field, default, help text, validation).

    config = resolve_config(["--zero", "3", "--data", "shards/demo", "--out", "runs/z3"])

The `pretrain` flags, the keys of a `--config` YAML file and the axes of a study grid are all generated from
these fields: adding a setting is one field here. Every check runs in `__post_init__`, before any rank is
spawned, so a bad flag, YAML file or study grid point fails in one line (`pipeline.common.UserError`).
This module imports neither torch nor DeepSpeed: the study validates whole grids with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from pipeline.common import UserError, need
from pipeline.settings import add_flags, build_settings, merged_settings, setting

ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "cpu", "nvme")
SCHEDULES = ("constant", "linear", "cosine", "inverse_sqrt")
PRECISIONS = ("auto", "bf16", "fp32", "fp8")    # fp8: bf16 plus FP8 GEMMs in the blocks (pretrain.model.fp8)
LOADERS = ("shards", "online", "remote")   # pretrain.data: mmap'd shard set, text tokenised in the workers, s3 stream
CPU_AFFINITIES = ("none", "split")
GATHER_UNITS = ("block", "stack")     # ZeRO 3's unit of gathering; pretrain.model.zero3 maps each to a module
MODULE_HOOKS = ("auto", "keep")       # ZeRO 3's module hooks: pretrain.model.zero3.drop_idle_module_hooks
OPTIMIZER_STEPS = ("auto", "triton", "fused", "deepspeed")   # ZeRO 1-3's optimizer step: pretrain.fused_step
STAGE3_TUNABLES = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                   "stage3_max_live_parameters", "stage3_max_reuse_distance")


def engine_precision(precision: str) -> str:
    """The precision DeepSpeed's engine, MFU's peak and the memory estimate see for a resolved run precision: fp8
    trains on the bf16 engine (its FP8 GEMMs are the blocks' linears, converted by the trainer) and counts as bf16."""
    return "bf16" if precision == "fp8" else precision


AUTO_GRAPHS_MEMORY_SHARE = 0.75
"""--cudagraphs auto leaves graphs off where the preflight's memory estimate fills more than this share of a
device: their private pools come on top of the estimate (none through pretrain at mt5-large micro 32 x 2, 33 GiB
for mt5-large alone at batch 64 in the model benchmark), and graphs are measured at mt5-base and mt5-large (estimates
38-66% of a device), not at mt5-xl's 86% of an H200 (docs/pretrain.md)."""


def memory_share(estimate_gib: float, device: dict[str, Any]) -> float | None:
    """What --cudagraphs auto weighs (TrainConfig.graphs_on): a memory estimate per GPU over one GPU's memory, None
    without a GPU. `device`: the preflight's or study tune's description ("kind", "per_device_gib")."""
    per_device = device.get("per_device_gib")
    if device.get("kind") != "cuda" or not per_device:
        return None
    return estimate_gib / per_device


@dataclass
class TrainConfig:
    """Everything one `pretrain` run needs; saved resolved as RUN_DIR/config.json["train"]."""

    model: str = setting("t5-tiny", "model preset (configs/models/*.yaml), e.g. t5-tiny, mt5-base")
    data: str = setting("", "shard set written by `prep corpus` (directory or URL) (required)")
    out: str = setting("", "run directory (config.json, metrics.jsonl, checkpoints/, tb/, summary.json) (required)")
    zero: int = setting(2, "ZeRO stage", choices=ZERO_STAGES)
    offload: str = setting("none", "offload optimizer state (and params at stage 3) to cpu or nvme",
                           choices=OFFLOADS)
    nvme_path: str | None = setting(None, "directory for --offload nvme")
    steps: int = setting(100, "total optimizer steps (the schedule is laid out over these)")
    stop_after: int | None = setting(None, "stop after this many steps of this launch, with a checkpoint")
    micro_batch: int = setting(8, "examples per rank per forward/backward")
    global_batch: int | None = setting(None, "examples per optimizer step; grad accumulation = global/(micro*ranks)",
                                       default_text="micro batch x ranks")
    lr: float = setting(1e-3, "peak learning rate")
    warmup_steps: int = setting(0, "linear warmup steps, from lr/warmup_steps to lr")
    schedule: str = setting("cosine", "decay after warmup", choices=SCHEDULES)
    min_lr_ratio: float = setting(0.1, "floor of linear/cosine decay as a fraction of --lr")
    weight_decay: float = setting(0.0, "AdamW weight decay", default_text=0)
    adam_beta1: float = setting(0.9, "AdamW beta1")
    adam_beta2: float = setting(0.999, "AdamW beta2")
    adam_eps: float = setting(1e-8, "AdamW epsilon")
    grad_clip: float = setting(1.0, "gradient-norm clip, 0 disables")
    precision: str = setting("auto", "auto: bf16 on GPU, fp32 on CPU (also --bf16 / --fp32); fp8: bf16 (DeepSpeed's "
                                     "bf16 engine) with the encoder/decoder blocks' linear layers as FP8 GEMMs "
                                     "(pretrain/model/fp8.py; GPUs of compute capability >= 8.9, or the CPU for "
                                     "tests; the embedding, attention and the LM head stay bf16)",
                             choices=PRECISIONS)
    activation_checkpointing: bool = setting(False, "recompute activations in backward")
    compile: bool = setting(False, "torch.compile each block's forward and the loss chunk (every stage; "
                                   "~10-30 s on the first step)")
    cudagraphs: bool | None = setting(None, "Inductor replays each compiled block's forward and backward as CUDA "
                                             "graphs (torch.compile mode reduce-overhead), one launch where the host "
                                             "launched every kernel; needs --compile, ZeRO 0-2 and no activation "
                                             "checkpointing; auto: on for such runs on CUDA without offload "
                                             "whose memory estimate leaves a quarter of the GPU free "
                                             "(--no-cudagraphs: off); the CPU runs the same code without graphs",
                                      default_text="auto")
    loader_workers: int = setting(0, "DataLoader workers per rank")
    prefetch_factor: int = setting(2, "batches prefetched per loader worker")
    save_every: int = setting(0, "checkpoint every N steps (0: only at the end of the launch)")
    # -- checkpoints, resume and anomalies (issues 14, 18; docs/pretrain.md "Checkpoints and resume", "Anomalies")
    save_final: bool = setting(True, "checkpoint at the end of every launch (--no-save-final: none, e.g. for "
                                     "throughput measurements; such a run cannot be resumed)")
    keep_checkpoints: int = setting(0, "keep the newest K complete checkpoints, deleting older ones after each save "
                                       "(never the one this launch resumed from; 0: keep all)")
    resume: bool = setting(False, "continue from the newest complete checkpoint in --out (a newer one that fails to "
                                  "load is skipped, with one line, for the one before it)")
    resume_allow: list[str] = setting(default_factory=list, help="with --resume: settings that may differ from the "
                                      "saved run's and apply from the resumed step on (e.g. steps schedule lr "
                                      "data); model, zero, offload, precision and the global batch never may",
                                      metavar="NAME")
    spike_sigmas: float = setting(6.0, "skip the update of a step whose loss or gradient norm is more than this many "
                                       "standard deviations above the mean of the last --spike-window accepted "
                                       "steps (0: off; non-finite ones are always skipped)")
    spike_window: int = setting(100, "accepted steps in the rolling window that spikes are measured against "
                                     "(judged once the window is full)")
    rollback_after: int = setting(3, "after this many skipped steps in a row, reload the newest checkpoint before "
                                     "them and skip every global batch since it (0: never roll back)")
    debug_nan_batches: list[int] = setting(default_factory=list, help="test/debug hook: make the loss of these "
                                           "global batches (1-based) NaN", metavar="N")
    debug_spike_batches: list[int] = setting(default_factory=list, help="test/debug hook: multiply the loss (and so "
                                             "the gradients) of these global batches (1-based) by 1000",
                                             metavar="N")
    seed: int = setting(0, "seed for model init and data order")
    nproc: int = setting(1, "local ranks to spawn; ignored under torchrun/deepspeed")
    vocab_size: int | None = setting(None, "pin the model vocabulary (default: follows the shard set's tokenizer)")
    tokenizer: str | None = setting(None, "tokenizer.json the shard set must have been built with (sha256 checked)")
    input_length: int | None = setting(None, "expected input length; a shard set with another one is refused")
    target_length: int | None = setting(None, "expected target length; a shard set with another one is refused")
    verify: bool = setting(False, "sha256 every shard before training")
    cache_dir: str | None = setting(None, "local cache for a remote shard set")
    export_hf: str | None = setting(None, "write the final model to this directory in HF transformers format")
    force: bool = setting(False, "run even if the memory estimate says it does not fit")
    log_every: int = setting(1, "console progress line every N steps")
    steady_skip: int = setting(2, "first steps left out of the summary medians (compile, allocator warm-up)")
    profile_steps: int = setting(0, "profile the last N steps on rank 0 (torch.profiler): RUN_DIR/profile/ gets the "
                                    "trace, op tables and device-busy / host-sync shares; the summary's medians "
                                    "leave those steps out (0: off)")
    peak_tflops: float | None = setting(None, "device peak TFLOP/s for MFU (default: by device; none on CPU)")
    stage3_prefetch_bucket_size: int | None = setting(None, "ZeRO-3 prefetch bucket (elements)")
    stage3_param_persistence_threshold: int | None = setting(
        None, "ZeRO-3: params smaller than this stay gathered")
    stage3_max_live_parameters: int | None = setting(None, "ZeRO-3: max gathered params at once")
    stage3_max_reuse_distance: int | None = setting(None, "ZeRO-3: keep a param gathered if reused within this")
    stage3_gather_unit: str = setting("block", "ZeRO-3: gather each T5 block, or each whole encoder/decoder stack "
                                               "at once", choices=GATHER_UNITS)
    optimizer_step: str = setting("auto", "ZeRO 1-3 without offload: auto (the default) is triton on CUDA and fused "
                                          "elsewhere; triton runs AdamW in one Triton kernel that reads the bf16 "
                                          "gradients where ZeRO keeps them (pretrain/one_pass_adamw.py; mt5-xl's "
                                          "ZeRO 2 step on an H200 397.5 against fused's 414.5 ms, the same losses); "
                                          "fused concatenates the gradients into fp32 in one pass and runs torch's "
                                          "fused AdamW with the clipping factor inside (pretrain/fused_step.py); "
                                          "deepspeed runs DeepSpeed's step as it is; under offload always "
                                          "DeepSpeed's",
                                  choices=OPTIMIZER_STEPS)
    stage3_module_hooks: str = setting("auto", "ZeRO-3: DeepSpeed's per-module fetch/release hooks; auto leaves them "
                                               "out where they have nothing to do (one rank, every weight resident, "
                                               "nothing offloaded), keep always runs them", choices=MODULE_HOOKS)
    # -- long runs (issue 18; docs/pretrain.md "Long runs"): restarts of the local launcher, its watchdog -------
    max_restarts: int = setting(0, "--nproc launches: when a rank dies or hangs, stop all ranks and start them again "
                                   "with --resume from the newest complete checkpoint, up to N times (torchrun: "
                                   "its own --max-restarts, with --resume)")
    rank_timeout: float = setting(1800.0, "--nproc launches: seconds a rank may go without finishing a step or a "
                                          "start-up phase before the job is stopped, naming the rank (0: never)")
    # -- data loading and host CPU (issue 16; docs/loader.md): a loader mode, its settings, core binding --------
    loader: str = setting("shards", "shards: mmap'd shard set; online: raw text read, tokenised and span-corrupted "
                                    "in the loader workers (--data corpus files or a shard set whose corpus and "
                                    "settings to reuse); remote: an s3:// shard set streamed shard by shard through "
                                    "a bounded cache", choices=LOADERS)
    noise_density: float | None = setting(None, "online: fraction of each raw window masked (a shard set given as "
                                                "--data brings its own)", default_text=0.15)
    mean_span_length: float | None = setting(None, "online: mean masked span length in tokens (a shard set given "
                                                   "as --data brings its own)", default_text=3.0)
    text_field: str = setting("text", "online: the JSON field / column holding each document's text")
    unit_bytes: int | None = setting(None, "online: input bytes per work unit (the unit of distribution over ranks "
                                           "and workers, and of resume)", default_text="4 MiB or the shard set's")
    remote_prefetch_shards: int = setting(2, "remote: shards fetched ahead of the one being read")
    cache_max_gib: float | None = setting(None, "remote: most GiB of shards kept in --cache-dir (consumed shards "
                                                "are evicted; default: keep the whole set)")
    omp_num_threads: int | None = setting(None, "OpenMP / torch intra-op threads per rank (DeepSpeed's CPU-Adam "
                                                "runs on them under --offload cpu)", default_text="leave as is")
    cpu_affinity: str = setting("none", "none, or split: loader workers pinned one core each, ranks on the other "
                                        "cores (Linux sched_setaffinity)", choices=CPU_AFFINITIES)
    deepspeed: dict[str, Any] = setting(default_factory=dict, flag=False,
                                        help="raw DeepSpeed keys merged last (YAML only)")
    model_overrides: dict[str, Any] = setting(default_factory=dict, flag=False,
                                              help="T5Config fields over the preset's (YAML only)")

    def __post_init__(self) -> None:
        for name, allowed in (("zero", ZERO_STAGES), ("offload", OFFLOADS), ("schedule", SCHEDULES),
                              ("precision", PRECISIONS), ("stage3_gather_unit", GATHER_UNITS),
                              ("stage3_module_hooks", MODULE_HOOKS), ("optimizer_step", OPTIMIZER_STEPS),
                              ("loader", LOADERS), ("cpu_affinity", CPU_AFFINITIES)):
            need(getattr(self, name) in allowed,
                 f"--{name.replace('_', '-')} must be one of {', '.join(map(str, allowed))}; got {getattr(self, name)!r}")
        need(self.cudagraphs is not True or self.compile, "--cudagraphs replays the compiled blocks: add --compile")
        need(self.cudagraphs is not True or self.zero < 3, "--cudagraphs: ZeRO 3 gathers each block's weights to new "
             "addresses every step, which a CUDA graph cannot replay; use --zero 0-2 or drop --cudagraphs")
        need(self.cudagraphs is not True or not self.activation_checkpointing,
             "--cudagraphs with --activation-checkpointing: the recomputed forward would run outside the graphs; "
             "pick one")
        need(self.offload == "none" or self.zero >= 1,
             "--offload needs ZeRO stage 1 or higher (stage 0 keeps everything on the device); use --zero 2 or 3")
        need(self.offload != "nvme" or self.zero == 3,
             "--offload nvme needs --zero 3 (ZeRO-Infinity); use --offload cpu at stages 1-2")
        need(self.offload != "nvme" or bool(self.nvme_path),
             "--offload nvme needs --nvme-path DIR (a directory on a fast local NVMe drive)")
        need(not self.nvme_path or not os.path.exists(self.nvme_path) or os.path.isdir(self.nvme_path),
             f"--nvme-path {self.nvme_path} is a file; it must be a directory (on a fast local NVMe drive)")
        need(self.zero == 3 or all(getattr(self, name) is None for name in STAGE3_TUNABLES),
             "the --stage3-* tunables apply to --zero 3 only; drop them or use --zero 3")
        for name in ("steps", "micro_batch", "nproc", "log_every", "prefetch_factor"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "save_every", "loader_workers", "steady_skip", "profile_steps", "grad_clip",
                     "weight_decay", "keep_checkpoints", "spike_sigmas", "rollback_after"):
            need(getattr(self, name) >= 0, f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        need(0 < self.lr < float("inf"), f"--lr must be a finite number > 0, got {self.lr}")
        need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
             f"--adam-beta1 and --adam-beta2 must be in [0, 1), got {self.adam_beta1} and {self.adam_beta2}")
        need(0 < self.adam_eps < float("inf"), f"--adam-eps must be a finite number > 0, got {self.adam_eps}")
        for name in ("input_length", "target_length", "peak_tflops"):
            need(getattr(self, name) is None or getattr(self, name) > 0,
                 f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for name in STAGE3_TUNABLES:
            need(getattr(self, name) is None or getattr(self, name) >= 0,
                 f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        need(0 <= self.seed < 2**64, f"--seed must be >= 0 and < 2**64 (numpy and torch seeds), got {self.seed}")
        need(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(self.stop_after is None or 1 <= self.stop_after,
             f"--stop-after must be >= 1, got {self.stop_after}")
        need(self.global_batch is None or self.global_batch >= 1, "--global-batch must be >= 1")
        need(isinstance(self.deepspeed, dict) and isinstance(self.model_overrides, dict),
             "deepspeed and model_overrides must be mappings (YAML: `deepspeed: {key: value}`)")
        self._check_loader()
        need(self.max_restarts >= 0, f"--max-restarts must be >= 0, got {self.max_restarts}")
        need(self.rank_timeout >= 0, f"--rank-timeout must be >= 0 seconds (0: no watchdog), got {self.rank_timeout}")
        self._check_resume_and_anomalies()
        need(bool(self.data), "--data SHARDS is required (a shard set written by `prep corpus`)")
        need(bool(self.out), "--out RUN_DIR is required")

    def _check_loader(self) -> None:
        """The loader mode's settings (issue 16): each only where its mode reads it."""
        online_only = ("noise_density", "mean_span_length", "unit_bytes")
        need(self.loader == "online" or all(getattr(self, name) is None for name in online_only),
             "--noise-density, --mean-span-length and --unit-bytes apply to --loader online; drop them or use it")
        need(self.loader == "remote" or self.cache_max_gib is None,
             "--cache-max-gib applies to --loader remote; drop it or use --loader remote")
        need(self.loader != "remote" or "://" in self.data,
             f"--loader remote reads an s3:// shard set; got --data {self.data!r} (use --loader shards for a local one)")
        need(self.loader != "online" or not self.verify, "--verify checks shards; --loader online makes none")
        need(self.cache_dir is None or (self.loader != "online" and "://" in self.data),
             f"--cache-dir holds the local copy of a shard set read from a URL (s3://...); --data {self.data!r} "
             f"{'is read by --loader online' if self.loader == 'online' else 'is local'}: drop --cache-dir")
        need(self.remote_prefetch_shards >= 0, f"--remote-prefetch-shards must be >= 0, got {self.remote_prefetch_shards}")
        need(self.cache_max_gib is None or self.cache_max_gib > 0, f"--cache-max-gib must be > 0, got {self.cache_max_gib}")
        need(self.unit_bytes is None or self.unit_bytes >= 1024, f"--unit-bytes must be >= 1024, got {self.unit_bytes}")
        need(self.omp_num_threads is None or self.omp_num_threads >= 1,
             f"--omp-num-threads must be >= 1, got {self.omp_num_threads}")
        need(self.noise_density is None or 0 < self.noise_density < 1,
             f"--noise-density must lie strictly between 0 and 1, got {self.noise_density}")
        need(self.mean_span_length is None or self.mean_span_length >= 1,
             f"--mean-span-length must be >= 1, got {self.mean_span_length}")

    def _check_resume_and_anomalies(self) -> None:
        """--resume-allow names settings; the spike window has room for a mean and a deviation."""
        unknown = sorted(set(self.resume_allow) - {f.name for f in dataclasses.fields(self)})
        need(not unknown, f"--resume-allow: no such setting {', '.join(unknown)}; name settings as in "
                          f"`pretrain --help` with _ (e.g. steps, schedule, lr)")
        need(self.spike_window >= 2, f"--spike-window must be >= 2 (a standard deviation needs two steps), got "
                                     f"{self.spike_window}")
        for name in ("debug_nan_batches", "debug_spike_batches"):
            need(all(int(n) >= 1 for n in getattr(self, name)),
                 f"--{name.replace('_', '-')} takes global batch numbers >= 1")

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

    def graphs_on(self, cuda: bool, memory_share: float | None = None) -> bool:
        """--cudagraphs resolved for a run on CUDA (cuda=True) or not: as given, or auto (None): on for compiled
        ZeRO 0-2 runs on CUDA without activation checkpointing or offload (measured: docs/pretrain.md, "The compiled
        blocks as CUDA graphs"; offload's step waits on CPU-Adam, which graphs do not shorten, and is not measured),
        and whose memory estimate fills at most AUTO_GRAPHS_MEMORY_SHARE of a device (`memory_share`, the
        estimate over the device's memory, where known): the graphs' private pools come on top of the estimate."""
        if self.cudagraphs is not None:
            return self.cudagraphs
        return (cuda and self.compile and self.zero < 3 and not self.activation_checkpointing
                and self.offload == "none" and (memory_share is None or memory_share <= AUTO_GRAPHS_MEMORY_SHARE))

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """`pretrain`'s flags: one per TrainConfig field, `--config FILE`, and --bf16 / --fp32 for --precision."""
    parser.add_argument("--config", default=argparse.SUPPRESS,
                        help="YAML file whose keys are these flags' names, with - or _ (flags win)")
    add_flags(parser, TrainConfig)
    shorthand = parser.add_mutually_exclusive_group()
    shorthand.add_argument("--bf16", dest="precision_shorthand", action="store_const", const="bf16",
                           default=argparse.SUPPRESS, help="--precision bf16 (the default on GPU)")
    shorthand.add_argument("--fp32", dest="precision_shorthand", action="store_const", const="fp32",
                           default=argparse.SUPPRESS, help="--precision fp32 (the default on CPU)")


def config_from_values(values: dict[str, Any], *, where: str) -> TrainConfig:
    """A TrainConfig from YAML-like values (a `--config` file, a study point), type-checked and validated."""
    if "bf16" in values or "fp32" in values:
        raise UserError(f"{where}: write `precision: bf16` or `precision: fp32` instead of bf16/fp32 keys")
    return build_settings(TrainConfig, values, where=where)


def resolve_flags(flags: dict[str, Any]) -> TrainConfig:
    """Parsed flags (a `--config` path among them, maybe) over the YAML file over the field defaults."""
    where = str(flags.get("config", "the command line"))
    if "precision_shorthand" in flags:
        flags = dict(flags)
        shorthand = flags.pop("precision_shorthand")
        if flags.get("precision", shorthand) != shorthand:
            raise UserError(f"--{shorthand} and --precision {flags['precision']} say different things; give one")
        flags["precision"] = shorthand
    values = merged_settings(TrainConfig, flags, command="pretrain", extra_keys=("config", "bf16", "fp32"))
    values.pop("config", None)
    return config_from_values(values, where=where)
