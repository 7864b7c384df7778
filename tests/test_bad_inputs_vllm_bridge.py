"""Bad inputs to the vLLM bridge, refused (issue 38): one row a case, without vLLM installed.

The rows follow ``tests/test_bad_inputs.py`` (its ``run_case``: the exception type, the parameter
named in the message, the object and every argument unchanged). They cover ``labkit.vllm_bridge``'s
``real`` (engine arguments, the offline runs, the server, the benchmark, the recorded steps),
``record`` (the committed record of the real runs), ``compare`` (labkit's side of the comparison)
and the one pure function of the ``driver`` that vLLM's Python runs. The standard: every argument is
checked before anything is used or written, and before the check whether vLLM is set up here, so a
wrong call says what is wrong on any machine. Against the code before issue 38 every row here fails:
accepted, a KeyError or AttributeError from inside, "vLLM is not set up" before the arguments were
read, a message that names no parameter, or state changed.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.vllm_bridge import compare, driver, real, record
from test_bad_inputs import busy_engine, idle_engine, run_case  # (no row here acts on a method, so no On)

nan, inf = math.nan, math.inf
# Every row that could write the record points here; a refused call must leave the folder empty.
SCRATCH = Path(tempfile.mkdtemp(prefix="labkit-bridge-rows-"))
RECORD = SCRATCH / "data" / "record.json"

ENGINE = dict(block_size=32, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)  # engine_args' values
RUN = dict(engine=ENGINE, prompts=[[1, 2, 3], [4, 5]], max_tokens=[4, 4])
BENCH = dict(request_rate=1.0, num_prompts=4, input_len=16, output_len=8)
STEP = dict(new_tokens=4, context_tokens=40, pairs=170.0, seconds=0.01, num_requests=4)
COLUMNS = {k: [v, v] for k, v in STEP.items()}
ENTRY = dict(inputs={"rate": 0.5}, date="2026-12-01T17:40:20+00:00", machine={"cores": 2}, result={"x": 1})
VLLM_STEPS = [{"scheduled": {"0-a4607f2b": 32, "1-a4607f2b": 32}, "preempted": []},
              {"scheduled": {"0-a4607f2b": 1}, "preempted": ["1-a4607f2b"]}]


def unstarted_server() -> real.Server:
    """A ``Server`` as its ``with`` block would find it, never started (no vLLM needed)."""
    server = object.__new__(real.Server)
    server.process = None
    return server


def run(**changes) -> dict:
    return RUN | changes


def step(**changes) -> dict:
    return STEP | changes


def entry(**changes) -> dict:
    return ENTRY | changes


def without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def entered(variables):
    """The driver's ``environment`` as its ``with`` statement uses it: the check runs on entering."""
    with driver.environment(variables):
        pass


def never_run() -> dict:
    raise AssertionError("a refused call must not make a run")


