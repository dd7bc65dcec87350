"""Flash-VStream's STAR memory, updated one frame at a time, for features of any width.

Four parts, each a fixed number of tokens once the stream is long enough:

- spatial: the fine tokens of the most recent frames (a FIFO);
- temporal: frames pooled coarser and merged by weighted k-means into a fixed number of centroids;
- abstract: one pooled token per frame, blended into a fixed set of slots by attention;
- retrieved: the fine tokens of a few key frames chosen from the temporal clustering (below).

Facts taken from the Flash-VStream repository (Flash-VStream-LLaVA): the pooling resolutions and
lengths from the 7B `config.json` fields `compress_size`, `compress_long_memory_size`,
`compress_Turing_memory_size`, `video_current_memory_length`, `video_long_memory_length`,
`video_Turing_memory_length`, `compress_Turing_update_ratio` (also `scripts/train_and_eval.sh`);
the update rules from `flash_vstream/model/vstream_arch.py` (`embed_video_streaming`, one frame per
call as `serve/cli_video_stream.py` feeds it; `compress_spatial_features`, `attention`) and
`flash_vstream/model/compress_functions.py` (`weighted_kmeans_feature`, `attention_feature`).

Faithful by default (tests/test_originals_parity.py compares with outputs recorded from that code):
- temporal: each frame, the old centroids plus the new frame are re-clustered from *unit* weights
  (`carry_weights=False`); k-means starts from `torch.randperm` and re-seeds an empty cluster with
  `random.randint`, returns the previous centroids once they move less than `tol`, and the weight of
  each centroid is the (unit) weight of its last assignment. Seeded like the original (torch and
  `random` seeded with `seed` before the stream), the draws are the same.
- retrieved (`retrieval="original"`): the cluster ids sorted by that weight index the *pre-clustering*
  rows (old centroids + new frame), and each picked row's nearest such row names a frame of the
  stream's frame buffer by its position. So the retrieved frames are always among the first
  `temporal_length + 1` frames of the stream (e.g. frames 23, 12, 24 after 60 frames), and only
  those frames' fine tokens are kept.

Our variants, as options:
- `carry_weights=True`: a centroid's weight (frames merged so far) carries into the next
  clustering, the weighting the paper describes;
- `retrieval="nearest"`: each centroid keeps one representative frame, re-chosen at every
  clustering as the candidate (old representatives and the new frame) nearest the new centroid, and
  the representatives of the heaviest centroids are retrieved.
"""

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (memory (M, D), new (N, D)) -> (M, N) weights, each row summing to 1 over the new tokens
AttentionWeights = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StarConfig:
    """Sizes are grid sides (tokens per frame = side²) and lengths in frames; defaults are Flash-VStream-7B's."""

    spatial_size: int = 8  # compress_size: 16×16 ViT-L/14 patches pooled to 8×8
    spatial_length: int = 1  # video_current_memory_length
    temporal_size: int = 4  # compress_long_memory_size
    temporal_length: int = 25  # video_long_memory_length
    abstract_size: int = 1  # compress_Turing_memory_size
    abstract_length: int = 25  # video_Turing_memory_length
    update_ratio: float = 0.2  # compress_Turing_update_ratio
    retrieved: int = 3  # key_length, hard-coded in vstream_arch.py
    kmeans_iters: int = 10  # weighted_kmeans_torch defaults
    kmeans_tol: float = 1e-4
    carry_weights: bool = False  # the original re-clusters from unit weights; True: our carried weights
    retrieval: str = "original"  # "original": their indexing; "nearest": our representative frames

    @classmethod
    def from_config(cls, config: dict, **overrides) -> "StarConfig":
        """From a Flash-VStream config.json; missing fields take the 7B values."""
        names = {
            "spatial_size": "compress_size", "spatial_length": "video_current_memory_length",
            "temporal_size": "compress_long_memory_size", "temporal_length": "video_long_memory_length",
            "abstract_size": "compress_Turing_memory_size", "abstract_length": "video_Turing_memory_length",
            "update_ratio": "compress_Turing_update_ratio",
        }
        found = {field: config[key] for field, key in names.items() if config.get(key) is not None}
        return cls(**{**found, **overrides})

    @property
    def max_tokens(self) -> int:
        """Read-out length once every part is full."""
        return (self.abstract_length * self.abstract_size ** 2 + self.temporal_length * self.temporal_size ** 2
                + (self.retrieved + self.spatial_length) * self.spatial_size ** 2)


