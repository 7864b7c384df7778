"""labkit.calibration: measured engine steps, a fitted device, and the engine on the wall clock."""

from __future__ import annotations

import numpy as np
import pytest

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.calibration import StepSample, fit_device, measure_steps, model_cost, serve_in_real_time
from labkit.costmodel import CostModel, Device
from labkit.engine import Engine
from labkit.model import Decoder, DecoderConfig
from labkit.workloads import RequestSpec

CONFIG = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


def synthetic_steps(cost: CostModel, rng: np.random.Generator) -> list[StepSample]:
    """Decode-like and prefill-like steps, timed by a known cost model."""
    out = []
    for _ in range(40):
        if rng.random() < 0.5:  # decodes: a few sequences with long histories
            batch = int(rng.integers(1, 16))
            new, context = batch, batch * int(rng.integers(100, 4000))
            pairs = context + batch
        else:  # a prompt chunk
            new, context = int(rng.integers(64, 2048)), 0
            pairs = new * (new + 1) / 2
        out.append(StepSample(new, context, pairs, cost.time_from_sums(new, context, pairs)))
    return out


def test_fit_recovers_a_known_device():
    shape_cost = model_cost(CONFIG, dtype_bytes=4)
    truth = CostModel(shape_cost, Device("truth", 1e9, memory_bandwidth=2e10, peak_flops=5e10), overhead_s=0.03)
    samples = synthetic_steps(truth, np.random.default_rng(0))
    device, overhead = fit_device(samples, shape_cost)
    fitted = CostModel(shape_cost, device, overhead_s=overhead)
    ratio = np.array([fitted.time_from_sums(s.new_tokens, s.context_tokens, s.pairs) / s.seconds for s in samples])
    assert np.abs(ratio - 1).max() < 0.1  # every step predicted within 10%
    assert 0.02 < overhead < 0.04
    assert 0.7 < device.peak_flops / 5e10 < 1.4  # the prefills pin the arithmetic rate


def test_model_cost_counts_the_decoder():
    cost = model_cost(CONFIG, dtype_bytes=4)
    decoder = Decoder(CONFIG)
    norms = sum(p.numel() for name, p in decoder.named_parameters() if "norm" in name)  # left out by the cost model
    assert cost.num_params + norms == sum(p.numel() for p in decoder.parameters())
    assert cost.shape.bytes_per_token() == 2 * 2 * 2 * 16 * 4


@pytest.fixture(scope="module")
def model():
    return Decoder.random(CONFIG, seed=0)


def specs(arrivals: list[float]) -> list[RequestSpec]:
    rng = np.random.default_rng(1)
    return [RequestSpec(i, t, rng.integers(0, 128, int(rng.integers(5, 30))).tolist(), int(rng.integers(2, 7)))
            for i, t in enumerate(arrivals)]


def engine(model) -> Engine:
    return Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=16, use_triton=False)


def test_measure_steps_times_every_step_and_its_sums(model):
    work = specs([0.0] * 4)
    samples = measure_steps(engine(model), work)
    prompt, outputs = sum(s.prompt_len for s in work), sum(s.output_len for s in work)
    assert sum(s.new_tokens for s in samples) == prompt + outputs - len(work)  # the last token is never fed back
    assert all(s.seconds > 0 and s.new_tokens <= 16 for s in samples)
    assert any(s.new_tokens == 16 for s in samples) and any(s.context_tokens > 0 for s in samples)


def test_serving_on_the_wall_clock(model):
    work = specs([0.0, 0.05, 0.1, 0.3])
    run = serve_in_real_time(engine(model), work)
    reference = engine(model).generate([s.prompt_token_ids for s in work], 6, eos_token_id=())
    assert run.outputs == [r[:s.output_len] for r, s in zip(reference, work)]
    assert (run.ttft > 0).all() and len(run.itl) == sum(s.output_len - 1 for s in work)
    assert (run.itl >= 0).all() and run.ttft_percentiles()["p50"] <= run.ttft_percentiles()["p90"]
    assert len(run.steps) >= max(s.output_len for s in work)


def test_bad_input():
    cost = model_cost(CONFIG, 4)
    with pytest.raises(ValueError, match="samples"):
        fit_device([StepSample(1, 0, 1.0, 0.1)] * 2, cost)
    with pytest.raises(ValueError, match="samples"):
        fit_device([StepSample(1, 0, 1.0, 0.0)] * 3, cost)
    with pytest.raises(ValueError, match="specs"):
        measure_steps(None, [])
    with pytest.raises(ValueError, match="specs"):
        serve_in_real_time(None, [])
