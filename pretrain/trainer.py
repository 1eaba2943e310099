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
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.profiler import record_function

from pipeline.common import REPO_ROOT, UserError, atomic_write_json
from pretrain import checkpoint as ckpt
from pretrain.ranks import launch_t0
from pretrain.metrics import MetricsLog, host_peak_rss_gib, peak_tflops_for, summarize, write_summary


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
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))
        # DeepSpeed JIT-compiles a shared-memory all-reduce op on CPU (~1 min, needs a C++ compiler) that only
        # its inference all-reduce uses; training never calls it, so mark it unavailable and skip the build.
        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        if isinstance(compatible, dict):
            compatible["deepspeed_shm_comm"] = False
    else:
        accelerator.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)


def any_inf_or_nan(params) -> bool:
    """Whether any gradient of `params` holds an inf or NaN: DeepSpeed's own per-tensor test
    (`deepspeed.runtime.utils.has_inf_or_nan`, a device scalar each), reduced on the device, one host sync."""
    from deepspeed.runtime.utils import has_inf_or_nan

    flags = [has_inf_or_nan(p.grad.data) for p in params if p.grad is not None]
    return bool(torch.stack(flags).any()) if flags else False


def fuse_overflow_check(optimizer) -> bool:
    """Give the optimizer's overflow check one host sync per step instead of one per parameter.

    At ZeRO 0 with bf16 (or fp16) DeepSpeed wraps the optimizer in its FP16_Optimizer, whose `CheckOverflow`
    tests gradient after gradient with Python truthiness: mt5-large's 390 tensors cost 390 device syncs per
    step, which on 2 H200s left the GPU idle ~37 ms of every optimizer step (profile in docs/pretrain.md). The
    answer is the same (`any_inf_or_nan`). Returns whether the optimizer had such a check."""
    from deepspeed.runtime.utils import CheckOverflow

    checker = getattr(optimizer, "overflow_checker", None)
    if not isinstance(checker, CheckOverflow):
        return False
    checker.has_overflow_serial = any_inf_or_nan
    return True


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

    def describe(self) -> str:
        return ", ".join(f"{phase} {at:.1f}s" for phase, at in self.marks.items())


