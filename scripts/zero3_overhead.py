"""Host-side cost of ZeRO 3 against ZeRO 2 per micro-step, and where it goes (cProfile of rank 0).

    python scripts/zero3_overhead.py --model mt5-large --shape-only                 # ZeRO 2 and 3, eager
    python scripts/zero3_overhead.py --model mt5-large --shape-only --compile --accum 2
    python scripts/zero3_overhead.py --model mt5-large --shape-only --json z2.json   # then one ZeRO-3 variant:
    python scripts/zero3_overhead.py --model mt5-large --shape-only --zero 3 --compare z2.json --profile \
        --ds '{"zero_optimization": {"memory_efficient_linear": false}}'

Spawns 2 gloo ranks on this CPU (as `pretrain --nproc 2` does) per ZeRO stage; each builds the model as the
trainer does (`build` at ZeRO 2, `build_partitioned` at ZeRO 3, `compile_regions()` with --compile), the DeepSpeed
config `pretrain` builds (configs/deepspeed/zero{N}.yaml + pretrain.ds_config, with --ds merged in last), and runs
`--steps` optimizer steps of `--accum` micro-steps on seeded random tokens (the same batches at every stage and
variant, so rank 0's losses must agree; --compare takes the ZeRO-2 run of an earlier --json). --shape-only keeps
the preset's module and parameter structure (layers, heads, the fused weights) at tiny widths, so the step time is
mostly framework overhead: what ZeRO 3 adds to it is host work (and, on gloo, communication) that ZeRO 2 does
not have. At ZeRO 3 --shape-only also sets
stage3_param_persistence_threshold 1000, so that the same parameters stay whole as at full width with the default
1e5 (the norms and position biases). --gather-unit stack makes a whole stack ZeRO 3's unit of gathering.

Prints per stage: median seconds per optimizer step and per micro-step over the steps after --skip, split into
forward / backward / optimizer step (host wall time), rank 0's losses, and with --profile the DeepSpeed functions
that take the most host time per micro-step (cProfile of rank 0 over the measured steps; cProfile's own overhead
inflates Python-heavy code, so use the unprofiled run for seconds and the profile for shares), grouped as
forward hooks, backward hooks, gradient reduction / partitioning and optimizer step (cumulative, so on gloo they
include waiting for the collectives), and Dynamo's counters (graph breaks, graphs) with --compile. `run_overhead()`
is what tests/pretrain/test_zero3_overhead.py calls.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# --shape-only: the preset's depth and head count, widths cut so that compute is negligible
SHAPE_ONLY = {"d_model": 64, "d_kv": 4, "d_ff": 128, "vocab_size": 1024}
# ... and at ZeRO 3 the same parameters persistent as at full width with the default threshold (1e5): the norms
# (d_model) and the position biases (32 x heads), not the matrices (at least d_model x heads*d_kv = 4,096 here)
SHAPE_ONLY_STAGE3 = {"zero_optimization": {"stage3_param_persistence_threshold": 1000}}
# entry points of DeepSpeed's per-micro-step work (cumulative time of each = that group's host time)
GROUPS = {
    "forward hooks": ("pre_sub_module_forward_function", "post_sub_module_forward_function",
                      "_pre_forward_module_hook", "_post_forward_module_hook", "_start_of_forward_hook",
                      "_end_of_forward_hook"),
    "backward hooks": ("pre_sub_module_backward_function", "post_sub_module_backward_function",
                       "_run_before_backward_function", "_run_after_backward_function", "_pre_backward_module_hook",
                       "_post_backward_module_hook"),
    "gradient reduction": ("reduce_ready_partitions_and_remove_grads",
                           "reduce_independent_p_g_buckets_and_remove_grads",
                           "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
                           "reduce_partition_and_remove_grads", "independent_gradient_partition_epilogue",
                           "reduce_gradients", "overlapping_partition_gradients_reduce_epilogue"),
    "optimizer step": ("step",),
}


# ---------------------------------------------------------------------------------------------- one rank's work

def dynamo_counters() -> dict:
    """torch._dynamo's counters (graph breaks with their reasons, frames compiled): whether --compile kept each
    block's forward one graph under ZeRO 3's hooks and its F.linear replacement."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters
    return {name: dict(counter) for name, counter in counters.items() if counter}


