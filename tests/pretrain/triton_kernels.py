"""What the tests of our Triton kernels share (test_relative_attention.py, test_gated_gelu.py): where they run.

    from tests.pretrain.triton_kernels import DEVICE, relative_error, require_kernels
    require_kernels()          # at module level, before importing the kernel modules

On a GPU the kernels compile; without one they run in Triton's interpreter, which tests/conftest.py switches on
before anything imports triton (Triton reads TRITON_INTERPRET when it defines a kernel).
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def require_kernels() -> None:
    """Skip the calling test module unless Triton is importable and the kernels can run (a GPU, or the interpreter)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton's interpreter was not switched on before triton was imported "
                    "(tests/conftest.py does it)", allow_module_level=True)


def relative_error(got, want) -> float:
    """|got - want| / |want| (Frobenius norms) in float64, on the CPU (a kernel's output against a reference)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm()).item()
