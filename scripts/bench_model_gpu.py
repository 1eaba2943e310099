"""Training-step throughput of our T5 (pretrain/model/t5.py) against transformers' T5ForConditionalGeneration.

    python scripts/bench_model_gpu.py --models mt5-base mt5-large --batch 64 --out /tmp/bench

Pure torch + transformers (no DeepSpeed). Both models hold the same weights (ours built with a seed, HF's
made from it by pretrain.model.hf.to_hf), run bf16 parameters with fused AdamW on the same random batch
(inputs 512, targets 114 by default). One step = zero_grad + forward (loss) + backward + optimizer step.
Reported per variant: ms/step (the median of the timed steps, each timed alone; min-max beside it), tokens/s (input
+ target tokens), TFLOP/s from the exact count (pretrain.model.flops.train_step_flops), MFU against the device's
datasheet dense bf16 peak (pretrain.metrics.PEAK_TFLOPS: 989.4 TFLOP/s for H100/H200 SXM, 312 for A100;
`--peak-tflops` for others), beside it `x GEMM`: the fraction of a bf16 8192^3 matmul measured in the same run, peak
memory, and speed-up against HF eager and HF compiled (what a user would pick instead) in the same run. The table is
printed last; results.json and results.md go to --out. Interrupted (SIGINT, e.g. `timeout -s INT` inside a device
call's limit), it still writes them for what it measured, says so, and exits 130. `--device cpu --models t5-tiny` is
a smoke test.

`--rounds N` separates a small difference from the drift between runs: every variant's model is built and warmed up
once, then the variants are timed in turn N times (A B A B ...), `--steps` steps a round; ms/step is the median of a
variant's round medians, min-max over them. Their models stay on the device together (peak memory: what each added;
a -cudagraphs variant's graphs hold 33 GiB more at mt5-large batch 64, too much beside HF compiled's 82: time those
two in separate runs, or without --rounds, where each variant's memory is given back before the next).

`--batches 96 128 192 ...` also measures every variant at those batch sizes, in increasing order until one does not
fit (a size whose peak memory, extrapolated from the sizes that fit, exceeds the device's is recorded as not
fitting without being compiled), and adds a second table: each variant at its fastest fitting batch, with its
speed-up over HF compiled at HF compiled's own fastest (the memory a variant saves, turned into throughput), beside
the equal-batch table.

Variants: hf, hf-compile (transformers, eager / whole-model torch.compile); ours, ours-compile (eager /
`compile_regions`); ours-compile-flex (`compile_regions` with `attention="flex"`: the self-attentions by
FlexAttention, the position bias added inside the kernel; CUDA only, PyTorch has no FlexAttention backward on CPU);
ours-compile-triton (`attention="triton"`: our kernels, pretrain/model/relative_attention.py; CUDA only);
ours-compile-triton-torchgate (the same with `gated_gelu="torch"`: the feed-forward's gate as Inductor fuses it, not
by our kernels of pretrain/model/gated_gelu.py; the A/B of those); ours-compile-triton-graphed (the same step captured
whole in one CUDA graph and replayed: a diagnostic of what the host's launches cost, CUDA only; `pretrain` does not
do this); ours-compile-triton-perdiagonal (the attention's bias gradient summed along the diagonals of every score
tile, as before score tiles in T5's last bucket were summed whole; the A/B of that); ours-compile-triton-fp8 (the
blocks' linears as FP8 GEMMs, pretrain/model/fp8.py: `pretrain --precision fp8`; MFU still on the bf16 peak);
ours-compile-triton-fp8-graphed (FP8's step in one CUDA graph: what its launches cost the host, a diagnostic);
ours-compile-triton-cudagraphs, ours-compile-triton-fp8-cudagraphs (the blocks compiled with mode="reduce-overhead").

`--profile VARIANT` traces 3 steps twice: with host events (the op table, kernel time by family) and with device
activity only (the host's pace close to an untraced run's: the device's busy share and its idle gaps, named by the
kernels around them), then times them back to back with one synchronisation (as a loop that does not read its loss
every step runs them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.metrics import peak_tflops_for  # noqa: E402
from pretrain.model.flops import count_parameters, train_step_flops  # noqa: E402
from pretrain.model.t5 import build  # noqa: E402
from pretrain.model.variants import attention_of, build_variant, parts  # noqa: E402

VARIANTS = ("hf", "hf-compile", "ours", "ours-compile", "ours-compile-flex", "ours-compile-triton",
            "ours-compile-triton-torchgate", "ours-compile-triton-graphed", "ours-compile-triton-perdiagonal",
            "ours-compile-triton-fp8", "ours-compile-triton-fp8-graphed",
            "ours-compile-triton-cudagraphs", "ours-compile-triton-fp8-cudagraphs")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_ceiling_tflops(device: str, size: int, repeats: int = 10) -> float:
    """bf16 size^3 matmul rate on random data (mean of `repeats` after 3 warm-ups)."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=generator)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=generator)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def profile(step, args, name: str) -> None:
    """Top GPU kernels of 3 steps (torch.profiler) -> OUT/profile-NAME.txt, the top 15 printed; on CUDA also the
    kernel time per step by family (pretrain/profiling.py's FAMILIES, as `pretrain --profile-steps` counts them)
    -> OUT/profile-NAME.json, printed as one line."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    sort_by = "self_cpu_time_total"
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        sort_by = "self_cuda_time_total"
    steps = 3
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(args.device)
    table = prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=90)
    (Path(args.out) / f"profile-{name}.txt").write_text(table)
    print("\n".join(table.splitlines()[:18]), flush=True)
    if args.device != "cuda":
        return
    import tempfile

    from pretrain.profiling import summarize_trace
    with tempfile.TemporaryDirectory() as tmp:        # the trace is tens of MB: only its summary is kept
        prof.export_chrome_trace(f"{tmp}/trace.json")
        summary = summarize_trace(f"{tmp}/trace.json")
    summary["steps"] = steps
    summary["per_step_ms"] = {family: round(1e3 * info["seconds"] / steps, 2)
                              for family, info in summary["families"].items()}
    summary["device_only"] = device_only_profile(step, steps)
    (Path(args.out) / f"profile-{name}.json").write_text(json.dumps(summary, indent=2))
    print(f"profile {name}, kernel ms per step by family: " + ", ".join(
        f"{family} {ms}" for family, ms in summary["per_step_ms"].items())
        + f"; device busy {100 * summary['device_busy_share']:.1f}% of the traced steps", flush=True)
    if summary["memsets_and_copies"]:
        print(f"profile {name}, memsets and copies a step, by the host op that made them: " + "; ".join(
            f"{m['what']} {m['calls'] // steps}x {m['seconds'] * 1e3 / steps:.2f} ms"
            for m in summary["memsets_and_copies"][:6]), flush=True)
    only = summary["device_only"]
    print(f"profile {name}, device activity only: {only['ms_per_step']:.1f} ms a step traced, kernels "
          f"{only['kernel_ms_per_step']:.1f} ms, device busy {100 * only['device_busy_share']:.1f}%; "
          f"untraced and unsynchronised between steps: {only['back_to_back_ms_per_step']:.1f} ms a step; "
          f"largest idle gaps: " + "; ".join(f"{g['seconds'] * 1e3 / steps:.2f} ms/step ({g['gaps'] // steps}x) "
                                           f"{g['between']}" for g in only["idle_gaps"][:6]), flush=True)


def device_only_profile(step, steps: int) -> dict:
    """The device's view of `steps` steps with only CUDA activity traced (no host op events: the host's pace stays
    close to an untraced run's, so the device's idle gaps are the real ones, named by the kernels around them), and
    the same steps untraced back to back with one synchronisation at the end (the step as a training loop that does
    not read its loss every step runs it). Milliseconds per step."""
    import tempfile

    from pretrain.profiling import summarize_trace
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        window = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        summary = summarize_trace(f"{tmp}/trace.json", window, top=12)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - start) / steps
    return {"ms_per_step": 1e3 * window / steps, "back_to_back_ms_per_step": 1e3 * back_to_back,
            "kernel_ms_per_step": 1e3 * sum(f["seconds"] for f in summary["families"].values()) / steps,
            "device_busy_share": summary["device_busy_share"], "idle_gaps": summary["idle_gaps"],
            "alloc_retries": alloc_retries("cuda"),
            "top_kernels": summary["top_kernels"]}


def sdpa_backends(model, args, attention: str = "sdpa") -> dict:
    """The fused SDPA kernel PyTorch picks for each attention of `model` (bf16, the benchmark's shapes and the
    model's own position biases, with gradients): encoder self, decoder self (causal bias), cross (no mask).
    attention="flex": the self-attentions are FlexAttention's (compiled Triton), only cross-attention is SDPA's."""
    from torch.nn.attention import SDPBackend
    names = {int(getattr(SDPBackend, n)): n.lower() for n in dir(SDPBackend) if n.isupper()}
    config, dtype, device = model.config, torch.bfloat16, args.device
    heads, d_kv, batch = config.num_heads, config.d_kv, args.batch

    def projected(length, n_parts):   # the layout Attention._heads gives: a permuted view of one fused projection
        x = torch.randn(batch, length, n_parts * heads * d_kv, device=device, dtype=dtype, requires_grad=True)
        return x.view(batch, length, n_parts, heads, d_kv).permute(2, 0, 3, 1, 4).unbind(0)

    encoder_bias = model.encoder.self_attention_bias(args.input_length, dtype).to(device)
    decoder_bias = model.decoder.self_attention_bias(args.target_length, dtype).to(device)
    cases = {"encoder-self": (*projected(args.input_length, 3), encoder_bias),
             "decoder-self": (*projected(args.target_length, 3), decoder_bias),
             "cross": (projected(args.target_length, 1)[0], *projected(args.input_length, 2), None)}
    own = {"flex": "flex_attention", "triton": "relative_attention (triton)"}
    return {name: own[attention] if attention in own and name.endswith("-self") else
            names.get(int(torch._fused_sdp_choice(q, k, v, bias, 0.0, False, scale=1.0)), "?")
            for name, (q, k, v, bias) in cases.items()}


def make_step(variant: str, model, batch):
    """A closure running one training step of `variant` on `batch`; returns the loss tensor."""
    input_ids, labels = batch
    if variant.startswith("hf"):
        def forward():
            return model(input_ids=input_ids, labels=labels).loss
    else:
        def forward():
            return model(input_ids, labels=labels)
    graphed = variant.endswith("-graphed")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                                  fused=input_ids.device.type == "cuda", capturable=graphed)

    marks_steps = "cudagraphs" in parts(variant)

    def step():
        if marks_steps:           # Inductor's CUDA graphs: the last step's outputs may be overwritten from here
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        loss = forward()
        loss.backward()
        optimizer.step()
        return loss
    return graphed_step(step, optimizer) if graphed else step


def graphed_step(step, optimizer):
    """`step` captured whole (forward, backward, optimizer) in one CUDA graph on its first call, after 3 eager steps
    on a side stream (which compile); every call then replays it and returns the graph's loss tensor. A diagnostic:
    the step with no host launches and no gaps between kernels that the host causes."""
    captured = {}

    def replay():
        if not captured:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()                  # the side stream's cached blocks (a step's activations)
            optimizer.zero_grad(set_to_none=True)     # the captured backward allocates the grads in the graph's pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                loss = step()
            captured.update(graph=graph, loss=loss)
        captured["graph"].replay()
        return captured["loss"]
    return replay


def start_variant(variant, ours_cpu, batch, args) -> dict:
    """`variant`'s model on the device with its step, compiled by its first step and warmed up: the step closure, the
    first loss, the first step's seconds and the peak memory it added to what was allocated before it was built."""
    device = args.device
    held = torch.cuda.memory_allocated() if device == "cuda" else 0   # other variants' models (--rounds)
    model = build_variant(variant, ours_cpu, device, torch.bfloat16)
    step = make_step(variant, model, batch)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    compile_start = time.perf_counter()
    first_loss = float(step().detach())          # first step (includes compilation for *-compile variants)
    sync(device)
    first_step_s = time.perf_counter() - compile_start
    for _ in range(args.warmup - 1):
        step()
    sync(device)
    peak = (torch.cuda.max_memory_allocated() - held) / 2**30 if device == "cuda" else float("nan")
    return {"model": model, "step": step, "first_loss": first_loss, "first_step_s": first_step_s, "peak_mem_gib": peak}


def alloc_retries(device: str) -> int:
    """The caching allocator's retries so far: each one freed every cached block and synchronised (a slow step)."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device == "cuda" else 0


def time_steps(step, args) -> tuple[list[float], float]:
    """`args.steps` steps, each timed on its own (for the spread); their seconds and the last loss."""
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step()
        sync(args.device)
        times.append(time.perf_counter() - start)
    return times, float(loss.detach())


def row_of(variant, size, started, step_s, low_s, high_s, last_loss, args, flops_per_step, ceiling, peak) -> dict:
    tokens = size * (args.input_length + args.target_length)
    tflops = flops_per_step / step_s / 1e12
    return {"variant": variant, "batch": size, "first_loss": started["first_loss"], "last_loss": last_loss,
            "ms_per_step": 1e3 * step_s, "ms_min": 1e3 * low_s, "ms_max": 1e3 * high_s,
            "tokens_per_s": tokens / step_s, "tflops": tflops, "mfu": tflops / peak if peak else float("nan"),
            "of_gemm": tflops / ceiling, "first_step_s": started["first_step_s"],
            "peak_mem_gib": started["peak_mem_gib"]}


def bench_variant(variant, ours_cpu, batch, args, flops_per_step, ceiling, peak):
    started = start_variant(variant, ours_cpu, batch, args)
    times, last_loss = time_steps(started["step"], args)
    if variant == args.profile:
        profile(started["step"], args, f"{ours_cpu.config.name}-{variant}")
    return row_of(variant, batch[0].shape[0], started, statistics.median(times), min(times), max(times), last_loss,
                  args, flops_per_step, ceiling, peak)


def release(variants, device: str) -> None:
    """Give back the memory the variants' models held, once they are dropped. The CUDA graphs of a -cudagraphs
    variant (mode="reduce-overhead") keep their memory pools in Inductor's global state, which outlives the model:
    33 GiB at mt5-large batch 64, so HF compiled timed after it in one process ran out of memory. Dynamo's reset frees
    them (and drops every compiled graph: a variant timed after it compiles again, as a new model does anyway)."""
    gc.collect()                                   # compiled modules sit in reference cycles
    if any("cudagraphs" in parts(variant) for variant in variants):
        torch._dynamo.reset()
        if device == "cuda":       # torch 2.13's reset does this itself; said outright for older releases
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees
            reset_cudagraph_trees()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_rounds(preset, ours_cpu, largest, args, ceiling, peak, rows: list[dict]) -> None:
    """--rounds: every variant's model built, compiled and warmed up once, then timed `args.rounds` times in turn
    (A B C A B C ...), `args.steps` steps a round, at `args.batch`; one row per variant appended to `rows`, its
    ms/step the median of its round medians, min-max over them. What drifts between runs (clocks, the machine's
    neighbours) then falls on every variant alike. A round line names a variant's slowest step when it is over 1.1x
    its median, and the allocator retries of its steps (all models are held, so memory is tighter than alone): what
    tells a slow round's cause. Interrupted, the rows of the rounds finished are still appended."""
    batch = tuple(part[:args.batch].to(args.device) for part in largest)
    flops = train_step_flops(ours_cpu.config, args.batch, args.input_length, args.target_length)
    started, errors, medians, last, retries = {}, {}, {}, {}, {}
    try:
        for variant in args.variants:
            try:
                started[variant] = start_variant(variant, ours_cpu, batch, args)
                medians[variant], retries[variant] = [], []
            except Exception as err:
                errors[variant] = failure(err, "beside the other variants' models (--rounds keeps them all)")
        for round_ in range(args.rounds):
            said = []
            for variant, held in started.items():
                before = alloc_retries(args.device)
                times, last[variant] = time_steps(held["step"], args)
                medians[variant].append(statistics.median(times))
                retries[variant].append(alloc_retries(args.device) - before)
                said.append(f"{variant} {1e3 * medians[variant][-1]:.1f} ms"
                            + round_detail(times, retries[variant][-1]))
            print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(said), flush=True)
        for variant, held in started.items():
            if variant == args.profile:
                profile(held["step"], args, f"{ours_cpu.config.name}-{variant}")
    finally:   # also on an interrupt: the rows of the rounds that finished
        for variant in args.variants:
            if variant in errors:
                rows.append({"variant": variant, "batch": args.batch, "error": errors[variant]})
            elif medians.get(variant):
                ms = medians[variant]
                row = row_of(variant, args.batch, started[variant], statistics.median(ms), min(ms), max(ms),
                             last[variant], args, flops, ceiling, peak)
                rows.append({**row, "rounds_ms": [round(1e3 * m, 2) for m in ms],
                             "rounds_alloc_retries": retries[variant][:len(ms)]})
            else:
                continue
            rows[-1]["model"] = preset
            print(json.dumps(rows[-1]), flush=True)
        started.clear()
        release(args.variants, args.device)


