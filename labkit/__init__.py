"""labkit: the code behind KV Cache Labs, one subpackage per layer of a serving engine.

Read it top to bottom: each layer imports only the layers above it in this table, never one below
(``tests/test_architecture.py`` holds that, lazy imports included).

=================  ==================================================================  ==================
subpackage         what it holds                                                       chapters
=================  ==================================================================  ==================
``checks``,        argument checks that name the parameter; byte sizes in binary       all
``units``          units (two modules, not packages: everything uses them)
``model``          the decoder (``decoder``), real weights from a GGUF file or a       01, capstone
                   Hugging Face folder (``gguf``, ``gguf_decoder``, ``pretrained``),
                   weights prepacked for the CPU (``prepack``), the projections
                   fused as the engine runs them (``fused``)
``memory``         what the KV cache's memory is, without tensors: block arithmetic    02, 03, 04, 08
                   (``blocks``), the allocator and block tables (``paging``), the
                   prefix cache (``prefix``), bytes per token and capacity
                   (``capacity``), a device's pool (``pool_plan``), cache formats of
                   fewer bytes per element (``formats``), a second tier behind the
                   prefix cache (``tiered``)
``kernels``        attention over a paged pool: the references (``reference``), the   03, A1, A3
                   CPU's batched path (``cpu``), the Triton kernels
                   (``triton_paged``), their launch settings (``launch``), argument
                   checks, the fallback, the public calls (``paged_attention``), and
                   where they run (``device``)
``caches``         caches that hold tensors: contiguous (``contiguous``), paged        01, 03, 04, 08, A3
                   (``paged``), prefix-cached (``prefix_cached``); what a quantized
                   cache costs in quality (``quant_quality``); one block in a checked
                   file (``block_files``) and second tiers holding real K/V, on disk
                   or in host memory (``tier_store``)
``serving``        a request, a step, the scheduler and the engine; the scheduler's    05 to 08, A5, A6
                   variants (``variants``: forking, priority, reservation, a second
                   tier); the simulator, its calibration on a real engine, Mooncake's
                   trace and the tiers' presets and break-even (``sim``); the engine
                   with a second tier (``tiered_engine``) and a real prefill-to-decode
                   hand-over (``handoff``); many replicas behind a router, and
                   prefill and decode on two pools (``cluster``)
``vllm_bridge``    vLLM beside the book: its start-up predicted (``predict``), the     A2, A4, A5, 07
                   real one run in its own environment (``real``, ``driver``), the
                   record of its runs (``record``), one workload through both
                   engines (``compare``), two replicas behind ``vllm-router``
                   (``cluster``)
``teaching``       the book's side only, on top of everything: exercise checkers,      all
                   hidden cases, quizzes, answers, excerpts, diagrams, widgets
=================  ==================================================================  ==================

Importing labkit decides where kernels run (``labkit.kernels.device``): on a CUDA GPU Triton
compiles them; without one it switches on Triton's interpreter *before* any kernel is defined, and
makes Triton's own helpers interpretable if another library imported Triton first. So
``import labkit``, in any order with other imports, is all a notebook needs; ``labkit.describe()``
says what was decided.
"""

from .kernels import device  # first: sets TRITON_INTERPRET when there is no GPU  # noqa: F401
from .kernels.device import DEVICE, RUNTIME, describe  # noqa: F401

__version__ = "0.1.0"
