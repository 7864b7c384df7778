"""Where labkit runs: a CUDA GPU when there is one, else the CPU.

Triton kernels need a GPU to compile. On a machine without one, Triton can
still *interpret* a kernel: it runs the same Python kernel body on CPU tensors,
one program instance at a time. That is slow, and it lets every reader step
through the book's kernels on a laptop or on Binder. It is exact in float32 and
float16; its bfloat16 arithmetic is not, so labkit's kernels upcast every load to
float32 before computing.

The interpreter has one catch: the flag ``TRITON_INTERPRET=1`` is read when a
function is decorated with ``@triton.jit``. It must be set *before* the module
that defines kernels is imported. ``labkit/__init__.py`` imports this module
first, so ``import labkit`` is all a notebook, test or script needs.

Set ``LABKIT_DEVICE=cpu`` to force the CPU (and the interpreter) on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

# The oldest GPU generation (compute capability) that recent Triton releases compile for.
MIN_TRITON_CAPABILITY = (7, 5)
# bfloat16 arithmetic in hardware starts with Ampere (compute capability 8.0).
MIN_BF16_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Runtime:
    """What labkit decided about this machine, and why."""

    device: torch.device
    triton_mode: str  # "compiled", "interpreter" or "unavailable"
    reason: str
    capability: tuple[int, int] | None = None

    @property
    def bf16_supported(self) -> bool:
        """Whether Triton kernels may run in bfloat16 here."""
        if self.triton_mode == "interpreter":
            return True  # the kernels upcast to float32 before any arithmetic
        if self.capability is None:
            return False
        return self.capability >= MIN_BF16_CAPABILITY

    def kernels_can_run(self, dtype: torch.dtype) -> bool:
        """True when the Triton kernels can run for ``dtype``; else labkit uses the PyTorch reference."""
        if self.triton_mode == "unavailable":
            return False
        return dtype != torch.bfloat16 or self.bf16_supported


def _decide() -> Runtime:
    has_triton = importlib.util.find_spec("triton") is not None
    forced_cpu = os.environ.get("LABKIT_DEVICE", "").lower() == "cpu"
    if torch.cuda.is_available() and not forced_cpu:
        cap = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
        if not has_triton:
            return Runtime(torch.device("cuda"), "unavailable",
                           f"GPU {name} found, but Triton is not installed: kernels fall back to PyTorch.", cap)
        if cap < MIN_TRITON_CAPABILITY:
            return Runtime(torch.device("cuda"), "unavailable",
                           f"GPU {name} has compute capability {cap[0]}.{cap[1]}; Triton needs "
                           f"{MIN_TRITON_CAPABILITY[0]}.{MIN_TRITON_CAPABILITY[1]} or newer: "
                           "kernels fall back to the PyTorch reference.", cap)
        return Runtime(torch.device("cuda"), "compiled",
                       f"GPU {name} (compute capability {cap[0]}.{cap[1]}): Triton compiles the kernels.", cap)
    why = "LABKIT_DEVICE=cpu was set" if forced_cpu else "no CUDA GPU was found"
    if not has_triton:
        return Runtime(torch.device("cpu"), "unavailable",
                       f"{why} and Triton is not installed: kernels fall back to the PyTorch reference.")
    # Must happen before any @triton.jit runs; see the module docstring.
    os.environ["TRITON_INTERPRET"] = "1"
    return Runtime(torch.device("cpu"), "interpreter",
                   f"{why}: Triton kernels run in Triton's interpreter on the CPU (slow; loads upcast to float32).")


RUNTIME: Runtime = _decide()
DEVICE: torch.device = RUNTIME.device


def describe() -> str:
    """A short report of the device, the Triton mode and the library versions."""
    lines = [
        f"device       : {RUNTIME.device}",
        f"triton mode  : {RUNTIME.triton_mode}",
        f"why          : {RUNTIME.reason}",
        f"bf16 kernels : {'yes' if RUNTIME.bf16_supported else 'no (float16/float32 only; bf16 uses the PyTorch reference)'}",
        f"torch        : {torch.__version__}",
    ]
    if importlib.util.find_spec("triton") is not None:
        import triton

        lines.append(f"triton       : {triton.__version__}")
    return "\n".join(lines)


def default_dtype() -> torch.dtype:
    """The half-precision dtype to use for caches here: bf16 where it is supported, else fp16."""
    return torch.bfloat16 if RUNTIME.bf16_supported else torch.float16