CASES = [
    # ---- the issue's cases
    ("engine_args block 16 (CPU attention needs a multiple of 32)", real.engine_args, (), {"block_size": 16},
     ValueError, "block_size"),
    ("run_offline no runs, before 'vLLM is not set up'", real.run_offline, ([],), {}, ValueError, "runs"),
    ("run_offline max_tokens 0", real.run_offline, ([run(max_tokens=[4, 0])],), {}, ValueError, "max_tokens"),
    ("run_offline max_tokens a string", real.run_offline, ([run(max_tokens=[4, "8"])],), {}, ValueError,
     "max_tokens"),
    ("bench_serve server None, num_prompts 0", real.bench_serve, (None,), BENCH | {"num_prompts": 0}, ValueError,
     "num_prompts"),
    ("bench_serve server None", real.bench_serve, (None,), BENCH, TypeError, "server"),
    ("vllm_schedule a dict of counts", compare.vllm_schedule, ({"abc": 1},), {}, ValueError, "steps"),
    ("save_record entry without inputs", record.save_record, ("s", without(ENTRY, "inputs"), RECORD), {},
     ValueError, "inputs"),
    ("step_samples a step without pairs", real.step_samples, ([without(STEP, "pairs")],), {}, ValueError, "pairs"),
    ("step_samples columns without seconds", real.step_samples, (without(COLUMNS, "seconds"),), {}, ValueError,
     "seconds"),
    # ---- real: engine arguments and the offline runs, all checked before vLLM is looked for
    ("engine_args block 48", real.engine_args, (), {"block_size": 48}, ValueError, "block_size"),
    ("engine_args batched tokens below max_num_seqs", real.engine_args, (),
     {"max_num_seqs": 256, "max_num_batched_tokens": 128}, ValueError, "max_num_batched_tokens"),
    ("run_offline runs a dict", real.run_offline, (RUN,), {}, ValueError, "runs"),
    ("run_offline a run that is a string", real.run_offline, (["engine"],), {}, TypeError, "runs[0]"),
    ("run_offline a run without engine", real.run_offline, ([without(RUN, "engine")],), {}, ValueError, "engine"),
    ("run_offline a misspelt key", real.run_offline, ([run(max_tokns=[4, 4])],), {}, ValueError, "max_tokns"),
    ("run_offline one count for two prompts", real.run_offline, ([run(max_tokens=[4])],), {}, ValueError,
     "max_tokens"),
    ("run_offline a negative token id", real.run_offline, ([run(prompts=[[1, -2], [4, 5]])],), {}, ValueError,
     "prompts"),
    ("run_offline an empty prompt", real.run_offline, ([run(prompts=[[], [4, 5]])],), {}, ValueError, "prompts"),
    ("run_offline a prompt as long as max_model_len", real.run_offline,
     ([run(prompts=[list(range(64)), [4, 5]])],), {}, ValueError, "max_model_len"),
    ("run_offline ignore_eos 'yes'", real.run_offline, ([run(ignore_eos="yes")],), {}, ValueError, "ignore_eos"),
    ("run_offline env value a number", real.run_offline, ([run(env={"VLLM_ENABLE_V1_MULTIPROCESSING": 0})],), {},
     ValueError, "env"),
    ("run_offline kv_cache_gib 0", real.run_offline, ([RUN],), {"kv_cache_gib": 0}, ValueError, "kv_cache_gib"),
    ("run_offline timeout 0 s", real.run_offline, ([RUN],), {"timeout_s": 0}, ValueError, "timeout_s"),
    # ---- real: the server and the benchmark
    ("Server block 16", real.Server, (), {"block_size": 16}, ValueError, "block_size"),
    ("Server kv_cache_gib 0", real.Server, (), {"kv_cache_gib": 0}, ValueError, "kv_cache_gib"),
    ("Server start timeout nan", real.Server, (), {"start_timeout_s": nan}, ValueError, "start_timeout_s"),
    ("bench_serve a server never started", real.bench_serve, (unstarted_server(),), BENCH, ValueError, "server"),
    ("bench_serve range_ratio 1", real.bench_serve, (None,), BENCH | {"range_ratio": 1.0}, ValueError,
     "range_ratio"),
    ("bench_serve seed -1", real.bench_serve, (None,), BENCH | {"seed": -1}, ValueError, "seed"),
    ("bench_serve output_len 0", real.bench_serve, (None,), BENCH | {"output_len": 0}, ValueError, "output_len"),
    # ---- real: recorded steps
    ("step_samples steps None", real.step_samples, (None,), {}, TypeError, "steps"),
    ("step_samples columns of two lengths", real.step_samples, (COLUMNS | {"pairs": [1.0]},), {}, ValueError,
     "steps"),
    ("step_samples new_tokens -1", real.step_samples, ([step(new_tokens=-1)],), {}, ValueError, "new_tokens"),
    ("step_samples seconds nan", real.step_samples, ([step(seconds=nan)],), {}, ValueError, "seconds"),
    ("step_samples num_requests 2.5", real.step_samples, ([step(num_requests=2.5)],), {}, ValueError,
     "num_requests"),
    # ---- record: nothing is read or written before the entry is checked
    ("save_record section 'history'", record.save_record, ("history", ENTRY, RECORD), {}, ValueError, "section"),
    ("save_record entry a list", record.save_record, ("s", [ENTRY], RECORD), {}, TypeError, "entry"),
    ("save_record entry without result", record.save_record, ("s", without(ENTRY, "result"), RECORD), {},
     ValueError, "result"),
    ("save_record inputs with NaN", record.save_record, ("s", entry(inputs={"rate": nan}), RECORD), {}, ValueError,
     "inputs"),
    ("save_record date without a zone", record.save_record, ("s", entry(date="2026-12-01T17:40:20"), RECORD), {},
     ValueError, "date"),
    ("save_record date 'yesterday'", record.save_record, ("s", entry(date="yesterday"), RECORD), {}, ValueError,
     "date"),
    ("recorded_run inputs with NaN", record.recorded_run, ("s", {"rate": nan}, never_run), {"path": RECORD},
     ValueError, "inputs"),
    ("recorded_run inputs a list", record.recorded_run, ("s", [0.5], never_run), {"path": RECORD}, TypeError,
     "inputs"),
    ("recorded_run inputs not JSON", record.recorded_run, ("s", {"rate": {0.5}}, never_run), {"path": RECORD},
     TypeError, "inputs"),
    ("recorded_run run None", record.recorded_run, ("s", {"rate": 0.5}, None), {"path": RECORD}, TypeError, "run"),
    ("recorded_run rerun 'no'", record.recorded_run, ("s", {"rate": 0.5}, never_run),
     {"rerun": "no", "path": RECORD}, ValueError, "rerun"),
    ("recorded_run fresh_s -1", record.recorded_run, ("s", {"rate": 0.5}, never_run),
     {"fresh_s": -1, "path": RECORD}, ValueError, "fresh_s"),
    ("recorded_run section empty", record.recorded_run, ("", {"rate": 0.5}, never_run), {"path": RECORD},
     ValueError, "section"),
    # ---- compare: vLLM's steps, and labkit's engine checked before a request is queued
    ("vllm_schedule a request id without its prompt index", compare.vllm_schedule,
     ([{"scheduled": {"abc-1": 3}, "preempted": []}],), {}, ValueError, "steps"),
    ("vllm_schedule a step without preempted", compare.vllm_schedule, ([{"scheduled": {"0-a": 3}}],), {},
     ValueError, "steps"),
    ("vllm_schedule 0 tokens scheduled", compare.vllm_schedule, ([{"scheduled": {"0-a": 0}, "preempted": []}],),
     {}, ValueError, "scheduled"),
    ("chat_workload tokenizer None", compare.chat_workload, (None,), {}, TypeError, "tokenizer"),
    ("serve_with_engine engine None", compare.serve_with_engine, (None, [[1, 2]], [2]), {}, TypeError, "engine"),
    ("serve_with_engine a busy engine", compare.serve_with_engine, (busy_engine(), [[1, 2]], [2]), {}, ValueError,
     "engine"),
    ("serve_with_engine the second prompt out of the vocabulary", compare.serve_with_engine,
     (idle_engine(), [[1, 2], [1, 99]], [2, 2]), {}, ValueError, "prompts[1]"),
    ("serve_with_engine max_tokens 0", compare.serve_with_engine, (idle_engine(), [[1, 2]], [0]), {}, ValueError,
     "max_tokens[0]"),
    ("serve_with_engine two counts for one prompt", compare.serve_with_engine, (idle_engine(), [[1, 2]], [2, 2]), {},
     ValueError, "max_tokens"),
    # ---- the driver (vLLM's Python runs it; this function imports nothing of vLLM)
    ("driver environment a number as a value", entered, ({"LABKIT_ROW_A": "1", "LABKIT_ROW_B": 1},), {},
     ValueError, "variables"),
]


