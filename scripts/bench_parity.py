"""Loss parity of the fast path: our T5 eager and compiled against HF's T5ForConditionalGeneration eager and compiled.

    python scripts/bench_parity.py --data SHARDS --model t5-v1_1-base --batch 64 --steps 400 --out /tmp/parity
    python scripts/bench_parity.py --pretrain --data SHARDS --model t5-v1_1-base --batch 64 --steps 400 --out /tmp/p

Default mode (pure torch + transformers, no DeepSpeed, no Ray): every variant starts from the same weights (ours
built with the seed, HF's made from them by pretrain.model.hf.to_hf) and trains on the same batches in the same
order (the trainer's GlobalOrderSampler over the shard set, seeded likewise) with torch AdamW, lr 5e-4 after a
linear warmup of 50 steps (the trainer's LRSchedule, constant), gradient-norm clip 1.0; fp32 parameters under bf16
autocast on CUDA, plain fp32 on CPU (`--precision` overrides). Variants: ours (eager), ours-compile
(`T5Model.compile_regions`), both with `attention: sdpa`; hf (eager), hf-compile (`torch.compile` of the whole HF
model, dynamic=False), and when named, ours-compile-flex and ours-compile-triton (ours compiled with `attention: flex`
or `attention: triton`, docs/model.md; CUDA only), with -fp8 (`--precision fp8`) or -cudagraphs (`--cudagraphs`).

`--pretrain` runs `pretrain` itself instead (DeepSpeed, bf16 parameters, ZeRO 2 on one process, the same data,
seed and schedule; its spike guard off, see run_pretrain; the model's default attention, `auto`: FlexAttention on a
GPU), once without and once with `--compile` (and, when named, pretrain-compile-fused: `--compile --optimizer-step
fused`, docs/pretrain.md; -fp8, -cudagraphs likewise: each part of the name one flag), and tabulates
their metrics.jsonl losses the same way (variants pretrain, pretrain-compile; HF is not in this mode, its
reference is the eager run).

`--repeats N` runs every (seed, variant) N times (VARIANT#2, ... as columns of their own) and adds each variant's
same-code spread: how far two runs of the same code and seed drift apart (atomics, kernel choices). That is the
noise a gap between two variants is judged against where no HF pair is the reference, e.g. FP8 with and without
`--cudagraphs`: `--variants ours-compile-triton-fp8 ours-compile-triton-fp8-cudagraphs --repeats 2`.

Printed (and written to OUT/parity.md, the curves to OUT/parity.png, every loss to OUT/parity.json): the mean
loss of each variant per window of `--window` steps, each variant's last window against the reference (HF eager,
or `pretrain` eager with --pretrain) in %, its gap to the reference over all windows and seeds as the max |gap|,
the mean gap (an offset) and the mean |gap|, and the noise reference: the spread of HF compiled against HF eager
(the same math, another kernel order), per-window max |diff| over all windows and seeds, with the count of each
variant's windows outside it. A variant whose gap to the reference exceeds that spread systematically (the same
sign in every window, or an offset beyond HF compiled's) trains differently; one extreme window does not decide
alone (over 4 seeds, two runs of the same code and seed differed by 0.1 in a window, docs/model.md).
`--device cpu --model t5-tiny --steps 20 --window 5` is a smoke test.
`--jobs N` runs N of the (seed, variant) runs at once, each its own process on the same device (the same weights
and batches as alone; kernels are chosen per process, not by load): on an H200 the eager variants leave most of
the GPU idle (HF eager runs at ~15% MFU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.data.dataset import ShardDataset  # noqa: E402
from pretrain.data.sampler import GlobalOrderSampler  # noqa: E402
from pretrain.model.t5 import T5Model, build, resolve_config  # noqa: E402
from pretrain.model.variants import build_variant, parts  # noqa: E402
from pretrain.preflight import resolve_vocab_size  # noqa: E402
from pretrain.trainer import LRSchedule  # noqa: E402

VARIANTS = ("ours", "ours-compile", "hf", "hf-compile")
OPT_IN_VARIANTS = ("ours-compile-flex", "ours-compile-triton", "ours-compile-triton-perdiagonal",
                   "ours-compile-triton-fp8", "ours-compile-triton-cudagraphs",
                   "ours-compile-triton-fp8-cudagraphs")   # named in --variants only: `attention: flex` or `triton`,
# compiled (CUDA: FlexAttention has no CPU backward, our Triton kernels run on CPU only interpreted); -perdiagonal:
# the bias gradient of every score tile along its diagonals (saturate 0); -fp8: the blocks' linears as FP8 GEMMs
# (pretrain/model/fp8.py); -cudagraphs: the blocks as CUDA graphs (`pretrain --cudagraphs`)
PRETRAIN_VARIANTS = ("pretrain", "pretrain-compile")
PRETRAIN_OPT_IN = ("pretrain-compile-fused", "pretrain-compile-cudagraphs", "pretrain-compile-fp8",
                   "pretrain-compile-fp8-cudagraphs")   # named in --variants only; each part a flag (PRETRAIN_FLAGS)
PRETRAIN_FLAGS = {"compile": ["--compile"], "fused": ["--optimizer-step", "fused"], "fp8": ["--precision", "fp8"],
                  "cudagraphs": ["--cudagraphs"]}
REPEAT = "#"     # `--repeats`: VARIANT#2 is VARIANT's second run of the same seed


def base_variant(variant: str) -> str:
    """The variant a run is of: `ours-compile#2` (a repeat, --repeats) is `ours-compile`."""
    return variant.split(REPEAT)[0]


def run_name(variant: str) -> str:
    """A run's name in OUT/runs: `ours-compile#2` is `ours-compile-run2`."""
    return variant.replace(REPEAT, "-run")


