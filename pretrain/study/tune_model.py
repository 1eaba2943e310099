"""`study tune`'s two models: the step-time cost model (priors, refitted by least squares after each measurement)
and the memory calibration (the preflight estimate scaled by measured peaks). docs/tune.md explains both.

    model = CostModel.for_device(device); model.refit(measured); model.predict(config, shape)["tokens_per_s"]

Step time of one candidate = compute + data wait, with compute a sum of terms, each a prior coefficient times a
feature of the configuration (the shape: parameters P, model FLOPs per rank and step F, micro batches per step A):

    compute = w0 * F * (4/3 with activation checkpointing) / rate      model FLOPs at an effective rate
            + w1 * A * micro_s * [no cudagraphs]                       per micro batch (launches, accumulation)
            + w1g * A * micro_s * graphed_share * [cudagraphs]         the same with the blocks as CUDA graphs
            + w2 * [stage 1 or 2] * (stage12_s + P * stage12_param_s)  partitioned gradients / optimizer
            + w3 * [stage 3] * A * (stage3_s + P * stage3_param_s)     stage 3 gathers, per micro batch
            + w4 * P * [offload] / threads * adam_s                    CPU-Adam on the host's free cores
            + w5 * P * [offload] * transfer_s                           gradients down, parameters up
            + w6 * step_s                                               fixed per step (optimizer step, logging)
    data wait = examples * load_s (no workers: loading is inline)  or  max(0, examples * load_s / workers - compute)

The weights w start at 1 and are refitted (ridge least squares towards 1, relative errors) on every measured
launch's compute time (step time minus its measured data wait); the per-example loading cost load_s per loader
mode is the median measured one (the loader's CPU seconds per example).

Candidates that differ only in how examples are loaded (LOADING_FIELDS) run the same step: once one of them is
measured, the others' compute is the model's scaled by that sibling's measured / modelled ratio (its anchor), so
only their data wait and, under offload, the cores their workers take from CPU-Adam are left to the model.

--cudagraphs changes how much of the step waits on the host, which these additive terms cannot tell (on one H200
graphs made a host-bound step 1.46x faster, one that kept the GPU busy ~1.0x). Once a pair of candidates differing
only in --cudagraphs is measured, every graphed candidate not measured itself takes its graph-free twin's compute
(anchored or modelled) times the median measured graphed / graph-free ratio of such pairs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pretrain.metrics import PEAK_TFLOPS

TERMS = ("flops", "micro_batches", "graphed_micro_batches", "stage12", "stage3", "host_adam", "offload_transfer",
         "per_step")
"""The compute terms of the cost model, in the order of their weights."""
GPU_PRIORS = {"rate_share": 0.30, "micro_s": 6e-3, "graphed_share": 0.25, "stage12_s": 3e-3,
              "stage12_param_s": 3e-11, "stage3_s": 5e-3, "stage3_param_s": 6e-11, "adam_s": 6.5e-9,
              "transfer_s": 2.5e-10, "step_s": 5e-3}
"""From the one-H200 study (docs/study/h200/, compiled, bf16, one rank): ZeRO 0 at 26-28% of the datasheet peak
with 2 micro batches; ZeRO 2 0.007-0.085 s over ZeRO 0 per step (mt5-base, mt5-large); ZeRO 3 0.013-0.12 s more
per micro batch; CPU-Adam 6.3e-9 CPU-seconds per parameter (7.6 s per step for mt5-large's 1.2B) and ~0.3 s of
offload traffic per step for 1.2B parameters. graphed_share, the share of a micro batch's own cost left with
--cudagraphs (each block's kernels replayed in one launch; the loss chunk, the embedding and DeepSpeed's gradient
hooks stay on the host), is a prior only: on one H200 graphs made mt5-large's ZeRO 2 step at micro 32 x 2 1.46x
faster in bf16 (docs/pretrain.md), which this model's terms cannot split; the first graphed launch refits it."""
CPU_PRIORS = {"rate_flops": 2e10, "micro_s": 3e-2, "graphed_share": 1.0, "stage12_s": 0.1,
              "stage12_param_s": 5e-9, "stage3_s": 0.05, "stage3_param_s": 2e-8, "adam_s": 1e-8, "transfer_s": 1e-9,
              "step_s": 5e-2}
"""Prior coefficients: share of the datasheet peak reached (GPU) or FLOP/s per rank (CPU); seconds per micro
batch, and the share of it left with --cudagraphs (1 on the CPU, which runs the same code without graphs); stages
1-2 per step (fixed + per parameter), stage 3 per micro batch (fixed + per parameter); per parameter-thread of
CPU-Adam; per parameter of offload traffic; fixed seconds per step."""
LOAD_S_PRIORS = {"shards": 2e-5, "online": 1.5e-3, "remote": 5e-5}   # online: 1.2-1.9e-3 on the H200 host
"""Prior host CPU seconds per example a loader mode spends (mmap'd shards, text made in the worker, a stream)."""
PRIOR_STRENGTH = 1.0       # ridge weight pulling each weight towards its prior (1), against relative errors
LOADING_FIELDS = frozenset({"loader", "loader_workers", "prefetch_factor", "remote_prefetch_shards", "cache_max_gib",
                            "cache_dir", "data", "tokenizer", "text_field", "unit_bytes"})
"""TrainConfig fields that change where a step's examples come from, not the step the model runs."""
RUN_FIELDS = frozenset({"out", "steps", "stop_after", "force", "save_every", "save_final", "log_every"})
"""Fields of a launch, not of a configuration (a rung's steps, its directory)."""


NOT_COMPUTE_FIELDS = LOADING_FIELDS | RUN_FIELDS


def compute_key(config) -> tuple:
    """What a configuration's step depends on: every field but the loading and launch ones. Equal keys, equal
    compute (the model's host-CPU terms aside, which the anchor's ratio carries over)."""
    return tuple(sorted((f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config)
                        if f.name not in NOT_COMPUTE_FIELDS))


@dataclass
class Shape:
    """What the cost model knows of the run every candidate shares: model size and work per step."""

    parameters: int
    flops_per_rank_step: float       # train_step_flops over one rank's examples per step (no recomputation)
    examples_per_rank_step: int
    tokens_per_step: int             # global batch x (input + target length): what pretrain's tokens/s counts
    host_cores_per_rank: int


def _threads(config, shape: Shape) -> int:
    """CPU-Adam threads a rank gets: its OpenMP threads (default: its share of cores) minus its loader workers."""
    threads = config.omp_num_threads or shape.host_cores_per_rank
    return max(1, min(threads, shape.host_cores_per_rank - config.loader_workers))


def prior_terms_s(config, shape: Shape, priors: dict[str, float], rate: float) -> np.ndarray:
    """Each compute term of TERMS in seconds, at the prior coefficients (what the weights multiply)."""
    micro_batches = shape.examples_per_rank_step // config.micro_batch
    offload = config.offload != "none"
    recompute = 4.0 / 3.0 if config.activation_checkpointing else 1.0
    p = float(shape.parameters)
    graphed = bool(config.cudagraphs)
    return np.array([shape.flops_per_rank_step * recompute / rate, (not graphed) * micro_batches * priors["micro_s"],
                     graphed * micro_batches * priors["micro_s"] * priors["graphed_share"],
                     (config.zero in (1, 2)) * (priors["stage12_s"] + p * priors["stage12_param_s"]),
                     (config.zero == 3) * micro_batches * (priors["stage3_s"] + p * priors["stage3_param_s"]),
                     offload * p * priors["adam_s"] / _threads(config, shape),
                     offload * p * priors["transfer_s"], priors["step_s"]])


@dataclass
class CostModel:
    """Predicted step time and tokens/s of a candidate (its `cudagraphs` resolved, as the tune's candidates are);
    `refit` after each measurement."""

    priors: dict[str, float]
    rate: float                               # effective FLOP/s per rank at the prior
    weights: np.ndarray = field(default_factory=lambda: np.ones(len(TERMS)))
    load_s: dict[str, float] = field(default_factory=lambda: dict(LOAD_S_PRIORS))
    residual: float | None = None             # RMS relative error of the fit on the measured launches
    anchors: dict[tuple, list[float]] = field(default_factory=dict)   # compute_key -> measured / modelled compute
    graph_ratios: list[float] = field(default_factory=list)   # measured compute, graphed / graph-free twin

    @classmethod
    def for_device(cls, device: dict[str, Any]) -> "CostModel":
        """Priors for the machine: a GPU by its datasheet peak (pretrain.metrics.PEAK_TFLOPS), else the CPU's."""
        if device["kind"] == "cuda":
            peaks = next((p for key, p in PEAK_TFLOPS.items() if key in device["name"]), {"bf16": 312.0})
            rate = GPU_PRIORS["rate_share"] * peaks.get(device["precision"], peaks["bf16"]) * 1e12
            return cls(GPU_PRIORS, rate)
        return cls(CPU_PRIORS, CPU_PRIORS["rate_flops"])

    def terms_s(self, config, shape: Shape) -> np.ndarray:
        return prior_terms_s(config, shape, self.priors, self.rate)

    def _compute(self, config, shape: Shape, anchored: bool) -> tuple[float, int]:
        """(compute seconds, measured siblings it came from): the model's, scaled by its siblings' anchor."""
        compute = float((self.terms_s(config, shape) * self.weights).sum())
        ratios = self.anchors.get(compute_key(config), []) if anchored else []
        return compute * (statistics.median(ratios) if ratios else 1.0), len(ratios)

    def predict(self, config, shape: Shape, anchored: bool = True) -> dict[str, float]:
        """{compute_s, data_wait_s, step_time_s, tokens_per_s, siblings, graph_ratio} of a configuration; with
        `anchored`, its compute scaled by the measured siblings' anchor (siblings: how many measured launches it
        came from), or for a graphed one without any, its graph-free twin's times the measured graph ratio."""
        compute, siblings = self._compute(config, shape, anchored)
        graph_ratio = None
        if anchored and not siblings and config.cudagraphs and self.graph_ratios:
            graph_ratio = statistics.median(self.graph_ratios)
            compute, siblings = self._compute(config.replace(cudagraphs=False), shape, anchored)
            compute *= graph_ratio
        loading = shape.examples_per_rank_step * self.load_s.get(config.loader, LOAD_S_PRIORS["shards"])
        wait = loading if config.loader_workers == 0 else max(0.0, loading / config.loader_workers - compute)
        step = compute + wait
        return {"compute_s": compute, "data_wait_s": wait, "step_time_s": step,
                "tokens_per_s": shape.tokens_per_step / step, "siblings": siblings, "graph_ratio": graph_ratio}

    def refit(self, measured: list[tuple[Any, dict[str, Any]]], shape: Shape) -> None:
        """Refit the weights and the loading costs on (config, figures) of every measured launch (figures:
        summarize_metrics of its steady steps: step_time_s, data_wait_s, cpu_loader_* seconds per step)."""
        self._refit_loading(measured, shape)
        timed = [(config, m) for config, m in measured if m.get("step_time_s")]
        if not timed:
            return
        z = np.array([self.terms_s(config, shape) for config, _ in timed])      # each term's prior seconds
        y = np.array([max(m["step_time_s"] - (m.get("data_wait_s") or 0.0), 1e-6) for _, m in timed])  # compute
        ridge = math.sqrt(PRIOR_STRENGTH)
        a = np.vstack([z / y[:, None], ridge * np.eye(len(TERMS))])
        b = np.concatenate([np.ones(len(y)), ridge * np.ones(len(TERMS))])
        solution, *_ = np.linalg.lstsq(a, b, rcond=None)
        self.weights = np.clip(solution, 0.02, None)
        predicted = np.array([self.predict(config, shape, anchored=False)["step_time_s"] for config, _ in timed])
        actual = np.array([m["step_time_s"] for _, m in timed])
        self.residual = float(np.sqrt(np.mean((predicted / actual - 1.0) ** 2)))
        self.anchors, measured_compute = {}, {}
        for (config, _), modelled, compute in zip(timed, z @ self.weights, y):
            self.anchors.setdefault(compute_key(config), []).append(float(compute / modelled))
            measured_compute.setdefault(compute_key(config), []).append(float(compute))
        graphed = {compute_key(config): compute_key(config.replace(cudagraphs=False)) for config, _ in timed
                   if config.cudagraphs}
        self.graph_ratios = [statistics.median(measured_compute[key]) / statistics.median(measured_compute[twin])
                             for key, twin in graphed.items() if twin in measured_compute]

    def _refit_loading(self, measured: list[tuple[Any, dict[str, Any]]], shape: Shape) -> None:
        per_mode: dict[str, list[float]] = {}
        for config, m in measured:
            spent = (m.get("cpu_loader_workers_s") or 0.0) + (m.get("cpu_loader_inline_s") or 0.0)
            if config.loader_workers == 0 and m.get("data_wait_s") is not None:
                spent = max(spent, m["data_wait_s"])
            if spent > 0:
                per_mode.setdefault(config.loader, []).append(spent / shape.examples_per_rank_step)
        for mode, costs in per_mode.items():
            self.load_s[mode] = statistics.median(costs)

    def explain(self) -> dict[str, Any]:
        """The fitted weights per term, the loading costs and the fit's error (for tune.json and tune.md)."""
        return {"weights": dict(zip(TERMS, (round(float(w), 3) for w in self.weights))),
                "load_s_per_example": {k: float(f"{v:.3g}") for k, v in self.load_s.items()},
                "rms_relative_error": None if self.residual is None else round(self.residual, 4),
                "anchors": len(self.anchors),
                "graph_ratio": round(statistics.median(self.graph_ratios), 4) if self.graph_ratios else None}


# ------------------------------------------------------------------------------------------------ memory

def memory_setting(offload: str, cudagraphs: bool) -> str:
    """The calibration's key beside the stage: the offload, with "+cudagraphs" where the blocks are CUDA graphs, whose
    private pools the preflight estimate does not hold (Calibration)."""
    return f"{offload}+cudagraphs" if cudagraphs else str(offload)


@dataclass
class Calibration:
    """Measured peak / preflight estimate: per (zero, memory_setting) where measured there, else the largest seen.

    `ratios` holds every observation; an out-of-memory launch adds the ratio that puts its own estimate at the
    pruning line, so anything larger at its stage is pruned from then on."""

    capacity_gib: float
    margin: float
    ratios: list[tuple[int, str, float, str]] = field(default_factory=list)   # zero, setting, ratio, source
    prior: float = 1.0

    def observe(self, zero: int, setting: str, peak_gib: float | None, estimate_gib: float | None,
                source: str) -> None:
        if peak_gib and estimate_gib:
            self.ratios.append((int(zero), str(setting), float(peak_gib) / float(estimate_gib), source))

    def observe_oom(self, zero: int, setting: str, estimate_gib: float, source: str) -> None:
        """An OOM at this estimate: its calibrated estimate is at least the pruning line from now on."""
        self.ratios.append((int(zero), str(setting), self.capacity_gib * (1 + self.margin) / estimate_gib * 1.001,
                            f"{source} (out of memory)"))

    def ratio(self, zero: int, setting: str) -> float:
        same = [r for z, o, r, _ in self.ratios if (z, o) == (zero, setting)]
        if same:
            return max(same)
        return max([r for *_, r, _ in self.ratios] or [self.prior])

    def verdict(self, zero: int, setting: str, estimate_gib: float) -> tuple[str, float]:
        """("fits" | "near" | "pruned", calibrated estimate): pruned above capacity x (1 + margin), near within
        the margin either side of the capacity (measured, not pruned: the estimate is 0.78-1.1x of peaks)."""
        calibrated = estimate_gib * self.ratio(zero, setting)
        if calibrated > self.capacity_gib * (1 + self.margin):
            return "pruned", calibrated
        return ("near" if calibrated > self.capacity_gib * (1 - self.margin) else "fits"), calibrated
