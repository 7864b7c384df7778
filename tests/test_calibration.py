"""labkit.serving.sim: measured engine steps, a fitted device, and the engine on the wall clock."""

from __future__ import annotations

import numpy as np
import pytest

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.serving.engine import Engine
from labkit.serving.sim.costmodel import CostModel, Device
from labkit.serving.sim.fit import StepFit, fit_device, fit_steps, model_cost
from labkit.serving.sim.measure import StepSample, measure_step_grid, measure_steps, measure_stream_bandwidth
from labkit.serving.sim.realtime import serve_in_real_time
from labkit.serving.sim.workloads import RequestSpec, chat_requests

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
    with pytest.raises(TypeError, match="engine"):  # the engine is checked first, the specs next
        measure_steps(None, [])
    with pytest.raises(TypeError, match="engine"):
        serve_in_real_time(None, [])


def test_bad_specs_leave_the_engine_idle(model):
    """Every spec is checked before any is queued: a bad one (a token outside the vocabulary) leaves nothing."""
    for run in (measure_steps, serve_in_real_time):
        e = engine(model)
        with pytest.raises(ValueError, match="specs"):
            run(e, [])
        with pytest.raises(ValueError, match="prompt_token_ids"):
            run(e, specs([0.0]) + [RequestSpec(1, 0.0, [1, 500], 2)])
        assert not e.has_unfinished() and not e.scheduler.requests
    busy = engine(model)
    busy.add_request([1, 2, 3], 2)
    with pytest.raises(ValueError, match="engine must be idle"):
        measure_steps(busy, specs([0.0]))


def test_serving_on_the_wall_clock_refuses_a_nan_arrival(model):
    """Issue 38, bug 5: before the fix a NaN arrival was accepted by ``RequestSpec`` and
    ``serve_in_real_time`` waited for it forever (no clock reading is >= NaN). Now the spec refuses it."""
    import signal

    def boom(*_):
        raise TimeoutError("serve_in_real_time did not return")
    signal.signal(signal.SIGALRM, boom)
    signal.alarm(10)
    try:
        with pytest.raises(ValueError, match="arrival_time"):
            work = specs([0.0]) + [RequestSpec(1, float("nan"), [1, 2, 3], 2)]
            serve_in_real_time(engine(model), work)
    finally:
        signal.alarm(0)


# --------------------------------------------------------------------------- the bandwidth, measured and pinned


def test_stream_bandwidth_is_a_plausible_memory_rate():
    bandwidth = measure_stream_bandwidth(64 * 2**20, repeats=3)
    assert 1e9 < bandwidth < 1e12  # between 1 GB/s and 1 TB/s: a CPU's memory, not its cache or a timer glitch
    with pytest.raises(ValueError, match="nbytes"):
        measure_stream_bandwidth(1000)
    with pytest.raises(ValueError, match="repeats"):
        measure_stream_bandwidth(2**20, repeats=0)


def test_pinned_fit_keeps_the_bandwidth_and_finds_the_rest():
    shape_cost = model_cost(CONFIG, dtype_bytes=4)
    truth = CostModel(shape_cost, Device("truth", 1e9, memory_bandwidth=2e10, peak_flops=5e10), overhead_s=0.03)
    samples = synthetic_steps(truth, np.random.default_rng(0))
    fit = fit_steps(samples, shape_cost, memory_bandwidth=2e10)
    assert fit.device.memory_bandwidth == 2e10  # pinned, not fitted
    assert 0.9 < fit.device.peak_flops / 5e10 < 1.1 and abs(fit.overhead_s - 0.03) < 0.002
    assert np.abs(fit.residuals / fit.measured).max() < 0.05
    assert np.allclose(fit.predicted, [truth.time_from_sums(s.new_tokens, s.context_tokens, s.pairs) for s in samples],
                       rtol=0.05)
    # a wrong bandwidth is not repaired by the fit: the residuals show it
    wrong = fit_steps(samples, shape_cost, memory_bandwidth=2e8)  # a hundred times too slow
    assert wrong.device.memory_bandwidth == 2e8 and np.abs(wrong.residuals / wrong.measured).max() > 0.1
    assert fit_device(samples, shape_cost, grid=512, memory_bandwidth=2e10) == (fit.device, fit.overhead_s)
    with pytest.raises(ValueError, match="memory_bandwidth"):
        fit_steps(samples, shape_cost, memory_bandwidth=0.0)


