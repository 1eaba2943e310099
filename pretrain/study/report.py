"""A study's report.md: the results table, the per-stage comparison and the recommendations derived from the rows.

    text = render_markdown(rows, setup=json.load(open("studies/x/study.json")), plots=written_plots)

Rows are results.csv rows (pretrain.study.results). The sections speak of the classic axes (model, ZeRO stage,
offload, micro batch, loader workers, GPUs, checkpointing); any other axis a grid varies (`extra_axes`) gets a
column in the results table and is named wherever a single point is described.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from pretrain.metrics import needed_peak

REPORT_MD = "report.md"
DATA_WAIT_TARGET = 0.01
"""The data-wait share the loader-worker recommendation aims under (1% of step time)."""
TIE_MARGIN = 0.03
"""Throughputs within this fraction of each other, or within either point's own step-to-step spread
(tokens_per_s_spread, when recorded), are reported as a tie: the steps measured cannot separate them."""


# ------------------------------------------------------------------------------------------------ helpers

def stage_label(zero: int, offload: str) -> str:
    return f"ZeRO-{zero}" + ("" if offload in (None, "", "none") else f" + {offload} offload")


def group_label(model: str, nproc: int, several_nproc: bool) -> str:
    return f"{model} ({nproc} GPU{'s' if nproc != 1 else ''})" if several_nproc else model


def _fmt(value: Any, spec: str = ".3g", scale: float = 1.0, suffix: str = "") -> str:
    if value is None:
        return "–"
    return f"{value * scale:{spec}}{suffix}"


def format_rate(tokens_per_s: float | None) -> str:
    """41234.5 -> "41.2k tok/s"; None -> "–"."""
    if tokens_per_s is None:
        return "–"
    return f"{tokens_per_s / 1e3:.1f}k tok/s" if tokens_per_s >= 1e3 else f"{tokens_per_s:.0f} tok/s"


def ok_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s") is not None]


def largest(rows: Iterable[dict[str, Any]], key: str, default: Any = None) -> Any:
    """The largest recorded (non-empty) value of `key` over `rows`, else `default`."""
    return max((r[key] for r in rows if r.get(key) is not None), default=default)


def largest_needed(rows: Iterable[dict[str, Any]], default: Any = None) -> Any:
    """The largest memory the rows' runs needed at their peak (pretrain.metrics.needed_peak: a --cudagraphs run's
    reserved peak, which holds the graphs' pools, else the allocated one), else `default`."""
    peaks = [needed_peak(r, bool(r.get("cudagraphs"))) for r in rows]
    return max((peak for peak in peaks if peak is not None), default=default)


