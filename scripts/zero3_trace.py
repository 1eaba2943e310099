"""ZeRO-3 parameter-fetch trace: is DeepSpeed's module trace kept, is each weight gathered only once, and what do
the per-module hooks cost?

    python scripts/zero3_trace.py --model t5-v1_1-small --steps 4            # spawns 2 gloo ranks on this CPU
    python scripts/zero3_trace.py --model mt5-large --shape-only --baseline  # mt5-large's module tree, tiny widths

Runs real training steps (forward, backward, optimizer step) of a preset at ZeRO 3 with the DeepSpeed config
`pretrain` builds (configs/deepspeed/zero3.yaml + pretrain.ds_config) and the model built partitioned as
`pretrain` builds it (pretrain.model.build_partitioned), on random token batches, and watches DeepSpeed's
parameter coordinator (deepspeed/runtime/zero/partitioned_param_coordinator.py) from outside. Per step:

- trace: the coordinator records the order of the hooked modules in the first step and replays it later to
  prefetch parameters; a module arriving out of the recorded order invalidates the trace (DeepSpeed's own
  warning is switched on too: zero_optimization.log_trace_cache_warnings, in the rank-0 log) and turns
  prefetching off until a new trace is recorded. Each invalidation is reported with its phase, the
  coordinator's position, the module expected there and the one that came.
- all-gathers: every parameter's `all_gather_coalesced` / `all_gather` (the only ways a partitioned parameter
  becomes whole) is wrapped; per phase (forward, backward, optimizer step) the collective calls, parameters and
  bytes gathered, split into prefetched (ahead of their module), on demand (the module waits for them) and
  external (outside the coordinator), against the ideal: each partitioned (non-persistent) parameter gathered
  once in forward and once in backward.
- fetches per parameter for the largest parameters (embedding, LM head, ...) and every parameter gathered more
  often than the ideal.
- DeepSpeed's host-side hooks: calls and seconds of the per-module fetch/release functions and of the
  per-parameter gradient hook. Their count grows with the number of hooked modules, not with the model's width.

--shape-only keeps the preset's module tree (layers, heads, the fused weights) at tiny widths and partitions
every weight (persistence threshold 0, as the full-width weights are): the step is then mostly DeepSpeed's host
overhead, which is the same per module at any width. --baseline also runs the same model and batches at ZeRO 2
and prints the ZeRO-3 / ZeRO-2 step-time ratio. --ds-debug turns on DeepSpeed's debug log (the coordinator's
-fetch/-prefetch/-release lines, in the rank logs; very verbose). `run_trace()` and `steady_state_problems()`
are what tests/pretrain/test_zero3_trace.py calls.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

PHASES = ("forward", "backward", "step")
# DeepSpeed's per-module fetch/release functions (DeepSpeedZeRoOffload) and its per-parameter gradient hook
# (DeepSpeedZeroOptimizer_Stage3); both classes call them as self.NAME(...), so an instance attribute can time them
MODULE_HOOKS = ("pre_sub_module_forward_function", "post_sub_module_forward_function",
                "pre_sub_module_backward_function", "post_sub_module_backward_function")
GRAD_HOOK = "reduce_ready_partitions_and_remove_grads"
MANGLED = "_PartitionedParameterCoordinator__"   # prefix of the coordinator's private attributes
# --shape-only: the preset's depth and head count, widths cut down so that a step costs milliseconds of compute
SHAPE_ONLY = {"d_model": 64, "d_kv": 16, "d_ff": 128, "vocab_size": 4096}


# ------------------------------------------------------------------------------------------ the DeepSpeed config

def trace_ds_config(*, zero: int, stage3: dict[str, int] | None = None, **train_fields) -> dict[str, Any]:
    """The DeepSpeed config `pretrain --zero N --micro-batch M` runs with on CPU (one micro-batch per step); at
    ZeRO 3 with DeepSpeed's trace-cache warnings on. `stage3` sets --stage3-* tunables, e.g.
    {"stage3_param_persistence_threshold": 0}."""
    from pretrain.ds_config import cpu_ds_config

    warnings = {"zero_optimization": {"log_trace_cache_warnings": True}} if zero == 3 else {}
    return cpu_ds_config(zero=zero, deepspeed=warnings, **train_fields, **(stage3 or {}))


# --------------------------------------------------------------------------------------------------- the probe

class FetchProbe:
    """Counts what DeepSpeed's ZeRO-3 machinery gathers, per phase, times its hooks, and records trace
    invalidations, by wrapping (never changing) the engine's parameters, coordinator and hook functions.

        probe = FetchProbe(engine)
        with probe.phase("forward"): loss = engine(...)
        ...
        report = probe.end_step(step, seconds)
    """

    def __init__(self, engine):
        module = engine.module
        offload = engine.optimizer.parameter_offload
        self.coordinator = offload.get_param_coordinator()
        self.params = {p.ds_id: p for p in module.parameters()}
        self.param_names = {p.ds_id: name for name, p in module.named_parameters()}
        # DeepSpeed hooks every module but the children of a z3 leaf module (those get no ds_id)
        self.module_names = {m.ds_id: name or "<model>" for name, m in module.named_modules() if hasattr(m, "ds_id")}
        self.current_phase: str | None = None
        self.current_position: int | None = None    # the trace position the coordinator is fetching for, if any
        self.current_module_params: set[int] = set()
        self.last_module = None                     # the module the coordinator checked last
        self.position_phase: dict[int, str] = {}    # trace position -> phase it was visited in (last seen)
        self.uses: dict[int, list[int]] | None = None   # ds_id -> trace positions of its modules (complete trace)
        self._reset()
        for param in module.parameters():
            self._wrap_gathers(param)
        self._wrap_coordinator()
        for name in MODULE_HOOKS:
            self._wrap_timed(offload, name)
        self._wrap_timed(engine.optimizer, GRAD_HOOK)

    def _reset(self) -> None:
        self.calls = Counter()            # (phase, kind) -> collective calls issued in the phase
        self.gathered = Counter()         # (phase, kind) -> parameters gathered in the phase
        self.gathered_bytes = Counter()   # (phase, kind) -> bytes gathered in the phase (whole parameters)
        self.fetches = Counter()          # (use, ds_id) -> gathers serving the parameter's forward / backward use
        self.hook_calls = Counter()       # hook name -> calls
        self.hook_seconds = Counter()     # hook name -> host seconds inside (on CPU incl. waiting for gathers)
        self.invalidations: list[dict[str, Any]] = []

    # -- instrumentation
    def _record(self, params) -> None:
        gathered = [p for p in params if p.ds_status.name == "NOT_AVAILABLE"]
        if not gathered:
            return
        phase = self.current_phase or "other"
        if self.current_position is None:
            kind = "external"    # not the coordinator: a parameter used outside its module, GatheredParameters
        elif any(p.ds_id in self.current_module_params for p in gathered):
            kind = "demand"
        else:
            kind = "prefetch"
        self.calls[phase, kind] += 1
        for param in gathered:
            self.fetches[self._use_served(param, kind, phase), param.ds_id] += 1
            self.gathered[phase, kind] += 1
            self.gathered_bytes[phase, kind] += param.ds_numel * param.ds_tensor.element_size()

    def _use_served(self, param, kind: str, phase: str) -> str:
        """The use a gather is for: the phase of the parameter's next module in the trace. The prefetcher walks
        the recorded forward+backward trace, so late in the forward it already gathers for backward uses."""
        if kind != "prefetch":
            return phase
        if self.uses is None:
            from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
            from deepspeed.utils import z3_leaf_module

            self.uses = {}
            for position, module in enumerate(getattr(self.coordinator, MANGLED + "submodule_order")):
                for used in iter_params(module, recurse=z3_leaf_module(module)):
                    self.uses.setdefault(used.ds_id, []).append(position)
        positions = self.uses.get(param.ds_id, [])
        following = bisect.bisect_right(positions, self.current_position)
        return self.position_phase.get(positions[following], phase) if following < len(positions) else phase

    def _wrap_gathers(self, param) -> None:
        probe, gather_coalesced, gather = self, param.all_gather_coalesced, param.all_gather

        def all_gather_coalesced(params, *args, **kwargs):
            params = list(params)
            probe._record(params)
            return gather_coalesced(params, *args, **kwargs)

        def all_gather(param_list=None, *args, **kwargs):
            probe._record([param] if param_list is None else list(param_list))
            return gather(param_list, *args, **kwargs)

        param.all_gather_coalesced, param.all_gather = all_gather_coalesced, all_gather

    def _wrap_timed(self, owner, name: str) -> None:
        probe, original = self, getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                probe.hook_calls[name] += 1
                probe.hook_seconds[name] += time.perf_counter() - start

        setattr(owner, name, timed)

    def _wrap_coordinator(self) -> None:
        probe, coordinator = self, self.coordinator
        fetch_sub_module, trace_prologue = coordinator.fetch_sub_module, coordinator.trace_prologue
        invalidate = coordinator._invalidate_trace

        def fetch(sub_module, *args, **kwargs):
            leaf = getattr(sub_module, "_z3_leaf", False)     # a z3 leaf module is fetched with its whole subtree
            probe.current_module_params = ({p.ds_id for p in sub_module.parameters(recurse=leaf)}
                                           | {p.ds_id for p in sub_module.ds_external_parameters()})
            probe.current_position = getattr(coordinator, MANGLED + "step_id")
            probe.position_phase[probe.current_position] = probe.current_phase
            if not coordinator.is_complete_trace():
                probe.uses = None                             # a new trace is being recorded
            try:
                return fetch_sub_module(sub_module, *args, **kwargs)
            finally:
                probe.current_position, probe.current_module_params = None, set()

        def prologue(sub_module, *args, **kwargs):
            probe.last_module = sub_module
            return trace_prologue(sub_module, *args, **kwargs)

        def invalidate_trace(*args, **kwargs):
            if probe.current_phase is not None:   # deepspeed.initialize invalidates once, registering its hooks
                position = getattr(coordinator, MANGLED + "step_id")
                order = getattr(coordinator, MANGLED + "submodule_order")
                probe.invalidations.append({
                    "phase": probe.current_phase, "position": position,
                    "got": None if probe.last_module is None else probe.module_name(probe.last_module),
                    "expected": (probe.module_name(order[position]) if position < len(order)
                                 else f"<end of the {len(order)}-module trace>")})
            return invalidate(*args, **kwargs)

        coordinator.fetch_sub_module = fetch
        coordinator.trace_prologue = prologue
        coordinator._invalidate_trace = invalidate_trace

    def module_name(self, module) -> str:
        return f"{self.module_names.get(module.ds_id, '?')} ({type(module).__name__})"

    # -- phases and steps
    @contextlib.contextmanager
    def phase(self, name: str):
        self.current_phase = name
        try:
            yield
        finally:
            self.current_phase = None

    def trace_mode(self) -> str:
        if self.coordinator.is_complete_trace():
            return "complete"
        return "record" if self.coordinator.is_record_trace() else "invalid"

    def ideal(self) -> dict[str, int]:
        """Each partitioned (not persistent) parameter gathered once in forward and once in backward."""
        partitioned = [p for p in self.params.values() if not p.ds_persist]
        return {"params": len(partitioned), "bytes": sum(p.ds_numel * p.ds_tensor.element_size() for p in partitioned),
                "persistent_params": len(self.params) - len(partitioned)}

    def end_step(self, step: int, seconds: dict[str, float], largest: int = 6) -> dict[str, Any]:
        """This step's report; the counters start again."""
        phases = {}
        for phase in (*PHASES, "other"):
            kinds = {kind: {"calls": self.calls[phase, kind], "params": self.gathered[phase, kind],
                            "bytes": self.gathered_bytes[phase, kind]} for kind in ("prefetch", "demand", "external")}
            if phase != "other" or any(k["params"] for k in kinds.values()):
                phases[phase] = {**{key: sum(k[key] for k in kinds.values()) for key in ("calls", "params", "bytes")},
                                 "by_kind": kinds}
        counts = {ds_id: {"forward": self.fetches["forward", ds_id], "backward": self.fetches["backward", ds_id]}
                  for ds_id in self.params}     # gathers for the parameter's forward use and for its backward use
        gathered_for = {use: {"params": sum(c[use] for c in counts.values()),
                              "bytes": sum(c[use] * self.params[ds_id].ds_numel
                                           * self.params[ds_id].ds_tensor.element_size()
                                           for ds_id, c in counts.items())} for use in ("forward", "backward")}
        over_ideal = [{"name": self.param_names[ds_id], **c} for ds_id, c in counts.items()
                      if c["forward"] > 1 or c["backward"] > 1]
        report = {
            "step": step, "trace_mode": self.trace_mode(),
            "trace_modules": len(getattr(self.coordinator, MANGLED + "submodule_order")),
            "invalidations": [dict(event, step=step) for event in self.invalidations],
            "phases": phases, "gathered_for": gathered_for, "ideal": self.ideal(), "seconds": seconds,
            "largest": [{"name": self.param_names[p.ds_id], "shape": list(p.ds_shape), "persistent": bool(p.ds_persist),
                         **counts[p.ds_id]}
                        for p in sorted(self.params.values(), key=lambda p: -p.ds_numel)[:largest]],
            "over_ideal": over_ideal,
            "hooks": {name: {"calls": self.hook_calls[name], "seconds": round(self.hook_seconds[name], 4)}
                      for name in (*MODULE_HOOKS, GRAD_HOOK)},
        }
        self._reset()
        return report


