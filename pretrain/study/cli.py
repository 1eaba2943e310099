"""The `study` command: run a ZeRO x data-loading grid of real `pretrain` launches, and build its report.

    study run configs/study/cpu-tiny.yaml --out studies/cpu-tiny && study report studies/cpu-tiny
"""

from __future__ import annotations

import argparse
import sys

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
