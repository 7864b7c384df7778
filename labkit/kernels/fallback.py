"""When the Triton kernels can run here, and what runs when they cannot.

The public functions of ``labkit.kernels.paged_attention`` run a Triton kernel, or their PyTorch
reference when Triton cannot run here (``fallback_reason`` says why: no Triton, a dtype or cache
format this GPU cannot compile, tensors on the wrong device) or when a compiled kernel fails to
compile or launch on this GPU (``launch_or_reference``). Either way a RuntimeWarning says so, once per
reason. In Triton's interpreter a failing kernel is a bug, and it raises.
"""

from __future__ import annotations

import warnings
from typing import Callable, TypeVar

import torch

from ..memory.formats import kv_quant
from .device import RUNTIME

try:  # Triton is optional: without it every public function uses its reference.
    import triton
except ImportError:  # pragma: no cover
    triton = None


T = TypeVar("T")
FP8_CAPABILITY = (8, 9)  # Triton's float8e4nv (e4m3) compiles from Ada (L4, RTX 40) and Hopper on


def kv_format_reason(kv_cache_dtype: str, capability: tuple[int, int] | None) -> str | None:
    """None when the kernels can read and write ``kv_cache_dtype`` on a GPU of ``capability``
    (None: the interpreter); else why not, naming the fallback.

    Triton compiles e4m3 conversions (``cvt.rn.f16x2.e4m3x2`` and back) only for compute
    capability 8.9 and up; for sm75 to sm86 it refuses ("type fp8e4nv not supported in this
    architecture"). int8 and int4 codes are plain integers and compile everywhere.
    """
    kq = kv_quant(kv_cache_dtype)
    if kq is None or kq.element != "fp8" or capability is None or capability >= FP8_CAPABILITY:
        return None
    return (f"{kv_cache_dtype}: Triton compiles fp8 (e4m3) only from compute capability "
            f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}, this GPU is {capability[0]}.{capability[1]}; the PyTorch "
            "reference (dequantize, then attend) runs instead")


def fallback_reason(dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: str = "auto") -> str | None:
    """None when the Triton kernels run for this dtype, device and cache format; else why the reference runs."""
    device = torch.device(device)
    if triton is None:
        return "Triton is not installed"
    if not RUNTIME.kernels_can_run(dtype):
        return f"{dtype} kernels cannot run here: {RUNTIME.reason}"
    why = kv_format_reason(kv_cache_dtype, None if RUNTIME.triton_mode != "compiled" else RUNTIME.capability)
    if why is not None:
        return why
    if RUNTIME.triton_mode == "interpreter" and device.type != "cpu":
        return f"Triton's interpreter runs on CPU tensors, these are on {device}"
    if RUNTIME.triton_mode == "compiled" and device.type != "cuda":
        return f"compiled Triton kernels need CUDA tensors, these are on {device}"
    return None


_warned: set[str] = set()
# Kernels that failed to compile or launch on this GPU, keyed by (kernel, dtype, head_dim): not retried.
failed_launches: dict[tuple[str, torch.dtype, int], str] = {}


def _warn_once(reason: str, stacklevel: int = 4) -> None:
    """Say once per distinct reason that the reference runs instead of Triton."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"labkit.kernels runs its PyTorch reference instead of Triton: {reason}",
                      RuntimeWarning, stacklevel=stacklevel)


def use_reference(dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: str = "auto") -> bool:
    """True when the reference must run instead of Triton; says why, once per reason."""
    reason = fallback_reason(dtype, device, *(() if kv_cache_dtype == "auto" else (kv_cache_dtype,)))
    if reason is not None:
        _warn_once(reason)
    return reason is not None


def launch_or_reference(kernel: str, dtype: torch.dtype, head_dim: int,
                        launch: Callable[[], T], reference: Callable[[], T]) -> T:
    """Run ``launch`` (a Triton launch); on a GPU, fall back to ``reference`` if it cannot compile or launch.

    A compiled Triton may not support every GPU or dtype (an old architecture, bf16 on a
    new one before the compiler learns it). Then the first launch raises, we warn once,
    naming the error, and this (kernel, dtype, head_dim) uses the PyTorch reference from
    then on. In the interpreter there is no such excuse: a failure there is a bug in the
    kernel or its arguments, and it propagates.
    """
    key = (kernel, dtype, head_dim)
    if RUNTIME.interpreted:
        return launch()
    if key not in failed_launches:
        try:
            return launch()
        except Exception as err:  # noqa: BLE001 - any compiler or driver error: the reference still works
            failed_launches[key] = f"{type(err).__name__}: {err}"
    _warn_once(f"the {kernel} kernel failed to compile or launch for {dtype}, head_dim {head_dim} "
               f"({failed_launches[key]})")
    return reference()
