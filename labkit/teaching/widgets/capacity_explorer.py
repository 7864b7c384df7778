"""The capacity explorer of chapter 02: how many sequences fit on one device.

A preset menu fills in a real model's shape; sliders change the layers, KV heads,
head dim, context length, concurrent sequences, device memory and the memory set aside
for weights and workspace, and a menu the KV cache dtype: float32, bfloat16, or one of
appendix A3's quantized caches (fp8 with one scale per layer, int8 with scales per block,
int4 with scales per 32 elements; :func:`labkit.memory.capacity.kv_bytes_per_token` counts their
scales). The readout shows bytes per
token, bytes per request and how many sequences fit; the plot shows how that
number falls as the context grows. A preset knows the longest context its model
was built for (``max_position_embeddings``): a context slider set past it gets a
warning, and the plot draws lengths past it dotted. The bytes are still what the
formula gives; the model just was not built to attend that far.

Below the table, "vLLM would print" shows the start-up lines vLLM would log for the
same device (:mod:`labkit.vllm_bridge.predict`): the pool is ``ceil(device × gpu_memory_utilization)``
minus the memory set aside, in 16-token blocks, with ``max_model_len`` = the context
length; sliding windows are budgeted as vLLM budgets them. When one request would not
fit, it shows vLLM's refusal instead. A quantized dtype becomes vLLM's nearest
``kv_cache_dtype`` (:data:`VLLM_KV_CACHE_DTYPES`): vLLM 0.33.0 keeps int8 and int4 with one
float32 scale per token and head, not per block or per group. For an MLA model fp8 takes
64-token blocks (FlashMLA, on Hopper) and int8/int4 are refused: no MLA backend lists them.

Every number comes from :mod:`labkit.memory.capacity`. The readout's elements carry CSS
classes (``capacity-readout``, ``capacity-fit`` ...) so that a browser test can
read them, and each slider's description names what it sets.

:func:`static_figure` draws the same curve for several presets: the picture for
readers without a live kernel.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, replace

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import clear_output, display
from matplotlib.figure import Figure
from matplotlib.ticker import StrMethodFormatter

from ...memory import capacity
from ...memory.capacity import ModelShape
from ...units import GiB, format_bytes
from ...vllm_bridge import predict

# Slider descriptions: the browser test finds sliders by these words.
LABELS = {
    "num_layers": "layers",
    "num_kv_heads": "KV heads",
    "head_dim": "head dim",
    "kv_cache_dtype": "KV cache dtype",
    "context_len": "context length (tokens)",
    "num_seqs": "concurrent sequences",
    "device_gib": "device memory (GiB)",
    "reserved_gib": "set aside (GiB)",
    "gpu_memory_utilization": "gpu_memory_utilization",
}
VLLM_BLOCK_SIZE = 16
MLA_FP8_BLOCK_SIZE = 64  # FlashMLA's block: what vLLM 0.33.0 picks for an fp8 MLA cache on Hopper (appendix A2)
CONTEXTS = 2 ** np.arange(9, 18)  # 512 ... 131,072 tokens, the plot's x axis
# The menu: (label, kv_cache_dtype). float32 and bfloat16 are plain caches of that element size.
KV_DTYPES = [("float32 (4 bytes)", "float32"), ("bfloat16 (2 bytes)", "bfloat16"),
             ("fp8 (1 byte, a scale per layer)", "fp8_per_tensor"),
             ("int8 (1 byte, scales per block)", "int8_per_block"),
             ("int4 (½ byte, scales per 32)", "int4_per_group")]
PLAIN_BYTES = {"float32": 4, "bfloat16": 2}
# What vLLM 0.33.0 would be started with for each: the scheme it has that comes closest.
VLLM_KV_CACHE_DTYPES = {"float32": "auto", "bfloat16": "auto", "fp8_per_tensor": "fp8",
                        "int8_per_block": "int8_per_token_head", "int4_per_group": "int4_per_token_head"}


@dataclass(frozen=True)
class Setting:
    """One position of every control of the explorer."""

    shape: ModelShape
    context_len: int
    num_seqs: int
    device_gib: float
    reserved_gib: float
    gpu_memory_utilization: float = 1.0
    vllm_shape: ModelShape | None = None  # the preset with its windows; None: use ``shape``
    kv_cache_dtype: str = "bfloat16"  # a value of KV_DTYPES

    @property
    def quantization(self) -> str:
        """labkit.memory.formats's name of the cache's scheme: "auto" for a plain float32 or bfloat16 cache."""
        return "auto" if self.kv_cache_dtype in PLAIN_BYTES else self.kv_cache_dtype

    @property
    def bytes_per_token(self) -> float:
        return capacity.kv_bytes_per_token(self.shape, self.quantization)

    def request_bytes(self, length: int) -> int:
        """The article's formula (windows not applied), scales included for a quantized cache."""
        return capacity.kv_cache_bytes(self.shape, length, self.quantization)

    @property
    def bytes_per_request(self) -> int:
        return self.request_bytes(self.context_len)

    @property
    def sequences_that_fit(self) -> int:
        return capacity.sequences_that_fit(self.bytes_per_request, self.device_gib * GiB, self.reserved_gib * GiB)

    def vllm_lines(self) -> list[str]:
        """What vLLM would log at start-up for this device and model, or its refusal (one line)."""
        available = predict.available_kv_bytes(self.device_gib * GiB, self.gpu_memory_utilization,
                                               self.reserved_gib * GiB)
        try:
            report = predict.kv_cache_report(self.vllm_shape or self.shape, available, block_size=self.vllm_block_size,
                                             max_model_len=self.context_len, kv_cache_dtype=self.vllm_kv_cache_dtype)
        except ValueError as refusal:
            return [f"ValueError: {refusal}"]
        return report.log_lines()

    @property
    def vllm_kv_cache_dtype(self) -> str:
        return VLLM_KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def vllm_block_size(self) -> int:
        """16, or 64 for an fp8 MLA cache (FlashMLA serves it on Hopper; appendix A2)."""
        return MLA_FP8_BLOCK_SIZE if self.shape.latent and self.vllm_kv_cache_dtype == "fp8" else VLLM_BLOCK_SIZE


