"""Attention over a paged pool: references, the CPU path and the Triton kernels (chapter 03, A1, A3).

* ``paged_attention``: what an engine calls: ``write_kv``, ``paged_decode_attention``,
  ``paged_prefill_attention``; each checks its arguments, then runs Triton or the reference;
* ``reference``: the same three in plain PyTorch, the definition the kernels are tested against;
* ``cpu``: the references' arithmetic for a whole batch at once, the CPU's fast path;
* ``triton_paged``: the Triton kernels themselves;
* ``launch``: tiles, warps, stages and splits per GPU generation, and the bare launchers;
* ``arguments``: the argument checks; ``fallback``: when Triton cannot run, and what runs instead;
* ``device``: a CUDA GPU or the CPU, Triton compiled or interpreted (imported first by ``labkit``).

This package's ``__init__`` imports nothing, so that ``import labkit`` sets up Triton's interpreter
before any kernel is defined.
"""
