"""Bad input to ``labkit.model.prepack`` (issue 38) and ``labkit.model.fused`` (issue 43) refused: one row a case, checked by
``tests/test_bad_inputs.py``'s ``run_case`` (the exception, the parameter named in its message, and
the model and arguments unchanged). A refused ``prepack`` also packs no layer, which the snapshot
(weights only) cannot see: the last test checks it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.model import fused, prepack
from labkit.model.decoder import Decoder, DecoderConfig
from test_bad_inputs import run_case

pytestmark = pytest.mark.skipif(not prepack.available(), reason="this PyTorch has no oneDNN")


def two_layers(part: str | None = None, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Two linear layers; the second one's ``part`` ("weight" or "bias"), if given, in ``dtype``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if part is not None:
        setattr(model[2], part, nn.Parameter(getattr(model[2], part).detach().to(dtype)))
    return model


CASES = [
    # ---- the model: a module, float32 on the CPU, weight and bias alike
    ("prepack model str", prepack.prepack, ("model",), {}, ValueError, "model"),
    ("prepack model None", prepack.prepack, (None,), {}, ValueError, "model"),
    ("prepack model a tensor", prepack.prepack, (torch.zeros(4, 4),), {}, ValueError, "model"),
    ("prepack model the class nn.Linear", prepack.prepack, (nn.Linear,), {}, ValueError, "model"),
    ("prepack model a list of modules", prepack.prepack, ([nn.Linear(4, 4)],), {}, ValueError, "model"),
    ("prepack bias float64", prepack.prepack, (two_layers("bias", torch.float64),), {}, ValueError, "2.bias"),
    ("prepack bias float16", prepack.prepack, (two_layers("bias", torch.float16),), {}, ValueError, "2.bias"),
    ("prepack weight float64", prepack.prepack, (two_layers("weight", torch.float64),), {}, ValueError, "2.weight"),
    ("prepack weight bfloat16", prepack.prepack, (two_layers("weight", torch.bfloat16),), {}, ValueError, "2.weight"),
    ("prepack a lone float64 layer", prepack.prepack, (nn.Linear(4, 4).double(),), {}, ValueError, "model.weight"),
    # ---- batch_size: an integer in [1, 4096]
    ("prepack batch_size 0", prepack.prepack, (two_layers(),), {"batch_size": 0}, ValueError, "batch_size"),
    ("prepack batch_size -1", prepack.prepack, (two_layers(),), {"batch_size": -1}, ValueError, "batch_size"),
    ("prepack batch_size 4097", prepack.prepack, (two_layers(),), {"batch_size": 4097}, ValueError, "batch_size"),
    ("prepack batch_size True", prepack.prepack, (two_layers(),), {"batch_size": True}, ValueError, "batch_size"),
    ("prepack batch_size 2.5", prepack.prepack, (two_layers(),), {"batch_size": 2.5}, ValueError, "batch_size"),
    ("prepack batch_size str", prepack.prepack, (two_layers(),), {"batch_size": "16"}, ValueError, "batch_size"),
    ("prepack batch_size None", prepack.prepack, (two_layers(),), {"batch_size": None}, ValueError, "batch_size"),
    ("prepack batch_size numpy 0", prepack.prepack, (two_layers(),), {"batch_size": np.int64(0)}, ValueError,
     "batch_size"),
    # ---- unpack and is_packed take a module too
    ("unpack model str", prepack.unpack, ("model",), {}, ValueError, "model"),
    ("unpack model a state_dict", prepack.unpack, (nn.Linear(4, 4).state_dict(),), {}, ValueError, "model"),
    ("is_packed model None", prepack.is_packed, (None,), {}, ValueError, "model"),
    ("is_packed model a list of modules", prepack.is_packed, ([nn.Linear(4, 4)],), {}, ValueError, "model"),
    # ---- fused: chapter 01's Decoder only (its layers are what it stacks)
    *[(f"{call.__name__} model {label}", call, (bad,), {}, ValueError, "model")
      for call in (fused.fuse, fused.unfuse, fused.is_fused, fused.prepare, fused.can_prepare, fused.unprepare,
                   fused.is_prepared)
      for label, bad in (("None", None), ("str", "model"), ("an nn.Linear", nn.Linear(4, 4)),
                         ("transformers-like Sequential", two_layers()),
                         ("a list of decoders", [Decoder(DecoderConfig(num_hidden_layers=1))]))],
]


@pytest.mark.parametrize("label, call, args, kwargs, exc, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused(label, call, args, kwargs, exc, param):
    run_case(call, args, kwargs, exc, param)


def test_labels_are_unique():
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("part, dtype", [("bias", torch.float64), ("weight", torch.float64), (None, None)])
def test_a_refused_prepack_packs_no_layer(part, dtype):
    model = two_layers(part, dtype)
    with pytest.raises(ValueError):
        prepack.prepack(model, batch_size=0 if part is None else 16)
    assert not prepack.is_packed(model)
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
