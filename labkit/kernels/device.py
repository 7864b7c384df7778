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
first, so ``import labkit`` is all a notebook, test or script needs. Triton's own
library (``tl.zeros``, ``tl.max``, ``tl.sum``...) is made of ``@triton.jit``
functions too, decorated when ``triton`` is first imported: if another library
imported Triton before labkit (``import torch._inductor`` does), labkit
re-wraps those for the interpreter (``_interpret_triton_language``), so the
import order does not matter.

Set ``LABKIT_DEVICE=cpu`` to force the CPU (and the interpreter) on a GPU machine.
Set ``TRITON_INTERPRET=0`` on a CPU machine to keep Triton's compiler instead:
then the kernels cannot run here (calls use the PyTorch reference), but they can
be compiled ahead of time for any GPU, as ``benchmarks/kernels_static.py`` does.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass

import torch

# The oldest GPU generation (compute capability) that recent Triton releases compile for.
MIN_TRITON_CAPABILITY = (7, 5)
# bfloat16 tensor cores start with Ampere (compute capability 8.0). Below that (a T4 is 7.5)
# the kernels still run in bfloat16: Triton 3.9 computes every tl.dot there with float32 FMAs,
# for float16 as for bfloat16, so labkit loads bfloat16, converts to float32 (exact) and
# computes in float32; bfloat16 costs a T4 what float16 costs it.
BF16_TENSOR_CORES_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Runtime:
    """What labkit decided about this machine, and why."""

    device: torch.device
    triton_mode: str  # "compiled", "interpreter" or "unavailable"
    reason: str
    capability: tuple[int, int] | None = None

    @property
    def bf16_supported(self) -> bool:
        """Whether Triton kernels may run in bfloat16 here: wherever they run at all.

        Interpreted, and compiled below compute capability 8.0, the kernels convert
        bfloat16 loads to float32 before any arithmetic; from 8.0 on, bfloat16 products
        run on the tensor cores with float32 accumulation.
        """
        return self.triton_mode in ("interpreter", "compiled")

    @property
    def bf16_tensor_cores(self) -> bool:
        """Whether this GPU multiplies bfloat16 on tensor cores (compute capability 8.0 and up)."""
        return self.triton_mode == "compiled" and self.capability is not None \
            and self.capability >= BF16_TENSOR_CORES_CAPABILITY

    @property
    def interpreted(self) -> bool:
        """Whether Triton runs the kernels in its interpreter, on the CPU."""
        return self.triton_mode == "interpreter"

    def triton_by_default(self, device: torch.device | str) -> bool:
        """Whether a pool on ``device`` attends with the Triton kernels unless told otherwise: only where they
        compile (a CUDA GPU). On a CPU the batched PyTorch path (``labkit.kernels.cpu``) is many times faster
        than Triton's interpreter, which runs only when asked for (``use_triton=True``): chapter 03, appendix A1
        and the kernel tests."""
        return self.triton_mode == "compiled" and torch.device(device).type == "cuda"

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
    if os.environ.get("TRITON_INTERPRET") == "0":
        return Runtime(torch.device("cpu"), "unavailable",
                       f"{why} and TRITON_INTERPRET=0 keeps Triton's compiler: kernels can be compiled ahead of "
                       "time for a GPU, and calls here fall back to the PyTorch reference.")
    # Must happen before any @triton.jit runs; see the module docstring.
    os.environ["TRITON_INTERPRET"] = "1"
    _interpret_triton_language()
    return Runtime(torch.device("cpu"), "interpreter",
                   f"{why}: Triton kernels run in Triton's interpreter on the CPU (slow; loads upcast to float32).")


def _interpret_triton_language() -> int:
    """Make Triton's own ``@triton.jit`` helpers interpretable if ``triton`` was imported before labkit.

    ``tl.zeros``, ``tl.max``, ``tl.sum`` and friends are ``@triton.jit`` functions in
    ``triton.language``. Decorated while ``TRITON_INTERPRET`` was off, they are compiler
    objects, and an interpreted kernel calling them fails with "Cannot call @triton.jit'd
    outside of the scope of a kernel". Wrap each one as the interpreter would have, in every
    ``triton.language`` module already imported and on ``tl.tensor`` (whose methods such as
    ``x.max()`` are the same functions). Modules imported later see the flag and need nothing.
    Returns how many attributes were re-wrapped (0 when Triton was not imported yet).
    """
    if "triton.language" not in sys.modules:
        return 0
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}
    owners = [m for name, m in list(sys.modules.items()) if name == "triton.language" or
              name.startswith("triton.language.")]
    owners.append(sys.modules["triton.language"].tensor)
    count = 0
    for owner in owners:
        for attr, value in list(vars(owner).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(owner, attr, wrapped[id(value)])
                count += 1
    return count


RUNTIME: Runtime = _decide()
DEVICE: torch.device = RUNTIME.device


def describe() -> str:
    """A short report of the device, the Triton mode and the library versions."""
    lines = [
        f"device       : {RUNTIME.device}",
        f"triton mode  : {RUNTIME.triton_mode}",
        f"why          : {RUNTIME.reason}",
        f"bf16 kernels : {_bf16_line()}",
        f"torch        : {torch.__version__}",
    ]
    if importlib.util.find_spec("triton") is not None:
        import triton

        lines.append(f"triton       : {triton.__version__}")
    return "\n".join(lines)


def _bf16_line() -> str:
    """What bfloat16 means for the kernels here, in one line of ``describe()``."""
    if not RUNTIME.bf16_supported:
        return "no (the PyTorch reference runs instead)"
    if RUNTIME.triton_mode == "interpreter":
        return "yes (interpreted: loads converted to float32)"
    if RUNTIME.bf16_tensor_cores:
        return "yes (tensor cores, float32 accumulation)"
    return ("yes (no bf16 tensor cores below compute capability 8.0: loads converted to float32, "
            "products on the FP32 units, as for float16)")

