"""labkit.device decides before kernels exist; exercise checkers never break a chapter."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import labkit
from labkit.device import RUNTIME, Runtime
from labkit.exercises import Exercises


def test_runtime_matches_the_machine():
    if torch.cuda.is_available() and os.environ.get("LABKIT_DEVICE") != "cpu":
        assert RUNTIME.device.type == "cuda"
    else:
        assert RUNTIME.device.type == "cpu"
        assert RUNTIME.triton_mode in ("interpreter", "unavailable")
        if RUNTIME.triton_mode == "interpreter":
            assert os.environ["TRITON_INTERPRET"] == "1"
    assert RUNTIME.reason and str(RUNTIME.device) in labkit.describe()


def test_import_labkit_alone_switches_the_interpreter_on():
    code = "import os, labkit; print(labkit.RUNTIME.triton_mode, os.environ.get('TRITON_INTERPRET'))"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LABKIT_DEVICE"] = "cpu"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    has_triton = importlib.util.find_spec("triton") is not None
    assert out.split() == (["interpreter", "1"] if has_triton else ["unavailable", "None"])


def test_old_gpus_get_a_fallback_not_a_crash():
    t4 = Runtime(torch.device("cuda"), "compiled", "T4", (7, 5))
    # A T4 runs bf16 kernels on its FP32 units (tests/test_kernels_static.py checks the compiled code).
    assert t4.kernels_can_run(torch.float16) and t4.kernels_can_run(torch.bfloat16)
    assert not t4.bf16_tensor_cores
    p100 = Runtime(torch.device("cuda"), "unavailable", "P100", (6, 0))
    assert not p100.kernels_can_run(torch.float16)
    h100 = Runtime(torch.device("cuda"), "compiled", "H100", (9, 0))
    assert h100.kernels_can_run(torch.bfloat16)


def test_checker_reports_not_solved_wrong_and_right(capsys):
    ex = Exercises("01_x")

    def verdict(call) -> str:
        assert call is None  # checkers print; a cell shows only the message
        return capsys.readouterr().out

    assert "not solved yet" in verdict(ex.check("e1", None, 3))
    assert "❌" in verdict(ex.check("e1", 4, 3))
    assert "✅" in verdict(ex.check("e1", 3, 3))
    assert "✅" in verdict(ex.check("e2", 0.1 + 0.2, 0.3, rel_tol=1e-9))

    def stub(x):
        raise NotImplementedError("your code here")

    out = verdict(ex.check_function("f", stub, [((1,), 2)]))
    assert "not solved yet" in out and "solutions/01_x.ipynb" in out
    assert "✅" in verdict(ex.check_function("f", lambda x: 2 * x, [((1,), 2), ((5,), 10)]))
    assert "❌" in verdict(ex.check_function("f", lambda x: x, [((1,), 2)]))


def test_behaviour_checker_runs_the_solution(capsys):
    ex = Exercises("05_x")

    def verify(policy) -> list[str]:
        order = sorted([3, 1, 2], key=policy)
        return [] if order == [1, 2, 3] else [f"served in the order {order}"]

    def stub(x):
        raise NotImplementedError

    assert ex.check_behaviour("b", None, verify) is None
    assert "not solved yet" in capsys.readouterr().out
    ex.check_behaviour("b", stub, verify)
    assert "not solved yet" in capsys.readouterr().out
    ex.check_behaviour("b", lambda x: -x, verify)
    out = capsys.readouterr().out
    assert "❌" in out and "[3, 2, 1]" in out
    ex.check_behaviour("b", lambda x: x, verify)
    assert "✅" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="served in the order"):
        Exercises("05_x", strict=True).check_behaviour("b", lambda x: -x, verify)


def test_strict_checker_raises():
    ex = Exercises("01_x", strict=True)
    with pytest.raises(AssertionError, match="not solved"):
        ex.check("e1", None, 3)
    with pytest.raises(AssertionError):
        ex.check("e1", 4, 3)
    ex.check("e1", 3, 3)  # passes without raising


@pytest.mark.parametrize("capability, mode, bf16", [((9, 0), "compiled", True), ((8, 0), "compiled", True),
                                                    ((7, 5), "compiled", True), ((6, 1), "unavailable", False)])
def test_gpu_decisions(monkeypatch, capability, mode, bf16):
    """What labkit decides on GPUs it has never seen here: each branch of _decide, with CUDA faked."""
    from labkit import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.delenv("LABKIT_DEVICE", raising=False)
    runtime = device._decide()
    assert runtime.device.type == "cuda" and runtime.triton_mode == mode
    assert runtime.bf16_supported is bf16
    assert runtime.bf16_tensor_cores is (capability >= (8, 0))
    assert runtime.kernels_can_run(torch.float16) is (mode == "compiled")
    assert "Fake GPU" in runtime.reason
    monkeypatch.setenv("LABKIT_DEVICE", "cpu")
    assert device._decide().device.type == "cpu"  # the reader can force the CPU