# ---------------------------------------------------------------------------------------------- one rank's work

def rank_main(args) -> None:
    """One rank: build the model (partitioned at ZeRO 3, as pretrain does), train `args.steps` steps on random
    tokens; rank 0 writes the per-step reports to args.report."""
    import deepspeed

    from pretrain.model import build, build_partitioned, load_config
    from pretrain.trainer import init_rank

    world_size = int(os.environ["WORLD_SIZE"])
    init_rank(int(os.environ["LOCAL_RANK"]), world_size, logging.DEBUG if args.ds_debug else logging.WARNING)
    rank = torch.distributed.get_rank()
    overrides = json.loads(args.model_overrides or "{}")
    model_config = load_config(args.model, **overrides)
    ds_config = trace_ds_config(model=args.model, micro_batch=args.micro_batch, world_size=world_size,
                                precision=args.precision, zero=args.zero, stage3=json.loads(args.stage3 or "{}"))
    model = build_partitioned(model_config, ds_config) if args.zero == 3 else build(model_config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config)
    probe = FetchProbe(engine) if args.zero == 3 else None
    generator = torch.Generator().manual_seed(1000 + rank)
    low = max(model_config.pad_token_id, model_config.eos_token_id) + 1
    reports = []
    for step in range(1, args.steps + 1):
        input_ids = torch.randint(low, model_config.vocab_size, (args.micro_batch, args.input_length),
                                  generator=generator)
        labels = torch.randint(low, model_config.vocab_size, (args.micro_batch, args.target_length),
                               generator=generator)
        marks = [time.perf_counter()]
        with probe.phase("forward") if probe else contextlib.nullcontext():
            loss = engine(input_ids, labels=labels)
        marks.append(time.perf_counter())
        with probe.phase("backward") if probe else contextlib.nullcontext():
            engine.backward(loss)
        marks.append(time.perf_counter())
        with probe.phase("step") if probe else contextlib.nullcontext():
            engine.step()
        marks.append(time.perf_counter())
        seconds = {"forward": marks[1] - marks[0], "backward": marks[2] - marks[1], "step": marks[3] - marks[2],
                   "total": marks[3] - marks[0]}
        seconds = {key: round(value, 4) for key, value in seconds.items()}
        report = probe.end_step(step, seconds) if probe else {"step": step, "seconds": seconds}
        reports.append(dict(report, loss=float(loss.detach())))
    if rank == 0:
        run = {"model": model_config.name, "zero": args.zero, "world_size": world_size,
               "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
               "modules": sum(1 for _ in model.modules()),
               "hooked_modules": len(probe.module_names) if probe else 0,
               "zero_optimization": ds_config["zero_optimization"],
               "precision": "bf16" if ds_config["bf16"]["enabled"] else "fp32", "micro_batch": args.micro_batch,
               "input_length": args.input_length, "target_length": args.target_length, "model_overrides": overrides}
        tmp = Path(args.report + ".tmp")
        tmp.write_text(json.dumps({"run": run, "steps": reports}, indent=1))
        tmp.rename(args.report)
    del engine, model, probe
    gc.collect()        # ZeRO-3 parameters still alive when the process group is gone abort the process at exit
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------- spawning the ranks

