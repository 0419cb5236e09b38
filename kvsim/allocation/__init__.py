"""Allocation, in one room: a budget per (layer, KV head) at uniform's memory (docs/allocation.md).

- ``split``: the arithmetic of a split, numbers and the registry alone: the allocators' names, the least
  budget a policy's parameters allow per head, PyramidKV's schedule, the integer split in proportion to
  weights, an allocation file read.
- ``allocators``: every allocator's split of a recorded bundle (those that read its attention among
  them), the exact optimum, and the retained mass each reaches on a replay.
- ``search``: the split searched by the model's truth, from the best static split.
- ``tune``: ``tune --allocate auto``, the allocator chosen beside the window.
- ``truth``: the model's loss and KL under a split (torch, imported when measured).
- ``deployed``: the bridge to the deployed cache (``kvsim.hf.cache(..., allocate=...)``).

The package imports none of them: each module stands on the floor of what it imports
(docs/architecture.md), ``split`` on the policies', ``deployed`` on the deployed cache's, ``truth`` on the
models', the rest on the analyses', so the deployed cache and a plan file reach the split without the
simulator, and ``import kvsim.allocation.split`` loads no torch.
"""
