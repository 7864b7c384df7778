"""labkit.kernels.device decides before kernels exist; exercise checkers never break a chapter."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import labkit
from labkit.kernels.device import RUNTIME, Runtime
from labkit.teaching.exercises import Exercises


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
    from labkit.kernels import device

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


def test_checker_turns_any_error_into_a_verdict(capsys):
    """A bug in the reader's code gives a ❌ with the error and the hint, not a traceback."""
    ex = Exercises("03_x")

    def crashes(x):
        return [1, 2][x]

    ex.check_function("f", crashes, [((5,), 1)], hint="mind the range")
    out = capsys.readouterr().out
    assert "❌" in out and "IndexError" in out and "mind the range" in out
    ex.check_behaviour("b", lambda x: 1 / 0, lambda fn: [] if fn(1) else ["no"], hint="h")
    out = capsys.readouterr().out
    assert "❌" in out and "ZeroDivisionError" in out
    with pytest.raises(AssertionError, match="KeyError"):
        Exercises("03_x", strict=True).check_function("f", lambda x: {}[x], [((1,), 1)])


def _library_twice(x):
    return 2 * x


def test_checker_refuses_the_library_function_under_any_name(capsys):
    """forbid=: the function itself, a wrapper around it, or a helper that calls it all get a ❌;
    a checker computing its expectation with the same function does not."""
    ex = Exercises("04_x")
    cases = [((1,), 2), ((3,), 6)]
    renamed = _library_twice

    def helper(x):
        return _library_twice(x)

    def via_helper(x):
        return helper(x) + 0

    for answer in (renamed, lambda x: _library_twice(x), via_helper):
        ex.check_function("f", answer, cases, forbid=[_library_twice])
        out = capsys.readouterr().out
        assert "❌" in out and "_library_twice" in out and "write it yourself" in out
    ex.check_function("f", lambda x: x + x, cases, forbid=[_library_twice])
    assert "✅" in capsys.readouterr().out

    def verify(fn):  # the checker may call the library function itself
        return [] if all(fn(x) == _library_twice(x) for x in range(4)) else ["wrong"]

    ex.check_behaviour("b", lambda x: x + x, verify, forbid=[_library_twice])
    assert "✅" in capsys.readouterr().out
    ex.check_behaviour("b", lambda x: _library_twice(x), verify, forbid=[_library_twice])
    assert "❌" in capsys.readouterr().out
    import sys
    assert sys.getprofile() is None  # nothing left watching calls
