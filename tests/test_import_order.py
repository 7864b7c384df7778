"""Importing Triton (or a library that does) before labkit must not break the interpreted kernels.

Triton's own helpers (``tl.zeros``, ``tl.max``...) are ``@triton.jit`` functions decorated when
``triton`` is first imported; labkit switches the interpreter on only when it is imported. Each
order runs in a fresh Python without a GPU and must give the reference's answer.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

PROGRAM = """
{first}
import torch
import labkit
from labkit.kernels.paged_attention import paged_decode_attention
from labkit.kernels.reference import paged_decode_attention_ref
assert labkit.RUNTIME.triton_mode == "interpreter", labkit.RUNTIME
gen = torch.Generator().manual_seed(0)
k_cache = torch.randn(6, 8, 2, 32, generator=gen)
v_cache = torch.randn(6, 8, 2, 32, generator=gen)
block_tables = torch.tensor([[4, 1, 5], [0, 2, 3]], dtype=torch.int32)
seq_lens = torch.tensor([19, 9], dtype=torch.int32)
q = torch.randn(2, 4, 32, generator=gen)
out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=2)
ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens)
print("max error", float((out - ref).abs().max()))
assert torch.allclose(out, ref, atol=1e-5)
"""


@pytest.mark.parametrize("first", ["import triton", "import triton.language as tl", "import torch._inductor",
                                   "import labkit"])
def test_any_import_order_runs_the_interpreted_kernels(first):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LABKIT_DEVICE"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", PROGRAM.format(first=first)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max error" in proc.stdout


def test_triton_interpret_0_keeps_the_compiler_and_falls_back():
    """TRITON_INTERPRET=0 on a CPU machine: kernels stay compilable (for ahead-of-time compiles), calls use the reference."""
    code = ("import labkit, triton.language as tl; from triton.runtime.jit import JITFunction; "
            "from labkit.kernels import triton_paged; print(labkit.RUNTIME.triton_mode, "
            "isinstance(triton_paged.paged_decode_kernel, JITFunction), isinstance(tl.zeros, JITFunction))")
    env = dict(os.environ, TRITON_INTERPRET="0", LABKIT_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         timeout=300).stdout
    assert out.split() == ["unavailable", "True", "True"]