def group_by(rows: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[tuple(row[k] for k in keys)].append(row)
    return dict(groups)


def stage_order(rows: Iterable[dict[str, Any]]) -> list[tuple[int, str]]:
    order = {"none": 0, "cpu": 1, "nvme": 2}
    return sorted({(r["zero"], r["offload"]) for r in rows}, key=lambda s: (s[0], order.get(s[1], 3)))


def _describe(row: dict[str, Any], *, with_workers: bool = True, extra_axes: tuple[str, ...] = ()) -> str:
    parts = [stage_label(row["zero"], row["offload"]), f"micro batch {row['micro_batch']}"]
    if with_workers:
        parts.append(f"{row['loader_workers']} loader worker{'s' if row['loader_workers'] != 1 else ''}")
    if row.get("activation_checkpointing"):
        parts.append("activation checkpointing")
    parts += [f"{axis} {row.get(axis)}" for axis in extra_axes]
    return ", ".join(parts)


def model_groups(rows: list[dict[str, Any]]) -> tuple[dict[tuple, list[dict[str, Any]]], bool]:
    several_nproc = len({r["nproc"] for r in rows}) > 1
    return group_by(rows, "model", "nproc"), several_nproc


# ------------------------------------------------------------------------------------------------ recommendations

def fastest_that_fits(rows: list[dict[str, Any]], extra_axes: tuple[str, ...] = ()) -> list[str]:
    """Per model (and GPU count): the fastest configuration that ran, with the near-ties and what did not fit."""
    lines = []
    groups, several_nproc = model_groups(rows)
    for (model, nproc), group in groups.items():
        name = f"**{group_label(model, nproc, several_nproc)}**"
        ok = sorted(ok_rows(group), key=lambda r: r["tokens_per_s"], reverse=True)
        failed = [r for r in group if r["status"] != "ok"]
        failed_text = ""
        if failed:
            by_status = group_by(failed, "status")
            failed_text = " Did not finish: " + "; ".join(
                f"{status} at " + ", ".join(sorted({stage_label(r['zero'], r['offload']) + f" mb={r['micro_batch']}"
                                                    for r in items}))
                for (status,), items in sorted(by_status.items())) + "."
        if not ok:
            lines.append(f"- {name}: no configuration finished, so the data can't tell which is fastest; "
                         f"try smaller micro batches, offload, activation checkpointing or more GPUs.{failed_text}")
            continue
        best = ok[0]
        mfu = "" if best.get("mfu") is None else f"MFU {best['mfu']:.1%}, "
        text = (f"- {name}: fastest that fits is {_describe(best, extra_axes=extra_axes)}: {format_rate(best['tokens_per_s'])}"
                f" ({mfu}step {_fmt(best.get('step_time_s'), '.3g', 1, ' s')}"
                f"; peak memory {_fmt(best.get('peak_mem_gib'), '.3g', 1, ' GiB')} measured, estimate "
                f"{_fmt(best.get('est_gpu_gib'), '.3g', 1, ' GiB')} per device).")
        stage_best: dict[tuple, dict[str, Any]] = {}
        for r in ok:  # sorted fastest first: the first row of each stage is its best
            stage_best.setdefault((r["zero"], r["offload"]), r)
        def margin(r: dict[str, Any]) -> float:
            return max(TIE_MARGIN, best.get("tokens_per_s_spread") or 0.0, r.get("tokens_per_s_spread") or 0.0)

        ties = [r for stage, r in stage_best.items() if stage != (best["zero"], best["offload"])
                and r["tokens_per_s"] >= best["tokens_per_s"] * (1 - margin(r))]
        if ties:
            text += (" Within the measurement spread of it: " + "; ".join(
                f"{_describe(r, extra_axes=extra_axes)} ({format_rate(r['tokens_per_s'])}, {1 - r['tokens_per_s'] / best['tokens_per_s']:.1%} "
                f"slower, spread {margin(r):.1%})" for r in ties[:3])
                + ": on this data they tie, more steps would separate them.")
        lines.append(text + failed_text)
    return lines


def fewest_workers(rows: list[dict[str, Any]], target: float = DATA_WAIT_TARGET) -> list[str]:
    """Per model and stage/offload: the fewest loader workers whose worst data-wait share is under `target`."""
    lines = []
    several_nproc = len({r["nproc"] for r in rows}) > 1
    groups = group_by(ok_rows(rows), "model", "nproc", "zero", "offload")
    stage_rank = {stage: i for i, stage in enumerate(stage_order(rows))}
    for (model, nproc, zero, offload), group in sorted(groups.items(),
                                                       key=lambda g: (g[0][0], g[0][1], stage_rank[g[0][2:]])):
        shares: dict[int, float] = {}
        for (workers,), items in group_by(group, "loader_workers").items():
            measured = [r["data_wait_share"] for r in items if r.get("data_wait_share") is not None]
            if measured:
                shares[workers] = max(measured)  # the worst over micro batch etc.: a setting that always holds
        name = f"{group_label(model, nproc, several_nproc)}, {stage_label(zero, offload)}"
        if not shares:
            lines.append(f"- {name}: no data-wait measurements; the data can't tell.")
            continue
        unfinished = sorted({(r["loader_workers"], r["status"]) for r in rows if r["status"] != "ok"
                             and (r["model"], r["nproc"], r["zero"], r["offload"]) == (model, nproc, zero, offload)})
        unfinished_text = "".join(f" {w} worker{'s' if w != 1 else ''}: {status}." for w, status in unfinished)
        tried = sorted(shares)
        listing = ", ".join(f"{w} worker{'s' if w != 1 else ''}: {shares[w]:.2%}" for w in tried)
        under = [w for w in tried if shares[w] < target]
        if not under:
            best = min(tried, key=lambda w: shares[w])
            lines.append(f"- {name}: none of the tried worker counts keeps data wait under {target:.0%} "
                         f"({listing}); the data can't tell how many would: try more than {max(tried)} workers "
                         f"or a faster disk (best here: {best}).{unfinished_text}")
            continue
        fewest = under[0]
        text = f"- {name}: {fewest} loader worker{'s' if fewest != 1 else ''} keep{'s' if fewest == 1 else ''} data wait under {target:.0%} ({listing})."
        if fewest == tried[0] and fewest > 0:
            text += f" It is the fewest that finished, so the data can't tell whether fewer than {fewest} would do."
        above = [w for w in tried if w > fewest and shares[w] >= target]
        if above:
            text += (f" But {', '.join(map(str, above))} workers measured {target:.0%} or more: noise or workers "
                     f"competing for host CPU (offload uses it too); more steps would tell.")
        lines.append(text + unfinished_text)
    return lines


def estimate_accuracy(rows: list[dict[str, Any]]) -> list[str]:
    """Per model: measured peak memory over the recorded estimate, per stage (how far to trust the estimate); a
    --cudagraphs point's peak is its reserved one (pretrain.metrics.needed_peak)."""
    lines = []
    groups, several_nproc = model_groups(rows)
    for (model, nproc), group in groups.items():
        ratios = []
        for zero, offload in stage_order(group):
            pairs = [(needed_peak(r, bool(r.get("cudagraphs"))), r["est_gpu_gib"]) for r in ok_rows(group)
                     if (r["zero"], r["offload"]) == (zero, offload) and r.get("peak_mem_gib") is not None
                     and r.get("est_gpu_gib")]
            if pairs:
                peak, estimate = max(pairs)
                ratios.append(f"{stage_label(zero, offload)} {peak / estimate:.2g}x ({peak:.3g} vs {estimate:.3g} GiB)")
        if ratios:
            lines.append(f"- {group_label(model, nproc, several_nproc)}: measured peak / estimate per device: "
                         + "; ".join(ratios) + ".")
        else:
            lines.append(f"- {group_label(model, nproc, several_nproc)}: no finished point with both numbers; "
                         f"the data can't tell.")
    return lines


# ------------------------------------------------------------------------------------------------ markdown

def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in body]
    return "\n".join(lines)


