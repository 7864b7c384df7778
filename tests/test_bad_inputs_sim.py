"""Bad inputs to the simulator's calibration side, refused (issue 38): one row a case.

The rows follow ``tests/test_bad_inputs.py`` (its ``run_case``: the exception type, the parameter
named in the message, the object and every argument unchanged). They cover what the issue lists for
``labkit.serving.sim`` (``measure``, ``fit``, ``realtime``, ``workloads``), the roofline's own
records (``costmodel``), and more of the same kind. Against the code before issue 38 every row here
fails: accepted, an AttributeError or TypeError from inside, a message that names no parameter, or
state changed (a request queued before a later one was refused).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.memory.capacity import TEACHING_MODEL
from labkit.serving.sim import costmodel, fit, measure, realtime, workloads
from labkit.serving.sim.measure import StepSample
from labkit.serving.sim.workloads import RequestSpec
from test_bad_inputs import On, busy_engine, idle_engine, run_case, tiny_config

nan, inf = math.nan, math.inf
CONFIG = tiny_config()
COST = fit.model_cost(CONFIG, 4)
SAMPLES = [StepSample(1, 0, 1.0, 0.1), StepSample(8, 0, 36.0, 0.3), StepSample(2, 10, 22.0, 0.12)]
SPEC = dict(request_id=0, arrival_time=0.0, prompt_token_ids=[1, 2, 3], output_len=2)
SAMPLE = dict(new_tokens=4, context_tokens=40, pairs=170.0, seconds=0.01, num_requests=4)
DEVICE = dict(name="d", memory_bytes=1e9, memory_bandwidth=1e11, peak_flops=1e12)
MODEL_COST = dict(shape=TEACHING_MODEL, hidden_size=4096, intermediate_size=14336, vocab_size=128256)


def spec(request_id: int = 0, arrival: float = 0.0, prompt: list[int] | None = None) -> RequestSpec:
    return RequestSpec(request_id, arrival, [1, 2, 3] if prompt is None else prompt, 2)


class NoChatTemplate:
    """A tokenizer without ``apply_chat_template`` (a base model's)."""

    def __call__(self, text, **kwargs):
        return {"input_ids": [1]}


CASES = [
    # ---- the issue's cases
    ("model_cost config None", fit.model_cost, (None, 4), {}, TypeError, "config"),
    ("fit_steps cost a model name", fit.fit_steps, (SAMPLES, "teaching model", 1e10), {}, TypeError, "cost"),
    ("measure_steps engine a string", measure.measure_steps, ("engine", [spec()]), {}, TypeError, "engine"),
    ("chat_requests tokenizer None", workloads.chat_requests, (None,), {}, TypeError, "tokenizer"),
    ("fit_device grid 0", fit.fit_device, (SAMPLES, COST), {"grid": 0}, ValueError, "grid"),
    # serve_in_real_time looped forever on a NaN arrival; now the spec cannot be built
    ("RequestSpec arrival nan", RequestSpec, (), SPEC | {"arrival_time": nan}, ValueError, "arrival_time"),
    # ---- RequestSpec checks its own arrival time
    ("RequestSpec arrival -5 s", RequestSpec, (), SPEC | {"arrival_time": -5.0}, ValueError, "arrival_time"),
    ("RequestSpec arrival inf", RequestSpec, (), SPEC | {"arrival_time": inf}, ValueError, "arrival_time"),
    ("RequestSpec arrival None", RequestSpec, (), SPEC | {"arrival_time": None}, ValueError, "arrival_time"),
    ("RequestSpec arrival a string", RequestSpec, (), SPEC | {"arrival_time": "0.5"}, ValueError, "arrival_time"),
    ("RequestSpec arrival a bool", RequestSpec, (), SPEC | {"arrival_time": True}, ValueError, "arrival_time"),
    # ---- workloads
    ("chat_requests tokenizer a string", workloads.chat_requests, ("smol",), {}, TypeError, "tokenizer"),
    ("chat_requests tokenizer without a chat template", workloads.chat_requests, (NoChatTemplate(),), {}, TypeError,
     "tokenizer"),
    ("poisson_arrivals rng None", workloads.poisson_arrivals, (3, 1.0, None), {}, TypeError, "rng"),
    ("poisson_arrivals rng a seed", workloads.poisson_arrivals, (3, 1.0, 0), {}, TypeError, "rng"),
    ("LengthProfile.sample rng None", On(lambda: workloads.SHAREGPT, "sample"), (3, None), {}, TypeError, "rng"),
    ("length_stats of ints", workloads.length_stats, ([1, 2],), {}, ValueError, "requests"),
    ("length_stats of dicts", workloads.length_stats, ([SPEC],), {}, ValueError, "requests"),
    # ---- measure: StepSample checks its fields
    ("StepSample new_tokens -1", StepSample, (), SAMPLE | {"new_tokens": -1}, ValueError, "new_tokens"),
    ("StepSample new_tokens 1.5", StepSample, (), SAMPLE | {"new_tokens": 1.5}, ValueError, "new_tokens"),
    ("StepSample context_tokens -1", StepSample, (), SAMPLE | {"context_tokens": -1}, ValueError, "context_tokens"),
    ("StepSample pairs nan", StepSample, (), SAMPLE | {"pairs": nan}, ValueError, "pairs"),
    ("StepSample seconds nan", StepSample, (), SAMPLE | {"seconds": nan}, ValueError, "seconds"),
    ("StepSample seconds inf", StepSample, (), SAMPLE | {"seconds": inf}, ValueError, "seconds"),
    ("StepSample seconds negative", StepSample, (), SAMPLE | {"seconds": -0.01}, ValueError, "seconds"),
    ("StepSample num_requests -1", StepSample, (), SAMPLE | {"num_requests": -1}, ValueError, "num_requests"),
    ("StepSample more requests than tokens", StepSample, (), SAMPLE | {"num_requests": 5}, ValueError,
     "num_requests"),
    # ---- measure: the engine and the specs, all checked before any request is queued
    ("measure_steps engine None", measure.measure_steps, (None, [spec()]), {}, TypeError, "engine"),
    ("measure_steps engine busy", measure.measure_steps, (busy_engine(), [spec()]), {}, ValueError, "engine"),
    ("measure_steps specs of ints", measure.measure_steps, (idle_engine(), [1, 2]), {}, ValueError, "specs"),
    ("measure_steps specs one RequestSpec", measure.measure_steps, (idle_engine(), spec()), {}, ValueError, "specs"),
    ("measure_steps specs a string", measure.measure_steps, (idle_engine(), "abc"), {}, ValueError, "specs"),
    ("measure_steps token outside the vocabulary, second spec", measure.measure_steps,
     (idle_engine(), [spec(), spec(1, prompt=[1, 500])]), {}, ValueError, "prompt_token_ids"),
    ("timed_step engine a string", measure.timed_step, ("engine",), {}, TypeError, "engine"),
    # ---- realtime
    ("serve_in_real_time engine a string", realtime.serve_in_real_time, ("engine", [spec()]), {}, TypeError, "engine"),
    ("serve_in_real_time engine busy", realtime.serve_in_real_time, (busy_engine(), [spec()]), {}, ValueError,
     "engine"),
    ("serve_in_real_time specs of ints", realtime.serve_in_real_time, (idle_engine(), [1, 2]), {}, ValueError, "specs"),
    ("serve_in_real_time specs one RequestSpec", realtime.serve_in_real_time, (idle_engine(), spec()), {}, ValueError,
     "specs"),
    ("serve_in_real_time duplicate request_id", realtime.serve_in_real_time, (idle_engine(), [spec(), spec()]), {},
     ValueError, "request_id"),
    ("serve_in_real_time token outside the vocabulary, second spec", realtime.serve_in_real_time,
     (idle_engine(), [spec(), spec(1, prompt=[1, 500])]), {}, ValueError, "prompt_token_ids"),
    # ---- fit
    ("model_cost config a dict", fit.model_cost, (vars(CONFIG).copy(), 4), {}, TypeError, "config"),
    ("model_cost dtype_bytes 3", fit.model_cost, (CONFIG, 3), {}, ValueError, "dtype_bytes"),
    ("model_cost name an int", fit.model_cost, (CONFIG, 4), {"name": 5}, ValueError, "name"),
    ("fit_steps samples an iterator", fit.fit_steps, (iter(SAMPLES), COST, 1e10), {}, ValueError, "samples"),
    ("fit_steps samples of tuples", fit.fit_steps, ([(1, 0, 1.0, 0.1)] * 3, COST, 1e10), {}, ValueError, "samples"),
    ("fit_steps samples None", fit.fit_steps, (None, COST, 1e10), {}, ValueError, "samples"),
    ("fit_steps name an int", fit.fit_steps, (SAMPLES, COST, 1e10), {"name": 5}, ValueError, "name"),
    ("fit_steps name empty", fit.fit_steps, (SAMPLES, COST, 1e10), {"name": ""}, ValueError, "name"),
    ("fit_device grid 1", fit.fit_device, (SAMPLES, COST), {"grid": 1}, ValueError, "grid"),
    ("fit_device grid 1.5", fit.fit_device, (SAMPLES, COST), {"grid": 1.5}, ValueError, "grid"),
    ("fit_device cost None", fit.fit_device, (SAMPLES, None), {}, TypeError, "cost"),
    ("fit_device samples of ints", fit.fit_device, ([1, 2, 3], COST), {}, ValueError, "samples"),
    ("fit_device samples a string", fit.fit_device, ("abc", COST), {}, ValueError, "samples"),
    # ---- costmodel: the roofline's records check their fields
    ("Device bandwidth inf", costmodel.Device, (), DEVICE | {"memory_bandwidth": inf}, ValueError,
     "memory_bandwidth"),
    ("Device peak_flops inf", costmodel.Device, (), DEVICE | {"peak_flops": inf}, ValueError, "peak_flops"),
    ("Device name an int", costmodel.Device, (), DEVICE | {"name": 5}, ValueError, "name"),
    ("ModelCost hidden_size 0", costmodel.ModelCost, (), MODEL_COST | {"hidden_size": 0}, ValueError, "hidden_size"),
    ("ModelCost vocab_size 1.5", costmodel.ModelCost, (), MODEL_COST | {"vocab_size": 1.5}, ValueError, "vocab_size"),
    ("ModelCost shape a name", costmodel.ModelCost, (), MODEL_COST | {"shape": "teaching model"}, TypeError, "shape"),
    ("ModelCost tie a string", costmodel.ModelCost, (), MODEL_COST | {"tie_word_embeddings": "no"}, ValueError,
     "tie_word_embeddings"),
    ("CostModel model an int", costmodel.CostModel, (5,), {}, TypeError, "model"),
    ("CostModel device a dict", costmodel.CostModel, ("teaching model", DEVICE), {}, TypeError, "device"),
]


@pytest.mark.parametrize("label, call, args, kwargs, exc, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused(label, call, args, kwargs, exc, param):
    run_case(call, args, kwargs, exc, param)


def test_the_table_covers_the_issue_and_has_unique_labels():
    assert len({c[0] for c in CASES}) == len(CASES)
    modules = {(c[1].factory if isinstance(c[1], On) else c[1]).__module__ for c in CASES}
    assert {"labkit.serving.sim.measure", "labkit.serving.sim.fit", "labkit.serving.sim.realtime",
            "labkit.serving.sim.workloads", "labkit.serving.sim.costmodel"} <= modules


def test_good_inputs_still_work():
    """The checks refuse only what is wrong: the same calls with good values run."""
    assert RequestSpec(**SPEC).arrival_time == 0.0 and RequestSpec(**SPEC | {"arrival_time": 3}).arrival_time == 3
    assert StepSample(**SAMPLE).is_decode and StepSample(0, 0, 0.0, 0.0).num_requests == 0
    assert len(workloads.poisson_arrivals(3, 1.0, np.random.default_rng(0))) == 3
    assert fit.model_cost(CONFIG, 2, name="tiny").shape.dtype_bytes == 2
    device, overhead = fit.fit_device(SAMPLES, COST, grid=2)
    assert device.memory_bandwidth > 0 and overhead >= 0
    assert costmodel.CostModel(COST, costmodel.Device(**DEVICE)).device.name == "d"
