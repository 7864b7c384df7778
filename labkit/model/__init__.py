"""The model: a small Llama-architecture decoder and the real weights it runs (chapter 01).

* ``decoder``: ``DecoderConfig``, ``Decoder`` and ``causal_attention``; the one method a cache
  implements, ``attend(layer_idx, q, k, v)``;
* ``gguf``: a GGUF file read, every claim in it checked, its tensors dequantized;
* ``gguf_decoder``: a GGUF file's metadata, weights and tokenizer as the decoder's;
* ``pretrained``: ``from_pretrained`` (a GGUF file or a Hugging Face folder), ``real_model()``
  (the book's one source of its real model), the tokenizer and its chat template;
* ``prepack``: the weights reordered once for the CPU's matrix multiply, as vLLM's CPU backend does;
* ``fused``: the decoder as the engine runs it, q/k/v and gate/up each one multiply (``fuse``), then
  packed (``prepare``), as vLLM builds and loads its Llama.
"""