def _with_range(row: dict[str, Any], key: str, spec: str) -> str:
    """A figure, and for a point run several times its min-max over the runs and the count: 1,234 (1,200-1,250, 3 runs)."""
    text = _fmt(row.get(key), spec)
    low, high = row.get(f"{key}_min"), row.get(f"{key}_max")
    if low is None or high is None:
        return text
    return f"{text} ({_fmt(low, spec)}-{_fmt(high, spec)}, {row['runs'].split('/')[0]} runs)"


def results_table(rows: list[dict[str, Any]], extra_axes: tuple[str, ...] = ()) -> str:
    """One line per point; the axes a grid varies beside the classic ones follow the `ckpt` column. A point run
    several times (a grid's `repeats`) shows its median run, with min-max over the runs. Where any point recorded
    its peak reserved memory (GPUs), a `reserved GiB` column follows `peak GiB`."""
    reserved = any(r.get("peak_reserved_gib") is not None for r in rows)
    header = ["model", "stage", "mb", "workers", "GPUs", "ckpt", *extra_axes, "status", "tok/s", "samples/s", "TFLOP/s/GPU",
              "MFU", "step s", "data wait s", "compute s", "data wait", "peak GiB", *(["reserved GiB"] * reserved),
              "est GPU GiB", "est CPU GiB", "reason"]
    body = [[r["model"], stage_label(r["zero"], r["offload"]), str(r["micro_batch"]), str(r["loader_workers"]),
             str(r["nproc"]), "on" if r.get("activation_checkpointing") else "off",
             *("–" if r.get(axis) is None else str(r[axis]) for axis in extra_axes), r["status"],
             _with_range(r, "tokens_per_s", ",.0f"), _fmt(r.get("samples_per_s"), ",.1f"),
             _fmt(r.get("tflops_per_gpu"), ".3g"), _fmt(r.get("mfu"), ".1f", 100, "%"),
             _with_range(r, "step_time_s", ".3g"), _fmt(r.get("data_wait_s"), ".3g"), _fmt(r.get("compute_s"), ".3g"),
             _fmt(r.get("data_wait_share"), ".2f", 100, "%"), _fmt(r.get("peak_mem_gib"), ".3g"),
             *([_fmt(r.get("peak_reserved_gib"), ".3g")] * reserved),
             _fmt(r.get("est_gpu_gib"), ".3g"), _fmt(r.get("est_cpu_gib"), ".3g"), r.get("reason") or ""]
            for r in rows]
    return _table(header, body)


