"""Every kernel launch compiled ahead of time for five GPU generations, on a machine without a GPU.

``benchmarks/kernels_static.py --subset`` records the launches labkit's public functions make
(CPU tensors, the launch intercepted: grid, arguments, constexprs, warps and stages as a GPU
would get them), compiles each with ``triton.compile`` for sm75, sm80, sm89 and sm90, and reads
registers and spills (ptxas), shared memory (kernel metadata) and the PTX. It runs once per test
session, in a subprocess: an interpreted kernel cannot be compiled, and this process interprets them.
The fifth generation, sm86, is not compiled again here: it gets sm89's launches (the same tile rules;
only fp8 differs), and in the committed full grid every one of its binaries measures as sm89's does
(``test_sm86_launches_and_compiles_as_sm89_does``); that saves a fifth of the compiles.
Static analysis only: nothing here says how fast a kernel runs.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "kernels_static.py"
COMMITTED = ROOT / "benchmarks" / "results" / "kernels_static.json"
GPUS = ["sm75", "sm80", "sm89", "sm90"]  # compiled here; sm86 is checked against sm89 (see the docstring)
SHARED_PER_BLOCK_KIB = {"sm75": 64, "sm80": 163, "sm86": 99, "sm89": 99, "sm90": 227}

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None or not sys.platform.startswith("linux"),
                                reason="ahead-of-time compiles need Triton's Linux wheel (it ships ptxas)")


def torch_dtype(name: str):
    """The dtype a case names ("fp16", "bf16", "fp32")."""
    import torch  # noqa: PLC0415

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def rows_of(doc: dict) -> list[dict]:
    """One row per launch: the results file lists each binary once and the launches by binary."""
    return [{**launch, **doc["binaries"][launch["binary"]]} for launch in doc["launches"]]


@pytest.fixture(scope="module")
def subset(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("kernels_static") / "subset.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--subset", "--workers", "2", "--gpus", *GPUS,
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.exists(), f"kernels_static.py wrote nothing:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    return {"meta": doc["meta"], "rows": rows_of(doc), "fallbacks": doc["fallbacks"]}


@pytest.mark.parametrize("gpu", GPUS)
def test_every_launch_compiles_fits_in_shared_memory_and_does_not_spill(subset, gpu):
    rows = [r for r in subset["rows"] if r["gpu"] == gpu]
    assert rows, f"no launch compiled for {gpu}"
    for r in rows:
        where = f"{gpu} {r['kernel']} [{r['case']}]"
        assert "error" not in r, f"{where}: {r.get('error')}"
        assert r["shared_bytes"] <= SHARED_PER_BLOCK_KIB[gpu] * 1024, f"{where}: {r['shared_bytes']} B of shared memory"
        assert r["spill_bytes"] == 0, f"{where}: {r['spill_bytes']} bytes of register spills ({r['registers']} registers)"
        assert r["registers"] <= 255 and r["problems"] == []


def test_the_subset_reaches_every_kernel_and_both_launch_rules(subset):
    rows = subset["rows"]
    assert {r["kernel"] for r in rows} == {"decode", "merge", "prefill", "write_kv", "write_kv_quant"}
    for gpu in GPUS:
        decode = [r for r in rows if r["gpu"] == gpu and r["kernel"] in ("decode", "prefill")]
        assert {r["upcast"] for r in decode} == ({True} if gpu == "sm75" else {True, False}), gpu
    # The launches were recorded from the public functions, not written down here: their tiles
    # are what labkit.kernels.launch.launch_settings chose for each target.
    from labkit.kernels.launch import launch_settings  # noqa: PLC0415

    for r in rows:
        if r["kernel"] == "decode":
            kind, dtype, d, *_ = r["case"].split()
            want = launch_settings("decode", torch_dtype(dtype), int(d[1:]),
                                   tuple(subset["meta"]["gpus"][r["gpu"]]["capability"]),
                                   quantized=kind not in ("decode", "decode_split"))
            assert (r["tiles"]["BLOCK_N"], r["num_warps"], r["num_stages"]) == \
                (want.block_n, want.num_warps, want.num_stages), r["case"]


def test_quantized_pools_compile_everywhere_but_fp8_before_sm89_which_names_its_fallback(subset):
    """Appendix A3's launches: int8/int4 decode and write on every GPU; fp8 only on sm89 and sm90 (Triton
    has no e4m3 below), and there the case is listed with the reference labkit runs instead."""
    rows = subset["rows"]
    for gpu in GPUS:
        kinds = {r["case"].split()[0] for r in rows if r["gpu"] == gpu}
        assert {"decode_int4_per_group", "write_kv_int8_per_block"} <= kinds, gpu
        assert ("decode_fp8_per_block" in kinds) == (gpu in ("sm89", "sm90")), gpu
    listed = {(f["gpu"], f["case"].split()[0]) for f in subset["fallbacks"]}
    assert listed == {(gpu, "decode_fp8_per_block") for gpu in ("sm75", "sm80")}
    assert all("the PyTorch reference (dequantize, then attend) runs instead" in f["fallback"]
               for f in subset["fallbacks"])


def test_sm86_launches_and_compiles_as_sm89_does(subset):
    """Why the subset skips sm86: today's launch rules give it sm89's tiles, and in the committed full grid
    (every case, compiled for all five) each sm86 binary has sm89's registers, spills, shared memory and
    instructions; only fp8, which Triton compiles from sm89, differs: sm86 lists its fallback instead."""
    from labkit.kernels.launch import launch_settings  # noqa: PLC0415

    cases = {r["case"] for r in subset["rows"] if r["gpu"] == "sm89" and r["kernel"] in ("decode", "prefill")}
    for case in cases:
        kind, dtype, d, *_ = case.split()
        quantized = kind not in ("decode", "decode_split", "prefill_long", "prefill_short")  # A3's pools
        for op, max_len in itertools.product(("decode", "prefill"), (16, 128, 4096)):  # short and long prefills
            on = [launch_settings(op, torch_dtype(dtype), int(d[1:]), cc, max_len, quantized=quantized)
                  for cc in ((8, 6), (8, 9))]
            assert on[0] == on[1], (case, op, max_len)
    committed = json.loads(COMMITTED.read_text())
    rows = rows_of(committed)
    sm89 = {(r["kernel"], r["case"]): r for r in rows if r["gpu"] == "sm89"}
    sm86 = [r for r in rows if r["gpu"] == "sm86"]
    assert {(r["kernel"], r["case"]) for r in sm86} == {k for k in sm89 if "fp8" not in k[1]}
    fields = ("registers", "spill_bytes", "stack_bytes", "shared_bytes", "num_warps", "num_stages", "tiles", "upcast",
              "load_widths", "tensor_core_ops", "fp32_fma", "problems")
    for r in sm86:
        assert {f: r[f] for f in fields} == {f: sm89[r["kernel"], r["case"]][f] for f in fields}, r["case"]
    assert {f["case"].split()[0] for f in committed["fallbacks"] if f["gpu"] == "sm86"} == \
        {k[1].split()[0] for k in sm89 if "fp8" in k[1]}


def test_bf16_on_a_t4_runs_on_fp32_units_and_on_tensor_cores_from_sm80(subset):
    """The compiled code behind labkit's bf16 decision: no tensor-core instruction on sm75, only float32 FMAs."""
    for r in subset["rows"]:
        if r["kernel"] in ("decode", "prefill") and " bf16 " in f" {r['case']} ":
            if r["gpu"] == "sm75":
                assert r["tensor_core_ops"] == 0 and r["fp32_fma"] > 0 and r["upcast"], r["case"]
            else:
                assert r["tensor_core_ops"] > 0 and not r["upcast"], (r["gpu"], r["case"])