def round_detail(times: list[float], retried: int) -> str:
    """What a round line adds to a variant's median: its slowest step if over 1.1x the median, its allocator
    retries if any; empty for a steady round."""
    median, slowest = statistics.median(times), max(times)
    notes = [f"slowest {1e3 * slowest:.1f}"] if slowest > 1.1 * median else []
    notes += [f"{retried} allocator {'retry' if retried == 1 else 'retries'}"] if retried else []
    return f" ({', '.join(notes)})" if notes else ""


def failure(err: Exception, where: str = "") -> str:
    """A measurement's error as its row says it: out of memory (and `where`), or the exception's first line."""
    if isinstance(err, torch.OutOfMemoryError):
        return f"out of memory{' ' + where if where else ''}: {str(err).splitlines()[0]}"
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"


def measure(variant, ours_cpu, largest, size, args, ceiling, peak) -> dict:
    """`bench_variant` on the first `size` examples of `largest`; a failure (out of memory, or any other) as the
    row's error, so that the other variants' numbers are kept."""
    batch = tuple(part[:size].to(args.device) for part in largest)
    flops = train_step_flops(ours_cpu.config, size, args.input_length, args.target_length)
    try:
        return bench_variant(variant, ours_cpu, batch, args, flops, ceiling, peak)
    except Exception as err:
        return {"variant": variant, "batch": size, "error": failure(err)}
    finally:
        release([variant], args.device)


