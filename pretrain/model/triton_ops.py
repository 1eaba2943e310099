"""How our Triton kernels become operators (`relative_attention.py`, `gated_gelu.py`).

    @kernel_op("t5zero::name")
    def _op(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        launch(_kernel, grid, x, out, BLOCK=64, num_warps=4)
        return out

On a GPU an op is a `torch.library.triton_op`: `torch.compile` traces into its body, so Inductor launches the kernels
from its own generated code and schedules the PyTorch ops around them with the rest of the graph. An opaque
`custom_op` instead costs a Python dispatch per call (with the kernels' launches about 0.2 ms of host time, measured
under the profiler on an H200), which the host pays for every layer and can fall behind the GPU on.

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) kernels cannot be traced: an op is then a
`custom_op` of the same body, the body also its fake (compile-time) kernel, in which `launch` does nothing.
"""

from __future__ import annotations

import os

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def kernel_op(name: str):
    """Decorator: the function (tensors in, new tensors out, nothing mutated) as the operator `name`."""
    def register(fn):
        if not INTERPRETED:
            return torch.library.triton_op(name, fn, mutates_args=())
        op = torch.library.custom_op(name, fn, mutates_args=())
        op.register_fake(fn)
        return op
    return register


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), traceable (`wrap_triton`); nothing for fake tensors under the interpreter."""
    if INTERPRETED and any(is_fake(arg) for arg in args if isinstance(arg, torch.Tensor)):
        return
    wrap_triton(kernel)[grid](*args, **kwargs)
