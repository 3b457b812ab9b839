"""The CPU row-blocked attention paths: the ``"cpu_blocked"`` backend of
:func:`vitattn.functional.attention`.

Each path computes ``normalize(q kᵀ · scale + bias) v`` one block of query rows at a time, so that no
``(B, H, N, N)`` tensor exists in the forward or the backward:

- :mod:`.plan`: the one block-size rule and planner;
- :mod:`.scratch`: the one pool of reused per-thread block buffers, with named slots;
- :mod:`.bias_blocks`: the Gaussian bias written block by block, in each path's layout;
- :mod:`.grads`: the q / k / v and bias-factor gradients of one block, shared by both backwards;
- :mod:`.softmax`: softmax with a Gaussian bias (the LocAt path), inference and training;
- :mod:`.entmax`: entmax-1.5, with or without a Gaussian bias, inference and training;
- :mod:`.ops`: both as ``torch.library`` custom ops, which compiled graphs call;
- :mod:`.backend`: what the backend supports, and which path runs a call.
"""

from __future__ import annotations

from .entmax import entmax15_attention
from .softmax import gaussian_softmax_attention, gaussian_softmax_attention_train

__all__ = ["entmax15_attention", "gaussian_softmax_attention", "gaussian_softmax_attention_train"]
