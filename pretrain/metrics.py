"""Per-step measurements of a run: metrics.jsonl, TensorBoard, the console progress line and summary.json.

    log = MetricsLog(run_dir, resume_from_step=0, enabled=rank == 0); log.write(record); log.close()

A step's record (DESIGN.md "Trainer"): step, loss, lr, step_time_s, data_wait_s, compute_s, tokens,
tokens_per_s, samples_per_s, tflops_per_gpu, mfu, peak_mem_gib, peak_reserved_gib (GPU; null on CPU), zero_stage,
offload, world_size, micro_batch, grad_accum, loader_workers (+ consumed_samples, batch_checksum, grad_norm, skipped:
null or why the update was skipped, global_batch: the 1-based global batch read; a rollback adds an event line),
loader (the mode)
and rank 0's host accounting (pretrain.hostcpu.HOST_KEYS: CPU seconds by role, loader cores and busy share, the
workers' RSS; their medians go into summary.json with time_to_first_batch_s). data_wait_s is
the time the step spent blocked in next(loader), summed over its micro-batches; compute_s the rest;
step_time_s = data_wait_s + compute_s. forward_s, backward_s and optimizer_s (PHASE_KEYS) split compute_s: the
device stream's time from the start of each forward to its end, to the end of its backward, and over the
optimizer step (CUDA events, no extra synchronisation; the host clock on CPU); what compute_s holds beyond them is
communication outside those calls and host gaps. MFU divides tflops_per_gpu by the device's datasheet dense peak
(PEAK_TFLOPS, the field's convention: H100/H200 SXM bf16 989.4 TFLOP/s, fp32 67; A100 bf16 312, fp32 19.5;
--precision fp8 against the bf16 peak);
on CPU there is no meaningful peak, so mfu is null unless --peak-tflops names one.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
from pathlib import Path
from typing import Any

from pipeline.common import atomic_write_bytes, atomic_write_json
from pretrain.config import engine_precision
from pretrain.hostcpu import HOST_KEYS

METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"
PEAK_TFLOPS = {"H200": {"bf16": 989.4, "fp32": 67.0}, "H100": {"bf16": 989.4, "fp32": 67.0},  # SXM datasheets, dense
               "A100": {"bf16": 312.0, "fp32": 19.5}}
PHASE_KEYS = ("forward_s", "backward_s", "optimizer_s")
STEP_KEYS = ("step", "loss", "lr", "step_time_s", "data_wait_s", "compute_s", *PHASE_KEYS, "tokens", "tokens_per_s",
             "samples_per_s", "tflops_per_gpu", "mfu", "peak_mem_gib", "peak_reserved_gib", "zero_stage", "offload",
             "world_size", "micro_batch", "grad_accum", "loader_workers", "loader", *HOST_KEYS)


class PhaseClock:
    """The step's phases (PHASE_KEYS) timed on the device stream with CUDA events, or on the host clock on CPU.

        clock.begin(); loss = engine(...); clock.end("forward_s"); ...; clock.totals() after the step's sync
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spans: list[tuple[str, Any, Any]] = []
        self.opened: Any = None

    def _now(self) -> Any:
        if not self.cuda:
            import time
            return time.perf_counter()
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self.opened = self._now()

    def end(self, phase: str) -> None:
        self.spans.append((phase, self.opened, self._now()))

    def totals(self) -> dict[str, float]:
        """Seconds per phase since the last call (the stream must have passed the last end(): sync first)."""
        totals = dict.fromkeys(PHASE_KEYS, 0.0)
        for phase, start, stop in self.spans:
            totals[phase] += start.elapsed_time(stop) / 1000.0 if self.cuda else stop - start
        self.spans = []
        return totals


def peak_tflops_for(device_name: str, precision: str, override: float | None) -> float | None:
    """Per-device peak TFLOP/s for MFU: the flag, else the table by device name, else None (CPU). fp8 runs are
    measured against the bf16 peak (issue 19), so that their MFU compares directly with a bf16 run's."""
    if override:
        return float(override)
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_name:
            return peaks.get(engine_precision(precision))
    return None


def host_peak_rss_gib() -> float:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


class MetricsLog:
    """Rank 0's writer of metrics.jsonl (one JSON line per step, flushed), TensorBoard scalars and the console."""

    def __init__(self, run_dir: str | os.PathLike, *, resume_from_step: int, total_steps: int, enabled: bool,
                 log_every: int = 1):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.enabled = enabled
        self.log_every = log_every
        self._file = None
        self._tb = None
        if not enabled:
            return
        path = self.run_dir / METRICS_NAME
        self.previous = read_metrics(path, up_to_step=resume_from_step, events=True) if resume_from_step else []
        # a resumed run keeps the steps up to its checkpoint and drops any the interrupted run logged later
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in self.previous).encode())
        self._file = open(path, "a")
        from torch.utils.tensorboard import SummaryWriter
        self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=resume_from_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key in ("loss", "lr", "step_time_s", "data_wait_s", "tokens_per_s", "tflops_per_gpu", "mfu",
                    "peak_mem_gib", "grad_norm"):
            if record.get(key) is not None:
                self._tb.add_scalar(f"train/{key}", record[key], record["step"])
        if record["step"] % self.log_every == 0 or record["step"] == self.total_steps:
            print(progress_line(record, self.total_steps), flush=True)

    def rollback(self, event: dict[str, Any]) -> None:
        """A rollback to the checkpoint of step event["step"]: the lines after it go (those steps run again) and the
        event line takes their place, listing the skipped steps and global batches."""
        if not self.enabled:
            return
        self._file.close()
        path = self.run_dir / METRICS_NAME
        kept = read_metrics(path, up_to_step=event["step"], events=True)
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in [*kept, event]).encode())
        self._file = open(path, "a")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    """`step 12/100 | loss 5.4321 | lr 1.00e-03 | 12,345 tok/s | MFU 41.2% | data-wait 0.3% | 0.52 s/step`."""
    share = record["data_wait_s"] / record["step_time_s"] if record["step_time_s"] > 0 else 0.0
    mfu = f"{100 * record['mfu']:.1f}%" if record.get("mfu") is not None else "n/a"
    loss = f"{record['loss']:.4f}" if record.get("loss") is not None else "nan"
    skipped = f" | SKIPPED ({record['skipped']})" if record.get("skipped") else ""
    return (f"step {record['step']}/{total_steps} | loss {loss} | lr {record['lr']:.2e} | "
            f"{record['tokens_per_s']:,.0f} tok/s | MFU {mfu} | data-wait {100 * share:.1f}% | "
            f"{record['step_time_s']:.3f} s/step | mem {record['peak_mem_gib']:.2f} GiB{skipped}")