def readout_html(s: Setting) -> str:
    """The explorer's text: each number in an element with its own CSS class."""
    if s.reserved_gib > s.device_gib:
        return (f'<div class="capacity-error" style="color:#b00">⚠ {s.reserved_gib:g} GiB set aside is more than '
                f'the device\'s {s.device_gib:g} GiB: labkit.memory.capacity refuses this with a ValueError.</div>')
    fit = s.sequences_that_fit
    pool = s.device_gib * GiB - s.reserved_gib * GiB
    limit = s.shape.max_position_embeddings
    context_note = ""
    if s.shape.beyond_context(s.context_len):
        context_note = (f'<div class="capacity-context-warning" style="color:#b60">⚠ {s.context_len:,} tokens is '
                        f'beyond {s.shape.name}\'s max_position_embeddings ({limit:,}): the bytes are what the '
                        f'formula gives, but the model was not built for this length.</div>')
    needed = s.num_seqs * s.bytes_per_request
    verdict = ("fit" if s.num_seqs <= fit else "do <b>not</b> fit")
    kind = "one latent vector (MLA, no factor 2)" if s.shape.latent else "K and V (factor 2)"
    rows = [
        ("bytes per token", "capacity-bytes-per-token",
         f"{format_bytes(s.bytes_per_token, 'bytes')} = {format_bytes(s.bytes_per_token)}"),
        (f"bytes per request ({s.context_len:,} tokens)", "capacity-bytes-per-request",
         format_bytes(s.bytes_per_request)),
        (f"{s.num_seqs} concurrent sequences need", "capacity-needed", format_bytes(needed)),
        (f"KV pool ({s.device_gib:g} GiB − {s.reserved_gib:g} GiB)", "capacity-pool", format_bytes(pool)),
        ("sequences that fit", "capacity-fit", f"{fit:,}"),
    ]
    body = "".join(f'<tr><td style="padding-right:1em">{name}</td><td><b class="{cls}">{value}</b></td></tr>'
                   for name, cls, value in rows)
    lines = "<br>".join(html.escape(line) for line in s.vllm_lines())
    vllm_dtype = "" if s.vllm_kv_cache_dtype == "auto" else f", kv_cache_dtype={s.vllm_kv_cache_dtype}"
    vllm_box = (f'<div>vLLM would print (gpu_memory_utilization={s.gpu_memory_utilization:g}, '
                f'block_size={s.vllm_block_size}, max_model_len={s.context_len:,}{vllm_dtype}):</div>'
                f'<pre class="capacity-vllm" style="white-space:pre-wrap;margin:0">{lines}</pre>')
    return (f'<table>{body}</table>{context_note}<div class="capacity-verdict">{s.num_seqs} requested: {verdict}. '
            f'Cache stores {kind} per token and layer.</div>{vllm_box}')


