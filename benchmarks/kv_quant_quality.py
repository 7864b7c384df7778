"""Benchmark: what fewer bytes per KV element cost in quality, on the real model (appendix A3).

SmolLM2-135M-Instruct (the GGUF file ``make setup`` installs, weights in float32) runs with its
KV cache stored in every scheme of ``labkit.memory.formats`` (fp8, int8 and int4, each with scales per
tensor, per block and per group of 32), in float32 and in bfloat16. Attention computes in
bfloat16 for every quantized scheme, as for the bfloat16 cache, so the storage is the only
difference from that baseline. Two measurements per scheme:

1. **Next-token loss** on the held-out text (``quant.sample_text("held_out")``: 3,312 tokens of a
   public-domain book), teacher-forced through the paged cache in 512-token chunks: every
   prediction reads the stored (quantized) K/V of all earlier tokens and of its own.
2. **Greedy agreement** with the bfloat16 cache: 24 chat prompts, 64 new tokens each (the
   end-of-turn token does not stop them); the share of tokens before each output's first
   divergence from the bfloat16 output, and the mean position of that first divergence.

Per-tensor schemes use scales calibrated on another passage (``quant.sample_text("calibration")``),
as a checkpoint's k_scale/v_scale would be; one more fp8 row keeps vLLM's default scale of 1.0.
Attention runs through the kernels' PyTorch references (``use_triton=False``): the Triton kernels
compute the same thing (``tests/test_quant.py``), and Triton's interpreter is far too slow for a
135M model on a CPU.

Writes ``benchmarks/results/kv_quant_quality.{json,md,png}`` with the command and the date.

Usage: ``python benchmarks/kv_quant_quality.py [--threads 2] [--prompts 24] [--new-tokens 64]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import labkit  # noqa: E402,F401  (first: Triton's interpreter without a GPU)
from labkit.caches import quant_quality  # noqa: E402
from labkit.caches.paged import generate_paged  # noqa: E402
from labkit.memory import formats
from labkit.model.pretrained import chat_token_ids, from_pretrained, load_tokenizer, real_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
QUESTIONS = [
    "What is a KV cache?", "Why is the sky blue?", "Name three rivers in Europe.", "How do I boil an egg?",
    "What is a prime number?", "Write a haiku about autumn.", "What does a compiler do?",
    "Give me two tips for sleeping better.", "What is photosynthesis?", "Who wrote Hamlet?",
    "How does a bicycle stay upright?", "What is the capital of Canada?", "Explain recursion to a child.",
    "What causes the seasons?", "Suggest a name for a grey cat.", "What is inflation?",
    "How many legs does a spider have?", "What is the difference between weather and climate?",
    "Describe the taste of a lemon.", "Why do we need sleep?", "What is a black hole?",
    "How do vaccines work?", "Translate 'good morning' into French.", "What is the speed of light?",
]
# (row label, kv_cache_dtype, cache dtype, calibrate per-tensor scales?)
SCHEMES = [("float32", "auto", torch.float32, False), ("bfloat16", "auto", torch.bfloat16, False)]
for element in formats.ELEMENTS:
    SCHEMES.append((f"{element}_per_tensor", f"{element}_per_tensor", torch.bfloat16, True))
    if element == "fp8":
        SCHEMES.append(("fp8_per_tensor, scale 1.0", "fp8_per_tensor", torch.bfloat16, False))
    SCHEMES += [(f"{element}_per_{s}", f"{element}_per_{s}", torch.bfloat16, False) for s in ("block", "group")]
BLOCK_SIZE = 16


def bytes_per_token(config, kv_cache_dtype: str, dtype: torch.dtype) -> float:
    """The cache's bytes per token for this model, scales included (chapter 02's formula)."""
    kq = formats.kv_quant(kv_cache_dtype)
    if kq is None:
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return kq.bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, BLOCK_SIZE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_quant_quality")
    parser.add_argument("--schemes", nargs="+", metavar="ROW",
                        help="only these rows (labels as in the table); bfloat16, the reference, always runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    path = real_model()
    model, tokenizer = from_pretrained(path), load_tokenizer(path)
    config = model.config
    held_out = tokenizer(quant_quality.sample_text("held_out"), add_special_tokens=False)["input_ids"]
    calibration = tokenizer(quant_quality.sample_text("calibration"), add_special_tokens=False)["input_ids"]
    prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[: args.prompts]]

    rows, reference = [], None
    for label, kv_cache_dtype, dtype, calibrate in SCHEMES:
        if args.schemes and label not in args.schemes and label != "bfloat16":
            continue
        t0 = time.perf_counter()
        kq = formats.kv_quant(kv_cache_dtype)
        scales = quant_quality.calibrate_kv_scales(model, calibration, kq) if calibrate else None
        loss = quant_quality.next_token_loss(model, held_out, kv_cache_dtype, dtype=dtype, kv_scales=scales,
                                             block_size=BLOCK_SIZE)
        outputs = [g.tokens for g in generate_paged(model, prompts, args.new_tokens, BLOCK_SIZE, dtype=dtype,
                                                    use_triton=False, kv_cache_dtype=kv_cache_dtype,
                                                    kv_scales=scales)]
        if label == "bfloat16":
            reference = outputs
        rows.append({"scheme": label, "kv_cache_dtype": kv_cache_dtype, "dtype": str(dtype).removeprefix("torch."),
                     "calibrated": calibrate, "bytes_per_token": bytes_per_token(config, kv_cache_dtype, dtype),
                     "loss": loss, "outputs": outputs})
        print(f"{label:28s} loss {loss:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    base = next(r for r in rows if r["scheme"] == "bfloat16")
    for r in rows:
        share, mean_first = quant_quality.greedy_agreement(reference, r.pop("outputs"))
        r.update(loss_increase=r["loss"] - base["loss"], perplexity=float(torch.tensor(r["loss"]).exp()),
                 bytes_vs_bf16=r["bytes_per_token"] / base["bytes_per_token"], agreement=share,
                 mean_first_divergence=mean_first)
    command = "python benchmarks/kv_quant_quality.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in (("threads", args.threads), ("prompts", args.prompts),
                                                     ("new_tokens", args.new_tokens)))
    meta = {"command": command, "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
            "model": f"{path.name} (weights float32)", "layers": config.num_hidden_layers,
            "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim, "block_size": BLOCK_SIZE,
            "held_out_tokens": len(held_out), "calibration_tokens": len(calibration),
            "prompts": len(prompts), "new_tokens": args.new_tokens, "chunk": 512,
            "attention": "the kernels' PyTorch references, bfloat16 compute (float32 for the float32 cache)",
            "seconds": round(time.perf_counter() - started)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    table = markdown(meta, rows)
    args.out.with_suffix(".md").write_text(table)
    figure(rows).savefig(args.out.with_suffix(".png"), dpi=120)
    print(table)
    return 0


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# KV-cache quantization on the real model ({meta['date']})", "",
             f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']}; {meta['attention']}  ",
             f"Model: {meta['model']}, {meta['layers']} layers x {meta['kv_heads']} KV heads x head_dim "
             f"{meta['head_dim']}, {meta['block_size']}-token blocks  ",
             f"Loss: {meta['held_out_tokens']:,} held-out tokens, teacher-forced in {meta['chunk']}-token chunks; "
             f"per-tensor scales calibrated on {meta['calibration_tokens']} other tokens  ",
             f"Agreement: {meta['prompts']} chat prompts x {meta['new_tokens']} greedy tokens against the "
             "bfloat16 cache", "",
             "| scheme | bytes/token | vs bf16 | loss (nats) | loss increase | perplexity | greedy agreement | "
             "mean first divergence |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['bytes_per_token']:,.0f} | {r['bytes_vs_bf16']:.3f} | {r['loss']:.4f} | "
                     f"{r['loss_increase']:+.4f} | {r['perplexity']:.2f} | {r['agreement']:.1%} | "
                     f"{r['mean_first_divergence']:.1f} |")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict]):
    """Bytes per token against loss increase, one point per scheme (the appendix draws the same)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    draw_tradeoff(ax, rows)
    fig.tight_layout()
    return fig