def pool_grid(tokens: torch.Tensor, side: int) -> torch.Tensor:
    """(P, D) tokens of a square grid → (side², D) by average pooling (their `compress_spatial_features`)."""
    grid = round(tokens.shape[0] ** 0.5)
    if grid * grid != tokens.shape[0] or grid % side:
        raise ValueError(f"cannot pool {tokens.shape[0]} tokens (a {grid}×{grid} grid?) to {side}×{side}")
    if grid == side:
        return tokens
    if side == 1:
        return tokens.mean(dim=0, keepdim=True)
    x = tokens.T.reshape(1, -1, grid, grid)
    return F.avg_pool2d(x, grid // side).reshape(tokens.shape[1], side * side).T


def weighted_kmeans(x: torch.Tensor, weights: torch.Tensor, k: int, iters: int = 10, tol: float = 1e-4,
                    generator: torch.Generator | None = None,
                    rng: random.Random | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, F) points with (N,) weights → (k, F) centroids and (k,) weight of each centroid's last assignment.

    Their `weighted_kmeans_torch`, step for step: k random points (`torch.randperm`, from `generator`
    or torch's global one), Euclidean distances written out, per-cluster weighted means, an empty
    cluster re-seeded at a random point (`rng.randint`, Python's `random` when None), and on
    convergence (total shift below `tol`) the centroids *before* the last update are returned.
    """
    n = x.shape[0]
    rng = rng or random
    centroids = x[torch.randperm(n, generator=generator)[:k].to(x.device)]
    weights_sum = torch.zeros(k, dtype=x.dtype, device=x.device)
    for _ in range(iters):
        labels = ((x[:, None] - centroids[None]) ** 2).sum(dim=2).sqrt().argmin(dim=1)
        weighted_sum = torch.zeros_like(centroids)
        weights_sum = torch.zeros(k, dtype=x.dtype, device=x.device)
        for j in range(k):
            member = labels == j
            weighted_sum[j] = torch.sum(weights[member, None] * x[member], dim=0)
            weights_sum[j] = torch.sum(weights[member])
        filled = weights_sum > 0
        new = torch.zeros_like(weighted_sum)
        new[filled] = weighted_sum[filled] / weights_sum[filled, None]
        empty = k - int(filled.sum())
        if empty:
            new[~filled] = torch.stack([x[rng.randint(0, n - 1)] for _ in range(empty)])
        if torch.norm(centroids - new, dim=1).sum() < tol:
            break
        centroids = new
    return centroids, weights_sum


def dot_product_weights(memory: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Untrained stand-in for their `NeuralTuringMachine.get_weight`: softmax of scaled dot products."""
    return torch.softmax(memory @ new.T / memory.shape[-1] ** 0.5, dim=-1)


class StarMemory:
    """STAR memory for one stream: `update` with each frame's (P, D) patch features, `readout` before a question."""

    def __init__(self, config: StarConfig = StarConfig(), attention: AttentionWeights | None = None, seed: int = 0):
        if config.retrieval not in ("original", "nearest"):
            raise ValueError(f"retrieval must be 'original' or 'nearest', got {config.retrieval!r}")
        self.config = config
        self.attention = attention or dot_product_weights
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        self.frames = 0
        self.generator = torch.Generator().manual_seed(self.seed)  # k-means starts (their torch.randperm)
        self.rng = random.Random(self.seed)  # empty-cluster re-seeding (their random.randint)
        self.spatial: deque[torch.Tensor] = deque(maxlen=self.config.spatial_length)
        self.centroids: torch.Tensor | None = None  # (K, t², D) temporal memory
        self.weights: torch.Tensor | None = None  # (K,) weight of each centroid (unit-weight counts by default)
        self.key_rows: torch.Tensor | None = None  # (k, s², D) retrieved frames, fine tokens ("original")
        self.buffer: list[torch.Tensor] = []  # fine tokens of the frames "original" retrieval can reach
        self.keys: torch.Tensor | None = None  # (K, s², D) each centroid's representative frame ("nearest")
        self.key_coarse: torch.Tensor | None = None  # (K, t², D) the same frames, pooled like the centroids
        self.abstract: torch.Tensor | None = None  # (A, a², D)

    # --- updates -------------------------------------------------------------------------------

    @torch.no_grad()
    def update(self, patches: torch.Tensor) -> None:
        """Add one frame: (P, D) features on a square grid of P patches."""
        cfg = self.config
        fine = pool_grid(patches.float(), cfg.spatial_size)
        self.spatial.append(fine)
        if len(self.buffer) <= cfg.temporal_length:
            self.buffer.append(fine)
        self._update_temporal(fine, pool_grid(fine, cfg.temporal_size))
        self._update_abstract(pool_grid(fine, cfg.abstract_size))
        self.frames += 1

    def update_clip(self, frames: torch.Tensor) -> None:
        """(T, P, D): frame by frame, in order."""
        for patches in frames:
            self.update(patches)

    def _update_temporal(self, fine: torch.Tensor, coarse: torch.Tensor) -> None:
        cfg = self.config
        one = torch.ones(1, dtype=coarse.dtype, device=coarse.device)
        if self.centroids is None:  # first frame: nothing to retrieve from yet
            self.centroids, self.weights = coarse[None], one
            self.keys, self.key_coarse = fine[None], coarse[None]
            return
        points = _append(self.centroids, coarse)
        weights = torch.cat([self.weights if cfg.carry_weights else torch.ones_like(self.weights), one])
        keys, key_coarse = _append(self.keys, fine), _append(self.key_coarse, coarse)
        if points.shape[0] <= cfg.temporal_length:
            centroids, mass, pick = points, weights, None
        else:
            flat, mass = weighted_kmeans(points.flatten(1), weights, cfg.temporal_length, cfg.kmeans_iters,
                                         cfg.kmeans_tol, self.generator, self.rng)
            centroids = flat.view(-1, *coarse.shape)
            pick = torch.cdist(flat, key_coarse.flatten(1), compute_mode="donot_use_mm_for_euclid_dist").argmin(dim=1)
        if cfg.retrieval == "original":
            self.key_rows = self._their_key_frames(points, mass)
        self.centroids, self.weights = centroids, mass
        self.keys, self.key_coarse = (keys, key_coarse) if pick is None else (keys[pick], key_coarse[pick])

    def _their_key_frames(self, points: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`embed_video_streaming`'s retrieval: cluster ids sorted by weight index the pre-clustering rows."""
        order = torch.argsort(weight, descending=True)
        key_centroids = points[order][: self.config.retrieved]
        dists = ((points.unsqueeze(1) - key_centroids.unsqueeze(0)) ** 2).sum(dim=3).sum(dim=2).sqrt()
        return torch.stack([self.buffer[i] for i in torch.argmin(dists, dim=0).tolist()])

    def _update_abstract(self, token: torch.Tensor) -> None:
        """Their `attention`: each slot moves toward the new tokens by its attention weight × update_ratio."""
        cfg = self.config
        slots = _append(self.abstract, token)
        if slots.shape[0] <= cfg.abstract_length:
            self.abstract = slots
            return
        memory, new = slots[: cfg.abstract_length].flatten(0, 1), slots[cfg.abstract_length:].flatten(0, 1)
        weight = self.attention(memory, new).float() * cfg.update_ratio  # (M, N)
        memory = memory * (1 - weight.sum(dim=1, keepdim=True)) + weight @ new
        self.abstract = memory.view(cfg.abstract_length, *token.shape)

    # --- read-out ------------------------------------------------------------------------------

    def retrieved(self) -> torch.Tensor:
        """(k, s², D): the key frames ("original": as their loop picks them; "nearest": representative frames
        of the heaviest centroids, heaviest first).

        Empty until a second frame arrives: their loop retrieves only once it has an old memory.
        """
        if self.frames < 2:
            return self.keys[:0] if self.keys is not None else torch.empty(0)
        if self.config.retrieval == "original":
            return self.key_rows
        order = torch.sort(self.weights, descending=True, stable=True).indices[: self.config.retrieved]
        return self.keys[order]

    def parts(self) -> dict[str, torch.Tensor]:
        """Each part as (tokens, D), in read-out order."""
        if self.frames == 0:
            return {}
        return {"abstract": self.abstract.flatten(0, 1), "temporal": self.centroids.flatten(0, 1),
                "retrieved": self.retrieved().flatten(0, 1), "spatial": torch.cat(list(self.spatial))}

    def readout(self) -> torch.Tensor:
        """(N, D) visual tokens for a question: abstract, temporal, retrieved, spatial, the order their
        `embed_video_streaming` / `prepare_inputs_labels_for_multimodal_streaming` concatenate them."""
        parts = self.parts()
        return torch.cat(list(parts.values())) if parts else torch.empty(0)

    def __len__(self) -> int:
        return sum(part.shape[0] for part in self.parts().values())


def _append(stack: torch.Tensor | None, item: torch.Tensor) -> torch.Tensor:
    return item[None] if stack is None else torch.cat([stack, item[None]])
