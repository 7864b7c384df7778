"""The load explorer of chapter 06: what traffic does to latency and to the cache.

Five controls: the arrival rate (requests per second), the length of a **shared system
prompt** (the same first tokens in every request, as a chat service puts its instructions in
front of every conversation), prefix caching on or off, the block size and the KV pool size.
Each change serves a fresh, seeded ShareGPT-like workload with :class:`labkit.serving.sim.simulator.Simulator`
(teaching model, RTX-4090-class device, roofline cost model) and shows time to first token
(TTFT) and inter-token latency (ITL) percentiles, cache occupancy and prefix reuse, with
occupancy over time.

A system prompt makes every prompt longer by its length, whether or not the cache shares it:
that is what a real one does. To see what sharing alone buys, keep the system prompt and turn
prefix caching off: the prompts stay the same, only the reuse goes. Chapter 06 draws that
comparison as the explorer's static figure, for readers without a live kernel.
"""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import clear_output, display

from ...checks import check_int, check_number
from ...serving.sim.costmodel import CostModel
from ...serving.sim.simulator import SimResult, Simulator
from ...serving.sim.workloads import SHAREGPT, make_workload
from ...units import GiB, format_bytes

SYSTEM_PROMPT_LEN = 512  # the explorer's starting value, and the static figure's system prompt
NUM_REQUESTS = 100


def explore(arrival_rate: float, system_prompt_len: int, block_size: int, pool_gib: float, *,
            enable_prefix_caching: bool = True, num_requests: int = NUM_REQUESTS,
            cost_model: CostModel | None = None, seed: int = 0) -> SimResult:
    """Serve one seeded workload with these settings (what the explorer runs on every change).

    Every request starts with the same ``system_prompt_len`` tokens, then its own ShareGPT-like
    prompt; the arrival times and the lengths of the requests' own prompts and answers depend on
    ``seed`` only, not on the other settings.
    """
    check_number("arrival_rate", arrival_rate, 0, strict=True)
    check_int("system_prompt_len", system_prompt_len, 0)
    requests = make_workload(num_requests, arrival_rate, SHAREGPT, shared_prefix_len=system_prompt_len,
                             prefix_share=1.0, seed=seed)
    sim = Simulator(cost_model or CostModel("teaching model", "RTX 4090 (24 GiB)"), pool_bytes=pool_gib * GiB,
                    block_size=block_size, max_num_batched_tokens=2048,
                    enable_prefix_caching=enable_prefix_caching)
    return sim.run(requests)


def readout(result: SimResult) -> str:
    """The numbers the explorer prints, as an HTML table."""
    ttft, itl = result.ttft_percentiles(), result.itl_percentiles()
    rows = [
        ("time to first token p50 / p90 / p99", " / ".join(f"{ttft[k] * 1e3:,.0f}" for k in ttft) + " ms"),
        ("inter-token latency (ITL) p50 / p90 / p99", " / ".join(f"{itl[k] * 1e3:,.1f}" for k in itl) + " ms"),
        ("mean cache occupancy", f"{result.mean_occupancy:.1%} of {result.num_blocks:,} blocks"),
        ("prompt tokens from the prefix cache", f"{result.reuse_ratio:.1%} (reusable: {result.reusable_ratio:.1%})"),
        ("prompt length, mean (system prompt included)", f"{result.prompt_len.mean():,.0f} tokens"),
        ("throughput", f"{result.output_tokens_per_s:,.0f} tokens/s"),
        ("preemptions", f"{int(result.preemptions.sum())}"),
    ]
    cells = "".join(f"<tr><td>{k}</td><td class='load-{i}'><b>{v}</b></td></tr>" for i, (k, v) in enumerate(rows))
    return f"<table class='load-readout'>{cells}</table>"


def plot_occupancy(result: SimResult, ax=None):
    """Blocks held over simulated time, as a share of the pool."""
    ax = ax or plt.gca()
    ax.step(result.step_start, result.used_blocks / result.num_blocks, where="post")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("pool occupancy")
    ax.set_ylim(0, 1.05)
    return ax


def load_explorer(cost_model: CostModel | None = None) -> widgets.Widget:
    """The interactive explorer (ipywidgets). Each change runs a short simulation: under a second
    when the pool is roomy, several seconds when it is overloaded and requests are preempted.

    Its children, in order: the rate, system-prompt, block-size and pool controls, the prefix
    caching switch, the readout table and the figure.
    """
    style = {"description_width": "190px"}
    layout = widgets.Layout(width="480px")
    rate = widgets.FloatSlider(value=4.0, min=0.5, max=12.0, step=0.5, description="arrival rate (req/s)",
                               style=style, layout=layout, continuous_update=False)
    system = widgets.IntSlider(value=SYSTEM_PROMPT_LEN, min=0, max=2048, step=128,
                               description="shared system prompt (tokens)", style=style, layout=layout,
                               continuous_update=False)
    block = widgets.Dropdown(options=[8, 16, 32, 64, 128], value=16, description="block size (tokens)",
                             style=style, layout=layout)
    pool = widgets.FloatSlider(value=2.0, min=1.0, max=7.0, step=0.5, description="KV pool (GiB)",
                               style=style, layout=layout, continuous_update=False)
    caching = widgets.Checkbox(value=True, description="prefix caching (shares the system prompt)",
                               style=style, layout=layout)
    table = widgets.HTML()
    figure = widgets.Output()

    def update(*_):
        try:
            result = explore(rate.value, system.value, block.value, pool.value,
                             enable_prefix_caching=caching.value, cost_model=cost_model)
        except ValueError as error:  # e.g. a request longer than the whole pool
            table.value = f"<p class='load-error'>{error}</p>"
            return
        table.value = readout(result)
        with figure:
            clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 2.8))
            plot_occupancy(result, ax)
            ax.set_title(f"{rate.value:g} req/s, {system.value}-token system prompt "
                         f"(caching {'on' if caching.value else 'off'}), pool {format_bytes(pool.value * GiB)}, "
                         f"{block.value}-token blocks (simulated)", fontsize=9)
            fig.tight_layout()
            display(fig)
            plt.close(fig)

    for control in (rate, system, block, pool, caching):
        control.observe(update, names="value")
    update()
    return widgets.VBox([rate, system, block, pool, caching, table, figure])


__all__ = ["SYSTEM_PROMPT_LEN", "explore", "readout", "plot_occupancy", "load_explorer"]