def ms_spread(row: dict) -> str:
    """A row's median ms per step with the min-max of its timed steps."""
    return f"{row['ms_per_step']:.1f} ({row['ms_min']:.1f}-{row['ms_max']:.1f})"


def predicted_peak_gib(fits: list[dict], size: int) -> float | None:
    """Peak memory at batch `size` from the batches that fit: the line through the two largest (fixed weights and
    optimizer state plus activations that grow with the batch), or proportional to the one (an overestimate)."""
    if not fits:
        return None
    fits = sorted(fits, key=lambda r: r["batch"])[-2:]
    if len(fits) == 1:
        return fits[0]["peak_mem_gib"] * size / fits[0]["batch"]
    (b0, m0), (b1, m1) = ((r["batch"], r["peak_mem_gib"]) for r in fits)
    return m1 + (m1 - m0) / (b1 - b0) * (size - b1)


def best_batches(rows: list[dict]) -> list[dict]:
    """Per (model, variant): the row of its fastest batch that fit, with the largest that fit and its tokens/s over
    HF compiled's fastest."""
    best = []
    for model, variant in dict.fromkeys((r["model"], r["variant"]) for r in rows):
        fits = [r for r in rows if (r["model"], r["variant"]) == (model, variant) and "error" not in r]
        if fits:
            best.append({**max(fits, key=lambda r: r["tokens_per_s"]), "largest_fit": max(r["batch"] for r in fits)})
    for row in best:
        base = next((b for b in best if b["model"] == row["model"] and b["variant"] == "hf-compile"), None)
        if base:
            row["best_vs_hf_compile"] = row["tokens_per_s"] / base["tokens_per_s"]
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mt5-base", "mt5-large"])
    parser.add_argument("--variants", nargs="+", default=["hf", "hf-compile", "ours", "ours-compile"], choices=VARIANTS,
                        metavar="VARIANT", help=f"any of {', '.join(VARIANTS)} (see above)")
    parser.add_argument("--batch", type=int, default=64, help="the equal-batch comparison's batch size")
    parser.add_argument("--batches", type=int, nargs="*", default=[],
                        help="more batch sizes per variant, larger first fitting ones kept (the best-batch table)")
    parser.add_argument("--input-length", type=int, default=512)
    parser.add_argument("--target-length", type=int, default=114)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="at --batch, build every variant once and time them in turn this many times, --steps steps a round (ms/step: the median of the round medians, min-max over them); their models stay on the device together")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--matmul-size", type=int, default=8192)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak for MFU (default: the datasheet figure of the device, PEAK_TFLOPS)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="", help="variant to profile (3 steps, every model) after timing")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch._dynamo.config.cache_size_limit = 64

    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    ceiling = matmul_ceiling_tflops(args.device, args.matmul_size)
    peak = peak_tflops_for(env["device"], "bf16", args.peak_tflops)
    print(f"{env} bf16 {args.matmul_size}^3 matmul ceiling: {ceiling:.1f} TFLOP/s; datasheet peak: {peak} TFLOP/s",
          flush=True)

    rows = []
    capacity = torch.cuda.get_device_properties(0).total_memory / 2**30 if args.device == "cuda" else None
    interrupted = False
    # a shell without job control starts background commands with SIGINT ignored, and Python then leaves it so:
    # the time limit's SIGINT must still stop the measuring
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:   # a device call's time limit (timeout -s INT) still gets the tables of what was measured
        for preset in args.models:
            ours_cpu = build(preset, seed=args.seed)
            config = ours_cpu.config
            sizes = sorted({args.batch, *args.batches})
            generator = torch.Generator().manual_seed(args.seed)
            low, high = 3, config.vocab_size - 100                    # no pad/eos/unk, no sentinels
            largest = (torch.randint(low, high, (sizes[-1], args.input_length), generator=generator),
                       torch.randint(low, high, (sizes[-1], args.target_length), generator=generator))
            print(f"{preset}: {count_parameters(config) / 1e6:.0f}M parameters, "
                  f"{train_step_flops(config, args.batch, args.input_length, args.target_length) / 1e12:.1f} TFLOP per "
                  f"step (batch {args.batch}, lengths {args.input_length}/{args.target_length})", flush=True)
            if args.device == "cuda":
                print(f"{preset}: SDPA kernels {sdpa_backends(ours_cpu, args)}", flush=True)
                for kind in sorted({attention_of(variant) for variant in args.variants} - {"sdpa"}):
                    print(f"{preset}: *-{kind} kernels {sdpa_backends(ours_cpu, args, kind)}", flush=True)
            if args.rounds > 1:          # args.batch first, every variant in turn; the other sizes below
                measure_rounds(preset, ours_cpu, largest, args, ceiling, peak, rows)
            for variant in args.variants:
                for size in sizes:            # the same examples at every size: a prefix of the largest batch
                    if args.rounds > 1 and size == args.batch:
                        if "error" in next(r for r in rows if (r["model"], r["variant"]) == (preset, variant)):
                            break
                        continue
                    fits = [r for r in rows if (r["model"], r["variant"]) == (preset, variant) and "error" not in r]
                    predicted = predicted_peak_gib(fits, size) if capacity else None
                    if predicted is not None and size > args.batch and predicted > capacity:
                        # not run: a whole-model compile (HF's takes ~150 s) only to run out of memory
                        row = {"variant": variant, "batch": size,
                               "error": f"predicted out of memory: {predicted:.0f} GiB > {capacity:.0f} GiB"}
                    else:
                        row = measure(variant, ours_cpu, largest, size, args, ceiling, peak)
                    row["model"] = preset
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if "error" in row and size >= args.batch:   # a larger batch will not fit either
                        break
            del ours_cpu
    except KeyboardInterrupt:
        interrupted = True
        print(f"interrupted: the tables below hold the {len(rows)} measurement(s) finished", flush=True)

    equal = [r for r in rows if r["batch"] == args.batch]
    for row in equal:
        for baseline, key in (("hf", "speedup_vs_hf"), ("hf-compile", "speedup_vs_hf_compile")):
            base = next((r for r in equal if r["model"] == row["model"] and r["variant"] == baseline
                         and "error" not in r), None)
            if base and "error" not in row:
                row[key] = row["tokens_per_s"] / base["tokens_per_s"]
    header = ("| model | variant | ms/step (min-max) | tokens/s | TFLOP/s | MFU | x GEMM | x HF | x HF compiled | "
              "peak GiB | first step s | loss |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [header]
    for r in equal:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | {r['error']} |||||||||")
            continue
        lines.append(f"| {r['model']} | {r['variant']} | {ms_spread(r)} | "
                     f"{r['tokens_per_s']:,.0f} | "
                     f"{r['tflops']:.1f} | {100 * r['mfu']:.1f}% | {100 * r['of_gemm']:.1f}% | "
                     f"{r.get('speedup_vs_hf', float('nan')):.2f} | {r.get('speedup_vs_hf_compile', float('nan')):.2f} | "
                     f"{r['peak_mem_gib']:.1f} | {r['first_step_s']:.1f} | {r['first_loss']:.4f} |")
    table = "\n".join(lines)
    best = best_batches(rows) if args.batches else []
    if best:
        table += ("\n\nAt each variant's fastest fitting batch (of " + ", ".join(map(str, sorted({args.batch, *args.batches})))
                  + "; x HF compiled: against HF compiled at its own fastest):\n\n"
                  "| model | variant | batch | largest that fit | ms/step (min-max) | tokens/s | MFU | peak GiB | "
                  "x HF compiled |\n"
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(
                      f"| {r['model']} | {r['variant']} | {r['batch']} | {r['largest_fit']} | {ms_spread(r)} | "
                      f"{r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_mem_gib']:.1f} | "
                      f"{r.get('best_vs_hf_compile', float('nan')):.2f} |" for r in best))
    summary = (f"{env['device']}, torch {env['torch']}, transformers {env.get('transformers', '-')}; bf16 params + "
               f"fused AdamW; batch {args.batch}, inputs {args.input_length}, targets {args.target_length}; "
               + (f"{args.rounds} rounds of {args.steps} timed steps, the variants in turn (ms/step: the median of the round "
                  f"medians, min-max over them)" if args.rounds > 1 else f"{args.steps} timed steps")
               + f" after {args.warmup} warm-up; MFU vs the datasheet dense bf16 peak {peak} "
               f"TFLOP/s; x GEMM vs a bf16 {args.matmul_size}^3 matmul measured here, {ceiling:.1f} TFLOP/s"
               + ("; INTERRUPTED before every variant and batch was measured" if interrupted else ""))
    result = {"env": env, "ceiling_tflops": ceiling, "peak_tflops": peak, "args": vars(args), "rows": rows,
              "best_batch": best, "interrupted": interrupted}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(summary + "\n\n" + table + "\n")
    print("\n" + summary + "\n\n" + table, flush=True)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