def draw_tradeoff(ax, rows: list[dict]) -> None:
    """One marker per scale placement, one colour per element format; log scale for the loss increase."""
    colours = {"fp8": "C0", "int8": "C1", "int4": "C2", "bfloat16": "C7", "float32": "C7"}
    markers = {"tensor": "o", "block": "s", "group": "^"}
    floor = 1e-4  # a loss increase at or below zero is drawn on this line
    for r in rows:
        element = r["scheme"].split("_")[0].split(",")[0]
        placement = r["scheme"].split("_per_")[1].split(",")[0] if "_per_" in r["scheme"] else None
        y = max(r["loss_increase"], floor)
        ax.scatter(r["bytes_per_token"] / 1024, y, color=colours[element],
                   marker=markers.get(placement, "D"), alpha=0.5 if "scale 1.0" in r["scheme"] else 1.0)
        ax.annotate(r["scheme"].replace("_per_", " / "), (r["bytes_per_token"] / 1024, y), fontsize=6,
                    xytext=(3, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("KV cache per token (KiB)")
    ax.set_ylabel(f"loss increase over bf16 (nats, ≤ {floor:g} drawn at {floor:g})")
    ax.set_title("Halving the bytes is nearly free; int4 costs loss unless its scales are fine")


if __name__ == "__main__":
    sys.exit(main())
