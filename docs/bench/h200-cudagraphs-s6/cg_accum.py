"""Gradient accumulation under compile_regions(mode="reduce-overhead") on CUDA: 2 micro batches a step, 3 steps,
grads against the same model compiled without CUDA graphs; with our copy-out hook and with it disabled."""
import torch
import pretrain.model.t5 as t5

torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
ids = [torch.randint(0, 500, (4, 64), device=dev) for _ in range(6)]
labels = [torch.randint(0, 500, (4, 16), device=dev) for _ in range(6)]
base = t5.build("t5-tiny")


def grads_of(mode, hook=True):
    keep = t5._own_gradient
    if not hook:
        t5._own_gradient = lambda g: g
    m = t5.build("t5-tiny").to(dev)
    m.load_state_dict(base.state_dict())
    m.compile_regions(mode=mode)
    t5._own_gradient = keep
    out = []
    for step in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        for p in m.parameters():
            p.grad = None
        for micro in range(2):
            m(ids[2 * step + micro], labels=labels[2 * step + micro]).backward()
        out.append([p.grad.detach().clone() for p in m.parameters() if p.grad is not None])
    return out


ref = grads_of(None)
for name, kw in (("cudagraphs + copy-out hook", dict(mode="reduce-overhead")),
                 ("cudagraphs, no hook", dict(mode="reduce-overhead", hook=False))):
    try:
        got = grads_of(**kw)
        diffs = [max(float((a - b).abs().max() / (a.abs().max() + 1e-12)) for a, b in zip(r, g))
                 for r, g in zip(ref, got)]
        print(f"{name}: max relative grad diff per step {['%.2e' % d for d in diffs]}")
    except Exception as err:  # noqa: BLE001 -- the experiment reports what torch says
        print(f"{name}: {type(err).__name__}: {str(err)[:300]}")