def run_trace(model: str = "t5-v1_1-small", *, zero: int = 3, steps: int = 4, nproc: int = 2, micro_batch: int = 2,
              input_length: int = 64, target_length: int = 16, precision: str = "fp32",
              stage3: dict[str, int] | None = None, model_overrides: dict[str, Any] | None = None,
              ds_debug: bool = False, timeout: float = 600, workdir: str | os.PathLike | None = None) -> dict:
    """Start `nproc` gloo ranks of this script on this machine (RANK / WORLD_SIZE / MASTER_* as pretrain's
    spawner sets them) and return rank 0's report {"run": {...}, "steps": [one report per step]}."""
    from pretrain.launch import run_script_ranks

    workdir = Path(workdir or tempfile.mkdtemp(prefix="zero3_trace_"))
    report = workdir / f"report-zero{zero}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--rank-worker", "--report", str(report), "--model", model,
            "--zero", str(zero), "--steps", str(steps), "--micro-batch", str(micro_batch), "--input-length",
            str(input_length), "--target-length", str(target_length), "--precision", precision,
            "--stage3", json.dumps(stage3 or {}), "--model-overrides", json.dumps(model_overrides or {})]
    if ds_debug:
        argv.append("--ds-debug")
    logs = [workdir / f"zero{zero}-rank-{rank}.log" for rank in range(nproc)]
    run_script_ranks(argv, logs, timeout, "zero3_trace", report)
    result = json.loads(report.read_text())
    result["run"]["logs"] = [str(path) for path in logs]
    return result


