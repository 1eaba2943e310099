"""One rank of a `pretrain` run: DeepSpeed engine, shard loader, the instrumented step loop and its hooks.

    run_rank(config, plan, rank_env())     # called by pretrain.cli in every rank process

The loop is a step generator (levanter-style): `steps()` yields one record per optimizer step and the hooks
(metrics log, checkpointing) run on each record. A step pulls `grad_accum` micro-batches; the time blocked
in next(loader) is data_wait_s, everything else (forward, backward, the optimizer step, device sync) is
compute_s. The loss of a step is the mean over its micro-batches and ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.profiler import record_function

from pipeline.common import REPO_ROOT, UserError, atomic_write_json, usable_cores
from pretrain import checkpoint as ckpt
from pretrain.anomalies import DEBUG_SPIKE_FACTOR, MAX_ROLLBACKS, StepGuard
from pretrain.ranks import RESUMABLE_EXIT, heartbeat, launch_t0, preemption, startup_threads
from pretrain.hostcpu import HostMeter, bind_rank, set_omp_threads
from pretrain.metrics import MetricsLog, PhaseClock, host_peak_rss_gib, peak_tflops_for, summarize, write_summary
from pretrain.fused_step import fuse_optimizer_step
from pretrain.grad_norm import fuse_grad_norm


@dataclasses.dataclass
class LRSchedule:
    """Multiplier of the peak lr after `step` optimizer steps: linear warmup, then constant, linear or
    cosine decay to min_lr_ratio at `total_steps`, or inverse square root (T5's schedule)."""

    schedule: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        n = step + 1                       # the step about to be taken, 1-based
        if self.warmup_steps and n <= self.warmup_steps:
            return n / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        if self.schedule == "inverse_sqrt":
            return math.sqrt(max(1, self.warmup_steps) / n)
        progress = min(1.0, (n - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        if self.schedule == "linear":
            return 1.0 - (1.0 - self.min_lr_ratio) * progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def git_revision() -> str:
    """HEAD of the repository this code runs from (+ '-dirty' when tracked files differ), or 'unknown'."""
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("-dirty" if dirty else "")) if head else "unknown"


def init_rank(local_rank: int, local_world_size: int, log_level: int = logging.WARNING) -> None:
    """This rank's DeepSpeed process group (gloo on CPU, nccl on GPU): DeepSpeed's log level, the rank's device
    (on CPU its share of the host's threads), then `deepspeed.init_distributed`."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    for target in (deepspeed.utils.logger, *deepspeed.utils.logger.handlers):
        target.setLevel(log_level)
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        torch.set_num_threads(max(1, usable_cores() // max(1, local_world_size)))
        # DeepSpeed JIT-compiles a shared-memory all-reduce op on CPU (~1 min, needs a C++ compiler) that only
        # its inference all-reduce uses; training never calls it, so mark it unavailable and skip the build.
        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        if isinstance(compatible, dict):
            compatible["deepspeed_shm_comm"] = False
    else:
        accelerator.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)


def any_inf_or_nan_fused(grads) -> torch.Tensor:
    """Whether any of `grads` holds an inf or NaN, as a [1] bool tensor on their device, from one multi-tensor
    max-abs (`torch._foreach_norm` at ord inf: NaN and inf propagate, and a max cannot overflow as a 2-norm can)
    instead of DeepSpeed's ~7 small ops per tensor."""
    grads = [g for g in grads if g is not None and g.numel()]
    if not grads:
        return torch.zeros(1, dtype=torch.bool)
    return torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().logical_not().any().reshape(1)


def any_inf_or_nan(params) -> bool:
    """Whether any gradient of `params` holds an inf or NaN (`any_inf_or_nan_fused`), read with one host sync."""
    return bool(any_inf_or_nan_fused([p.grad for p in params]))


def fuse_overflow_check(optimizer) -> bool:
    """Give DeepSpeed's overflow check of a bf16 (or fp16) step one host sync and a few kernels, the same answers.

    - ZeRO 0: DeepSpeed wraps the optimizer in its FP16_Optimizer, whose `CheckOverflow` tests gradient after
      gradient with Python truthiness: mt5-large's 390 tensors cost 390 device syncs per step, which on 2 H200s
      left the GPU idle ~37 ms of every optimizer step (profile in docs/pretrain.md). Replaced by
      `any_inf_or_nan`.
    - ZeRO 1 and 2: DeepSpeedZeroOptimizer sums amax/amin/isfinite tests per gradient on the device (no sync per
      tensor, but ~2,700 op launches per step for mt5-large, host time the GPU waits for at the end of the step:
      docs/model.md's profile). Replaced by `any_inf_or_nan_fused` over the same gradients.
    - ZeRO 3 already tests its flat gradient buffer in one op. Returns whether a check was replaced."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.utils import CheckOverflow
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    checker = getattr(optimizer, "overflow_checker", None)
    if isinstance(checker, CheckOverflow):
        checker.has_overflow_serial = any_inf_or_nan
        return True
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        def partitioned_grads_overflow() -> torch.Tensor:
            grads = [g for i in range(len(optimizer.bit16_groups)) for g in optimizer.averaged_gradients[i]]
            return any_inf_or_nan_fused(grads).to(get_accelerator().current_device_name())
        optimizer.has_overflow_partitioned_grads_serial = partitioned_grads_overflow
        return True
    return False


def run_rank(config, plan, env) -> int:
    """Initialise the process group (gloo on CPU, nccl on GPU), train, and tear down."""
    timeline = Timeline(launch_t0())
    timeline.mark("preflight")   # process start, imports, the preflight again
    init_rank(env.local_rank, env.local_world_size)
    timeline.mark("distributed")
    try:
        trainer = Trainer(config, plan, env, timeline)
        return trainer.run()
    except torch.OutOfMemoryError as err:
        raise UserError(f"out of memory on rank {env.rank} ({str(err).splitlines()[0][:160]}); try a higher "
                        f"--zero stage, --offload cpu, --activation-checkpointing or a smaller --micro-batch")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class Timeline:
    """Seconds from the launch's start (`pretrain.ranks.launch_t0`) to each start-up phase's end, in order:
    where a launch's fixed cost goes (preflight, process group, model build, engine, loader, first step)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.marks: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        self.marks[phase] = round(time.time() - self.t0, 3)
        heartbeat(phase)            # the local launcher's watchdog (pretrain.launch): this rank is alive

    def describe(self) -> str:
        return ", ".join(f"{phase} {at:.1f}s" for phase, at in self.marks.items())


class Trainer:
    """Holds the engine, loader and hooks of one rank; `run()` trains and writes the run directory."""

    def __init__(self, config, plan, env, timeline: Timeline):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        from pretrain.data.modes import open_loader
        from pretrain.ds_config import build_ds_config, resolve_precision
        self.accelerator = get_accelerator()
        self.on_cpu = self.accelerator.device_name() == "cpu"
        # --cudagraphs auto -> on or off for this device and the memory estimate; config.json records what ran
        config = config.replace(cudagraphs=config.graphs_on(cuda=self.accelerator.device_name() == "cuda",
                                                            memory_share=plan.memory_share()))
        self.config, self.plan, self.env = config, plan, env
        self.timeline = timeline
        self.device = torch.device("cpu") if self.on_cpu else torch.device(self.accelerator.device_name(),
                                                                            env.local_rank)
        self.run_dir = Path(config.out)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.world_size = env.world_size
        self.grad_accum = config.grad_accum(self.world_size)
        self.global_batch = config.resolved_global_batch(self.world_size)
        self.precision = resolve_precision(config.precision, "cpu" if self.on_cpu else "gpu")
        self.ds_config = build_ds_config(config, world_size=self.world_size, grad_accum=self.grad_accum,
                                         accelerator="cpu" if self.on_cpu else "gpu")
        device_name = "cpu" if self.on_cpu else torch.cuda.get_device_name(self.device)
        self.peak_tflops = peak_tflops_for(device_name, self.precision, config.peak_tflops)

        # --cpu-affinity / --omp-num-threads before DeepSpeed starts its threads and loads CPU-Adam (pretrain.hostcpu)
        self.binding, self.worker_cores = bind_rank(config.cpu_affinity, local_rank=env.local_rank,
                                                    local_world_size=env.local_world_size,
                                                    workers=config.loader_workers)
        set_omp_threads(config.omp_num_threads, torch.set_num_threads)
        self.resume_tag = self._prepare_resume() if config.resume else None
        if config.zero == 3:     # the partitioned build already puts weights on the devices
            self._wait_for_start_gate()
        with startup_threads(env.local_world_size, torch.get_num_threads, torch.set_num_threads) as threads:
            self.model_init = self._build_model(plan.model_config, config.seed)   # ahead of its gate: a core share
        self.model_init["startup_threads"] = threads
        model = self.model_init.pop("model")
        self.timeline.mark("model_built")
        if config.zero < 3:      # built on the host: wait for the devices only now
            self._wait_for_start_gate()
        if self.precision == "fp8":   # the blocks' linears as FP8 GEMMs, before compiling and the engine
            from pretrain.model.fp8 import convert_to_fp8
            self.model_init["fp8_linears"] = len(convert_to_fp8(model, self.device))
        if config.compile:
            model.compile_regions(mode="reduce-overhead" if config.cudagraphs else None)
        schedule = LRSchedule(config.schedule, config.warmup_steps, config.steps, config.min_lr_ratio)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.ds_config,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule))
        self.engine_note = {"optimizer": type(self.optimizer).__name__,
                            "overflow_check_fused": fuse_overflow_check(self.optimizer),
                            "grad_norm_fused": fuse_grad_norm(self.optimizer),
                            "optimizer_step": fuse_optimizer_step(self.optimizer, config.optimizer_step)}
        if config.zero == 3:
            from pretrain.model.zero3 import drop_idle_module_hooks
            self.engine_note["module_hooks"] = ("dropped" if config.stage3_module_hooks == "auto"
                                                and drop_idle_module_hooks(self.optimizer) else "kept")
        self.pending: dict[str, Any] = {}      # the optimizer step being taken: its loss, grad norm and verdict
        self._guard_inner_optimizer()
        self.timeline.mark("engine")
        # --loader shards | online | remote (pretrain.data.modes); ids checked against the vocabulary (issue 14.12)
        self.loader = open_loader(config, rank=env.rank, world_size=self.world_size, global_batch=self.global_batch,
                                  pin_memory=not self.on_cpu, token_limit=plan.model_config.vocab_size,
                                  worker_cores=self.worker_cores)
        self.host = HostMeter(self.loader, config.loader_workers)
        self.timeline.mark("loader")
        self.start_step = 0
        self.resumed_from = None
        self.global_batches_read = 0         # global batches this run has read (skipped ones too)
        anomaly_state = None
        if config.resume:
            if self.resume_tag is None:
                self._say(f"[resume] no complete checkpoint in {self.checkpoint_dir}: starting at step 0")
            else:
                tag, client = self._load_with_fallback(self.resume_tag)
                self.start_step = int(client["step"])
                self.loader.load_state_dict(client["loader"])
                self.global_batches_read = int(client.get("global_batches", self.start_step))
                anomaly_state = client.get("anomalies")
                self.resumed_from = tag
                self._apply_allowed_changes()
                self._say(f"[resume] {tag}: step {self.start_step}, loader {client['loader']}")
        self.guard = StepGuard(sigmas=config.spike_sigmas, window=config.spike_window,
                               rollback_after=config.rollback_after, state=anomaly_state)
        from pretrain.model.flops import train_step_flops
        self.step_flops = train_step_flops(plan.model_config, self.global_batch, plan.input_length,
                                           plan.target_length)
        self.tokens_per_step = self.global_batch * (plan.input_length + plan.target_length)
        self.end_step = config.steps if config.stop_after is None else min(config.steps,
                                                                            self.start_step + config.stop_after)
        self.position_weights = torch.arange(1, plan.input_length + 1, dtype=torch.int64)
        self.profiler = None
        if config.profile_steps and env.is_main:
            from pretrain.profiling import StepProfiler
            first = max(self.start_step + 1, self.end_step - config.profile_steps + 1)
            self.profiler = StepProfiler(self.run_dir / "profile", first_step=first, last_step=self.end_step,
                                         cuda=not self.on_cpu, say=self._say)

    # -- helpers -----------------------------------------------------------------------------------------------

    def _prepare_resume(self) -> str | None:
        """The tag to resume from, before the engine exists: the newest complete one whose files are all there at
        their saved sizes and, when a ZeRO 1-3 tag was saved at another world size, whose universal conversion
        (rank 0, once) succeeds; the DeepSpeed config then asks for a universal load. A newer tag that fails is
        reported in one line and the one before it tried. None: no complete checkpoint."""
        tags = ckpt.complete_tags(self.checkpoint_dir)
        for tag in tags:
            problem = ckpt.tag_problem(self.checkpoint_dir, tag) or self._universal_problem(tag)
            if problem is None:
                return tag
            self._fall_back(tag, problem, tags)
        return None

    def _universal_problem(self, tag: str) -> str | None:
        """Convert `tag` for this world size when it needs it; why it cannot be, or None."""
        import torch.distributed as dist

        if not ckpt.needs_universal(self.checkpoint_dir, tag, world_size=self.world_size, zero_stage=self.config.zero):
            return None
        if self.config.offload == "nvme":
            saved = ckpt.saved_world_size(self.checkpoint_dir / tag)
            return (f"{self.checkpoint_dir / tag}: saved by {saved} ranks, resumed with {self.world_size}; with "
                    f"--offload nvme DeepSpeed copies each rank's swapped optimizer state back as it is and cannot "
                    f"load a universal checkpoint: resume with --nproc {saved}")
        failure = [None]
        if self.env.rank == 0:
            try:
                ckpt.convert_to_universal(self.checkpoint_dir, tag, say=self._say)
            except Exception as err:      # every rank must hear of it, not wait at a barrier
                failure = [f"{self.checkpoint_dir / tag}: conversion to a universal checkpoint failed "
                           f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"]
        dist.broadcast_object_list(failure, src=0)
        if failure[0] is None:
            self.ds_config["checkpoint"] = {**self.ds_config.get("checkpoint", {}), "load_universal": True}
        return failure[0]

    def _fall_back(self, tag: str, problem: str, tags: list[str]) -> None:
        """One line saying why `tag` is skipped and what comes next; a UserError when nothing older is left."""
        older = tags[tags.index(tag) + 1:]
        if older:
            self._say(f"[resume] {tag} cannot be loaded: {problem}; falling back to {older[0]}")
            return
        raise UserError(f"{problem}; no older complete checkpoint in {self.checkpoint_dir} to fall back to (start "
                        f"over with a new --out, or restore the file)")

    def _load_with_fallback(self, first: str, *, before_step: int | None = None) -> tuple[str, dict[str, Any]]:
        """Load `first` into the engine, else the complete tags before it (newest first, every rank alike: a load
        that fails on any rank fails on all). Returns (tag, client state)."""
        tags = [t for t in ckpt.complete_tags(self.checkpoint_dir) if t <= first]
        universal = bool(self.ds_config.get("checkpoint", {}).get("load_universal"))
        for tag in tags:
            problem = None if tag == first else ckpt.tag_problem(self.checkpoint_dir, tag)
            if problem is None and ckpt.needs_universal(self.checkpoint_dir, tag, world_size=self.world_size,
                                                        zero_stage=self.config.zero) != universal:
                problem = (f"{self.checkpoint_dir / tag}: saved at {ckpt.saved_world_size(self.checkpoint_dir / tag)}"
                           f" ranks, another layout than {first}'s; --resume from it alone")
            client = None
            if problem is None:
                try:
                    client = ckpt.load_checkpoint(self.engine, self.checkpoint_dir, tag, rank=self.env.rank,
                                                  world_size=self.world_size)
                except Exception as err:           # agreed on below: no rank goes on alone
                    problem = (f"{self.checkpoint_dir / tag}: loading failed on rank {self.env.rank} "
                               f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})")
                problems = [None] * self.world_size
                torch.distributed.all_gather_object(problems, problem)
                problem = next((p for p in problems if p), None)
            if problem is None:
                return tag, client
            self._fall_back(tag, problem, tags)
        raise UserError(f"{self.checkpoint_dir}: no complete checkpoint left to load")

    def _apply_allowed_changes(self) -> None:
        """With --resume-allow: the new schedule, peak lr and AdamW settings replace the saved ones from the resumed
        step on (the scheduler's saved state carries the old schedule and lr, the optimizer's the old settings)."""
        allowed = set(self.config.resume_allow)
        if not allowed & {"steps", "schedule", "warmup_steps", "min_lr_ratio", "lr", "weight_decay", "adam_beta1",
                          "adam_beta2", "adam_eps"}:
            return
        config = self.config
        schedule = LRSchedule(config.schedule, config.warmup_steps, config.steps, config.min_lr_ratio)
        self.scheduler.lr_lambdas = [schedule] * len(self.optimizer.param_groups)
        self.scheduler.base_lrs = [config.lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group.update(lr=config.lr * schedule(self.scheduler.last_epoch), betas=(config.adam_beta1, config.adam_beta2),
                         eps=config.adam_eps, weight_decay=config.weight_decay)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    # -- skipping bad updates (pretrain.anomalies) ---------------------------------------------------------------

    def _guard_inner_optimizer(self) -> None:
        """Route the basic optimizer's step (torch AdamW, FusedAdam, DeepSpeedCPUAdam) through the guard. DeepSpeed's
        ZeRO 1-3 and bf16 wrappers call it after they computed the global gradient norm (all-reduced, before
        clipping), so the verdict sees this step's norm; a skipped inner step leaves weights, moments and step
        counts as they were, and DeepSpeed then clears the gradients and partitions as after any step. At ZeRO 0
        fp32 the engine holds the basic optimizer itself: the norm is taken from the gradients before the step."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        original = inner.step

        def guarded_step(*args, **kwargs):
            pending = self.pending
            if not pending.get("judged"):
                pending["grad_norm"] = self._grad_norm_now()
                pending["reason"] = self.guard.verdict(pending["loss"], pending["grad_norm"])
                pending["judged"] = True
            if pending["reason"] is None:
                return original(*args, **kwargs)
            return None

        inner.step = guarded_step

    def _grad_norm_now(self) -> float | None:
        norm = getattr(self.optimizer, "_global_grad_norm", None)
        if norm is None:
            norm = self.pending.get("pre_step_norm")
        return None if norm is None else float(norm)

    def _begin_verdict(self, loss: float) -> None:
        """Before the update: this step's loss, and at ZeRO 0 fp32 the gradient norm (identical on every rank)."""
        self.pending = {"loss": loss, "judged": False, "reason": None, "grad_norm": None}
        if getattr(self.optimizer, "optimizer", None) is None:
            norms = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
            self.pending["pre_step_norm"] = float(torch.stack(norms).norm()) if norms else None

    def _finish_verdict(self, step: int) -> str | None:
        """After engine.step(): the verdict recorded in the guard. When DeepSpeed skipped the update by itself (its
        overflow path: a non-finite gradient norm at ZeRO 1-3 fp32) the inner step never ran; the scheduler, which
        DeepSpeed then leaves alone, is stepped here so the lr keeps following the step number."""
        pending = self.pending
        if not pending["judged"]:
            pending["grad_norm"] = float("inf") if not self.engine.was_step_applied() else self._grad_norm_now()
            pending["reason"] = self.guard.verdict(pending["loss"], pending["grad_norm"])
            if not self.engine.was_step_applied():
                self.scheduler.step()
        self.guard.record(step, self.global_batches_read, pending["reason"], pending["loss"], pending["grad_norm"])
        return pending["reason"]

    def _debug_loss_factor(self, global_batch: int) -> float | None:
        if global_batch in self.config.debug_nan_batches:
            return float("nan")
        if global_batch in self.config.debug_spike_batches:
            return DEBUG_SPIKE_FACTOR
        return None

    @staticmethod
    def _finite(value: float | None) -> float | None:
        return None if value is None or not math.isfinite(value) else float(value)

    def _roll_back(self, step: int) -> dict[str, Any]:
        """After `rollback_after` skipped updates in a row ending at `step`: reload the newest complete checkpoint
        before them (falling back past unloadable ones), drop the complete checkpoints after it (another timeline)
        and go on from there with the global batch after the last one read: every batch since the checkpoint is
        skipped. Returns the rollback event (its "step" is the step training continues from)."""
        first_skipped = step - self.guard.streak + 1
        reasons = sorted({s["reason"] for s in self.guard.skipped[-self.guard.streak:]})
        before = [t for t in ckpt.complete_tags(self.checkpoint_dir) if ckpt.step_of(t) < first_skipped]
        if not before:
            raise UserError(f"steps {first_skipped}-{step}: {self.guard.streak} updates skipped in a row "
                            f"({', '.join(reasons)}) and no checkpoint before them in {self.checkpoint_dir} to roll "
                            f"back to; lower --lr, raise --spike-sigmas, or save checkpoints with --save-every")
        if len(self.guard.rollbacks) >= MAX_ROLLBACKS:
            raise UserError(f"step {step}: {MAX_ROLLBACKS} rollbacks in this launch and the updates are still skipped "
                            f"({', '.join(reasons)}); the run diverges: lower --lr or check the data")
        tag, client = self._load_with_fallback(before[0])
        to_step = int(client["step"])
        since = int(client.get("global_batches", to_step))
        self._barrier()
        if self.env.is_main:
            ckpt.drop_after(self.checkpoint_dir, to_step, say=self._say)
        self._barrier()
        skipped_batches = list(range(since + 1, self.global_batches_read + 1))
        event = self.guard.rolled_back(from_step=step, to_step=to_step, skipped_batches=skipped_batches)
        self._say(f"[rollback] steps {first_skipped}-{step} skipped in a row ({', '.join(reasons)}): reloaded {tag}, "
                  f"skipping global batches {skipped_batches[0]}-{skipped_batches[-1]}")
        return {"event": "rollback", "step": to_step, **event}

    def _build_model(self, model_config, seed: int) -> dict[str, Any]:
        """The seeded model; at ZeRO 3 built partitioned (`pretrain.model.zero3.build_partitioned`: no rank ever holds
        the whole model, the weights are `build`'s bit for bit). Returns {model, method, parameters,
        local_parameters, host_peak_rss_gib}: local_parameters are the elements this rank holds (its partitions
        at ZeRO 3); host_peak_rss_gib is this rank's peak host memory up to the end of the build."""
        from pretrain.model.t5 import build
        from pretrain.model.zero3 import build_partitioned

        if self.config.zero == 3:
            model = build_partitioned(model_config, self.ds_config, seed=seed,
                                      gather_unit=self.config.stage3_gather_unit)
            parameters = sum(p.ds_numel for p in model.parameters())
            local = sum(p.ds_tensor.numel() for p in model.parameters())
            method = "deepspeed.zero.Init + GatheredParameters(modifier_rank=0) per module"
        else:
            model = build(model_config, seed=seed)
            parameters = local = sum(p.numel() for p in model.parameters())
            method = "pretrain.model.t5.build (whole model on every rank)"
        return {"model": model, "method": method, "parameters": parameters, "local_parameters": local,
                "attention": model_config.self_attention_kind(self.device.type),   # what `auto` resolved to
                "host_peak_rss_gib": round(host_peak_rss_gib(), 3)}   # this rank's host peak so far

    def _wait_for_start_gate(self) -> None:
        """Under `study run` with overlap_startup, hold here until the previous point has left the devices."""
        from pretrain.ranks import wait_for_start_gate

        waited = wait_for_start_gate()
        if waited is not None:
            self.timeline.mark("start_gate")

    def _say(self, message: str) -> None:
        if self.env.is_main:
            print(message, flush=True)

    def _barrier(self) -> None:
        torch.distributed.barrier()

    def _write_run_config(self) -> None:
        import deepspeed

        if not self.env.is_main:
            return
        atomic_write_json(self.run_dir / "config.json", {
            "train": dataclasses.asdict(self.config),
            "model": self.plan.model_config.to_dict(),
            "vocab": self.plan.vocab_note,
            "deepspeed": self.ds_config,
            "memory_estimate": self.plan.memory_estimate,
            "model_init": self.model_init,
            "engine": self.engine_note,
            "git_revision": git_revision(),
            "shard_fingerprint": self.plan.shard_fingerprint,
            "tokenizer_sha256": self.plan.tokenizer_sha256,
            "input_length": self.plan.input_length, "target_length": self.plan.target_length,
            "world_size": self.world_size, "grad_accum": self.grad_accum, "global_batch": self.global_batch,
            "precision": self.precision, "accelerator": self.accelerator.device_name(),
            "device": self.plan.device, "peak_tflops": self.peak_tflops, "step_flops": self.step_flops,
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
            "resumed_from": self.resumed_from, "start_step": self.start_step,
        })

    def _peak_mem_gib(self) -> tuple[float, float]:
        """(peak memory, peak reserved): on CPU the process's peak RSS, and 0 (no allocator's reserve to tell); on
        a GPU torch's peak allocated and peak reserved. Reserved holds the allocator's cached blocks and CUDA graphs'
        private pools (--cudagraphs), whose replays allocate nothing: what the device gives the process."""
        if self.on_cpu:
            return host_peak_rss_gib(), 0.0
        return (torch.cuda.max_memory_allocated(self.device) / (1 << 30),
                torch.cuda.max_memory_reserved(self.device) / (1 << 30))

    # -- the loop ------------------------------------------------------------------------------------------------

    def steps(self) -> Iterator[dict[str, Any]]:
        """Train from start_step to end_step, yielding one metrics record per optimizer step (and a rollback
        event when `rollback_after` updates in a row were skipped: training goes on from that checkpoint)."""
        batches = iter(self.loader)
        engine, config = self.engine, self.config
        synchronize = (lambda: None) if self.on_cpu else self.accelerator.synchronize
        clock = PhaseClock(cuda=not self.on_cpu)
        step = self.start_step
        while step < self.end_step:
            step += 1
            self.global_batches_read += 1        # never rewound: a rollback skips the batches since its checkpoint
            global_batch = self.global_batches_read
            loss_factor = self._debug_loss_factor(global_batch)
            lr = float(self.optimizer.param_groups[0]["lr"])
            data_wait_s = 0.0
            losses = []
            checksum = 0
            synchronize()
            if self.profiler is not None:
                self.profiler.before_step(step)
            step_start = time.perf_counter()
            self.host.start_step()
            if self.config.cudagraphs:   # the blocks' graphs may overwrite the last step's outputs from here
                torch.compiler.cudagraph_mark_step_begin()
            for micro in range(self.grad_accum):
                wait_start = time.perf_counter()
                with record_function("pretrain.data"), self.host.loading():
                    batch = next(batches)
                data_wait_s += time.perf_counter() - wait_start
                checksum += int((batch["input_ids"] * self.position_weights).sum())
                input_ids = batch["input_ids"].to(self.device, non_blocking=True)
                labels = batch["labels"].to(self.device, non_blocking=True)
                clock.begin()
                with record_function("pretrain.forward"):
                    loss = engine(input_ids, labels=labels)
                    if loss_factor is not None:            # --debug-nan-batches / --debug-spike-batches
                        loss = loss * loss_factor
                clock.end("forward_s")
                clock.begin()
                with record_function("pretrain.backward"):
                    engine.backward(loss)
                clock.end("backward_s")
                losses.append(loss.detach().float())
                if micro == self.grad_accum - 1:           # the step's loss on every rank, before its update
                    reduced = torch.stack([torch.stack(losses).mean().double().to(self.device),
                                           torch.tensor(float(checksum), dtype=torch.float64, device=self.device)])
                    torch.distributed.all_reduce(reduced)
                    self._begin_verdict(float(reduced[0]) / self.world_size)
                clock.begin()
                with record_function("pretrain.step"), self.host.optimizer():   # the optimizer step (last micro)
                    engine.step()
                clock.end("optimizer_s")
            skipped = self._finish_verdict(step)
            synchronize()
            step_time_s = time.perf_counter() - step_start
            host = self.host.end_step(step_time_s)      # rank 0's process tree (pretrain.hostcpu)
            if self.profiler is not None:
                self.profiler.after_step(step)
            peak = torch.tensor(self._peak_mem_gib(), dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            grad_norm = self.pending["grad_norm"]
            tflops_per_gpu = self.step_flops / step_time_s / self.world_size / 1e12
            yield {
                "step": step, "loss": self._finite(self.pending["loss"]), "lr": lr,
                "step_time_s": step_time_s, "data_wait_s": data_wait_s, "compute_s": step_time_s - data_wait_s,
                **clock.totals(),
                "tokens": self.tokens_per_step, "tokens_per_s": self.tokens_per_step / step_time_s,
                "samples_per_s": self.global_batch / step_time_s, "tflops_per_gpu": tflops_per_gpu,
                "mfu": tflops_per_gpu / self.peak_tflops if self.peak_tflops else None,
                "peak_mem_gib": float(peak[0]), "peak_reserved_gib": None if self.on_cpu else float(peak[1]),
                "zero_stage": config.zero, "offload": config.offload,
                "world_size": self.world_size, "micro_batch": config.micro_batch, "grad_accum": self.grad_accum,
                "loader_workers": config.loader_workers,
                "consumed_samples": self.loader.state_dict()["consumed_samples"],
                "epoch": self.loader.state_dict()["epoch"], "batch_checksum": int(reduced[1]),
                "grad_norm": self._finite(grad_norm), "skipped": skipped, "global_batch": global_batch,
                "profiled": self.profiler is not None and self.profiler.covers(step),   # rank 0 writes the records
                "loader": config.loader, **host,
            }
            if skipped is not None and self.guard.must_roll_back():
                event = self._roll_back(step)
                yield event
                step = event["step"]

    def _loader_state(self) -> dict[str, Any]:
        """The loader's state to checkpoint: one for all ranks, or every rank's (--loader online: per_rank_state)."""
        state = self.loader.state_dict()
        if not getattr(self.loader, "per_rank_state", False):
            return state
        states: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(states, state)
        return {"per_rank": states}

    def save(self, step: int) -> None:
        client_state = {"step": step, "loader": self._loader_state(), "world_size": self.world_size,
                        "train_config": dataclasses.asdict(self.config), "global_batches": self.global_batches_read,
                        "anomalies": self.guard.state_dict(), "shard_fingerprint": self.plan.shard_fingerprint}
        ckpt.save_checkpoint(self.engine, self.checkpoint_dir, step, client_state, rank=self.env.rank,
                             world_size=self.world_size, barrier=self._barrier)
        self._say(f"[checkpoint] step {step} -> {self.checkpoint_dir / ckpt.tag_for(step)}")
        if self.env.is_main and self.config.keep_checkpoints:
            ckpt.prune(self.checkpoint_dir, self.config.keep_checkpoints,
                       protect=tuple(t for t in (self.resumed_from,) if t), say=self._say)
        self._barrier()

    def run(self) -> int:
        config = self.config
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._write_run_config()
        log = MetricsLog(self.run_dir, resume_from_step=self.start_step, total_steps=config.steps,
                         enabled=self.env.is_main, log_every=config.log_every)
        records: list[dict[str, Any]] = []
        started = time.time()
        save_at_end = config.save_final or config.stop_after is not None
        preempted_at = None
        try:
            for record in self.steps():          # hooks: metrics, then checkpoint, then a preemption request
                if record.get("event") == "rollback":      # the steps after its checkpoint are run again
                    records = [r for r in records if r["step"] <= record["step"]]
                    log.rollback(record)
                    continue
                records.append(record)
                if len(records) == 1:
                    self.timeline.mark("first_step")
                log.write(record)
                step = record["step"]
                saved = (config.save_every and step % config.save_every == 0) or (save_at_end and step == self.end_step)
                if saved:
                    self.save(step)
                heartbeat(step)
                if step < self.end_step and self._preemption_agreed():
                    if not saved:
                        self.save(step)
                    preempted_at = step
                    break
        finally:
            log.close()
            self.loader.close()
        if config.export_hf and preempted_at is None:
            self.export_hf(Path(config.export_hf))
        self.timeline.mark("trained")
        self._say(f"[startup] seconds since launch: {self.timeline.describe()}")
        if self.env.is_main:
            status = "preempted" if preempted_at else "ok" if self.end_step == config.steps else "stopped"
            summary = summarize(records, steady_skip=config.steady_skip, status=status, start_step=self.start_step,
                                total_steps=config.steps, wall_s=time.time() - started,
                                memory_estimate=self.plan.memory_estimate, resumed_from=self.resumed_from,
                                zero_stage=config.zero, offload=config.offload, world_size=self.world_size,
                                micro_batch=config.micro_batch, grad_accum=self.grad_accum,
                                global_batch=self.global_batch, loader_workers=config.loader_workers,
                                model=self.plan.model_config.name, precision=self.precision,
                                launch_t0=self.timeline.t0, timeline_s=dict(self.timeline.marks),
                                anomalies=self.guard.summary(), loader=config.loader,
                                time_to_first_batch_s=self.loader.first_batch_s, host_binding=self.binding)
            write_summary(self.run_dir, summary)
            print(final_summary_line(summary), flush=True)
        if preempted_at is not None:
            self._say(f"[preempt] stopped at step {preempted_at} with a checkpoint; exit status {RESUMABLE_EXIT} "
                      f"(resumable): run the same command with --resume to continue")
            return RESUMABLE_EXIT
        return 0

    def _preemption_agreed(self) -> bool:
        """Whether any rank was asked to stop (SIGTERM / SIGUSR1 / SIGINT, `pretrain.ranks.preemption`): the flag is
        all-reduced at every step boundary, so all ranks stop after the same step."""
        flag = torch.tensor([float(preemption.signum)], dtype=torch.float32, device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def export_hf(self, out_dir: Path) -> None:
        """Gather the full weights (ZeRO-3 partitions too) and let rank 0 write them in HF format (fp32)."""
        import deepspeed

        from pretrain.model.hf import export_hf
        from pretrain.model.t5 import T5Model

        module = self.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None,
                                               enabled=self.config.zero == 3):
            if self.env.is_main:
                state = {name: tensor.detach().float().cpu() for name, tensor in module.state_dict().items()}
        if self.env.is_main:
            model = T5Model(self.plan.model_config)
            model.load_state_dict(state)
            export_hf(model, out_dir)
            print(f"[export] HF model -> {out_dir}", flush=True)
        self._barrier()


def final_summary_line(summary: dict[str, Any]) -> str:
    if not summary["steady_steps"]:
        return f"[done] {summary['status']}: no steps left to run (step {summary['steps']}/{summary['total_steps']})"
    median = summary["median"]
    mfu = f"{100 * median['mfu']:.1f}%" if median.get("mfu") is not None else "n/a"
    share = summary.get("data_wait_share")
    loss = summary["final_loss"]
    return (f"[done] {summary['status']}: step {summary['steps']}/{summary['total_steps']}, final loss "
            f"{'not finite' if loss is None else f'{loss:.4f}'}; median {median['tokens_per_s'] or 0:,.0f} tok/s, "
            f"{median['tflops_per_gpu'] or 0:.3f} TFLOP/s per device, MFU {mfu}, data-wait "
            f"{100 * (share or 0):.2f}%, peak mem {summary['peak_mem_gib']:.2f} GiB"
            + (f", {summary['peak_reserved_gib']:.2f} reserved" if summary.get("peak_reserved_gib") is not None else "")
            + f" (estimate "
            f"{summary['memory_estimate']['per_gpu_gib']:.2f} GiB per device), {summary['wall_s']:.0f} s")