@pytest.fixture(autouse=True)
def empty_scratch():
    """Each test starts with the scratch folder empty (a row that wrongly wrote cannot disturb the next);
    the folder goes once the last test is done."""
    shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir()
    yield SCRATCH


@pytest.fixture(scope="module", autouse=True)
def remove_scratch():
    yield
    shutil.rmtree(SCRATCH, ignore_errors=True)


@pytest.mark.parametrize("label, call, args, kwargs, exc, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused(label, call, args, kwargs, exc, param):
    environ = dict(os.environ)
    run_case(call, args, kwargs, exc, param)
    assert list(SCRATCH.rglob("*")) == [], "a refused call wrote the record"
    assert dict(os.environ) == environ, "a refused call changed the environment"


def test_the_table_covers_the_issue_and_has_unique_labels():
    assert len({c[0] for c in CASES}) == len(CASES)
    calls = {c[1] for c in CASES}
    for fn in (real.engine_args, real.run_offline, real.bench_serve, real.step_samples, real.Server,
               compare.vllm_schedule, compare.serve_with_engine, record.save_record, record.recorded_run):
        assert fn in calls, fn.__name__
    assert len(CASES) >= 10 + 8


def test_good_inputs_still_work(tmp_path):
    """The same calls with good values: refusing the rows above did not refuse these."""
    assert real.engine_args(**ENGINE)["block_size"] == 32
    assert real.engine_args(block_size=64)["max_num_batched_tokens"] == 2048
    assert [s.pairs for s in real.step_samples([STEP, STEP])] == [170.0, 170.0]
    assert real.step_samples(COLUMNS) == real.step_samples([STEP, STEP])
    assert real.step_samples([]) == []
    assert compare.vllm_schedule(VLLM_STEPS) == ([{0: 32, 1: 32}, {0: 1}], [[], [1]])
    path = tmp_path / "record.json"
    record.save_record("s", ENTRY, path)
    assert record.load_record(path)["s"] == ENTRY
    assert record.recorded_run("s", {"rate": 0.5}, never_run, rerun=False, path=path) == ENTRY
    ours = compare.serve_with_engine(idle_engine(), [[1, 2, 3], [4, 5]], [2, 3])
    assert [len(o) for o in ours["outputs"]] == [2, 3]  # the tiny model has no EOS: each runs to its count
    assert ours["num_cached_tokens"] == [0, 0] and ours["schedule"][0] == {0: 3, 1: 2}
    with driver.environment({"LABKIT_ROW_C": "1"}):
        assert os.environ["LABKIT_ROW_C"] == "1"
    assert "LABKIT_ROW_C" not in os.environ


def test_the_arguments_are_checked_before_whether_vllm_is_here():
    """Good arguments reach the one check left, vLLM's presence: the bad ones above were refused sooner."""
    if real.is_available():
        pytest.skip("vLLM is set up here: these calls would start it")
    with pytest.raises(RuntimeError, match="vLLM is not set up"):
        real.run_offline([RUN])
    with pytest.raises(RuntimeError, match="vLLM is not set up"):
        real.Server(**ENGINE)