def rank_main(args) -> None:
    import deepspeed

    from pretrain.ds_config import cpu_ds_config
    from pretrain.model import build, build_partitioned, load_config
    from pretrain.trainer import init_rank

    world_size = int(os.environ["WORLD_SIZE"])
    init_rank(int(os.environ["LOCAL_RANK"]), world_size)
    rank = torch.distributed.get_rank()
    model_config = load_config(args.model, **json.loads(args.model_overrides))
    ds_config = cpu_ds_config(model=args.model, zero=args.zero, micro_batch=args.micro_batch, grad_accum=args.accum,
                              world_size=world_size, precision=args.precision, deepspeed=json.loads(args.ds))
    model = (build_partitioned(model_config, ds_config, seed=0, gather_unit=args.gather_unit) if args.zero == 3
             else build(model_config, seed=0))
    if args.compile:
        model.compile_regions()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config)
    generator = torch.Generator().manual_seed(1000 + rank)
    low = max(model_config.pad_token_id, model_config.eos_token_id) + 1
    profiler = cProfile.Profile() if args.profile and rank == 0 else None
    steps = []
    for step in range(1, args.steps + 1):
        batches = [(torch.randint(low, model_config.vocab_size, (args.micro_batch, args.input_length),
                                  generator=generator),
                    torch.randint(low, model_config.vocab_size, (args.micro_batch, args.target_length),
                                  generator=generator)) for _ in range(args.accum)]
        torch.distributed.barrier()
        measured = step > args.skip
        if profiler is not None and measured:
            profiler.enable()
        seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        losses = []
        start = time.perf_counter()
        for input_ids, labels in batches:
            t0 = time.perf_counter()
            loss = engine(input_ids, labels=labels)
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()            # an optimizer step at the accumulation boundary only
            t3 = time.perf_counter()
            seconds["forward"] += t1 - t0
            seconds["backward"] += t2 - t1
            seconds["step"] += t3 - t2
            losses.append(float(loss.detach()))
        seconds["total"] = time.perf_counter() - start
        if profiler is not None and measured:
            profiler.disable()
        steps.append({"step": step, "seconds": {k: round(v, 5) for k, v in seconds.items()}, "losses": losses})
    if rank == 0:
        if profiler is not None:
            profiler.dump_stats(args.report + ".prof")
        run = {"model": model_config.name, "zero": args.zero, "compile": args.compile, "accum": args.accum,
               "micro_batch": args.micro_batch, "lengths": [args.input_length, args.target_length],
               "precision": args.precision, "ds_extra": json.loads(args.ds),
               "zero_optimization": ds_config["zero_optimization"], "model_overrides": json.loads(args.model_overrides),
               "parameter_tensors": sum(1 for _ in model.parameters()),
               "gather_unit": args.gather_unit, "hooked_modules": sum(1 for m in model.modules() if hasattr(m, "ds_id")),
               "linear": f"{torch.nn.functional.linear.__module__}.{torch.nn.functional.linear.__name__}",
               "dynamo_counters": dynamo_counters(),
               "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())}
        tmp = Path(args.report + ".tmp")
        tmp.write_text(json.dumps({"run": run, "steps": steps}, indent=1))
        tmp.rename(args.report)
    del engine, model
    gc.collect()        # ZeRO-3 parameters alive when the process group is gone abort the process at exit
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------- spawning the ranks

def run_overhead(model: str = "mt5-large", *, zero: int = 3, compile: bool = False, steps: int = 10, skip: int = 3,
                 accum: int = 1, nproc: int = 2, micro_batch: int = 2, input_length: int = 64, target_length: int = 16,
                 precision: str = "fp32", ds: dict | None = None, model_overrides: dict | None = None,
                 profile: bool = False, gather_unit: str = "block", timeout: float = 900,
                 workdir: str | os.PathLike | None = None) -> dict:
    """Start `nproc` gloo ranks of this script and return rank 0's report {"run", "steps"[, "profile"]}."""
    from pretrain.launch import run_script_ranks

    workdir = Path(workdir or tempfile.mkdtemp(prefix="zero3_overhead_"))
    report = workdir / f"report-zero{zero}-{time.monotonic_ns()}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--rank-worker", "--report", str(report), "--model", model,
            "--zero", str(zero), "--steps", str(steps), "--skip", str(skip), "--accum", str(accum),
            "--micro-batch", str(micro_batch), "--input-length", str(input_length),
            "--target-length", str(target_length), "--precision", precision, "--ds", json.dumps(ds or {}),
            "--model-overrides", json.dumps(model_overrides or {}), "--gather-unit", gather_unit]
    if compile:
        argv.append("--compile")
    if profile:
        argv.append("--profile")
    logs = [report.with_suffix(f".rank-{rank}.log") for rank in range(nproc)]
    run_script_ranks(argv, logs, timeout, "zero3_overhead", report)
    result = json.loads(report.read_text())
    result["run"]["logs"] = [str(path) for path in logs]
    if profile:
        result["profile"] = summarize_profile(str(report) + ".prof", micro_steps=(steps - skip) * accum)
        result["run"]["profile_path"] = str(report) + ".prof"
    return result