def batches(dataset: ShardDataset, batch: int, seed: int, steps: int, device: str):
    """The first `steps` global batches of the trainer's data order (GlobalOrderSampler, one rank), as tensors."""
    sampler = GlobalOrderSampler(len(dataset), batch, seed)
    per_epoch = len(dataset) // batch
    for step in range(steps):
        epoch, k = divmod(step, per_epoch)
        inputs, labels = dataset.get_batch(sampler.global_batch(epoch, k), dtype=np.int64)
        yield torch.from_numpy(inputs).to(device), torch.from_numpy(labels).to(device)


def train_variant(variant: str, ours_cpu: T5Model, data, args) -> dict:
    """Losses and grad norms of `args.steps` steps of `variant` (torch AdamW, warmup + constant lr, clip)."""
    model = build_variant(variant, ours_cpu, args.device, torch.float32)
    graphs = "cudagraphs" in parts(variant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    schedule = LRSchedule("constant", args.warmup, args.steps, 1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    losses, grad_norms = [], []
    start = time.perf_counter()
    for input_ids, labels in data:
        if graphs:          # a new step: the blocks' graphs may reuse the last step's memory (as pretrain's loop)
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            if variant.startswith("hf"):
                loss = model(input_ids=input_ids, labels=labels).loss
            else:
                loss = model(input_ids, labels=labels)
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).detach())
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach().float())
    losses = torch.stack(losses).cpu().tolist()        # one sync at the end
    grad_norms = torch.stack(grad_norms).float().cpu().tolist()
    seconds = time.perf_counter() - start
    del model, optimizer
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"losses": losses, "grad_norms": grad_norms, "seconds": seconds}


def run_pretrain(variant: str, seed: int, args) -> dict:
    """One `pretrain` run (DeepSpeed ZeRO 2, bf16 on CUDA, one process) -> its per-step losses from metrics.jsonl.
    The spike guard is off (`--spike-sigmas 0`; non-finite steps are still skipped): a gradient-norm spike skipped
    in one variant and not in the other changes its curve for a reason that is not the kernels (on the H200 at lr
    5e-4, clip 1.0, 6 sigma skipped 0-3 steps per run, and three in a row stopped a run). The run's directory is
    scratch: what is left of an earlier, unfinished attempt is removed first (pretrain refuses a used --out)."""
    out = Path(args.out) / "runs" / f"{run_name(variant)}-seed{seed}"
    if out.exists():
        shutil.rmtree(out)
    command = pretrain_command(variant, seed, out, args)
    print(" ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=Path(__file__).resolve().parents[1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"losses": [r["loss"] for r in records], "grad_norms": [r.get("grad_norm") for r in records],
            "seconds": time.perf_counter() - start}