def test_weight_read_share_of_a_decode_step():
    cost = model_cost(CONFIG, dtype_bytes=4)
    device = Device("d", 1e9, memory_bandwidth=cost.weight_bytes / 0.01, peak_flops=1e12)  # 10 ms per weight read
    decode = [StepSample(4, 400, 404.0, 0.04, num_requests=4)] * 3  # 40 ms steps: a quarter is the weight read
    prefill = [StepSample(64, 0, 2080.0, 0.5, num_requests=1)]
    fit = StepFit(device, 0.03, tuple(decode + prefill), cost)
    assert fit.weight_read_s == pytest.approx(0.01)
    assert fit.weight_read_share() == pytest.approx(0.25)
    assert [s.is_decode for s in fit.samples] == [True, True, True, False]


def test_measured_steps_record_their_requests(model):
    samples = measure_steps(engine(model), specs([0.0] * 3))
    assert all(1 <= s.num_requests <= 3 for s in samples) and any(s.is_decode for s in samples)


# --------------------------------------------------------------------------- the calibration's chosen steps


def grid_engine(model, **kwargs) -> Engine:
    return Engine(model, **({"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 16} | kwargs))


def test_step_grid_runs_exactly_the_chosen_steps(model):
    """Each batch size: one step with all the prompts, then ``decode_steps`` decodes of the whole batch (the
    history one token longer each time); each chunk length: one step of that many new tokens, nothing cached;
    the whole grid ``rounds`` times. The untimed first step is not among the samples, and the engine is idle
    again at the end."""
    e = grid_engine(model)
    samples = measure_step_grid(e, batch_sizes=(1, 3, 4), chunk_lens=(5, 9), decode_steps=2, prompt_len=3, rounds=2)
    one_round = []
    for b in (1, 3, 4):
        one_round.append((3 * b, 0, b * 3 * 4 / 2, b))  # the prompts: 3 tokens each, pairs 1 + 2 + 3 per request
        one_round += [(b, b * (3 + k), b * (4 + k), b) for k in range(2)]  # decodes: one token after 3 + k cached
    one_round += [(n, 0, n * (n + 1) / 2, 1) for n in (5, 9)]
    assert [(s.new_tokens, s.context_tokens, s.pairs, s.num_requests) for s in samples] == one_round * 2
    assert [s.is_decode for s in samples] == ([False, True, True] * 3 + [False, False]) * 2
    assert all(s.seconds > 0 for s in samples) and not e.has_unfinished()
    assert e.scheduler.num_steps == 1 + len(samples)  # one untimed step first
    once = measure_step_grid(grid_engine(model), batch_sizes=(2,), chunk_lens=(4,), decode_steps=2, rounds=1)
    assert [s.new_tokens for s in once] == [2 * 8, 2, 2, 4]  # two 8-token prompts, two decodes, the chunk


def test_step_grid_prompts_share_nothing(model):
    """Prompts drawn at random share no block: with the prefix cache on, a second grid on the same engine
    (another seed) computes every token again. The same seed draws the same prompts, which the cache finds:
    their chunks shrink, which is why a grid wants a fresh engine or a new seed."""
    e = grid_engine(model)
    grid = dict(batch_sizes=(2,), chunk_lens=(8, 12), decode_steps=1, prompt_len=4, rounds=1)
    first = measure_step_grid(e, seed=3, **grid)
    again = measure_step_grid(e, seed=4, **grid)
    assert [s.new_tokens for s in again] == [s.new_tokens for s in first] == [8, 2, 8, 12]
    repeated = measure_step_grid(e, seed=3, **grid)
    assert sum(s.new_tokens for s in repeated) < sum(s.new_tokens for s in first)


@pytest.mark.parametrize("kwargs, engine_kwargs, match", [
    ({"batch_sizes": ()}, {}, "batch_sizes"),
    ({"batch_sizes": (1, 0)}, {}, "batch_sizes"),
    ({"batch_sizes": 4}, {}, "batch_sizes"),
    ({"batch_sizes": (1, 2.5)}, {}, "batch_sizes"),
    ({"chunk_lens": []}, {}, "chunk_lens"),
    ({"chunk_lens": (8, 17)}, {}, "chunk_lens"),                       # longer than the budget of 16
    ({"batch_sizes": (1, 8), "prompt_len": 3}, {}, "batch_sizes"),     # 8 prompts of 3 tokens: 24 > 16
    ({"batch_sizes": (1, 4)}, {"max_num_seqs": 2}, "max_num_seqs"),
    # 8 requests of 3 + 4 tokens hold 2 blocks of 4 each: 16 > 12
    ({"batch_sizes": (8,), "prompt_len": 3}, {"num_blocks": 12, "max_num_batched_tokens": 32}, r"batch_sizes: .* pool"),
    ({"batch_sizes": (1,), "chunk_lens": (8, 16)}, {"num_blocks": 3}, "chunk_lens"),  # 16 tokens: 4 blocks > 3
    ({"decode_steps": 0}, {}, "decode_steps"),
    ({"prompt_len": 0}, {}, "prompt_len"),
    ({"prompt_len": True}, {}, "prompt_len"),
    ({"seed": -1}, {}, "seed"),
    ({"rounds": 0}, {}, "rounds"),
])
def test_step_grid_refuses_bad_input_before_running_anything(model, kwargs, engine_kwargs, match):
    e = grid_engine(model, **engine_kwargs)
    with pytest.raises(ValueError, match=match):
        measure_step_grid(e, **({"batch_sizes": (1, 2), "chunk_lens": (8,), "prompt_len": 2} | kwargs))
    assert e.scheduler.num_steps == 0 and not e.scheduler.requests


def test_step_grid_wants_an_idle_engine(model):
    with pytest.raises(TypeError, match="engine"):
        measure_step_grid(None)
    busy = grid_engine(model)
    busy.add_request([1, 2, 3], 2)
    with pytest.raises(ValueError, match="engine must be idle"):
        measure_step_grid(busy, batch_sizes=(1,), chunk_lens=(4,))


@pytest.fixture(scope="module")
def smol():
    """The real model in float32 and its tokenizer, loaded once for the tests that time it."""
    import torch

    from labkit.model.pretrained import from_pretrained, load_tokenizer, real_model

    path = real_model()
    return from_pretrained(path, dtype=torch.float32), load_tokenizer(path)


@pytest.fixture(scope="module")
def first_fit(smol):
    """One calibration for both tests' first attempts (a retry calibrates afresh): the chosen steps of
    ``measure_step_grid`` on the real model, one PyTorch thread, the copy bandwidth pinned."""
    import torch

    model, _ = smol
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grid_engine = Engine(model, num_blocks=128, block_size=16, max_num_batched_tokens=128, use_triton=False)
        return fit_steps(measure_step_grid(grid_engine), model_cost(model.config, dtype_bytes=4),
                         measure_stream_bandwidth())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("budgets", [(16, 64)])
def test_the_simulator_predicts_a_budget_comparison_on_the_real_model(budgets, smol, first_fit):
    """Appendix A6's claim: the simulator, fitted to the chosen steps of ``measure_step_grid``, is right in its
    comparisons. Budget 16 against 64 tokens per step, six chat requests on the real model: the simulated ratio
    of the two run times lands within 25% of the measured one. Each budget is measured twice, in turn with the
    other, and the faster kept (a busy machine only slows). A busy machine can still bend one attempt, so there
    are up to three: the first on the module's calibration, each retry calibrated afresh."""
    import torch

    from labkit.model.pretrained import chat_token_ids
    from labkit.serving.sim.simulator import Simulator

    smol, tokenizer = smol
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        asks = ["What is the capital of France?", "Name three primary colours.", "What does a CPU do?",
                "How do you say hello in Spanish?", "Why is the sky blue?", "Who wrote Hamlet?"]
        work = [RequestSpec(i, 0.0, chat_token_ids(tokenizer, [{"role": "system", "content": "Answer briefly."},
                                                               {"role": "user", "content": q}]), 6)
                for i, q in enumerate(asks)]
        cost = model_cost(smol.config, dtype_bytes=4)

        def real_engine(budget: int) -> Engine:
            return Engine(smol, num_blocks=64, block_size=16, max_num_batched_tokens=budget, use_triton=False,
                          enable_prefix_caching=False)

        small, large = budgets

        def attempt(fit=None) -> tuple[float, dict, dict]:
            fit = fit or fit_steps(measure_step_grid(real_engine(128)), cost, measure_stream_bandwidth())
            runs = {small: [], large: []}
            for _ in range(2):  # the budgets in turn: a busy spell slows a run of each
                for b in runs:
                    runs[b].append(sum(s.seconds for s in measure_steps(real_engine(b), work)))
            measured = {b: min(times) for b, times in runs.items()}
            simulated = {b: Simulator(fit.cost_model(), num_blocks=64, block_size=16, max_num_batched_tokens=b,
                                      enable_prefix_caching=False).run(work).makespan for b in (small, large)}
            return (simulated[large] / simulated[small]) / (measured[large] / measured[small]), measured, simulated

        # Another job on the machine can land in the calibration run or in one budget's runs and bend one
        # attempt; a wrong model bends every attempt. So up to three attempts, each calibrated afresh.
        attempts = [attempt(first_fit)]
        while len(attempts) < 3 and not any(abs(ratio - 1) <= 0.25 for ratio, _, _ in attempts):
            attempts.append(attempt())
    finally:
        torch.set_num_threads(threads)
    assert all(measured[large] < measured[small] for _, measured, _ in attempts)  # fewer steps for the prompts
    assert abs(attempts[-1][0] - 1) <= 0.25, attempts


def test_the_fitted_simulator_predicts_held_out_requests_on_the_real_model(smol, first_fit):
    """Appendix A6's prediction: calibrated on the chosen steps of ``measure_step_grid`` (decodes of 1 to 16
    requests, prompt chunks of 8 to 128 tokens; the copy bandwidth pinned), the simulator predicts eight chat
    requests, arriving as a Poisson stream at 5 per second and served by the engine on the wall clock: TTFT
    and ITL p50 within 25% of the measurement. The notebook's cell fails only when three runs land past a
    factor of 2; here the 25% holds, with up to three attempts, the first on the module's calibration and each
    retry calibrated afresh (a busy machine bends one attempt, a wrong model every attempt)."""
    import torch

    from labkit.serving.sim.simulator import Simulator

    smol, tokenizer = smol
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, test_specs = chat_requests(tokenizer)  # appendix A6's held-out requests
        cost = model_cost(smol.config, dtype_bytes=4)

        def engine() -> Engine:
            return Engine(smol, num_blocks=128, block_size=16, max_num_batched_tokens=64, use_triton=False)

        def attempt(fit=None) -> dict[str, float]:
            grid_engine = Engine(smol, num_blocks=128, block_size=16, max_num_batched_tokens=128, use_triton=False)
            fit = fit or fit_steps(measure_step_grid(grid_engine), cost, measure_stream_bandwidth())
            predicted = Simulator(fit.cost_model(), num_blocks=128, block_size=16,
                                  max_num_batched_tokens=64).run(test_specs)
            measured = serve_in_real_time(engine(), test_specs)
            return {"TTFT": predicted.ttft_percentiles()["p50"] / measured.ttft_percentiles()["p50"],
                    "ITL": predicted.itl_percentiles()["p50"] / measured.itl_percentiles()["p50"]}

        attempts: list[dict[str, float]] = [attempt(first_fit)]
        while len(attempts) < 3 and not any(all(abs(r - 1) <= 0.25 for r in a.values()) for a in attempts):
            attempts.append(attempt())
    finally:
        torch.set_num_threads(threads)
    assert all(abs(r - 1) <= 0.25 for r in attempts[-1].values()), attempts
