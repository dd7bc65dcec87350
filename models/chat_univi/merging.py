"""Chat-UniVi's token merging: DPC-KNN clustering of visual tokens, each cluster averaged into one token.

Chat-UniVi cuts a frame's 256 CLIP patch tokens to 64 + 32 + 16 = 112 tokens by clustering in three
steps, and cuts a video to a few *events* by clustering whole frames. Every step is the same
DPC-KNN (density peaks clustering with k nearest neighbours): a token's density comes from its k
nearest neighbours, its delta is the distance to the nearest denser token, the tokens with the
largest density × delta are the cluster peaks, and every token joins its nearest peak.

Values taken from Chat-UniVi's code (github.com/PKU-YuanGroup/Chat-UniVi):

- ChatUniVi/model/cluster.py (`cluster_dpc_knn`, `merge_tokens`, `CTM`): distances are Euclidean
  divided by sqrt(feature dim); density = exp(-mean of the squared distances to the k nearest
  tokens, the token itself included); the densest token's delta is the largest distance in the set;
  a cluster count above 1 is absolute, one at or below 1 is a fraction of the tokens (rounded up);
  when k exceeds the cluster count, k becomes min(3, max(clusters // 2, 1)); merged tokens are
  weighted means with all weights 1.
- ChatUniVi/config/model_config.py: spatial cluster counts 64, 32, 16; temporal rate 1/16.
- ChatUniVi/model/arch.py (`MetaModel.__init__`, `ChatUniViMetaForCausalLM.project`): k = 5, 3, 3 for
  the spatial steps and 5 for the temporal one; each step clusters the previous step's output; a
  video is one whose frames number more than 2; events cluster the frames' mean tokens, and each
  event re-runs every spatial step on its frames' tokens of that step, concatenated.

Faithful by default, with our variants as options (tests/test_originals_parity.py compares the
defaults with outputs recorded from Chat-UniVi's own code):

- Ties. Chat-UniVi adds uniform noise in [0, 1e-6) to every density (`torch.rand`, torch's global
  generator) so no two tokens tie; where densities and scores differ by more than the noise its
  clustering is deterministic, and nearer than that it follows the draw. `ties="noise"` (default)
  draws the same noise, from `generator` if one is given (a `torch.Generator` seeded like the
  global one gives the same numbers), in the same order as Chat-UniVi's `project` (temporal step
  first, then the spatial steps on every frame, then per event), so a seeded run reproduces the
  original bit for bit. `ties="index"` is our deterministic variant: no noise, the earlier token
  wins exact ties, for density and for the peak score.
- Means. Chat-UniVi divides each cluster's sum by (count + 1e-6), token by token, in the tokens'
  dtype (`merge_tokens`); `eps=MERGE_EPS` does the same, `eps=0` gives exact means.

Cluster counts are capped at the token count (Chat-UniVi would fail), which matters only for
inputs smaller than CLIP ViT-L/14's 256 patches.
"""

import math
from dataclasses import dataclass

import torch

SPATIAL_STEPS: tuple[tuple[int, int], ...] = ((64, 5), (32, 3), (16, 3))  # (clusters, k): ctm0, ctm1, ctm2
TEMPORAL_RATE = 1 / 16  # events per frame: ctm3
TEMPORAL_K = 5
REFERENCE_TOKENS = 256  # CLIP ViT-L/14 patches per 224-px frame, for which SPATIAL_STEPS were chosen
VIDEO_MIN_FRAMES = 3  # fewer frames are treated as separate images
TIE_NOISE = 1e-6  # cluster_dpc_knn: density + torch.rand(...) * 1e-6
MERGE_EPS = 1e-6  # merge_tokens: all_weight + 1e-6
TIES = ("noise", "index")


@dataclass(frozen=True)
class Clustering:
    labels: torch.Tensor  # (B, N) cluster of each token; cluster i is peak centers[:, i]
    centers: torch.Tensor  # (B, n) token index of each cluster's peak, highest score first
    density: torch.Tensor  # (B, N)
    delta: torch.Tensor  # (B, N) distance to the nearest denser token


