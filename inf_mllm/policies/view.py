"""What a policy may look at of one layer: its length and the statistics its observers recorded."""

from dataclasses import dataclass

import torch


@dataclass
class LayerView:
    n: int
    prompt_len: int
    num_kv_heads: int
    window_scores: torch.Tensor | None = None  # (B, Hq, n): mean attention of the window queries
    acc_scores: torch.Tensor | None = None  # (B, Hkv, n): attention accumulated since arrival
    post_scores: torch.Tensor | None = None  # (B, Hq, n): mean post-vision attention (VL-Cache)
    sparsity: torch.Tensor | None = None  # (B, Hq): thresholded post-vision sparsity (VL-Cache)

    def require(self, scores: torch.Tensor | None, policy: str) -> torch.Tensor:
        """`scores` (one of the fields above), or a one-line explanation of why they are missing."""
        if scores is None:
            raise RuntimeError(
                f"{policy} needs attention scores but none were observed: load the model through "
                "inf_mllm (or call use_observing_attention(model)) so its attention reports to the cache"
            )
        return scores
