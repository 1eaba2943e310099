"""The `study` command: run a ZeRO x data-loading grid of real `pretrain` launches, build its report, or tune.

    study run configs/study/cpu-tiny.yaml --out studies/cpu-tiny && study report studies/cpu-tiny
    study tune --model t5-tiny --data shards/demo --nproc 1 --global-batch 16 --out tunes/tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.common import run_cli
from pretrain.study.results import rebuild_report
from pretrain.study.runner import run_study


def cmd_run(args: argparse.Namespace) -> int:
    """Run every unfinished point of GRID (one `pretrain` launch each), then write results.csv, report.md, plots.

    A point that fails (out of memory, non-zero exit, timeout) is recorded with its reason and the sweep goes
    on. Rerunning the same command skips finished points (ok or failed); --retry-failed reruns the failed ones.
    """
    counts = run_study(args.grid, args.out, data=args.data, dry_run=args.dry_run, retry_failed=args.retry_failed,
                       argv=["study", *map(str, sys.argv[1:])] if sys.argv[1:] else None)
    return 0 if args.dry_run or counts.get("ok", 0) > 0 else 1


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild results.csv, report.md and the plots of STUDY_DIR from its run dirs (or from its results.csv)."""
    written = rebuild_report(args.study_dir)
    print(f"results: {written['csv']}\nreport:  {written['md']}\nplots:   "
          + ", ".join(str(p) for p in written["plots"]))
    return 0


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(v) for v in text.split(","))
    except ValueError:
        steps = ()
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"expected steps per rung like 6,12; got {text!r}")
    return steps


