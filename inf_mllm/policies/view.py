"""What a policy may look at of one layer: its length and the statistics its observers recorded."""

from dataclasses import dataclass, field

import torch


@dataclass
class LayerView:
    """`stats` holds what the layer's observers recorded, by their statistics' keys (observers.py): "window"
    (B, Hq, n), mean attention of the window queries; "acc" (B, Hkv, n), attention accumulated since arrival;
    "post" (B, Hq, n), mean post-vision attention, and "sparsity" (B, Hq), its thresholded sparsity (VL-Cache);
    any other an observer declares."""

    n: int
    prompt_len: int
    num_kv_heads: int
    stats: dict = field(default_factory=dict)

    def stat(self, key: str) -> torch.Tensor | None:
        return self.stats.get(key)

    def require(self, key: str, policy: str) -> torch.Tensor:
        """Statistic `key`, or a one-line explanation of why it is missing."""
        scores = self.stats.get(key)
        if scores is None:
            raise RuntimeError(
                f"{policy} needs attention scores ({key}) but none were observed: load the model through inf_mllm "
                "(or call use_observing_attention(model)) and run each forward inside the cache's forward() (as "
                "StreamSession does), so its attention reports to the cache"
            )
        return scores
