"""kvsan: a KV-cache memory sanitizer for LLM inference engines.

This package is the Python API over the kvsan shim's C ABI
(``shim/include/kvsan.h``): register your engine's KV page pool, report its
page events, and check the buffers your attention and store kernels take.
"""

from ._abi import Owner, PageRef
from .sanitizer import KvsanError, Pool, Sanitizer, Verdict, Violation, attach, owners

__all__ = [
    "KvsanError",
    "Owner",
    "PageRef",
    "Pool",
    "Sanitizer",
    "Verdict",
    "Violation",
    "attach",
    "owners",
]
__version__ = "0.1.0"