def read_metrics(path: str | os.PathLike, up_to_step: int | None = None, *, events: bool = False
                 ) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl (a torn last line from a killed run is skipped); with `events` also the
    event lines ({"event": "rollback", "step": the step rolled back to, ...})."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "event" in record and not events:
            continue
        if up_to_step is None or record["step"] <= up_to_step:
            records.append(record)
    return records


STEP_FIGURES = ("step_time_s", "data_wait_s", "compute_s", *PHASE_KEYS, "tokens_per_s", "samples_per_s", "tflops_per_gpu", "mfu",
                *HOST_KEYS)     # host CPU by role, loader busy share and workers' RSS (pretrain.hostcpu)
MEAN_FIGURES = tuple(key for key in HOST_KEYS if key != "loader_rss_gib")
"""Host CPU seconds by role, loader cores and busy share: means, not medians. Loader workers work in bursts (the
online mode makes a whole work unit's examples at once, then idles for several steps), so the median step of a
busy loader can show no loader CPU at all; the mean is what it costs per step."""


def steady_state_figures(steady: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-step figures of `steady` (steady-state metrics records) reduced to one value each: the median of
    every STEP_FIGURES key (the mean of the MEAN_FIGURES ones); data_wait_share = total data wait / total step time (a median would hide the
    occasional stall that a share of time shows); tokens_per_s_spread = interquartile range of tokens/s over its
    median (how far apart two runs must be to call one faster; None under two steps). Used by summary.json
    and by the study's results, so both report the same numbers."""
    def median(key: str) -> float | None:
        values = [float(r[key]) for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    def mean(key: str) -> float | None:
        values = [float(r[key]) for r in steady if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    figures: dict[str, Any] = {key: (mean if key in MEAN_FIGURES else median)(key) for key in STEP_FIGURES}
    total_step = sum(float(r.get("step_time_s") or 0.0) for r in steady)
    total_wait = sum(float(r.get("data_wait_s") or 0.0) for r in steady)
    figures["data_wait_share"] = total_wait / total_step if total_step > 0 else None
    rates = [float(r["tokens_per_s"]) for r in steady if r.get("tokens_per_s") is not None]
    figures["tokens_per_s_spread"] = None
    if len(rates) >= 2 and figures["tokens_per_s"]:
        q1, _, q3 = statistics.quantiles(rates, n=4, method="inclusive")
        figures["tokens_per_s_spread"] = (q3 - q1) / figures["tokens_per_s"]
    return figures


def needed_peak(row: dict[str, Any], cudagraphs: bool) -> float | None:
    """The memory a run needed at its peak: the allocator's peak allocated memory, or with --cudagraphs its peak
    reserved memory where recorded (a replay allocates nothing: the graphs' pools hold their memory outside the
    allocated figure; mt5-large FP8 through pretrain, micro 32 x 2: 29.3 GiB allocated and 42.7 reserved with graphs,
    38.4 and 43.2 without; the model alone at batch 64: 33 GiB more reserved; docs/pretrain.md). What the tune
    calibrates its memory estimate by and the report compares it with."""
    if cudagraphs and row.get("peak_reserved_gib"):
        return row["peak_reserved_gib"]
    return row.get("peak_mem_gib")


def largest_peak(records: list[dict[str, Any]], key: str) -> float | None:
    """The largest of the steps' `key` (peak_mem_gib, peak_reserved_gib: each step's peak so far), over every step,
    warm-up included; None where no step has one (peak_reserved_gib on CPU)."""
    return max((float(r[key]) for r in records if r.get(key) is not None), default=None)


def summarize(records: list[dict[str, Any]], *, steady_skip: int, status: str, **extra: Any) -> dict[str, Any]:
    """summary.json: status, steps, and medians over the steady-state steps (the first `steady_skip`
    steps of this launch and the steps run under the profiler left out, at least one step kept)."""
    steady = records[min(steady_skip, max(0, len(records) - 1)):]
    steady = [r for r in steady if not r.get("profiled")] or steady[-1:]
    figures = steady_state_figures(steady)
    step_time, data_wait = figures["step_time_s"], figures["data_wait_s"]
    summary = {
        "status": status,
        "steps": records[-1]["step"] if records else int(extra.get("start_step", 0)),
        "steady_steps": len(steady),
        "final_loss": records[-1]["loss"] if records else None,
        "median": {key: figures[key] for key in STEP_FIGURES},
        "data_wait_share": figures["data_wait_share"],
        "peak_mem_gib": largest_peak(records, "peak_mem_gib"),
        "peak_reserved_gib": largest_peak(records, "peak_reserved_gib"),
    }
    if step_time and data_wait is not None:
        summary["median"]["data_wait_share"] = data_wait / step_time
    summary.update(extra)
    return summary


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> None:
    atomic_write_json(Path(run_dir) / SUMMARY_NAME, summary)