# ------------------------------------------------------------------------------------------ reading the reports

def steady_state_problems(result: dict, skip: int = 1) -> list[str]:
    """What is wrong after the first `skip` steps (step 1 records the trace): a trace invalidation, a trace not
    complete at the end of a step, a parameter gathered more than once for its forward or for its backward use,
    or more bytes gathered for a phase's uses than the ideal. (Gathers on demand are reported by
    `demand_gathers`, not here: a tight stage3_max_live_parameters makes some on purpose.)"""
    problems = []
    for report in result["steps"][skip:]:
        step = report["step"]
        for event in report["invalidations"]:
            problems.append(f"step {step}: trace invalidated in {event['phase']} at position {event['position']} "
                            f"(expected {event['expected']}, got {event['got']})")
        if report["trace_mode"] != "complete":
            problems.append(f"step {step}: trace {report['trace_mode']} at the end of the step")
        for param in report["over_ideal"]:
            problems.append(f"step {step}: {param['name']} gathered {param['forward']}x for its forward use, "
                            f"{param['backward']}x for its backward use")
        for phase in ("forward", "backward"):
            if report["gathered_for"][phase]["bytes"] > report["ideal"]["bytes"]:
                problems.append(f"step {step}: {report['gathered_for'][phase]['bytes']:,} bytes gathered for {phase} "
                                f"uses, the ideal is {report['ideal']['bytes']:,}")
    return problems


