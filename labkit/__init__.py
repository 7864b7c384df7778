"""labkit: the code behind KV Cache Labs.

Importing labkit decides where kernels run (``labkit.device``): on a CUDA GPU
Triton compiles them; without one it switches on Triton's interpreter *before*
any kernel is defined, and makes Triton's own helpers interpretable if another
library imported Triton first. So ``import labkit``, in any order with other
imports, is all a notebook needs.
"""

from . import device  # noqa: F401  (first: sets TRITON_INTERPRET when there is no GPU)
from .device import DEVICE, RUNTIME, describe  # noqa: F401
from .units import format_bytes  # noqa: F401

__version__ = "0.1.0"
