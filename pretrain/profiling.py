"""`pretrain --profile-steps N`: a torch.profiler trace of a run's last N optimizer steps on rank 0, and what it says.

    profiler = StepProfiler(run_dir / "profile", first_step=99, last_step=100, cuda=True)
    profiler.before_step(step); ...; profiler.after_step(step)     # around each optimizer step
    summary = summarize_trace("trace.json.gz", window_s)              # also usable on any exported trace

The profiled steps are the last ones of the launch, so the earlier steps (and the run's medians, which leave the
profiled steps out) are not perturbed by the profiler. RUN_DIR/profile/ then holds the Chrome trace
(trace-rank0.json.gz, open it in chrome://tracing or https://ui.perfetto.dev), ops.txt (the profiler's op tables)
and summary.json: for the profiled window, how busy each GPU stream was (union of its kernels' intervals), how
busy the GPU was at all, the share of each kernel family (FAMILIES: GEMM, attention forward and backward, NCCL
collectives, optimizer, loss, embedding and position-bias gradients, norms, other Triton / elementwise, copies), and how long the host thread sat in device synchronisations (cudaStreamSynchronize,
cudaEventSynchronize, cudaDeviceSynchronize, synchronous copies) and in each of the trainer's phases (data,
forward, backward, DeepSpeed's step: host wall time, which runs ahead of the device unless it syncs). A GPU idle
for a large share of the window while the host is not waiting on it means the host is the bottleneck (Python,
launches); a long host wait beside an idle GPU means a synchronisation stalls the pipeline.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import torch

from pipeline.common import atomic_write_bytes, atomic_write_json

TRACE_NAME = "trace-rank0.json.gz"
PHASE_PREFIX = "pretrain."      # the trainer's record_function ranges: pretrain.{data,forward,backward,step}
BLOCKING_SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
SYNC_CALLS = BLOCKING_SYNC_CALLS + ("cudaStreamWaitEvent",)   # counted too; it only enqueues a dependency
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
FAMILIES = (   # first match wins, on the lower-cased kernel name; the step-time breakdown of docs/model.md
    ("nccl", ("nccl",)),
    ("attention_bwd", ("fmha_cutlassb", "attentionbackward", "flash_bprop", "flash_bwd", "attn_bwd",
                       "flex_attention_backward")),
    ("attention_fwd", ("fmha", "flash", "attention", "attn", "cudnn_generated_fort_native_sdpa")),
    ("gemm", ("gemm", "nvjet", "sm90_xmma", "cutlass", "cublas", "matmul")),
    ("optimizer", ("adam", "multi_tensor")),
    ("loss", ("logsumexp", "cross_entropy", "nll_loss", "log_softmax")),
    ("embedding_bwd", ("embedding_dense_backward", "embedding_backward", "index_put", "scatter_add")),
    ("norm", ("rsqrt",)),                   # RMSNorm, fused by Inductor with what surrounds it
    ("triton", ("triton_", "_gated_gelu", "_cast_kernel")),   # the rest of Inductor's fused elementwise /
    # reduction kernels, and ours of that kind: the feed-forward's gate (gated_gelu.py), FP8's casts (fp8.py)
    ("copy", ("memcpy", "memset", "copy", "cat", "fill")),
)
"""attention_bwd / _fwd: the fused attention kernels (with T5's position bias: memory-efficient attention, whose
backward also writes the bias gradient); embedding_bwd: the gradients of the token embedding and of the position
bias's bucket table (gathers turned into scatter-adds); loss is matched before it because the chunked loss's
kernels also scatter-add. Host gaps are what the device-busy share leaves."""


FAMILY_RULES = 2
"""summary.json's `family_rules`: 2 since our gate and FP8 cast kernels count as "triton" (other fused kernels);
summaries without it counted them as "other" (scripts/profile_table.py marks their rows)."""


def kernel_family(name: str) -> str:
    lowered = name.lower()
    for family, needles in FAMILIES:
        if any(needle in lowered for needle in needles):
            return family
    return "other"


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (microseconds in, seconds out)."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total / 1e6


def idle_gaps(kernels: list[tuple[float, float, str]], top: int = 10) -> list[dict[str, Any]]:
    """Where the device sat idle between kernels ([start, end) microseconds, name; every stream together): each gap
    named by the kernel that ran before it and the one after, summed over equal pairs, the `top` largest totals."""
    gaps: dict[str, list] = defaultdict(lambda: [0, 0.0])
    busy_until, last_name = None, None
    for start, end, name in sorted(kernels):
        if busy_until is not None and start > busy_until:
            pair = gaps[f"{last_name[:60]} -> {name[:60]}"]
            pair[0] += 1
            pair[1] += (start - busy_until) / 1e6
        if busy_until is None or end >= busy_until:
            busy_until, last_name = end, name
    return [{"between": pair, "gaps": count, "seconds": round(seconds, 6)}
            for pair, (count, seconds) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]]


def launchers(events: list[dict[str, Any]], top: int = 10) -> list[dict[str, Any]]:
    """Which host op put each device memset and memcpy on the device (their names say only "Memset (Device)"): the
    `cpu_op` of the same "External id" (how torch.profiler links a device event to its op), else the innermost
    `cpu_op` around the runtime call of the same "correlation" on its thread; the `top` (device event, op) pairs by
    time, "?" where the trace has no host ops (a device-only trace)."""
    def arg(event, key):
        return (event.get("args") or {}).get(key)
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    by_external = {arg(e, "External id"): e["name"] for e in ops if arg(e, "External id") is not None}
    runtime = {arg(e, "correlation"): e for e in events
               if e.get("cat") == "cuda_runtime" and arg(e, "correlation") is not None}

    by_thread: dict[Any, list[tuple[float, int, float, str]]] = defaultdict(list)   # (start, -order, end, name)
    for order, op in enumerate(ops):
        by_thread[op.get("tid")].append((float(op["ts"]), -order, float(op["ts"]) + float(op["dur"]), op["name"]))
    for spans in by_thread.values():
        spans.sort()

    def enclosing_op(call):   # the latest-starting host op of the call's thread whose span holds the call
        spans, ts = by_thread.get(call.get("tid"), []), float(call["ts"])
        started = bisect.bisect_right(spans, (ts, float("inf")))       # the ops that started by the call
        return next((spans[i][3] for i in range(started - 1, -1, -1) if spans[i][2] >= ts), None)

    pairs = []
    for event in events:
        if event.get("cat") not in ("gpu_memset", "gpu_memcpy"):
            continue
        op = by_external.get(arg(event, "External id"))
        if op is None and arg(event, "correlation") in runtime:
            op = enclosing_op(runtime[arg(event, "correlation")])
        pairs.append((f"{event.get('name', '?')} <- {op or '?'}", event["dur"]))
    return [{"what": what, "calls": calls, "seconds": round(seconds, 6)}
            for what, (calls, seconds) in sorted(tally(pairs).items(), key=lambda kv: -kv[1][1])[:top]]


def tally(items: Iterable[tuple[str, float]]) -> dict[str, list]:
    """{name: [calls, seconds]} of (name, duration in microseconds) pairs, in order of first appearance."""
    totals: dict[str, list] = {}
    for name, micros in items:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += float(micros) / 1e6
    return totals


def load_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    return data.get("traceEvents", data) if isinstance(data, dict) else data


def summarize_trace(path: str | os.PathLike, window_s: float | None = None, top: int = 15) -> dict[str, Any]:
    """Device busy time by stream and kernel family, host time in synchronisations, the device's largest idle gaps
    (by the kernels around them) and the host ops behind its memsets and copies, from a Chrome trace written by
    torch.profiler. `window_s` is the wall time of the
    profiled steps (default: the span from the first to the last event in the trace)."""
    events = [e for e in load_trace(path) if e.get("ph") == "X" and "dur" in e]
    if not events:
        return {"window_s": window_s, "device_events": 0}
    first = min(float(e["ts"]) for e in events)
    last = max(float(e["ts"]) + float(e["dur"]) for e in events)
    window = window_s if window_s else (last - first) / 1e6
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    by_stream: dict[str, list[tuple[float, float]]] = defaultdict(list)
    by_family: dict[str, float] = defaultdict(float)
    for event in device:
        start, duration = float(event["ts"]), float(event["dur"])
        args = event.get("args") or {}
        stream = f"device {args.get('device', '?')} stream {args.get('stream', '?')}"
        by_stream[stream].append((start, start + duration))
        family = "copy" if event.get("cat") != "kernel" else kernel_family(event.get("name", ""))
        by_family[family] += duration / 1e6
    by_kernel = tally((event.get("name", "?")[:120], event["dur"]) for event in device)
    busy = union_seconds(interval for intervals in by_stream.values() for interval in intervals)
    stream_busy = {stream: union_seconds(intervals) for stream, intervals in by_stream.items()}
    syncs = tally((event["name"], event["dur"]) for event in events
                  if event.get("cat") == "cuda_runtime" and event.get("name") in SYNC_CALLS)
    phases = tally((event["name"][len(PHASE_PREFIX):], event["dur"]) for event in events   # record_function ranges
                   if event.get("cat") == "user_annotation" and str(event.get("name", "")).startswith(PHASE_PREFIX))
    kernel_total = sum(by_family.values())
    host_sync_s = sum(seconds for name, (_, seconds) in syncs.items() if name in BLOCKING_SYNC_CALLS)
    return {
        "family_rules": FAMILY_RULES,
        "window_s": round(window, 6),
        "device_events": len(device),
        "device_busy_s": round(busy, 6),
        "device_busy_share": round(busy / window, 4) if window and device else None,
        "streams": {stream: {"kernels": len(intervals), "busy_s": round(stream_busy[stream], 6),
                             "busy_share": round(stream_busy[stream] / window, 4) if window else None}
                    for stream, intervals in sorted(by_stream.items(), key=lambda kv: -len(kv[1]))},
        "families": {family: {"seconds": round(seconds, 6),
                              "share_of_kernel_time": round(seconds / kernel_total, 4) if kernel_total else None}
                     for family, seconds in sorted(by_family.items(), key=lambda kv: -kv[1])},
        "host_phases": {name: {"calls": calls, "seconds": round(seconds, 6),
                               "share": round(seconds / window, 4) if window else None}
                        for name, (calls, seconds) in phases.items()},
        "host_sync_s": round(host_sync_s, 6),
        "host_sync_share": round(host_sync_s / window, 4) if window else None,
        "sync_calls": {name: {"calls": calls, "seconds": round(seconds, 6)} for name, (calls, seconds) in
                       sorted(syncs.items(), key=lambda kv: -kv[1][1])},
        "top_kernels": [{"name": name, "calls": calls, "seconds": round(seconds, 6)} for name, (calls, seconds) in
                        sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]],
        "idle_gaps": idle_gaps([(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?"))
                                for e in device], top),
        "memsets_and_copies": launchers(events, top),
    }


def describe(summary: dict[str, Any], steps: int) -> str:
    """One console line: `[profile] 2 steps, 1.234 s: host in forward 40%, backward 52%, step 6%; device busy
    61.0% (kernel time: gemm 46%, attention 27%, ...); host blocked in device syncs 12.0%`."""
    phases = ", ".join(f"{name} {100 * (info['share'] or 0):.0f}%"
                       for name, info in summary.get("host_phases", {}).items()) or "no trainer phases"
    head = f"[profile] {steps} step{'s' if steps != 1 else ''}, {summary['window_s']:.3f} s: host in {phases}"
    if not summary.get("device_events"):
        return head + "; no device kernels (CPU run): ops.txt has the op times"
    families = ", ".join(f"{name} {100 * (info['share_of_kernel_time'] or 0):.0f}%"
                         for name, info in list(summary["families"].items())[:5])
    return (f"{head}; device busy {100 * summary['device_busy_share']:.1f}% (kernel time: {families}); "
            f"host blocked in device syncs {100 * (summary['host_sync_share'] or 0):.1f}%")


class StepProfiler:
    """torch.profiler over optimizer steps first_step..last_step (inclusive) of rank 0; writes RUN_DIR/profile/."""

    def __init__(self, out_dir: Path, first_step: int, last_step: int, cuda: bool, say=print):
        self.out_dir, self.first_step, self.last_step, self.cuda = Path(out_dir), first_step, last_step, cuda
        self.say = say
        self._profiler = None
        self._started = 0.0
        self.summary: dict[str, Any] | None = None

    def covers(self, step: int) -> bool:
        return self.first_step <= step <= self.last_step

    def before_step(self, step: int) -> None:
        if step != self.first_step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()
        self._started = time.perf_counter()

    def after_step(self, step: int) -> None:
        if step != self.last_step or self._profiler is None:
            return
        window_s = time.perf_counter() - self._started     # the caller synchronised the device already
        self._profiler.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw, packed = self.out_dir / "trace-rank0.json.partial", self.out_dir / (TRACE_NAME + ".partial")
        self._profiler.export_chrome_trace(str(raw))
        with open(raw, "rb") as source, gzip.open(packed, "wb", compresslevel=5) as target:
            while chunk := source.read(1 << 20):
                target.write(chunk)
        raw.unlink()
        packed.replace(self.out_dir / TRACE_NAME)
        averages = self._profiler.key_averages()
        tables = ["# host: self CPU time", averages.table(sort_by="self_cpu_time_total", row_limit=40)]
        if self.cuda:
            tables += ["# device: self device time", averages.table(sort_by="self_device_time_total", row_limit=40)]
        atomic_write_bytes(self.out_dir / "ops.txt", ("\n\n".join(tables) + "\n").encode())
        steps = self.last_step - self.first_step + 1
        self.summary = {"first_step": self.first_step, "last_step": self.last_step, "steps": steps,
                        **summarize_trace(self.out_dir / TRACE_NAME, window_s)}
        atomic_write_json(self.out_dir / "summary.json", self.summary)   # written last
        self._profiler = None
        self.say(describe(self.summary, steps) + f" -> {self.out_dir}")