def pretrain_command(variant: str, seed: int, out: Path, args) -> list[str]:
    """The `pretrain` command line of one --pretrain run: the shared settings, then a flag per part of the variant's
    name (PRETRAIN_FLAGS; a later --precision, fp8's, or --cudagraphs wins over the first: graphs only where the
    name says, not by pretrain's auto)."""
    command = [sys.executable, "-m", "pretrain.cli", "--zero", "2", "--model", args.model, "--data", args.data,
               "--out", str(out), "--steps", str(args.steps), "--micro-batch", str(args.batch),
               "--global-batch", str(args.batch), "--lr", str(args.lr), "--warmup-steps", str(args.warmup),
               "--schedule", "constant", "--grad-clip", str(args.clip), "--weight-decay", "0", "--seed", str(seed),
               "--precision", args.precision, "--no-save-final", "--log-every", str(args.window), "--nproc", "1",
               "--spike-sigmas", "0", "--no-cudagraphs"]
    for part in parts(base_variant(variant))[1:]:
        command += PRETRAIN_FLAGS[part]
    return command


@functools.lru_cache(maxsize=None)
def data_fingerprint(data: str) -> str | None:
    """The shard set's content fingerprint (its manifest's): a set prepared again at the same path with other
    contents does not match runs made on the old one."""
    return json.loads((Path(data) / "manifest.json").read_text()).get("fingerprint")


def run_settings(args, seed: int, variant: str) -> dict:
    """What a (seed, variant) run's losses depend on: a result file of other settings is not reused."""
    return {"data": str(Path(args.data).resolve()), "data_fingerprint": data_fingerprint(args.data),
            "model": args.model, "steps": args.steps, "batch": args.batch,
            "lr": args.lr, "warmup": args.warmup, "clip": args.clip, "device": args.device,
            "precision": args.precision, "pretrain": bool(args.pretrain), "seed": seed, "variant": variant,
            **({"spike_sigmas": 0} if args.pretrain else {})}


def run_pool(runs: list[tuple[int, str]], args, report) -> dict[int, dict]:
    """Each (seed, variant) as its own process of this script (`--result FILE`), args.jobs at a time. A run that
    fails while others share the device (on one H200, four runs of t5-v1_1-base at batch 64 can exceed its memory)
    does not stop the others: it runs again alone once they are done, and a second failure stops the benchmark with
    its log's tail. A run whose result file is in OUT/runs with the same settings (an interrupted benchmark rerun
    with the same --out) is read, not run again."""
    from concurrent.futures import ThreadPoolExecutor
    pool_dir = Path(args.out) / "runs"
    pool_dir.mkdir(parents=True, exist_ok=True)
    forwarded = ["--data", args.data, "--model", args.model, "--steps", str(args.steps), "--batch", str(args.batch),
                 "--lr", str(args.lr), "--warmup", str(args.warmup), "--clip", str(args.clip), "--window",
                 str(args.window), "--device", args.device, "--precision", args.precision, "--out", args.out]

    def one(run: tuple[int, str]) -> tuple[int, str, dict]:
        seed, variant = run
        result, log = (pool_dir / f"{run_name(variant)}-seed{seed}.{suffix}" for suffix in ("json", "log"))
        if result.is_file():
            earlier = json.loads(result.read_text())
            if earlier.get("settings") == run_settings(args, seed, variant):
                print(f"seed {seed} {variant}: finished earlier ({result})", flush=True)
                return seed, variant, earlier
        if args.report:
            raise SystemExit(f"bench_parity --report: {result} is missing or was made with other settings; "
                             f"run the benchmark without --report to make it")
        command = [sys.executable, __file__, *forwarded, "--seeds", str(seed), "--result", str(result)]
        command += [*(["--pretrain"] if args.pretrain else []), "--variants", variant]
        with open(log, "w") as output:
            code = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT).returncode
        if code != 0:
            return seed, variant, {"failed": code, "tail": "\n".join(log.read_text().splitlines()[-20:])}
        return seed, variant, json.loads(result.read_text())

    results: dict[int, dict] = {seed: {} for seed, _ in runs}
    failed: list[tuple[int, str]] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for seed, variant, result in pool.map(one, runs):
            if "failed" in result:
                print(f"seed {seed} {variant}: failed (exit {result['failed']}) beside other runs; "
                      f"it runs again alone at the end. Its log's last line: {result['tail'].splitlines()[-1:]}",
                      flush=True)
                failed.append((seed, variant))
                continue
            results[seed][variant] = result
            report(seed, variant, result)
    for seed, variant in failed:
        _, _, result = one((seed, variant))
        if "failed" in result:
            raise SystemExit(f"bench_parity: seed {seed} {variant} failed (exit {result['failed']}), alone too:\n"
                             + result["tail"])
        results[seed][variant] = result
        report(seed, variant, result)
    return results


def window_means(losses: list[float], window: int) -> list[float]:
    return [float(np.mean(losses[i:i + window])) for i in range(0, len(losses), window)]


