#!/usr/bin/env python3
"""Where each run's step time goes, as one markdown table (issue 19's profile-driven breakdown, docs/model.md).

    python3 scripts/profile_table.py RUN_OR_STUDY_DIR... [--out table.md]

Reads every `profile/summary.json` that `pretrain --profile-steps N` wrote under the given run directories (a
study's `runs/` holds one per point) and its run's `config.json`. One row per run: the profiled steps' wall time
per step, then the share of that time each kernel family kept the GPU busy (pretrain/profiling.py FAMILIES: GEMMs,
attention forward, attention backward with the position-bias gradient, the embedding and bias-bucket gradients,
norms, Inductor's other fused elementwise and reduction kernels, the loss, the optimizer, NCCL collectives, copies),
and the share the GPU sat idle (host gaps: launches, Python, host-side optimizer or offload work). Family shares
are summed kernel time over the window: kernels on two streams at once (a collective beside compute) count twice,
so a row can add up to more than 100% less the idle share.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLUMNS = (   # (family in summary.json, column title)
    ("gemm", "GEMM"), ("attention_fwd", "attn fwd"), ("attention_bwd", "attn bwd (+bias grad)"),
    ("embedding_bwd", "emb/bias-bucket grad"), ("norm", "norm"), ("triton", "other fused"), ("loss", "loss"),
    ("optimizer", "optimizer"), ("nccl", "NCCL"), ("copy", "copies"), ("other", "other"),
)


def find_profiles(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if (path / "profile" / "summary.json").is_file():
            found.append(path / "profile" / "summary.json")
        else:
            found.extend(sorted(path.glob("**/profile/summary.json")))
    return list(dict.fromkeys(found))


def row(summary_path: Path) -> dict:
    summary = json.loads(summary_path.read_text())
    run_dir = summary_path.parent.parent
    # the run's config.json as pretrain writes it: the TrainConfig under "train", what it resolved beside it
    launched = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    train = launched.get("train", {})
    steps = summary.get("steps") or 1
    window = summary.get("window_s") or 0.0
    families = summary.get("families", {})
    shares = {family: (families.get(family, {}).get("seconds", 0.0) / window if window else None)
              for family, _ in COLUMNS}
    busy = summary.get("device_busy_share")
    offload = train.get("offload", "none")
    ranks = launched.get("world_size", 1)
    what = (f"{train.get('model', '?')} ZeRO {train.get('zero', '?')}"
            f"{'' if offload in (None, 'none') else ' + ' + offload + ' offload'}, micro {train.get('micro_batch', '?')}"
            f" x {launched.get('grad_accum', '?')}{f' x {ranks} ranks' if ranks > 1 else ''}")
    return {"what": what, "step_s": window / steps if window else None,
            "device_events": summary.get("device_events", 0), "shares": shares,
            "idle": None if busy is None else 1.0 - busy}


def table(rows: list[dict]) -> str:
    head = ["run", "step (ms)", *(title for _, title in COLUMNS), "GPU idle (host gaps)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    percent = lambda share: "-" if share is None else f"{100 * share:.1f}%"   # noqa: E731
    for r in rows:
        if not r["device_events"]:
            cells = ["no device kernels (a CPU run: see its ops.txt)"] + [""] * (len(COLUMNS))
        else:
            cells = [percent(r["shares"][family]) for family, _ in COLUMNS] + [percent(r["idle"])]
        step = "-" if r["step_s"] is None else f"{1000 * r['step_s']:.1f}"
        lines.append(f"| {r['what']} | {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="run directories, or folders holding them (a study)")
    parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args()
    missing = [str(path) for path in args.paths if not path.is_dir()]
    if missing:
        print(f"profile_table: no such directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    profiles = find_profiles(args.paths)
    if not profiles:
        print(f"profile_table: no profile/summary.json under {', '.join(map(str, args.paths))}; run pretrain with "
              f"--profile-steps N (a study: profile_steps in its grid's base)", file=sys.stderr)
        return 2
    text = table([row(path) for path in profiles])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        print(f"wrote {args.out} ({len(profiles)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