# ------------------------------------------------------------------------------------------ reading the results

def summarize_profile(path: str, micro_steps: int, top: int = 25) -> dict:
    """Per micro-step ms: the cumulative time of each group's DeepSpeed entry points (GROUPS), and the DeepSpeed /
    torch functions with the most cumulative and own time."""
    stats = pstats.Stats(path).stats     # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    per = 1e3 / max(1, micro_steps)

    def label(key):
        file, line, name = key
        marker = "site-packages/"
        short = file.split(marker, 1)[1] if marker in file else file.replace(str(REPO_ROOT) + "/", "")
        return f"{short}:{line}:{name}"

    groups = {}
    for group, names in GROUPS.items():
        entries = {}
        for key, (cc, nc, tottime, cumtime, callers) in stats.items():
            if key[2] in names and "deepspeed" in key[0] and not (group == "optimizer step" and
                                                                  "engine.py" not in key[0]):
                entries[label(key)] = {"calls": round(nc / max(1, micro_steps), 1), "cum_ms": round(cumtime * per, 2)}
        groups[group] = entries

    def table(sort_index: int, only_deepspeed: bool):
        rows = [(key, value) for key, value in stats.items() if not only_deepspeed or "deepspeed" in key[0]]
        rows.sort(key=lambda kv: -kv[1][sort_index])
        return [{"function": label(key), "calls": round(v[1] / max(1, micro_steps), 1),
                 "own_ms": round(v[2] * per, 2), "cum_ms": round(v[3] * per, 2)} for key, v in rows[:top]]

    total = sum(v[2] for v in stats.values()) * per
    return {"micro_steps": micro_steps, "profiled_ms_per_micro_step": round(total, 1), "groups": groups,
            "deepspeed_by_cum": table(3, True), "deepspeed_by_own": table(2, True), "all_by_own": table(2, False)}


def summarize(result: dict, skip: int) -> dict:
    measured = [s for s in result["steps"] if s["step"] > skip]
    accum = result["run"]["accum"]
    med = {key: statistics.median(s["seconds"][key] for s in measured)
           for key in ("total", "forward", "backward", "step")}
    spread = [s["seconds"]["total"] for s in measured]
    return {"step_s": med["total"], "micro_step_s": med["total"] / accum, "forward_s": med["forward"] / accum,
            "backward_s": med["backward"] / accum, "optimizer_s": med["step"], "min_s": min(spread),
            "max_s": max(spread)}


def format_summary(name: str, result: dict, skip: int) -> str:
    s = summarize(result, skip)
    losses = [round(loss, 6) for step in result["steps"] for loss in step["losses"]]
    return (f"{name}: {s['step_s']:.4f} s/step ({s['min_s']:.3f}-{s['max_s']:.3f}), "
            f"{s['micro_step_s']:.4f} s/micro-step "
            f"(forward {s['forward_s']:.4f}, backward {s['backward_s']:.4f}), optimizer {s['optimizer_s']:.4f} s; "
            f"losses {losses[:3]} ... {losses[-2:]}")