def stage_comparison(rows: list[dict[str, Any]]) -> str:
    """Per model: the best point of each stage/offload, its throughput relative to the model's fastest stage."""
    sections = []
    groups, several_nproc = model_groups(rows)
    for (model, nproc), group in groups.items():
        ok = ok_rows(group)
        fastest = largest(ok, "tokens_per_s")
        body = []
        for zero, offload in stage_order(group):
            stage_rows = [r for r in group if (r["zero"], r["offload"]) == (zero, offload)]
            stage_ok = ok_rows(stage_rows)
            count = f"{len(stage_ok)}/{len(stage_rows)}"
            if not stage_ok:
                statuses = ", ".join(sorted({r["status"] for r in stage_rows}))
                body.append([stage_label(zero, offload), "–", "–", "–", "–", "–",
                             _fmt(largest(stage_rows, "est_gpu_gib"), ".3g"),
                             _fmt(largest(stage_rows, "est_cpu_gib"), ".3g"), f"{count} ({statuses})"])
                continue
            best = max(stage_ok, key=lambda r: r["tokens_per_s"])
            body.append([stage_label(zero, offload), format_rate(best["tokens_per_s"]),
                         _fmt(best["tokens_per_s"] / fastest, ".2f", 1, "x"), _fmt(best.get("step_time_s"), ".3g"),
                         _fmt(best.get("data_wait_share"), ".2f", 100, "%"),
                         _fmt(largest_needed(stage_ok), ".3g"),
                         _fmt(best.get("est_gpu_gib"), ".3g"), _fmt(best.get("est_cpu_gib"), ".3g"), count])
        header = ["stage", "best throughput", "vs fastest", "step s", "data wait", "max peak GiB", "est GPU GiB",
                  "est CPU GiB", "points ok"]
        sections.append(f"### {group_label(model, nproc, several_nproc)}\n\n" + _table(header, body))
    return "\n\n".join(sections)


def _setup_section(rows: list[dict[str, Any]], setup: dict[str, Any]) -> str:
    lines = []
    machine = setup.get("machine") or {}
    if machine:
        gpus = ", ".join(machine.get("gpus") or []) or "none"
        lines.append(f"- Machine: {machine.get('platform')}, {machine.get('cpus')} CPUs, {machine.get('ram_gib')} GiB "
                     f"RAM, GPUs: {gpus}; torch {machine.get('torch')}, deepspeed {machine.get('deepspeed')}.")
    else:
        lines.append("- Machine: not recorded (this report was rebuilt from results.csv alone).")
    shard_set = setup.get("shard_set") or {}
    if shard_set:
        lines.append(f"- Shard set: `{shard_set.get('path')}`, fingerprint `{shard_set.get('fingerprint')}`, "
                     f"{shard_set.get('examples')} examples in {shard_set.get('shards')} shards, input/target length "
                     f"{shard_set.get('input_length')}/{shard_set.get('target_length')}, vocabulary "
                     f"{shard_set.get('vocab_size')}.")
    elif setup.get("fingerprint"):
        lines.append(f"- Shard set fingerprint: `{setup['fingerprint']}`.")
    base = setup.get("base") or {}
    if base:
        def shared(key: str) -> Any:   # a setting that is an axis is not in `base`: the table has it
            return base.get(key, "(per point)")

        lines.append(f"- Every point: {shared('steps')} steps, the first {shared('skip_steps')} excluded from the "
                     f"medians; global batch {shared('global_batch')}; precision {shared('precision') or 'default'}; "
                     f"seed {shared('seed')}; timeout {shared('timeout_s')} s per point.")
        if base.get("overlap_startup"):
            lines.append("- overlap_startup: each point's host-side start-up (imports, preflight, model build) ran "
                         "while the point before it trained (not beside offload points); training steps never "
                         "overlapped.")
    else:
        steps = sorted({r["steps"] for r in rows if r.get("steps")})
        batches = sorted({r["global_batch"] for r in rows if r.get("global_batch")})
        lines.append(f"- Every point: steps {steps}, global batch {batches}.")
    graphed = sum(bool(r.get("cudagraphs")) for r in rows)
    if graphed:         # also where no axis shows it: pretrain's auto turns graphs on for compiled GPU runs
        lines.append(f"- CUDA graphs (`--cudagraphs` as each run resolved it, auto included; results.csv's "
                     f"`cudagraphs`): {graphed} of {len(rows)} runs; their memory is their reserved peak.")
    if setup.get("earlier_machines"):
        lines.append(f"- Note: some points ran earlier on other machines ({len(setup['earlier_machines'])} recorded "
                     f"in study.json); compare rows with care.")
    commands = setup.get("commands") or []
    text = "\n".join(lines)
    if commands:
        runs = {command: commands.count(command) for command in commands}   # in first-run order
        text += "\n- Commands:\n\n```\n" + "\n".join(
            command + (f"   # run {count} times; each rerun skipped the finished points" if count > 1 else "")
            for command, count in runs.items()) + "\n```"
    if setup.get("point_command"):
        text += "\n- One point's own launch (each point is one such `pretrain` command):\n\n```\n" \
                + setup["point_command"] + "\n```"
    methods = sorted({r["est_method"] for r in rows if r.get("est_method")})
    text += ("\n- Numbers are medians over the steady-state steps of each point; `data wait` is the share of step "
             "time spent blocked on the next batch (total wait / total step time over those steps); `peak` is the "
             "largest peak memory pretrain measured in any step (GPU memory on GPUs, host memory on CPU); `reserved` "
             "(GPUs) the largest the allocator held, its cache and the private pools of CUDA graphs (`--cudagraphs`, "
             "whose replays allocate nothing) included: what a larger micro batch must fit beside; `est` is "
             "the memory estimate pretrain records for the stage and offload before training (config.json "
             "`memory_estimate`; method: " + ("; ".join(methods) or "not recorded") + ").")
    return text