def cluster_count(rate: float, tokens: int) -> int:
    """Chat-UniVi's CTM rule: a rate above 1 is a count, otherwise a fraction (rounded up); capped at `tokens`."""
    n = math.ceil(rate) if rate > 1 else math.ceil(tokens * rate)
    return min(max(n, 1), tokens)


def neighbours(k: int, clusters: int, tokens: int) -> int:
    """Chat-UniVi's CTM shrinks k when it exceeds the cluster count; capped at `tokens`."""
    if k > clusters:
        k = min(3, max(clusters // 2, 1))
    return min(k, tokens)


def dpc_knn(x: torch.Tensor, clusters: int, k: int, ties: str = "noise",
            generator: torch.Generator | None = None) -> Clustering:
    """Cluster (B, N, C) tokens into `clusters` groups per batch row by density peaks (ties: see the module doc)."""
    if ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, got {ties!r}")
    b, n, c = x.shape
    x = x.float()
    dist = torch.cdist(x, x) / c ** 0.5
    nearest = dist.topk(k, dim=-1, largest=False).values
    density = (-(nearest ** 2).mean(dim=-1)).exp()
    if ties == "noise":
        device = generator.device if generator is not None else density.device
        noise = torch.rand(density.shape, generator=generator, dtype=density.dtype, device=device)
        density = density + noise.to(density.device) * TIE_NOISE
        denser = density[:, None, :] > density[:, :, None]  # denser[b, i, j]: token j is denser than token i
    else:  # exact ties go to the earlier token, so exactly one peak tops all
        idx = torch.arange(n, device=x.device)
        di, dj = density[:, :, None], density[:, None, :]
        denser = (dj > di) | ((dj == di) & (idx[None, :] < idx[:, None]))
    farthest = dist.flatten(1).amax(dim=-1)[:, None, None]
    delta = torch.where(denser, dist, farthest).amin(dim=-1)
    score = delta * density
    if ties == "noise":
        centers = score.topk(clusters, dim=-1).indices  # as cluster_dpc_knn: highest score first
    else:
        centers = score.sort(dim=-1, descending=True, stable=True).indices[:, :clusters]  # ties: earlier
    to_centers = dist.gather(1, centers[:, :, None].expand(b, clusters, n))  # (B, n, N)
    labels = to_centers.argmin(dim=1)
    labels.scatter_(1, centers, torch.arange(clusters, device=x.device).expand(b, clusters).contiguous())
    return Clustering(labels, centers, density, delta)


def merge(x: torch.Tensor, labels: torch.Tensor, clusters: int, weight: torch.Tensor | None = None,
          eps: float = MERGE_EPS) -> torch.Tensor:
    """(B, N, C) tokens → (B, clusters, C): each cluster's weighted sum over (weight sum + eps), in x's dtype.

    As `merge_tokens`: every token is scaled by weight / (its cluster's weight sum + eps) and the
    scaled tokens are summed with `index_add_`, in token order (weights default to 1).
    """
    b, n, c = x.shape
    w = x.new_ones(b, n, 1) if weight is None else weight.reshape(b, n, 1).to(x.dtype)
    idx = (labels + torch.arange(b, device=x.device)[:, None] * clusters).reshape(b * n)
    total = w.new_zeros(b * clusters, 1).index_add_(0, idx, w.reshape(b * n, 1)) + eps
    scaled = x * (w / total[idx].reshape(b, n, 1))
    return x.new_zeros(b * clusters, c).index_add_(0, idx, scaled.reshape(b * n, c)).reshape(b, clusters, c)


@dataclass(frozen=True)
class Options:
    """How ties are broken and means taken (module doc); the defaults are Chat-UniVi's."""

    ties: str = "noise"
    eps: float = MERGE_EPS
    generator: torch.Generator | None = None  # for ties="noise"; None: torch's global generator, as Chat-UniVi


FAITHFUL = Options()


def cluster_merge(x: torch.Tensor, clusters: int, k: int, options: Options = FAITHFUL) -> torch.Tensor:
    """One Chat-UniVi merging step (a CTM): DPC-KNN, then averaging. (B, N, C) → (B, ≤clusters, C)."""
    n = x.shape[1]
    clusters = min(clusters, n)
    found = dpc_knn(x, clusters, neighbours(k, clusters, n), options.ties, options.generator)
    return merge(x, found.labels, clusters, eps=options.eps)


def spatial_levels(frames: torch.Tensor, steps=SPATIAL_STEPS, options: Options = FAITHFUL) -> list[torch.Tensor]:
    """(T, N, C) per-frame tokens → one (T, n_i, C) tensor per step, each step merging the previous one."""
    levels, x = [], frames
    for clusters, k in steps:
        x = cluster_merge(x, clusters, k, options)
        levels.append(x)
    return levels


def image_tokens(frames: torch.Tensor, steps=SPATIAL_STEPS, options: Options = FAITHFUL) -> torch.Tensor:
    """(T, N, C) → (T·Σn_i, C): each frame on its own, as Chat-UniVi treats one or two images."""
    return torch.cat(spatial_levels(frames, steps, options), dim=1).flatten(0, 1)


def temporal_events(frames: torch.Tensor, rate: float = TEMPORAL_RATE, k: int = TEMPORAL_K,
                    options: Options = FAITHFUL) -> list[list[int]]:
    """Group frames into events by DPC-KNN on their mean tokens; events ordered by their first frame.

    As in Chat-UniVi, clustering is in feature space only, so an event need not be contiguous in time
    (a scene that comes back joins its earlier event).
    """
    t = frames.shape[0]
    clusters = cluster_count(rate, t)
    labels = dpc_knn(frames.mean(dim=1)[None], clusters, neighbours(k, clusters, t), options.ties,
                     options.generator).labels[0]
    events: dict[int, list[int]] = {}
    for frame, label in enumerate(labels.tolist()):
        events.setdefault(label, []).append(frame)
    return list(events.values())


def video_tokens(frames: torch.Tensor, steps=SPATIAL_STEPS, rate: float = TEMPORAL_RATE,
                 k: int = TEMPORAL_K, options: Options = FAITHFUL) -> torch.Tensor:
    """(T, N, C) → (E·Σn_i, C): per event, every spatial level of its frames merged again into n_i tokens.

    The steps run in Chat-UniVi's order (events, then the levels, then per event), so seeded noise
    is drawn as theirs is.
    """
    events = temporal_events(frames, rate, k, options)
    levels = spatial_levels(frames, steps, options)
    out = []
    for event in events:
        for level, (clusters, step_k) in zip(levels, steps, strict=True):
            out.append(cluster_merge(level[event].flatten(0, 1)[None], clusters, step_k, options)[0])
    return torch.cat(out)


def clip_tokens(frames: torch.Tensor, steps=SPATIAL_STEPS, rate: float = TEMPORAL_RATE,
                k: int = TEMPORAL_K, options: Options = FAITHFUL) -> torch.Tensor:
    """A clip's merged tokens: the video path from VIDEO_MIN_FRAMES frames on, the image path below."""
    if frames.shape[0] >= VIDEO_MIN_FRAMES:
        return video_tokens(frames, steps, rate, k, options)
    return image_tokens(frames, steps, options)


def scaled_steps(tokens: int, steps=SPATIAL_STEPS) -> tuple[tuple[int, int], ...]:
    """The spatial steps for frames of `tokens` tokens: cluster counts kept at the same share of the frame."""
    return tuple((max(1, clusters * tokens // REFERENCE_TOKENS), k) for clusters, k in steps)


def tokens_per_event(steps=SPATIAL_STEPS, frame_tokens: int = REFERENCE_TOKENS) -> int:
    """Merged tokens per event (video) or per frame (image)."""
    total, n = 0, frame_tokens
    for clusters, _ in steps:
        n = min(clusters, n)
        total += n
    return total
