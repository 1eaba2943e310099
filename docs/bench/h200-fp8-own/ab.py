# In-process A/B of relative_attention switches (run with .gpu/ra_ab.py copied over the module):
#   SUM_KERNEL: the bias gradient's sums in one Triton kernel (True) or eager aten ops (False, main's code)
#   FWD_FAR: the forward adds far tiles' one bias value through a masked load (True) or loads per score (False, main)
# Part 1: one mt5-large encoder/decoder self-attention layer, batch 64, do_bench, configs alternated, 3 repeats.
# Part 2: the model step (ours-compile-triton, mt5-large, batch 64), configs alternated over rounds in one process;
# per step: wall ms (synchronised) and host ms (until step() returns, before the synchronisation).
import importlib.util, statistics, sys, time, json, os
sys.path.insert(0, os.getcwd())
import torch
import pretrain.model.relative_attention as ra
assert hasattr(ra, "SUM_KERNEL"), "copy .gpu/ra_ab.py over pretrain/model/relative_attention.py first"
spec = importlib.util.spec_from_file_location("bam", "scripts/bench_model_gpu.py")
bam = importlib.util.module_from_spec(spec); spec.loader.exec_module(bam)
spec = importlib.util.spec_from_file_location("baa", "scripts/bench_attention_gpu.py")
baa = importlib.util.module_from_spec(spec); spec.loader.exec_module(baa)

CONFIGS = {"main": (False, False, 4096), "sumkernel": (True, False, 4096), "fwdfar": (False, True, 4096),
           "both": (True, True, 4096), "chunk8192": (False, False, 8192), "sumkernel-chunk8192": (True, False, 8192)}
MODEL = []
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CONFIGS)
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
parts = sys.argv[3] if len(sys.argv) > 3 else "attention,model"


def use(name):
    ra.SUM_KERNEL, ra.FWD_FAR, chunk = CONFIGS[name]
    for model in MODEL:
        model.lm_head.chunk_tokens = chunk


def spread(v):
    return f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"


results = {}
if "attention" in parts:
    lines = ["| layer | config | forward ms | forward + backward ms |", "|---|---|---|---|"]
    for decoder in (False, True):
        config, stack, qkv, dout, length = baa.make_case("mt5-large", 64, decoder)
        qkv.requires_grad_(True)
        fn, bias = baa.runner("triton", config, stack, qkv, length, decoder)
        fwd = {n: [] for n in names}; fb = {n: [] for n in names}
        for rep in range(3):
            for n in names:
                use(n)
                with torch.no_grad():
                    fwd[n] += baa.timed(fn, repeats=1)
                fb[n] += baa.timed(baa.forward_backward(fn, qkv, dout, bias), repeats=1)
        for n in names:
            lines.append(f"| {'decoder' if decoder else 'encoder'} | {n} | {spread(fwd[n])} | {spread(fb[n])} |")
        results["attention_decoder" if decoder else "attention_encoder"] = {"fwd": fwd, "fwd_bwd": fb}
        print("\n".join(lines), flush=True)
    att_lines = lines

if "model" in parts:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch._dynamo.config.cache_size_limit = 64
    ours_cpu = bam.build("mt5-large", seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = ours_cpu.config.vocab_size
    batch = (torch.randint(3, vocab - 100, (64, 512), generator=g).cuda(),
             torch.randint(3, vocab - 100, (64, 114), generator=g).cuda())
    model = bam.prepare("ours-compile-triton", ours_cpu, "cuda")
    step = bam.make_step("ours-compile-triton", model, batch)
    MODEL.append(model)
    flops = bam.train_step_flops(ours_cpu.config, 64, 512, 114)
    for n in names:                       # compile every config's kernels, then warm
        use(n)
        for _ in range(2):
            step()
    torch.cuda.synchronize()
    wall = {n: [] for n in names}; host = {n: [] for n in names}; medians = {n: [] for n in names}
    for r in range(rounds):
        for n in names:
            use(n)
            step(); torch.cuda.synchronize()
            w = []
            for _ in range(6):
                t0 = time.perf_counter()
                loss = step()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                w.append(1e3 * (t2 - t0)); host[n].append(1e3 * (t1 - t0))
            wall[n] += w; medians[n].append(statistics.median(w))
            if r == 0:
                print(f"{n}: peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB so far", flush=True)
            print(f"round {r} {n}: {statistics.median(w):.1f} ms (host {statistics.median(host[n][-6:]):.1f}) loss {float(loss):.4f}", flush=True)
    lines = ["| config | round medians ms | ms/step median (min-max of rounds) | MFU | host ms per step, median (min-max) |",
             "|---|---|---|---:|---|"]
    for n in names:
        m = statistics.median(medians[n])
        lines.append(f"| {n} | {', '.join(f'{x:.1f}' for x in medians[n])} | {m:.1f} ({min(medians[n]):.1f}-{max(medians[n]):.1f}) "
                     f"| {flops / (m / 1e3) / 1e12 / 989.4:.1%} | {spread(host[n])} |")
    results["model"] = {"wall": wall, "host": host, "round_medians": medians}
    print("\n".join(att_lines if "attention" in parts else []))
    print("\n".join(lines), flush=True)
out = os.environ.get("OUT", ".")
json.dump(results, open(os.path.join(out, "ab.json"), "w"))
