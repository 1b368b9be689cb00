"""Triton kernels of the ``triton`` attention backend (importing this package imports triton).

- ``write_kv``: stores a step's new K/V rows into their paged-cache slots (slot -1 = skip).
- ``paged_attention``: one launch for a mixed batch of prefill chunks and decodes.

Each module also holds a plain-torch ``*_ref`` twin that the tests compare against.
"""

from services.model_runner.attention.kernels.paged_attention import paged_attention, paged_attention_ref
from services.model_runner.attention.kernels.write_kv import write_kv, write_kv_ref

__all__ = ["paged_attention", "paged_attention_ref", "write_kv", "write_kv_ref"]