def demand_gathers(result: dict, skip: int = 1) -> int:
    """Parameters gathered on demand (the module waited; not prefetched) in forward and backward after `skip`
    steps: 0 while the trace holds and stage3_max_live_parameters leaves room to prefetch."""
    return sum(report["phases"][phase]["by_kind"]["demand"]["params"]
               for report in result["steps"][skip:] for phase in ("forward", "backward"))


def steady_median(result: dict, key: str = "total", skip: int = 2) -> float:
    """Median seconds of the steps after `skip`: step 1 records the trace, and in step 2 DeepSpeed works out (and
    caches) which parameters each module may release, a one-time cost that grows with the trace length."""
    steps = result["steps"][skip:] or result["steps"][-1:]
    return statistics.median(report["seconds"][key] for report in steps)


def mib(numbytes: int) -> str:
    return f"{numbytes / 2**20:,.1f} MiB"


def format_step(report: dict) -> str:
    seconds, ideal = report["seconds"], report["ideal"]
    lines = [f"step {report['step']}: loss {report['loss']:.4f}, {seconds['total']:.3f} s (forward "
             f"{seconds['forward']:.3f}, backward {seconds['backward']:.3f}, optimizer {seconds['step']:.3f}); trace "
             f"{report['trace_mode']} ({report['trace_modules']} module visits)"]
    lines += [f"  TRACE INVALIDATED in {event['phase']} at position {event['position']}: expected {event['expected']}, "
              f"got {event['got']}" for event in report["invalidations"]] or ["  trace invalidated: no"]
    for phase, figures in report["phases"].items():
        kinds = ", ".join(f"{kind} {v['params']} params in {v['calls']} calls"
                          for kind, v in figures["by_kind"].items() if v["params"])
        lines.append(f"  issued in {phase:8s}: {figures['calls']:4d} all-gather calls, {figures['params']:4d} params, "
                     f"{mib(figures['bytes'])}" + (f" ({kinds})" if kinds else ""))
    for use in ("forward", "backward"):
        served = report["gathered_for"][use]
        lines.append(f"  gathered for {use} uses: {served['params']:4d} params, {mib(served['bytes'])}; ideal "
                     f"{ideal['params']} params, {mib(ideal['bytes'])}")
    lines.append("  gathers for the forward/backward use of the largest parameters: " + "; ".join(
        f"{p['name']} {tuple(p['shape'])}{' (persistent)' if p['persistent'] else ''} {p['forward']}/{p['backward']}"
        for p in report["largest"]))
    over = report["over_ideal"]
    lines.append(f"  parameters gathered more than the ideal: {len(over)}" + ("".join(
        f"; {p['name']} {p['forward']}/{p['backward']}" for p in over[:12]) + (" ..." if len(over) > 12 else "")))
    lines.append("  DeepSpeed hooks (calls, host s): " + "; ".join(
        f"{name.replace('_function', '').replace('sub_module_', '')} {h['calls']}, {h['seconds']:.3f}"
        for name, h in report["hooks"].items()))
    return "\n".join(lines)


