"""Write the book's real model as a Hugging Face folder, for vLLM (`make vllm`).

vLLM reads a model folder (config.json, safetensors, tokenizer files), not the GGUF file the
book ships. transformers will not save a model it loaded from GGUF, so the folder is written from
the book's own loader: ``labkit.model.pretrained.from_pretrained`` dequantizes the GGUF weights to
float32, ``to_transformers`` puts them in a ``LlamaForCausalLM`` and ``save_pretrained`` writes
them; the tokenizer rebuilt from the GGUF metadata is saved beside them, chat template included.
Both engines then compute with the same float32 numbers.

Usage: ``python tools/write_hf_model.py FOLDER`` (run with the book's environment, ``.venv``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.model.pretrained import from_pretrained, load_tokenizer, real_model, to_transformers


def write(folder: Path) -> Path:
    """Save model and tokenizer into ``folder`` (float32); returns the folder."""
    source = real_model()
    model = from_pretrained(source, dtype=torch.float32)
    hf = to_transformers(model)
    hf.config.dtype = torch.float32
    hf.generation_config.do_sample = False  # no sampling defaults for vLLM to pick up
    folder.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar in make's output
    hf.save_pretrained(folder)
    load_tokenizer(source).save_pretrained(folder)
    (folder / "labkit_source.json").write_text(json.dumps({"source": str(source), "dtype": "float32"}, indent=1))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    folder = write(args.folder)
    total = sum(p.stat().st_size for p in folder.iterdir())
    print(f"wrote {folder} ({total / 2**20:.0f} MiB): {', '.join(sorted(p.name for p in folder.iterdir()))}")


if __name__ == "__main__":
    main()