class Trainer:
    """Holds the engine, loader and hooks of one rank; `run()` trains and writes the run directory."""

    def __init__(self, config, plan, env, timeline: Timeline):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        from pretrain.data.dataset import ShardDataset
        from pretrain.data.loader import make_loader
        from pretrain.ds_config import build_ds_config, resolve_precision
        self.config, self.plan, self.env = config, plan, env
        self.timeline = timeline
        self.accelerator = get_accelerator()
        self.on_cpu = self.accelerator.device_name() == "cpu"
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

        self.resume_tag = self._prepare_resume() if config.resume else None
        if config.zero == 3:     # the partitioned build already puts weights on the devices
            self._wait_for_start_gate()
        self.model_init = self._build_model(plan.model_config, config.seed)
        model = self.model_init.pop("model")
        self.timeline.mark("model_built")
        if config.zero < 3:      # built on the host: wait for the devices only now
            self._wait_for_start_gate()
        if config.compile:
            model.compile_regions()
        schedule = LRSchedule(config.schedule, config.warmup_steps, config.steps, config.min_lr_ratio)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.ds_config,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule))
        self.engine_note = {"optimizer": type(self.optimizer).__name__,
                            "overflow_check_fused": fuse_overflow_check(self.optimizer)}
        self.timeline.mark("engine")
        dataset = ShardDataset(config.data, input_length=plan.input_length, target_length=plan.target_length,
                               cache_dir=config.cache_dir)
        self.loader = make_loader(dataset, micro_batch_size=config.micro_batch, global_batch_size=self.global_batch,
                                  seed=config.seed, rank=env.rank, world_size=self.world_size,
                                  num_workers=config.loader_workers, pin_memory=not self.on_cpu,
                                  prefetch_factor=config.prefetch_factor, persistent_workers=True)
        self.timeline.mark("loader")
        self.start_step = 0
        self.resumed_from = None
        if config.resume:
            tag = self.resume_tag
            if tag is None:
                self._say(f"[resume] no complete checkpoint in {self.checkpoint_dir}: starting at step 0")
            else:
                client = ckpt.load_checkpoint(self.engine, self.checkpoint_dir, tag, rank=env.rank,
                                              world_size=self.world_size)
                self.start_step = int(client["step"])
                self.loader.load_state_dict(client["loader"])
                self.resumed_from = tag
                self._say(f"[resume] {tag}: step {self.start_step}, loader {client['loader']}")
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
        """The tag to resume from (None: none complete). A ZeRO 1-3 tag saved at another world size is converted
        to a universal checkpoint by rank 0 (once) and the DeepSpeed config asks for a universal load."""
        import torch.distributed as dist

        tag = ckpt.latest_complete(self.checkpoint_dir)
        if tag is None or not ckpt.needs_universal(self.checkpoint_dir, tag, world_size=self.world_size,
                                                   zero_stage=self.config.zero):
            return tag
        if self.config.offload == "nvme":
            saved = ckpt.saved_world_size(self.checkpoint_dir / tag)
            raise UserError(f"{self.checkpoint_dir / tag}: saved by {saved} ranks, resumed with {self.world_size}; "
                            f"with --offload nvme DeepSpeed copies each rank's swapped optimizer state back as it "
                            f"is and cannot load a universal checkpoint: resume with --nproc {saved}")
        failure = [None]
        if self.env.rank == 0:
            try:
                ckpt.convert_to_universal(self.checkpoint_dir, tag, say=self._say)
            except Exception as err:      # every rank must hear of it, not wait at a barrier
                failure = [f"{self.checkpoint_dir / tag}: conversion to a universal checkpoint failed "
                           f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"]
        dist.broadcast_object_list(failure, src=0)
        if failure[0] is not None:
            raise UserError(failure[0])
        self.ds_config["checkpoint"] = {**self.ds_config.get("checkpoint", {}), "load_universal": True}
        return tag

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

    def _peak_mem_gib(self) -> float:
        if self.on_cpu:
            return host_peak_rss_gib()
        return torch.cuda.max_memory_allocated(self.device) / (1 << 30)

    # -- the loop ------------------------------------------------------------------------------------------------

    def steps(self) -> Iterator[dict[str, Any]]:
        """Train from start_step to end_step, yielding one metrics record per optimizer step."""
        batches = iter(self.loader)
        engine, config = self.engine, self.config
        synchronize = (lambda: None) if self.on_cpu else self.accelerator.synchronize
        for step in range(self.start_step + 1, self.end_step + 1):
            lr = float(self.optimizer.param_groups[0]["lr"])
            data_wait_s = 0.0
            losses = []
            checksum = 0
            synchronize()
            if self.profiler is not None:
                self.profiler.before_step(step)
            step_start = time.perf_counter()
            for _ in range(self.grad_accum):
                wait_start = time.perf_counter()
                with record_function("pretrain.data"):
                    batch = next(batches)
                data_wait_s += time.perf_counter() - wait_start
                checksum += int((batch["input_ids"] * self.position_weights).sum())
                input_ids = batch["input_ids"].to(self.device, non_blocking=True)
                labels = batch["labels"].to(self.device, non_blocking=True)
                with record_function("pretrain.forward"):
                    loss = engine(input_ids, labels=labels)
                with record_function("pretrain.backward"):
                    engine.backward(loss)
                with record_function("pretrain.step"):     # DeepSpeed's optimizer step (at the last micro-batch)
                    engine.step()
                losses.append(loss.detach().float())
            synchronize()
            step_time_s = time.perf_counter() - step_start
            if self.profiler is not None:
                self.profiler.after_step(step)
            reduced = torch.stack([torch.stack(losses).mean().double().to(self.device),
                                   torch.tensor(float(checksum), dtype=torch.float64, device=self.device)])
            torch.distributed.all_reduce(reduced)
            peak = torch.tensor([self._peak_mem_gib()], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            grad_norm = engine.get_global_grad_norm()
            tflops_per_gpu = self.step_flops / step_time_s / self.world_size / 1e12
            yield {
                "step": step, "loss": float(reduced[0]) / self.world_size, "lr": lr,
                "step_time_s": step_time_s, "data_wait_s": data_wait_s, "compute_s": step_time_s - data_wait_s,
                "tokens": self.tokens_per_step, "tokens_per_s": self.tokens_per_step / step_time_s,
                "samples_per_s": self.global_batch / step_time_s, "tflops_per_gpu": tflops_per_gpu,
                "mfu": tflops_per_gpu / self.peak_tflops if self.peak_tflops else None,
                "peak_mem_gib": float(peak[0]), "zero_stage": config.zero, "offload": config.offload,
                "world_size": self.world_size, "micro_batch": config.micro_batch, "grad_accum": self.grad_accum,
                "loader_workers": config.loader_workers,
                "consumed_samples": self.loader.state_dict()["consumed_samples"],
                "epoch": self.loader.state_dict()["epoch"], "batch_checksum": int(reduced[1]),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "profiled": self.profiler is not None and self.profiler.covers(step),   # rank 0 writes the records
            }

    def save(self, step: int) -> None:
        client_state = {"step": step, "loader": self.loader.state_dict(), "world_size": self.world_size,
                        "train_config": dataclasses.asdict(self.config)}
        ckpt.save_checkpoint(self.engine, self.checkpoint_dir, step, client_state, rank=self.env.rank,
                             world_size=self.world_size, barrier=self._barrier)
        self._say(f"[checkpoint] step {step} -> {self.checkpoint_dir / ckpt.tag_for(step)}")

    def run(self) -> int:
        config = self.config
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._write_run_config()
        log = MetricsLog(self.run_dir, resume_from_step=self.start_step, total_steps=config.steps,
                         enabled=self.env.is_main, log_every=config.log_every)
        records: list[dict[str, Any]] = []
        started = time.time()
        save_at_end = bool(config.save_every) or config.stop_after is not None
        try:
            for record in self.steps():          # hooks: metrics, then checkpoint
                records.append(record)
                if len(records) == 1:
                    self.timeline.mark("first_step")
                log.write(record)
                step = record["step"]
                if (config.save_every and step % config.save_every == 0) or (save_at_end and step == self.end_step):
                    self.save(step)
        finally:
            log.close()
            self.loader.close()
        if config.export_hf:
            self.export_hf(Path(config.export_hf))
        self.timeline.mark("trained")
        self._say(f"[startup] seconds since launch: {self.timeline.describe()}")
        if self.env.is_main:
            status = "ok" if self.end_step == config.steps else "stopped"
            summary = summarize(records, steady_skip=config.steady_skip, status=status, start_step=self.start_step,
                                total_steps=config.steps, wall_s=time.time() - started,
                                memory_estimate=self.plan.memory_estimate, resumed_from=self.resumed_from,
                                zero_stage=config.zero, offload=config.offload, world_size=self.world_size,
                                micro_batch=config.micro_batch, grad_accum=self.grad_accum,
                                global_batch=self.global_batch, loader_workers=config.loader_workers,
                                model=self.plan.model_config.name, precision=self.precision,
                                launch_t0=self.timeline.t0, timeline_s=dict(self.timeline.marks))
            write_summary(self.run_dir, summary)
            print(final_summary_line(summary), flush=True)
        return 0

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
    return (f"[done] {summary['status']}: step {summary['steps']}/{summary['total_steps']}, final loss "
            f"{summary['final_loss']:.4f}; median {median['tokens_per_s'] or 0:,.0f} tok/s, "
            f"{median['tflops_per_gpu'] or 0:.3f} TFLOP/s per device, MFU {mfu}, data-wait "
            f"{100 * (share or 0):.2f}%, peak mem {summary['peak_mem_gib']:.2f} GiB (estimate "
            f"{summary['memory_estimate']['per_gpu_gib']:.2f} GiB per device), {summary['wall_s']:.0f} s")