def format_report(result: dict) -> str:
    run = result["run"]
    head = (f"{run['model']} at ZeRO {run['zero']}: {run['parameters']:,} parameters, {run['modules']} modules"
            + (f" ({run['hooked_modules']} hooked by ZeRO 3)" if run["zero"] == 3 else "")
            + f", {run['world_size']} ranks, {run['precision']}, micro batch {run['micro_batch']}, lengths "
              f"{run['input_length']}/{run['target_length']}" + (f", model overrides {run['model_overrides']}"
                                                                if run["model_overrides"] else ""))
    if run["zero"] != 3:
        return "\n".join([head] + [f"step {r['step']}: loss {r['loss']:.4f}, {r['seconds']['total']:.3f} s (forward "
                                   f"{r['seconds']['forward']:.3f}, backward {r['seconds']['backward']:.3f}, "
                                   f"optimizer {r['seconds']['step']:.3f})" for r in result["steps"]])
    zero = run["zero_optimization"]
    tunables = ", ".join(f"{key}={zero[key]:g}" for key in sorted(zero)
                         if key.startswith("stage3_") and type(zero[key]) in (int, float))
    ideal = result["steps"][0]["ideal"]
    head += f"\n{ideal['params']} partitioned + {ideal['persistent_params']} persistent parameters; {tunables}"
    return "\n".join([head, *(format_step(report) for report in result["steps"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="t5-v1_1-small", help="preset in configs/models/ (default t5-v1_1-small)")
    parser.add_argument("--steps", type=int, default=4, help="training steps; step 1 records the trace")
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--input-length", type=int, default=64)
    parser.add_argument("--target-length", type=int, default=16)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--shape-only", action="store_true",
                        help=f"the preset's module tree at tiny widths {SHAPE_ONLY}, every weight partitioned")
    parser.add_argument("--stage3", default="{}", help='JSON of --stage3-* tunables, e.g. '
                                                       '\'{"stage3_param_persistence_threshold": 0}\'')
    parser.add_argument("--model-overrides", default="{}", help='JSON of T5Config fields, e.g. \'{"num_layers": 2}\'')
    parser.add_argument("--baseline", action="store_true", help="also run ZeRO 2 on the same model and batches")
    parser.add_argument("--ds-debug", action="store_true", help="DeepSpeed's debug log in the rank logs (verbose)")
    parser.add_argument("--json", default="", help="also write the full report(s) to this file")
    parser.add_argument("--zero", type=int, choices=(2, 3), default=3, help=argparse.SUPPRESS)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        rank_main(args)
        return 0
    stage3, overrides = json.loads(args.stage3), json.loads(args.model_overrides)
    if args.shape_only:
        overrides = {**SHAPE_ONLY, **overrides}
        stage3 = {"stage3_param_persistence_threshold": 0, **stage3}
    common = dict(steps=args.steps, nproc=args.nproc, micro_batch=args.micro_batch, input_length=args.input_length,
                  target_length=args.target_length, precision=args.precision, model_overrides=overrides,
                  workdir=tempfile.mkdtemp(prefix="zero3_trace_"))
    result = run_trace(args.model, stage3=stage3, ds_debug=args.ds_debug, **common)
    print(format_report(result))
    problems = steady_state_problems(result)
    print("\nsteady state (steps 2+): " + ("no trace invalidation, no parameter gathered more than the ideal"
                                          if not problems else f"{len(problems)} problem(s)")
          + f"; {demand_gathers(result)} parameter gathers on demand (not prefetched)")
    for problem in problems[:40]:
        print("  " + problem)
    steady = result["steps"][1:] or result["steps"]
    visits = statistics.median(r["hooks"][MODULE_HOOKS[0]]["calls"] + r["hooks"][MODULE_HOOKS[2]]["calls"]
                               for r in steady)
    print(f"DeepSpeed module visits per step (pre-forward + pre-backward hooks): {visits:.0f} "
          f"({result['run']['hooked_modules']} hooked modules); median step (steps 3+) {steady_median(result):.3f} s")
    results = {"zero3": result}
    if args.baseline:
        baseline = run_trace(args.model, zero=2, **common)
        results["zero2"] = baseline
        print("\n" + format_report(baseline))
        zero3_s, zero2_s = steady_median(result), steady_median(baseline)
        print(f"\nmedian step (steps 3+): ZeRO 3 {zero3_s:.3f} s, ZeRO 2 {zero2_s:.3f} s: ZeRO 3 at "
              f"{zero2_s / zero3_s:.2f}x ZeRO 2's throughput; {zero3_s - zero2_s:.3f} s more per step, "
              f"{1e3 * (zero3_s - zero2_s) / max(1.0, visits):.2f} ms per module visit")
    print(f"rank logs (DeepSpeed's own trace-cache warnings in rank 0's): {', '.join(result['run']['logs'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
