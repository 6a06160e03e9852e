"""Serving: paged V4.1 caches, chunked prefill and the static-capacity jitted decode step.

Built so far (issue 4, in progress): `CacheSpec` (the decode-state layout and its exact byte
accounting, with the LCM logical block shared by every global cache group) and `BlockAllocator`
(per-request block tables and batch slots, admission control, release on finish / cancel).
The cached prefill / decode step, the engine and the ``generate`` / ``bench`` CLI are not built yet.
"""

from v41cp.serving.allocator import AllocationError, BlockAllocator
from v41cp.serving.cache_spec import CacheGroup, CacheSpec

__all__ = ["AllocationError", "BlockAllocator", "CacheGroup", "CacheSpec"]