def tabulate(results: dict, variants: list[str], reference: str, window: int, steps: int) -> tuple[str, dict]:
    """The per-window table (mean over seeds of the window means), the last window vs `reference` in %, each
    variant's gap to the reference over windows and seeds (max |gap|, mean gap, mean |gap|), and with HF eager as
    the reference the HF compiled vs HF eager spread with each variant's windows outside it."""
    seeds = sorted(results)
    means = {v: np.mean([window_means(results[s][v]["losses"], window) for s in seeds], axis=0) for v in variants}
    gaps = {v: np.array([np.subtract(window_means(results[s][v]["losses"], window),
                                     window_means(results[s][reference]["losses"], window)) for s in seeds])
            for v in variants}
    starts = list(range(0, steps, window))
    others = [v for v in variants if v != reference]

    def row(label: str, value) -> str:   # one table row: value(variant) per column, "-" under the reference
        return f"| {label} | " + " | ".join("-" if v == reference else value(v) for v in variants) + " |"
    lines = [f"| loss, mean of steps | {' | '.join(variants)} |", "|---" * (len(variants) + 1) + "|"]
    for i, first in enumerate(starts):
        lines.append(f"| {first}-{min(first + window, steps) - 1} | "
                     + " | ".join(f"{means[v][i]:.4f}" for v in variants) + " |")
    summary = {"window_means": {v: means[v].tolist() for v in variants},
               "max_abs_gap": {v: float(np.abs(gaps[v]).max()) for v in others},
               "mean_gap": {v: float(gaps[v].mean()) for v in others},
               "mean_abs_gap": {v: float(np.abs(gaps[v]).mean()) for v in others}}
    lines += [row(f"last window vs {reference}", lambda v: f"{100 * (means[v][-1] / means[reference][-1] - 1):+.2f}%"),
              row(f"max abs gap to {reference}, any window", lambda v: f"{summary['max_abs_gap'][v]:.4f}"),
              row(f"windows above {reference}", lambda v: f"{int((gaps[v].mean(axis=0) > 0).sum())}/{len(starts)}"),
              row(f"mean gap to {reference} (offset), all windows and seeds",
                  lambda v: f"{summary['mean_gap'][v]:+.4f}"),
              row(f"mean abs gap to {reference}", lambda v: f"{summary['mean_abs_gap'][v]:.4f}")]
    note = ""
    if reference == "hf" and "hf-compile" in variants:   # main's reference whenever HF eager runs
        spread = np.abs(gaps["hf-compile"])
        summary["hf_compile_spread"] = float(spread.max())
        summary["windows_outside_spread"] = {v: int((np.abs(gaps[v]) > spread.max()).sum()) for v in others}
        lines.append(row(f"windows outside the spread (of {gaps[reference].size})",
                         lambda v: str(summary["windows_outside_spread"][v])))
        note = (f"\n\nnoise reference: HF compiled vs HF eager, per-window max |diff| over {len(starts)} windows x "
                f"{len(seeds)} seed(s): {spread.max():.4f} (mean {spread.mean():.4f})")
    spreads = same_code_spreads(results, variants, window)
    if spreads:
        summary["same_code_spread"] = spreads
        bound = {v: max(spreads.get(base_variant(v), 0.0), spreads.get(base_variant(reference), 0.0)) for v in others}
        summary["windows_outside_same_code_spread"] = {v: int((np.abs(gaps[v]) > bound[v]).sum()) for v in others}
        lines.append(row(f"windows outside the same-code spread (of {gaps[reference].size})",
                         lambda v: str(summary["windows_outside_same_code_spread"][v])))
        note += (f"\n\nsame-code spread (--repeats): per-window max |diff| between runs of one variant and seed, "
                 f"{len(starts)} windows x {len(seeds)} seed(s): "
                 + ", ".join(f"{v} {spread:.4f}" for v, spread in spreads.items())
                 + "; a gap counts as outside where it exceeds the larger spread of its variant and the reference")
    text = "\n".join(lines) + note
    return text, summary


def same_code_spreads(results: dict, variants: list[str], window: int) -> dict[str, float]:
    """Per variant run more than once (--repeats): the largest |diff| of a window mean between its first run and
    another run of the same seed, over every window and seed: what the same code does twice (atomics, kernel
    choices), the noise a gap between two variants is measured against."""
    spreads = {}
    for variant in dict.fromkeys(base_variant(v) for v in variants):
        repeats = [v for v in variants if v != variant and base_variant(v) == variant]
        if variant in variants and repeats:
            spreads[variant] = max(float(np.abs(np.subtract(window_means(results[s][r]["losses"], window),
                                                            window_means(results[s][variant]["losses"], window))).max())
                                   for s in results for r in repeats)
    return spreads


