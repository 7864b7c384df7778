"""Prepacked weights: how a serving engine sets up the CPU's matrix multiplies once, at load.

On a CPU, a decode step of a small model is mostly matrix multiplies: a few rows against every
weight matrix (211 of them per step for SmolLM2-135M). ``nn.Linear`` hands each weight to the
BLAS library as stored, and the library rearranges its tiles on every call. oneDNN (the CPU
library inside PyTorch) can instead *reorder* a weight once into the blocked layout its kernels
read. vLLM's CPU backend does this when a model loads: ``UnquantizedLinearMethod.
process_weights_after_loading`` (``vllm/model_executor/layers/linear.py``) calls
``dispatch_cpu_unquantized_gemm`` (``vllm/model_executor/layers/utils.py``), which builds a oneDNN
matmul from the weight (``ops.create_onednn_mm``). Same weights, same float32 arithmetic in
another summation order (results agree to about 1e-4, not bit for bit), same threads.

``prepack(model)`` does it with PyTorch's own oneDNN operators: every ``nn.Linear`` of any module
(the book's ``Decoder``, transformers' Llama) becomes a ``PackedLinear`` that keeps its ``weight``
(``state_dict`` and a tied embedding are untouched) and multiplies with a reordered copy;
``unpack(model)`` turns them back. Inference only, CPU and float32 only; the copy does not follow
later changes to ``weight``. ``benchmarks/continuous_batching.py`` measures what it saves (its
results are chapter 05's table).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PackedLinear", "available", "is_packed", "prepack", "unpack"]


def available() -> bool:
    """Whether this PyTorch has the oneDNN operators ``prepack`` uses (CPU builds usually do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward multiplies with a oneDNN-reordered copy of its weight."""

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def prepack(model: nn.Module, batch_size: int = 16) -> int:
    """Pack every ``nn.Linear`` of ``model`` in place; returns how many were packed.

    ``batch_size``: the number of rows a multiply usually gets (a step's tokens), a hint for
    oneDNN's choice of layout; any number of rows still works. Layers already packed are left as
    they are. Raises (and packs nothing) unless every linear layer is float32 on the CPU.
    """
    _check_model(model)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 4096:
        raise ValueError(f"batch_size must be an integer in [1, 4096], got {batch_size!r}")
    if not available():
        raise RuntimeError("this PyTorch has no oneDNN (torch.backends.mkldnn): prepack cannot run here")
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, m in linears:
        if m.weight.device.type != "cpu" or m.weight.dtype != torch.float32:
            raise ValueError(f"prepack needs float32 weights on the CPU; {name or 'model'}.weight is "
                             f"{m.weight.dtype} on {m.weight.device}")
    with torch.no_grad():  # every copy made before any layer changes: a failure leaves the model as it was
        packed = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), batch_size) for _, m in linears]
    for (_, m), w in zip(linears, packed):
        m.__class__ = PackedLinear
        m.packed_weight = w
    return len(linears)


def unpack(model: nn.Module) -> int:
    """Turn every ``PackedLinear`` of ``model`` back into a plain ``nn.Linear``; returns how many."""
    _check_model(model)
    packed = [m for m in model.modules() if type(m) is PackedLinear]
    for m in packed:
        m.__class__ = nn.Linear
        del m.packed_weight
    return len(packed)


def is_packed(model: nn.Module) -> bool:
    """Whether any linear layer of ``model`` multiplies with a packed weight."""
    _check_model(model)
    return any(type(m) is PackedLinear for m in model.modules())
