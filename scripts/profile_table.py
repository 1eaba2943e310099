#!/usr/bin/env python3
"""Where each run's step time goes, as one markdown table (issue 19's profile-driven breakdown, docs/model.md).

    python3 scripts/profile_table.py RUN_OR_STUDY_DIR... [--out table.md]

Reads every `profile/summary.json` that `pretrain --profile-steps N` wrote under the given run directories (a
study's `runs/` holds one per point), its run's `config.json` and `summary.json`. One row per run: the median
step time of the run's unprofiled steady steps (the profiler slows the steps it traces, mostly on the host: a
traced mt5-xl ZeRO 3 step took 1.53 s against 0.86 s untraced, with the same GPU busy time), then the share of that
step each kernel family kept the GPU busy (pretrain/profiling.py FAMILIES: GEMMs, attention forward, attention
backward with the position-bias gradient, the embedding and bias-bucket gradients, norms, Inductor's other fused
elementwise and reduction kernels with ours of that kind (rows marked * count ours as other), the loss, the
optimizer, NCCL collectives, copies), and the share the GPU sat idle (host gaps: launches, Python, hooks, host-side
optimizer or offload work). Kernel time per step is the traced steps' (a kernel runs as long traced or not); the
idle share is what the busy time leaves of the untraced step.
Family shares are summed kernel time: kernels on two streams at once (a collective beside compute) count twice, so
a row can add up to more than 100% less the idle share. A run without an untraced steady step falls back to the
traced steps' wall time (the step column then says "traced"). Settings that differ between the rows beyond model,
stage, offload, micro batch and ranks (a study's other axes, e.g. stage3_param_persistence_threshold) are named in
the run column.
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


RENAMED = {"_forward_kernel": "attention_fwd", "_backward_kv_kernel": "attention_bwd",
           "_backward_q_kernel": "attention_bwd", "_delta_kernel": "attention_bwd"}
"""Our Triton attention kernels (pretrain/model/relative_attention.py) before they were named `_attn_*`, which
summaries written then counted as "other": moved to their family from the summary's top kernels."""


EARLIER_RULES = ("*: a summary from before family_rules 2, whose other holds our gate and FP8 cast kernels "
                 "(`_gated_gelu_*`, `_cast_kernel`), later in other fused")
"""Summaries written before pretrain/profiling.py's FAMILY_RULES 2 counted those kernels as "other"; their top
kernels need not name all of them, so their rows are marked rather than moved."""


def find_profiles(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if (path / "profile" / "summary.json").is_file():
            found.append(path / "profile" / "summary.json")
        else:
            found.extend(sorted(path.glob("**/profile/summary.json")))
    return list(dict.fromkeys(found))


LABELLED = frozenset({"model", "zero", "offload", "micro_batch", "global_batch", "nproc", "nnodes"})  # in the label
UNLABELLED = frozenset({"out", "data", "resume", "cache_dir", "profile_steps", "steps", "steady_skip", "log_every"})


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def row(summary_path: Path) -> dict:
    summary = json.loads(summary_path.read_text())
    run_dir = summary_path.parent.parent
    # the run's config.json as pretrain writes it: the TrainConfig under "train", what it resolved beside it
    launched = read_json(run_dir / "config.json")
    train = launched.get("train", {})
    steps = summary.get("steps") or 1
    window = summary.get("window_s") or 0.0
    traced = window / steps if window else None
    untraced = (read_json(run_dir / "summary.json").get("median") or {}).get("step_time_s")
    step = untraced or traced
    families = {family: dict(values) for family, values in summary.get("families", {}).items()}
    for kernel in summary.get("top_kernels", []):
        family = RENAMED.get(kernel.get("name"))
        if family and "other" in families:
            families["other"]["seconds"] -= kernel["seconds"]
            families.setdefault(family, {"seconds": 0.0})["seconds"] += kernel["seconds"]
    shares = {family: (families.get(family, {}).get("seconds", 0.0) / steps / step if step else None)
              for family, _ in COLUMNS}
    busy = summary.get("device_busy_s")
    offload = train.get("offload", "none")
    ranks = launched.get("world_size", 1)
    what = (f"{train.get('model', '?')} ZeRO {train.get('zero', '?')}"
            f"{'' if offload in (None, 'none') else ' + ' + offload + ' offload'}, "
            f"micro {train.get('micro_batch', '?')} x {launched.get('grad_accum', '?')}"
            f"{f' x {ranks} ranks' if ranks > 1 else ''}")
    return {"what": what, "train": train, "step_s": step, "traced": not untraced, "traced_step_s": traced,
            "earlier_rules": summary.get("family_rules", 1) < 2,
            "device_events": summary.get("device_events", 0), "shares": shares,
            "idle": None if busy is None or not step else max(0.0, 1.0 - busy / steps / step)}


def name_differences(rows: list[dict]) -> None:
    """Append to each row's label the settings that differ between the rows and are not in the label already."""
    keys = sorted({key for r in rows for key in r["train"]} - LABELLED - UNLABELLED)
    differing = [key for key in keys if len({json.dumps(r["train"].get(key), sort_keys=True) for r in rows}) > 1]
    for r in rows:
        r["what"] += "".join(f", {key}={r['train'].get(key)}" for key in differing)


def table(rows: list[dict]) -> str:
    head = ["run", "step (ms)", "traced step (ms)", *(title for _, title in COLUMNS), "GPU idle (host gaps)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    percent = lambda share: "-" if share is None else f"{100 * share:.1f}%"   # noqa: E731
    ms = lambda seconds: "-" if seconds is None else f"{1000 * seconds:.1f}"   # noqa: E731
    for r in rows:
        if not r["device_events"]:
            cells = ["no device kernels (a CPU run: see its ops.txt)"] + [""] * (len(COLUMNS))
        else:
            cells = [percent(r["shares"][family]) for family, _ in COLUMNS] + [percent(r["idle"])]
        step = ms(r["step_s"]) + (" (traced)" if r["traced"] else "")
        what = r["what"] + (" *" if r["earlier_rules"] else "")
        lines.append(f"| {what} | {step} | {ms(r['traced_step_s'])} | " + " | ".join(cells) + " |")
    if any(r["earlier_rules"] for r in rows):
        lines += ["", EARLIER_RULES]
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
    rows = [row(path) for path in profiles]
    name_differences(rows)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        print(f"wrote {args.out} ({len(profiles)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