def plot(results: dict, variants: list[str], reference: str, window: int, spread: float | None, path: Path) -> None:
    """Loss curves of the first seed (per step, faint; window means, bold) and every seed's per-window gap of each
    variant to the reference (one line style per seed), with HF compiled vs HF eager's spread (tabulate's
    hf_compile_spread) shaded where both ran."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    seeds = sorted(results)
    figure, (curves, gaps) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    styles = ["-", "--", ":", "-."]
    if spread is not None:
        gaps.axhspan(-spread, spread, color="grey", alpha=0.15,
                     label=f"HF compiled vs eager, max |gap| {spread:.3f}")
    for variant in variants:
        losses = results[seeds[0]][variant]["losses"]
        line, = curves.plot(losses, alpha=0.3, linewidth=0.8)
        centres = [i + window / 2 for i in range(0, len(losses), window)]
        curves.plot(centres, window_means(losses, window), color=line.get_color(), linewidth=2, marker="o",
                    label=variant)
        if variant == reference:
            continue
        for n, seed in enumerate(seeds):
            gap = np.subtract(window_means(results[seed][variant]["losses"], window),
                              window_means(results[seed][reference]["losses"], window))
            gaps.plot(centres, gap, color=line.get_color(), marker="o", linestyle=styles[n % len(styles)],
                      label=f"{variant} - {reference}, seed {seed}")
    first = [results[seeds[0]][v]["losses"] for v in variants]
    curves.set_ylim(0.97 * min(min(l) for l in first), 1.1 * max(window_means(l, window)[0] for l in first))
    curves.set_ylabel("loss")
    curves.set_title(f"loss parity, seed {seeds[0]} (bold: means of {window}-step windows)")
    curves.legend()
    gaps.axhline(0, color="grey", linewidth=0.8)
    gaps.set_xlabel("step")
    gaps.set_ylabel(f"window mean minus {reference}")
    gaps.set_title(f"per-window gap to {reference}, seeds {', '.join(map(str, seeds))}")
    gaps.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="shard set written by `prep corpus`")
    parser.add_argument("--model", default="t5-v1_1-base", help="model preset (configs/models/*.yaml)")
    parser.add_argument("--variants", nargs="+", metavar="VARIANT",
                        help=f"any of {', '.join(VARIANTS)} (default all) and "
                             f"{', '.join(OPT_IN_VARIANTS)} (CUDA), or with --pretrain of "
                             f"{', '.join(PRETRAIN_VARIANTS)} (default both) and {', '.join(PRETRAIN_OPT_IN)}")
    parser.add_argument("--pretrain", action="store_true", help="run `pretrain` (DeepSpeed ZeRO 2) eager and --compile")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="init and data-order seeds")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each (seed, variant): the second is VARIANT#2, a column of its own, and the "
                             "table adds each variant's same-code spread (max |diff| between its runs of one seed), "
                             "the noise its gap to another variant is measured against (default 1)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=50, help="linear warmup steps, then constant")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    parser.add_argument("--window", type=int, default=50, help="steps per window of the table")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: bf16 (autocast, fp32 parameters; with --pretrain bf16 parameters) on CUDA, "
                             "fp32 on CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_parity_out"))
    parser.add_argument("--jobs", type=int, default=1,
                        help="(seed, variant) runs at once, each its own process on the same device (default 1: one "
                             "after the other). Each run builds the same weights and batches as alone; several at once "
                             "share the GPU (memory: about a quarter of an H200 each for t5-v1_1-base at batch 64)")
    parser.add_argument("--report", action="store_true",
                        help="run nothing: the table and plot again from the finished runs in OUT/runs (same flags "
                             "as the benchmark that made them; e.g. on a machine without its GPU)")
    parser.add_argument("--result", help=argparse.SUPPRESS)    # internal: one (seed, variant) run's JSON (--jobs)
    args = parser.parse_args()
    if args.precision == "auto":
        args.precision = "bf16" if args.device == "cuda" else "fp32"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch._dynamo.config.cache_size_limit = 64
    if args.report:                  # the machine the runs were made on, not this one
        if not (out / "parity.json").is_file():
            parser.error(f"--report: {out / 'parity.json'} is missing; it reads a finished benchmark's --out")
        env = json.loads((out / "parity.json").read_text())["env"]
    else:
        env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
        try:
            import transformers
            env["transformers"] = transformers.__version__
        except ImportError:
            pass
    dataset = ShardDataset(args.data)
    per_epoch = len(dataset) // args.batch
    if per_epoch == 0:
        parser.error(f"--batch {args.batch} is larger than the shard set ({len(dataset)} examples)")
    default = PRETRAIN_VARIANTS if args.pretrain else VARIANTS
    allowed = default + (PRETRAIN_OPT_IN if args.pretrain else OPT_IN_VARIANTS)
    variants = args.variants or list(default)
    if {base_variant(v) for v in variants} - set(allowed):
        parser.error(f"--variants {' '.join(variants)}: {'with' if args.pretrain else 'without'} --pretrain the "
                     f"variants are {', '.join(allowed)}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more")
    if not args.result:      # a pool's run (--result) is one named run, a repeat's name included
        variants = [f"{v}{REPEAT}{k}" if k > 1 else v for v in variants for k in range(1, args.repeats + 1)]
    reference = "pretrain" if args.pretrain else ("hf" if "hf" in variants else variants[0])
    mode = (f"pretrain (DeepSpeed ZeRO 2, {args.precision} parameters)" if args.pretrain else
            "bf16 autocast, fp32 parameters" if args.precision == "bf16" else "fp32")
    header = (f"{env}; {args.model}, batch {args.batch} at {dataset.input_length}/{dataset.target_length}, "
              f"{args.steps} steps ({args.steps / per_epoch:.1f} epochs of {len(dataset)} examples), {mode}; "
              f"AdamW lr {args.lr} (warmup {args.warmup}, constant), clip {args.clip}; seeds {args.seeds}")
    print(header, flush=True)

    # the model's vocabulary for this shard set, as pretrain resolves it (the preset's, or the tokenizer's if larger)
    vocab, _ = resolve_vocab_size(resolve_config(args.model).vocab_size,
                                  int(dataset.manifest["tokenizer"]["vocab_size"]), None)

    @functools.lru_cache(maxsize=1)          # runs come seed by seed: each seed's weights are built once
    def initial_model(seed: int) -> T5Model:
        return build(args.model, seed=seed, vocab_size=vocab)

    def run_one(seed: int, variant: str) -> dict:
        if args.pretrain:
            return run_pretrain(variant, seed, args)
        data = batches(dataset, args.batch, seed, args.steps, args.device)
        return train_variant(base_variant(variant), initial_model(seed), data, args)

    if args.result:                  # one run of a --jobs pool: its losses to a file, no table
        finished = {**run_one(args.seeds[0], variants[0]), "settings": run_settings(args, args.seeds[0], variants[0])}
        partial = Path(args.result).with_suffix(".partial")
        partial.write_text(json.dumps(finished))
        partial.replace(args.result)          # whole or absent: a killed run leaves no result to reuse
        return 0

    def report(seed: int, variant: str, result: dict) -> None:
        losses = result["losses"]
        print(f"seed {seed} {variant}: {result['seconds']:.0f}s, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"window means {' '.join(f'{m:.4f}' for m in window_means(losses, args.window))}", flush=True)

    runs = [(seed, variant) for seed in args.seeds for variant in variants]
    results: dict[int, dict] = {seed: {} for seed in args.seeds}
    start = time.perf_counter()
    if args.jobs <= 1 and not args.report:
        for seed, variant in runs:
            results[seed][variant] = run_one(seed, variant)
            report(seed, variant, results[seed][variant])
    else:
        results = run_pool(runs, args, report)
    print(f"{len(runs)} runs in {time.perf_counter() - start:.0f} s ({args.jobs} at once)", flush=True)

    table, summary = tabulate(results, variants, reference, args.window, args.steps)
    text = f"{header}\n\n{table}\n"
    print("\n" + text, flush=True)
    (out / "parity.md").write_text(text)
    (out / "parity.json").write_text(json.dumps({"env": env, "args": vars(args), "summary": summary,
                                                 "results": {str(s): r for s, r in results.items()}}, indent=1))
    plot(results, variants, reference, args.window, summary.get("hf_compile_spread"), out / "parity.png")
    print(f"wrote {out / 'parity.md'}, {out / 'parity.json'}, {out / 'parity.png'}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:   # a time limit's SIGINT (scripts/gpu_parity.sh): one line, not the pool's traceback
        print("bench_parity: interrupted; with --jobs, each finished run's losses are in OUT/runs and the same "
              "command run again reads them instead of running them again", file=sys.stderr, flush=True)
        sys.exit(130)