def _workers(count: int) -> str:
    return f"{count} worker" + ("" if count == 1 else "s")


def _same_within_spread(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two points' throughputs differ by less than TIE_MARGIN or either point's own step-to-step spread."""
    fast, slow = max(a["tokens_per_s"], b["tokens_per_s"]), min(a["tokens_per_s"], b["tokens_per_s"])
    margin = max(TIE_MARGIN, a.get("tokens_per_s_spread") or 0.0, b.get("tokens_per_s_spread") or 0.0)
    return (fast - slow) / fast <= margin


def loader_cpu_per_example(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Host CPU seconds of loading per example, per loader mode: the median over the points whose measured steps
    saw their loader work (loader cores x ranks / samples per second). A property of the mode and the data, not of
    the stage, so it is pooled over every point of the report: online workers make a whole work unit's examples at
    once, and a short run of a slow model can consume what they made before its measured steps (0 cores there)."""
    costs: dict[str, list[float]] = {}
    for row in rows:
        cores, rate = row.get("loader_cores"), row.get("samples_per_s")
        if cores and rate:
            costs.setdefault(row["loader"], []).append(cores * row["nproc"] / rate)
    return {mode: statistics.median(values) for mode, values in costs.items()}


def _loading_cores(mode: str, items: list[dict[str, Any]], per_example_s: float | None) -> str:
    """What loading in `mode` takes of the host at this stage: the cores it needs at the stage's fastest
    consumption rate from the mode's CPU per example (loader_cpu_per_example), or why that is not known."""
    rate = max(r["samples_per_s"] for r in items)
    measured = [r["loader_cores"] * r["nproc"] for r in items if r.get("loader_cores") is not None]
    if per_example_s is None:    # no point of this mode saw loader CPU (any that did would have given a cost)
        return (f"`{mode}`: no loader CPU in the measured steps (under the OS's 10 ms ticks, or the workers made "
                f"these examples before them; more steps would measure it)" if measured
                else f"`{mode}`: loading CPU not recorded")
    need = f"`{mode}` needs {per_example_s * rate:.2g} host cores at this stage's {rate:.0f} examples/s " \
           f"({per_example_s * 1e3:.2g} ms of CPU per example)"
    if measured and max(measured) == 0:
        need += " (its workers made these points' examples before the measured steps: cost from the other points)"
    return need


def loading_findings(rows: list[dict[str, Any]]) -> list[str]:
    """Per model and stage, from the host accounting (issue 16): the host cores loading keeps busy at the stage's
    consumption rate (rank 0's loader cores x ranks), what the `online` mode costs the step beside `shards` at equal
    workers (a difference inside the spread is reported as none), and the fastest loader mode + workers + threads
    whose data wait stays under DATA_WAIT_TARGET (of the points the spread cannot tell from the fastest, the one
    whose loading keeps fewest host cores busy, then the fewest workers)."""
    lines = []
    groups, several_nproc = model_groups([{"loader": "shards", **r} for r in ok_rows(rows)])  # older rows: shards
    per_example = loader_cpu_per_example([{"loader": "shards", **r} for r in ok_rows(rows)])
    for (model, nproc), group in groups.items():
        for zero, offload in stage_order(group):
            stage = [r for r in group if (r["zero"], r["offload"]) == (zero, offload)]
            name = f"**{group_label(model, nproc, several_nproc)}, {stage_label(zero, offload)}**"
            parts = []
            for (mode,), items in sorted(group_by(stage, "loader").items(), key=lambda kv: str(kv[0])):
                parts.append(_loading_cores(mode, items, per_example.get(mode)))
            costs = []
            by_workers = group_by(stage, "loader_workers")
            for (workers,), items in sorted(by_workers.items()):
                modes = {r.get("loader"): r for r in items}
                if "shards" in modes and "online" in modes:
                    base, online = modes["shards"], modes["online"]
                    if _same_within_spread(base, online):
                        costs.append(f"none at {_workers(workers)} (inside the spread)")
                    else:
                        costs.append(f"{online['step_time_s'] / base['step_time_s']:.2f}x the step at {_workers(workers)}")
            if costs:
                parts.append("online vs shards: " + ", ".join(costs))
            quiet = [r for r in stage if r.get("data_wait_share") is not None and r["data_wait_share"] < DATA_WAIT_TARGET]
            if quiet:
                fastest = max(quiet, key=lambda r: r["tokens_per_s"])
                # among those the spread cannot tell from the fastest, the one that takes least of the host
                ties = [r for r in quiet if _same_within_spread(r, fastest)]
                best = min(ties, key=lambda r: (r.get("loader_cores") or 0.0, r["loader_workers"]))
                threads = best.get("omp_num_threads")
                tie_note = f", the least host CPU of {len(ties)} inside the spread" if len(ties) > 1 else ""
                parts.append(f"fastest under {DATA_WAIT_TARGET:.0%} data wait{tie_note}: `{best.get('loader', 'shards')}`, "
                             f"{_workers(best['loader_workers'])}"
                             + (f", {threads} OpenMP threads" if threads else "")
                             + (f", cpu_affinity {best['cpu_affinity']}" if best.get("cpu_affinity") not in (None, "none") else "")
                             + f" ({format_rate(best['tokens_per_s'])})")
            else:
                parts.append(f"no point kept data wait under {DATA_WAIT_TARGET:.0%}")
            lines.append(f"- {name}: " + "; ".join(parts) + ".")
    return lines


def render_markdown(rows: list[dict[str, Any]], setup: dict[str, Any], plots: dict[str, Path],
                    extra_axes: tuple[str, ...] = ()) -> str:
    """The whole report.md: title, setup, results table, per-stage comparison, plots, recommendations."""
    name = setup.get("study") or "study"
    counts = group_by(rows, "status")
    status_text = ", ".join(f"{len(items)} {status}" for (status,), items in sorted(counts.items()))
    plot_lines = "\n\n".join(f"![{key}]({Path(path).name})" for key, path in plots.items())
    parts = [
        f"# Study `{name}`: ZeRO stage x data loading",
        f"{len(rows)} points: {status_text}.",
        "## Setup\n\n" + _setup_section(rows, setup),
        "## Results\n\n" + results_table(rows, extra_axes),
        "## Per-stage comparison\n\nThe best point of each stage (over micro batch, loader workers, checkpointing), "
        "its throughput relative to the model's fastest stage, and memory.\n\n" + stage_comparison(rows),
        "## Plots\n\n" + plot_lines,
        "## Recommendations\n\nDerived from the table above.\n\n### Fastest configuration that fits\n\n"
        + "\n".join(fastest_that_fits(rows, extra_axes))
        + f"\n\n### Fewest loader workers that keep data wait under {DATA_WAIT_TARGET:.0%}\n\n"
        + "\n".join(fewest_workers(rows) or ["- No point finished; the data can't tell."])
        + "\n\n### Data loading and host CPU\n\nA loader mode's CPU per example is the median over this report's "
        "points of that mode of loader CPU / examples consumed (rank 0's loader cores x ranks / samples per second, "
        "pretrain.hostcpu); the cores a stage needs are that times the stage's fastest rate. `online` tokenises and "
        "span-corrupts in the loader workers, `shards` reads mmap'd shards.\n\n"
        + "\n".join(loading_findings(rows) or ["- No point recorded host accounting."])
        + "\n\n### How far the memory estimate can be trusted\n\nThe estimate counts what pretrain's method "
        "names (see Setup); a measured peak above it is what that method leaves out (allocator cache, "
        "workspaces, communication buffers, fragmentation); plan with the measured peak.\n\n" + "\n".join(estimate_accuracy(rows)),
    ]
    return "\n\n".join(parts) + "\n"