def test_committed_table_matches_a_fresh_compile(subset):
    """benchmarks/results/kernels_static.json (read by chapter 03) says what the compiler says today."""
    committed = json.loads(COMMITTED.read_text())
    if committed["meta"]["triton"] != subset["meta"]["triton"]:  # e.g. a CUDA torch's own triton pin
        pytest.skip(f"{COMMITTED.name} was compiled with Triton {committed['meta']['triton']}, "
                    f"this is {subset['meta']['triton']}: the registers may differ")
    index = {(r["gpu"], r["kernel"], r["case"]): r for r in rows_of(committed)}
    fields = ("registers", "spill_bytes", "shared_bytes", "num_warps", "num_stages", "tiles", "occupancy")
    for r in subset["rows"]:
        key = (r["gpu"], r["kernel"], r["case"])
        assert key in index, f"{key} is missing from {COMMITTED.name}: run benchmarks/kernels_static.py"
        assert {f: index[key][f] for f in fields} == {f: r[f] for f in fields}, \
            f"{key} changed: run benchmarks/kernels_static.py and commit its results"


def test_triton_itself_has_no_tensor_core_path_on_sm75():
    """The evidence behind labkit's upcast on a T4: one 16-bit tl.dot, *not* upcast, compiled by Triton.

    labkit's sm75 launches upcast every load, so their zero tensor-core count alone would not
    show what Triton does. This kernel hands fp16 and bf16 tiles straight to tl.dot: on sm75 the
    PTX and SASS hold only float32 FMAs (no mma / HMMA), on sm80 the same source becomes mma.
    """
    committed = json.loads((ROOT / "benchmarks" / "results" / "bare_dot.json").read_text())
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bare_dot_{os.getpid()}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--bare-dot", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(out.read_text())
    out.unlink()
    rows = fresh["rows"]
    tile = rows[0]["tile"]
    for r in rows:
        if r["gpu"] == "sm75":  # every multiply-add of the tile on the FP32 units: M*N*K over 128 threads
            assert r["ptx_mma"] == r["sass_hmma"] == 0, r
            assert r["ptx_fma_f32"] == r["sass_ffma"] == tile ** 3 // 128, r
        else:
            assert r["ptx_mma"] > 0 and r["sass_hmma"] > 0 and r["ptx_fma_f32"] == 0, r
    if committed["meta"]["triton"] == fresh["meta"]["triton"]:  # chapter 03 prints the committed file
        assert committed["rows"] == rows, "run benchmarks/kernels_static.py --bare-dot and commit its result"