def draw(ax: plt.Axes, shape: ModelShape, pool_bytes: float, label: str | None = None, kv_cache_dtype: str = "auto",
         **style) -> None:
    """Sequences that fit in ``pool_bytes`` against context length (log-log; zero is not drawn).

    Lengths beyond the model's ``max_position_embeddings`` are drawn dotted and faint.
    ``kv_cache_dtype``: a quantized cache of labkit.memory.formats ("auto": ``shape.dtype_bytes`` per element).
    """
    fits = np.array([pool_bytes // capacity.kv_cache_bytes(shape, int(t), kv_cache_dtype) for t in CONTEXTS],
                    dtype=float)
    fits[fits == 0] = np.nan
    within = np.array([not shape.beyond_context(int(t)) for t in CONTEXTS])
    (line,) = ax.plot(CONTEXTS[within], fits[within], marker=".", label=label, **style)
    if not within.all():
        start = max(int(within.sum()) - 1, 0)  # join the dotted part to the last point within the limit
        ax.plot(CONTEXTS[start:], fits[start:], marker=".", linestyle=":", alpha=0.5, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("sequences that fit")


class CapacityExplorer:
    """The widget. ``CapacityExplorer()`` in a cell shows it; ``.setting`` is what it shows."""

    def __init__(self, preset: str = "teaching model", context_len: int = 8192, num_seqs: int = 3,
                 device_gib: float = 24, reserved_gib: float = 17, gpu_memory_utilization: float = 1.0):
        style, layout = {"description_width": "13em"}, widgets.Layout(width="34em")

        def slider(cls, key, value, lo, hi, step):
            return cls(value=value, min=lo, max=hi, step=step, description=LABELS[key], style=style,
                       layout=layout, continuous_update=False)

        self.preset = widgets.Dropdown(options=list(capacity.PRESETS), value=preset, description="preset",
                                       style=style, layout=layout)
        self.kv_dtype = widgets.Dropdown(options=KV_DTYPES, value="bfloat16", description=LABELS["kv_cache_dtype"],
                                         style=style, layout=layout)
        self.sliders = {
            "num_layers": slider(widgets.IntSlider, "num_layers", 32, 1, 128, 1),
            "num_kv_heads": slider(widgets.IntSlider, "num_kv_heads", 8, 1, 128, 1),
            "head_dim": slider(widgets.IntSlider, "head_dim", 128, 16, 1024, 16),
            "context_len": slider(widgets.IntSlider, "context_len", context_len, 512, 131072, 512),
            "num_seqs": slider(widgets.IntSlider, "num_seqs", num_seqs, 1, 256, 1),
            "device_gib": slider(widgets.IntSlider, "device_gib", device_gib, 1, 192, 1),
            "reserved_gib": slider(widgets.FloatSlider, "reserved_gib", reserved_gib, 0, 192, 0.5),
            "gpu_memory_utilization": slider(widgets.FloatSlider, "gpu_memory_utilization", gpu_memory_utilization,
                                             0.5, 1.0, 0.01),
        }
        self.readout = widgets.HTML()
        self.readout.add_class("capacity-readout")
        self.plot = widgets.Output(layout=widgets.Layout(width="36em"))
        self._latent = False
        self._applying_preset = False
        self._apply_preset(preset)
        self.preset.observe(lambda change: self._apply_preset(change["new"]), names="value")
        for s in [*self.sliders.values(), self.kv_dtype]:
            s.observe(lambda change: self._update(), names="value")
        controls = widgets.VBox([self.preset, self.kv_dtype, *self.sliders.values(), self.readout])
        self.ui = widgets.HBox([controls, self.plot])
        self.ui.add_class("capacity-explorer")
        self._update()

    @property
    def setting(self) -> Setting:
        """The shape and numbers the controls show now.

        Changing only the KV cache dtype keeps the preset's model (and its context
        limit); changing layers, KV heads or head dim makes a "custom" model whose
        context limit is unknown. A quantized dtype keeps the shape's 2-byte element size
        (what vLLM's "auto" would store); its own bytes come from ``kv_cache_dtype``.
        """
        v = {k: s.value for k, s in self.sliders.items()}
        kv = self.kv_dtype.value
        preset = capacity.PRESETS[self.preset.value]
        element = PLAIN_BYTES.get(kv, preset.dtype_bytes)
        if self._architecture_edited():
            name, limit = "custom", None
        elif kv != "bfloat16":
            name, limit = f"{preset.name} ({kv} cache)", preset.max_position_embeddings
        else:
            name, limit = preset.name, preset.max_position_embeddings
        shape = ModelShape(name, v["num_layers"], 1 if self._latent else v["num_kv_heads"], v["head_dim"],
                           element, latent=self._latent, max_position_embeddings=limit)
        windowed = None if self._architecture_edited() else replace(preset, dtype_bytes=element)
        return Setting(shape, v["context_len"], v["num_seqs"], v["device_gib"], v["reserved_gib"],
                       v["gpu_memory_utilization"], windowed, kv)

    def _architecture_edited(self) -> bool:
        p = capacity.PRESETS[self.preset.value]
        return (p.num_layers, p.num_kv_heads, p.head_dim) != tuple(
            self.sliders[k].value for k in ("num_layers", "num_kv_heads", "head_dim"))

    def _apply_preset(self, name: str) -> None:
        p = capacity.PRESETS[name]
        self._latent = p.latent
        self._applying_preset = True  # one redraw for the whole preset, not one per slider
        try:
            for key in ("num_layers", "num_kv_heads", "head_dim"):
                self.sliders[key].value = getattr(p, key)
        finally:
            self._applying_preset = False
        self.sliders["num_kv_heads"].disabled = p.latent  # a latent cache has no KV heads to change
        self._update()

    def _update(self) -> None:
        if self._applying_preset:
            return
        s = self.setting
        self.readout.value = readout_html(s)
        with self.plot:
            clear_output(wait=True)
            pool = s.device_gib * GiB - s.reserved_gib * GiB
            if pool <= 0:
                print("No memory left for the KV cache: lower 'set aside' or raise 'device memory'.")
                return
            fig, ax = plt.subplots(figsize=(6, 3.5))
            draw(ax, s.shape, pool, label=s.shape.name, kv_cache_dtype=s.quantization)
            ax.axhline(s.num_seqs, color="grey", linestyle="--", label=f"{s.num_seqs} requested")
            fit = s.sequences_that_fit
            if fit:
                ax.plot([s.context_len], [fit], "o", color="C3", label="this setting")
            if s.shape.max_position_embeddings is not None and s.shape.max_position_embeddings < CONTEXTS[-1]:
                ax.axvline(s.shape.max_position_embeddings, color="grey", linestyle=":",
                           label="max_position_embeddings")
            ax.set_title(f"{fit:,} sequences of {s.context_len:,} tokens fit in {format_bytes(pool)}")
            ax.legend(loc="upper right", fontsize="small")
            fig.tight_layout()
            display(fig)
            plt.close(fig)

    def _repr_mimebundle_(self, **kwargs):
        return self.ui._repr_mimebundle_(**kwargs)


def static_figure(names: list[str], pool_bytes: float) -> Figure:
    """Sequences that fit in one pool against context length, one line per preset."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in names:
        shape = capacity.PRESETS[name]
        draw(ax, shape, pool_bytes, label=f"{name} ({format_bytes(shape.bytes_per_token())}/token)")
    ax.set_title(f"In a {format_bytes(pool_bytes)} pool, fewer bytes per token means more long sequences")
    if any(capacity.PRESETS[name].beyond_context(int(CONTEXTS[-1])) for name in names):
        ax.plot([], [], color="grey", linestyle=":", alpha=0.5, label="beyond the model's max_position_embeddings")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