def cmd_tune(args: argparse.Namespace) -> int:
    """Find the fastest pretrain configuration for one model, machine and global batch: enumerate the space (ZeRO
    stage, offload, micro batch, activation checkpointing, loader and workers, CPU-Adam threads, and on GPUs with
    --set compile=true the blocks as CUDA graphs; narrowed by --space and --set), prune what the calibrated memory
    estimate says cannot fit, rank the rest by a cost model refitted after every measurement, and measure in rank
    order with short real launches (successive halving) until --budget-s or until no candidate left can beat the
    best by the noise. Writes DIR/best.yaml
    (`pretrain --config DIR/best.yaml`), tune.md, tune.json and plots. A rerun of the same command continues.
    """
    from pretrain.study.tune import TuneOptions, run_tune
    from pretrain.study.tune_report import speedup

    options = TuneOptions(out=Path(args.out), data=args.data, model=args.model, nproc=args.nproc,
                          global_batch=args.global_batch, space=args.space, sets=args.set, budget_s=args.budget_s,
                          rung_steps=args.rung_steps, skip_steps=args.skip_steps, keep=args.keep,
                          min_measured=args.min_measured, model_margin=args.model_margin,
                          sibling_margin=args.sibling_margin,
                          device_memory_gib=args.device_memory_gib, calibrate_from=args.calibrate_from,
                          best_steps=args.best_steps, dry_run=args.dry_run, write_grid=args.write_grid,
                          compare_grid=args.compare_grid, argv=["study", *map(str, sys.argv[1:])])
    tune = run_tune(options)
    if args.write_grid:
        print(f"full grid: {args.write_grid} (run it as: study run {args.write_grid} --out DIR)")
    for stop in tune.stops:
        print(f"[tune] stop: {stop}")
    if args.dry_run:
        return 0
    best = tune.best()
    if best is None:
        print(f"tune: no candidate finished ok; see {args.out}/tune.md")
        return 1
    ratio, basis = speedup(tune)
    rung, row = best.best_result()
    print(f"tune: best {best.point_id}: {row['tokens_per_s']:.0f} tok/s at rung {rung}; "
          f"{'%.2fx' % ratio if ratio else 'n/a'} the defaults ({basis}); {len(tune.state['launches'])} launches, "
          f"{tune.spent_s:.0f} s\nbest:   {args.out}/best.yaml (pretrain --config {args.out}/best.yaml)\n"
          f"report: {args.out}/tune.md")
    against = tune.state.get("against_grid")
    if against:
        chosen = against["tune_best"] or {}
        print(f"against the grid {against['study_dir']}: its best {against['grid_best']['point_id']} "
              f"{against['grid_best']['tokens_per_s']:.0f} tok/s; the tune's best "
              + (f"{against['gap']:.1%} below it there" if against["gap"] is not None
                 else f"not a point of it ({chosen.get('point_id')})")
              + f"; {against['tune_device_s']:.0f} s against {against['grid_device_s']:.0f} s of launches "
              f"({against['time_share']:.0%}); goal {'met' if against['goal_met'] else 'not met'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a study grid", description=cmd_run.__doc__)
    run.add_argument("grid", help="grid file (YAML), e.g. configs/study/cpu-tiny.yaml")
    run.add_argument("--out", required=True, help="study directory, e.g. studies/cpu-tiny")
    run.add_argument("--data", help="shard set to use instead of the grid's `data` (a prep'd directory)")
    run.add_argument("--dry-run", action="store_true", help="list the points, their pretrain commands and settings only")
    run.add_argument("--retry-failed", action="store_true", help="rerun points recorded as failed/oom/timeout")
    run.set_defaults(handler=cmd_run)
    report = commands.add_parser("report", help="rebuild results.csv, report.md and plots",
                                 description=cmd_report.__doc__)
    report.add_argument("study_dir", help="a study directory written by `study run`")
    report.set_defaults(handler=cmd_report)
    tune = commands.add_parser("tune", help="find the fastest configuration by measuring few candidates",
                               description=cmd_tune.__doc__)
    tune.add_argument("--out", required=True, help="tune directory, e.g. tunes/mt5-large")
    tune.add_argument("--data", help="shard set (a prep'd directory or URL); or `data:` in --space")
    tune.add_argument("--model", help="model preset, e.g. mt5-large (or base.model in --space)")
    tune.add_argument("--nproc", type=int, help="ranks (GPUs) per launch (or base.nproc in --space)")
    tune.add_argument("--global-batch", type=int, help="examples per optimizer step (or base.global_batch)")
    tune.add_argument("--space", help="a grid file narrowing the space: base (fixed settings), grid (axes), "
                                      "exclude; see configs/tune/")
    tune.add_argument("--set", action="append", default=[], metavar="AXIS=V1,V2",
                      help="an axis and its values (repeatable), e.g. --set zero=2,3 --set loader_workers=1")
    tune.add_argument("--budget-s", type=float, help="stop once the launches' wall seconds reach this")
    tune.add_argument("--rung-steps", type=_positive_ints, default=(6, 12),
                      help="steps of each successive-halving rung (default 6,12)")
    tune.add_argument("--skip-steps", type=int, default=2, help="first steps of each launch left out (default 2)")
    tune.add_argument("--keep", type=float, default=0.34, help="share of a rung kept for the next (default 0.34)")
    tune.add_argument("--min-measured", type=int, default=3,
                      help="candidates measured before the cost model may stop the first rung (default 3)")
    tune.add_argument("--model-margin", type=float, default=0.15,
                      help="least relative error the cost model is granted when it stops early (default 0.15)")
    tune.add_argument("--sibling-margin", type=float, default=0.06,
                      help="error granted a prediction whose compute comes from measured candidates differing only "
                           "in loading: one configuration's run-to-run spread (default 0.06)")
    tune.add_argument("--device-memory-gib", type=float,
                      help="memory per device to prune against (default: the GPU's, on CPU the host's per rank)")
    tune.add_argument("--calibrate-from", nargs="+", default=[], metavar="STUDY_DIR",
                      help="study or tune directories whose measured peaks calibrate the memory estimate")
    tune.add_argument("--best-steps", type=int, default=100, help="steps best.yaml sets for the real run (default 100)")
    tune.add_argument("--write-grid", metavar="FILE", help="also write the whole space as a study grid file")
    tune.add_argument("--compare-grid", metavar="STUDY_DIR",
                      help="a full grid over the same space, measured (study run of --write-grid's file): tune.md "
                           "compares the best found and the device time against it")
    tune.add_argument("--dry-run", action="store_true", help="enumerate, prune, rank and print; launch nothing")
    tune.set_defaults(handler=cmd_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: args.handler(args), "study")


if __name__ == "__main__":
    sys.exit(main())