def format_profile(profile: dict, rows: int = 15) -> str:
    lines = [f"cProfile of rank 0, per micro-step ({profile['micro_steps']} micro-steps; "
             f"{profile['profiled_ms_per_micro_step']} ms profiled per micro-step):"]
    for group, entries in profile["groups"].items():
        ordered = sorted(entries.items(), key=lambda kv: -kv[1]["cum_ms"])
        lines.append(f"  {group}: " + "; ".join(f"{name.rsplit(':', 1)[1]} {v['calls']:g} calls {v['cum_ms']:.2f} ms"
                                                for name, v in ordered))
    for title, key in (("DeepSpeed by cumulative time", "deepspeed_by_cum"),
                       ("DeepSpeed by own time", "deepspeed_by_own"), ("everything by own time", "all_by_own")):
        lines.append(f"  {title} (calls, own ms, cum ms per micro-step):")
        lines += [f"    {r['calls']:7g} {r['own_ms']:8.2f} {r['cum_ms']:8.2f}  {r['function']}"
                  for r in profile[key][:rows]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from pretrain.cli import GATHER_UNITS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mt5-large", help="preset name or YAML path (default mt5-large)")
    parser.add_argument("--shape-only", action="store_true", help=f"tiny widths {SHAPE_ONLY}, the preset's structure")
    parser.add_argument("--model-overrides", default="{}", help="JSON of T5Config fields")
    parser.add_argument("--zero", default="2,3", help="stages to run, comma-separated (default 2,3)")
    parser.add_argument("--compile", action="store_true", help="compile_regions() as pretrain --compile")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps not measured (default 3)")
    parser.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--input-length", type=int, default=64)
    parser.add_argument("--target-length", type=int, default=16)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--ds", default="{}", help="JSON merged into the DeepSpeed config of ZeRO 3 (and --ds2: 2)")
    parser.add_argument("--ds2", default="{}", help="JSON merged into the DeepSpeed config of ZeRO 2")
    parser.add_argument("--gather-unit", default="block", choices=GATHER_UNITS,
                        help="ZeRO 3's unit of gathering (pretrain --stage3-gather-unit)")
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0 over the measured steps")
    parser.add_argument("--compare", default="", help="a --json file whose ZeRO 2 run to compare against")
    parser.add_argument("--json", default="", help="also write the full results to this file")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report", default="", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    if args.rank_worker:
        args.zero = int(args.zero)
        rank_main(args)
        return 0
    from pretrain.ds_config import deep_merge

    overrides = json.loads(args.model_overrides)
    ds3 = json.loads(args.ds)
    if args.shape_only:
        overrides = {**SHAPE_ONLY, **overrides}
        ds3 = deep_merge(SHAPE_ONLY_STAGE3, ds3)
    results = {}
    for zero in (int(z) for z in args.zero.split(",")):
        result = run_overhead(args.model, zero=zero, compile=args.compile, steps=args.steps, skip=args.skip,
                              accum=args.accum, nproc=args.nproc, micro_batch=args.micro_batch,
                              input_length=args.input_length, target_length=args.target_length,
                              precision=args.precision, ds=ds3 if zero == 3 else json.loads(args.ds2),
                              model_overrides=overrides, profile=args.profile, gather_unit=args.gather_unit)
        results[f"zero{zero}"] = result
        run = result["run"]
        print(format_summary(f"ZeRO {zero}{' compiled' if args.compile else ''} ({run['parameter_tensors']} parameter "
                             f"tensors, accum {args.accum})", result, args.skip))
        if args.compile:
            counters = run["dynamo_counters"]
            print(f"  dynamo: {counters.get('stats', {}).get('unique_graphs')} graphs, graph breaks "
                  f"{counters.get('graph_break', {}) or 'none'}; F.linear is {run['linear']}")
        if args.profile:
            print(format_profile(result["profile"]))
    if args.compare:
        reference = json.loads(Path(args.compare).read_text())["zero2"]
        results.setdefault("zero2", reference)
    if "zero2" in results and "zero3" in results:
        two, three = summarize(results["zero2"], args.skip), summarize(results["zero3"], args.skip)
        diffs = [abs(a - b) / max(1e-12, abs(a)) for a, b in
                 zip((l for s in results["zero2"]["steps"] for l in s["losses"]),
                     (l for s in results["zero3"]["steps"] for l in s["losses"]))]
        print(f"ZeRO 3 - ZeRO 2: {three['micro_step_s'] - two['micro_step_s']:+.4f} s per micro-step, ZeRO 3 at "
              f"{two['step_s'] / three['step_s']:.2f}x ZeRO 2's speed; largest relative loss difference "
              f"{max(diffs):.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
