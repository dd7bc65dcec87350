"""Independent NumPy references for Inf-MLLM, our variant of it, StreamingLLM, SnapKV, H2O and Elastic Cache,
written from their papers (our variant: from its description).

Each reference is transcribed from the method's own description (equations, algorithm), not from
inf_mllm/policies/ or inf_mllm/cache.py, and compared with our implementation on random attention:
SnapKV and H2O through `make_policy(...).select(...)` on LayerViews, and every method end to end through a
small `StreamingCache` fed the way a model feeds it (each forward appends K/V, then the attention function
reports its scores; see `Fed`), so the observers, `evict()`, `step()`, `keep` and `merge` are all on the path.

Attention comes from random queries and keys (softmax of continuous logits), so no two scores tie and the
kept indices must match exactly (max pooling, which copies a peak onto its neighbours, is checked tie-aware).
Where our implementation makes a documented choice the paper leaves open (GQA grouping, the recent/heavy split,
post-RoPE keys), the reference says so and follows that choice; where the paper says otherwise, an xfail says how.
"""

import numpy as np
import pytest
import torch

from inf_mllm import StreamingCache
from inf_mllm.policies import LayerView, make_policy

D = 8  # head dim of the synthetic layers

# --- shared NumPy pieces ------------------------------------------------------------------------------


def causal_softmax(q, k):
    """Attention of m queries sitting at the last m of n positions: q (Hq, m, D), k (Hkv, n, D) ->
    (Hq, m, n), float64. Query head h reads KV head h // (Hq / Hkv); query i sees keys 0..n-m+i."""
    hq, m, d = q.shape
    hkv, n, _ = k.shape
    g = hq // hkv
    logits = np.einsum("hmd,hnd->hmn", q.astype(np.float64), np.repeat(k.astype(np.float64), g, axis=0))
    logits /= np.sqrt(d)
    visible = np.arange(n)[None, :] <= (np.arange(m) + n - m)[:, None]
    logits = np.where(visible, logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    w = np.exp(logits)
    return w / w.sum(axis=-1, keepdims=True)


def rope(x, delta, inv_freq):
    """Rotate vectors x (..., T, D) by delta[t] positions, half-split RoPE layout (the first D/2 dims pair with
    the last D/2): (a, b) -> (a cos - b sin, b cos + a sin), angle = delta * inv_freq."""
    angle = np.asarray(delta, dtype=np.float64)[:, None] * np.asarray(inv_freq, dtype=np.float64)[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    h = x.shape[-1] // 2
    a, b = x[..., :h].astype(np.float64), x[..., h:].astype(np.float64)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def group_mean(per_query_head, hkv):
    """(Hq, ...) -> (Hkv, ...): the mean over each KV head's group of query heads."""
    hq = per_query_head.shape[0]
    return per_query_head.reshape(hkv, hq // hkv, *per_query_head.shape[1:]).mean(axis=1)


def inv_freq_of(rotating):
    return 1.0 / (10000 ** (np.arange(0, D, 2) / D)) if rotating else np.zeros(D // 2)


# --- the cache, fed as a model would feed it --------------------------------------------------------------


class Fed:
    """A StreamingCache with `layers` layers and no model: `forward` appends one forward's K/V to a layer, then
    reports the attention of the queries the cache's observers ask for, computed here in torch from the layer's
    own (possibly evicted, merged, re-rotated) keys, exactly as the observing attention function would.

    Every token's value carries its id in channel 0 (values are never rotated), so which tokens a layer holds
    can be read back from it."""

    def __init__(self, policy, budget, layers, inv_freq):
        self.cache = StreamingCache(policy, [budget] * layers, torch.tensor(inv_freq, dtype=torch.float32), layers)

    def forward(self, i, q, k, v, decoding=False):
        with self.cache.forward(k.shape[1], decoding=decoding) as fwd:  # the seam a session opens around each forward
            self._forward(self.cache.layers[i], fwd, q, k, v)

    @staticmethod
    def _forward(layer, fwd, q, k, v):
        layer.update(torch.tensor(k, dtype=torch.float32)[None], torch.tensor(v, dtype=torch.float32)[None], fwd)
        l = layer.window_len(q.shape[1], fwd)
        if l == 0:
            return
        keys = layer.keys  # (1, Hkv, n, D)
        query = torch.tensor(q[:, -l:], dtype=torch.float32)[None]  # (1, Hq, l, D)
        hq, hkv, n = query.shape[1], keys.shape[1], keys.shape[2]
        logits = query @ keys.repeat_interleave(hq // hkv, dim=1).transpose(-1, -2) * D ** -0.5
        hidden = torch.arange(n)[None, :] > (torch.arange(l) + n - l)[:, None]
        scores = logits.masked_fill(hidden, float("-inf")).softmax(dim=-1).mean(dim=2)  # (1, Hq, n)
        layer.observe_scores(scores, l, query, keys, D ** -0.5)

    def ids(self, i):
        """Token ids layer i holds, (Hkv, K)."""
        return self.cache.layers[i].values[0, :, :, 0].round().long().numpy()


def random_tokens(rng, hq, hkv, first, count, inv_freq):
    """Queries, keys (post-RoPE at positions first..first+count-1) and values of `count` new tokens, whose
    values carry their ids in channel 0."""
    pos = np.arange(first, first + count)
    q = rope(rng.normal(size=(hq, count, D)) * 1.5, pos, inv_freq)
    k = rope(rng.normal(size=(hkv, count, D)) * 1.5, pos, inv_freq)
    v = rng.normal(size=(hkv, count, D))
    v[..., 0] = pos
    return q, k, v


# --- SnapKV -------------------------------------------------------------------------------------------------


def snapkv_reference(w_obs, budget, num_kv_heads, kernel=5, pooling="avg", return_scores=False):
    """SnapKV (Li et al. 2024, Sec. 4: the observation window votes, pooling clusters, top-k selects).

    w_obs (Hq, L_obs, L) is the attention of the observation window (the last L_obs prompt queries) over all L
    cached tokens; the prefix is the first L_prefix = L - L_obs.
    1. Voting: C = sum_i W_obs[:, i, :L_prefix], each prefix token's attention summed over the window.
    2. Clustering: C smoothed by a 1-D pooling, stride 1, kernel `kernel`, padding kernel // 2 on each side;
       average pooling divides by the kernel size with the padding counted as zeros (the released code's default
       'avgpool', kernel 5: our deliberate choice; that code also offers max pooling, which its ablation
       configurations run with kernel 7).
    3. Selection: I = Top_k(C, k), k = budget - L_obs; the window itself is always kept.
    The paper selects per attention head (MHA). With GQA our choice is one set per KV head, voting with the mean
    of its group's votes (pooled after the mean), so the reference averages the groups too.
    Returns the kept indices, (Hkv, budget), ascending (and the pooled votes with return_scores)."""
    hq, l_obs, length = w_obs.shape
    prefix = length - l_obs
    votes = group_mean(w_obs[:, :, :prefix].sum(axis=1), num_kv_heads)  # (Hkv, L_prefix)
    pad = kernel // 2
    fill = 0.0 if pooling == "avg" else -np.inf
    padded = np.full((num_kv_heads, prefix + 2 * pad), fill)
    padded[:, pad:pad + prefix] = votes
    pooled = np.empty_like(votes)
    for j in range(prefix):
        span = padded[:, j:j + kernel]
        pooled[:, j] = span.sum(axis=1) / kernel if pooling == "avg" else span.max(axis=1)
    top = np.argsort(-pooled, axis=1, kind="stable")[:, :budget - l_obs]
    window = np.broadcast_to(np.arange(prefix, length), (num_kv_heads, l_obs))
    kept = np.sort(np.concatenate([top, window], axis=1), axis=1)
    return (kept, pooled) if return_scores else kept


def prompt_attention(rng, n, l_obs, hq, hkv):
    """Causal attention of the last l_obs of n tokens, from random queries and keys: (Hq, l_obs, n)."""
    q = rng.normal(size=(hq, l_obs, D)) * 1.5
    k = rng.normal(size=(hkv, n, D)) * 1.5
    return causal_softmax(q, k)


SNAPKV_CASES = [  # (n, prompt_len, window, budget, Hq, Hkv, kernel, pooling, seed)
    (200, 200, 32, 96, 4, 2, 5, "avg", 0),
    (600, 600, 32, 160, 8, 2, 5, "avg", 1),
    (300, 80, 16, 64, 6, 3, 5, "avg", 2),  # a later turn: the layer holds earlier tokens too
    (150, 150, 8, 40, 4, 4, 5, "avg", 3),  # MHA
    (400, 400, 24, 100, 8, 1, 7, "avg", 4),  # MQA, a wider kernel
    (400, 400, 32, 128, 8, 2, 7, "max", 5),  # max pooling, kernel 7
    (120, 20, 32, 60, 4, 2, 5, "avg", 6),  # a prompt shorter than the window: the whole prompt is the window
]


@pytest.mark.parametrize("case", SNAPKV_CASES, ids=lambda c: "n{}-p{}-w{}-b{}-{}x{}-k{}{}-s{}".format(*c))
def test_snapkv_select_matches_the_paper(case):
    n, prompt_len, window, budget, hq, hkv, kernel, pooling, seed = case
    l_obs = min(window, prompt_len)  # what the window observer scores
    w_obs = prompt_attention(np.random.default_rng(seed), n, l_obs, hq, hkv)
    view = LayerView(n=n, prompt_len=prompt_len, num_kv_heads=hkv,
                     stats={"window": torch.tensor(w_obs.mean(axis=1), dtype=torch.float32)[None]})
    policy = make_policy("snapkv", window=window, pool=kernel, pool_mode=pooling)
    got = policy.select(view, budget)
    want, pooled = snapkv_reference(w_obs, budget, hkv, kernel, pooling, return_scores=True)
    assert got.shape == (1, hkv, budget)
    if pooling == "avg":  # continuous scores: no ties, one right answer
        np.testing.assert_array_equal(got[0].numpy(), want)
    else:  # max pooling copies a peak onto its neighbours: ties by construction, any of them may fill the last places
        k = budget - l_obs
        for h in range(hkv):
            chosen = got[0, h].numpy()
            assert np.array_equal(chosen[k:], want[h, k:])  # the window
            kth = np.sort(pooled[h])[::-1][k - 1]
            assert set(np.flatnonzero(pooled[h] > kth)) <= set(chosen[:k]) and (pooled[h][chosen[:k]] >= kth).all()
    # the pooling matters on these scores: without it a different set is chosen
    assert not np.array_equal(snapkv_reference(w_obs, budget, hkv, 1, pooling), want)


@pytest.mark.parametrize("hq,hkv,seed", [(4, 2, 10), (6, 3, 11), (4, 1, 12)])
def test_snapkv_turns_through_the_cache(hq, hkv, seed):
    """Two prompts through a 2-layer cache, each answered by 3 decode steps: at each prompt's end SnapKV
    compresses what the layer holds with that prompt's observation window; decoding keeps every new token (the
    paper compresses the prompt only). The reference recomputes the window's attention over its own copy of the
    kept tokens (keys unrotated, inv_freq = 0, so content alone decides)."""
    rng = np.random.default_rng(seed)
    window, budget, layers = 16, 48, 2
    fed = Fed(make_policy("snapkv", window=window), budget, layers, inv_freq_of(False))
    held = [np.zeros((hkv, 0), dtype=int) for _ in range(layers)]  # per layer: token ids kept per KV head
    keys = [np.zeros((hkv, 0, D)) for _ in range(layers)]  # every token's key, by id
    token = 0
    for turn_len in (90, 70):
        l_obs = min(window, turn_len)
        for i in range(layers):
            q, k, v = random_tokens(rng, hq, hkv, token, turn_len, inv_freq_of(False))
            keys[i] = np.concatenate([keys[i], k], axis=1)
            fed.forward(i, q, k, v)
            ids = np.concatenate([held[i], np.broadcast_to(np.arange(token, token + turn_len), (hkv, turn_len))], 1)
            kept = []
            for h in range(hkv):  # each KV head holds its own tokens: its group attends over them
                group = slice(h * (hq // hkv), (h + 1) * (hq // hkv))
                w_obs = causal_softmax(q[group, -l_obs:], keys[i][h:h + 1, ids[h]])
                kept.append(ids[h][snapkv_reference(w_obs, budget, 1)[0]])
            held[i] = np.stack(kept)
        token += turn_len
        fed.cache.evict()
        for i in range(layers):
            np.testing.assert_array_equal(fed.ids(i), held[i])
        for _ in range(3):
            for i in range(layers):
                q, k, v = random_tokens(rng, hq, hkv, token, 1, inv_freq_of(False))
                keys[i] = np.concatenate([keys[i], k], axis=1)
                fed.forward(i, q, k, v, decoding=True)
                held[i] = np.concatenate([held[i], np.full((hkv, 1), token)], axis=1)
            token += 1
            fed.cache.step()
            for i in range(layers):
                np.testing.assert_array_equal(fed.ids(i), held[i])
    assert held[0].shape == (hkv, budget + 3)


# --- Inf-MLLM, our variant of it, StreamingLLM and the window ----------------------------------------------


def inf_mllm_reference(w_obs, budget, bias):
    """Inf-MLLM (Ning et al. 2024), Algorithm 1. w_obs (Hq, l, n): the attention of the prompt's last l queries (its
    retrieval window) over the n cached tokens. S_j = the mean over the window's queries and every head of the
    attention paid to candidate j (the n - l older tokens); D_j = -(c - 1 - j) b / c, the recency bias over the c
    candidates; the layer keeps the top r = budget - l of S + D and the l window tokens: one set for all heads."""
    hq, l, n = w_obs.shape
    c = n - l
    s = w_obs[:, :, :c].mean(axis=(0, 1)) - np.arange(c - 1, -1, -1) * bias / c
    top = np.argsort(-s, kind="stable")[:budget - l]
    return np.sort(np.concatenate([top, np.arange(c, n)]))


def inf_mllm_plus_reference(w_obs, budget, num_kv_heads, bias, sinks, pool, return_scores=False):
    """Our variant of Inf-MLLM, from its description (inf_mllm_plus's docstring and ARCHITECTURE.md): each KV head
    keeps its own set, scored by the mean window attention of its query group; the scores max-pooled over `pool`
    neighbours (stride 1, the window centred, nothing past the ends); a relative bias, the oldest candidate losing
    `bias` times the mean pooled score (D_j = -(c - 1 - j) b / c of it); the first `sinks` tokens always kept; then
    the top budget - l and the l window tokens. Returns (Hkv, budget), ascending (and the adjusted scores)."""
    hq, l, n = w_obs.shape
    c = n - l
    s = group_mean(w_obs[:, :, :c].mean(axis=1), num_kv_heads)  # (Hkv, c)
    half = pool // 2
    pooled = np.stack([s[:, max(0, j - half):j + half + 1].max(axis=1) for j in range(c)], axis=1)
    adjusted = pooled - np.arange(c - 1, -1, -1) * bias / c * pooled.mean(axis=1, keepdims=True)
    adjusted[:, :min(sinks, c)] = np.inf
    top = np.argsort(-adjusted, axis=1, kind="stable")[:, :budget - l]
    window = np.broadcast_to(np.arange(c, n), (num_kv_heads, l))
    kept = np.sort(np.concatenate([top, window], axis=1), axis=1)
    return (kept, adjusted) if return_scores else kept


# the shapes and options of every case the kept-index golden file held (recorded from the code itself, retired
# for these references): (policy, options, n, prompt_len, budget, Hq, Hkv)
WINDOWED_CASES = [
    ("inf_mllm", {"window": 8, "bias": 0.01}, 60, 20, 24, 4, 2),
    ("inf_mllm", {"window": 32, "bias": 0.1}, 400, 64, 128, 9, 3),
    ("inf_mllm", {"window": 64, "bias": 0.0}, 500, 20, 100, 6, 2),
    ("inf_mllm", {"window": 16, "bias": 0.05}, 300, 300, 96, 8, 1),
    ("inf_mllm_plus", {"window": 8}, 60, 20, 24, 4, 2),
    ("inf_mllm_plus", {"window": 32, "bias": 0.5, "pool": 5}, 400, 64, 128, 9, 3),
    ("inf_mllm_plus", {"window": 16, "sinks": 2, "pool": 1}, 300, 10, 64, 6, 6),
    ("inf_mllm_plus", {"window": 64}, 120, 100, 80, 4, 2),
]


@pytest.mark.parametrize("i", range(len(WINDOWED_CASES)), ids=lambda i: "-".join(map(str, WINDOWED_CASES[i][::2])))
def test_inf_mllm_and_our_variant_select_as_described(i):
    name, options, n, prompt_len, budget, hq, hkv = WINDOWED_CASES[i]
    policy = make_policy(name, **options)
    l_obs = min(policy.window, prompt_len)  # what the window observer scores, and what is always kept
    w_obs = prompt_attention(np.random.default_rng(100 + i), n, l_obs, hq, hkv)
    view = LayerView(n=n, prompt_len=prompt_len, num_kv_heads=hkv,
                     stats={"window": torch.tensor(w_obs.mean(axis=1), dtype=torch.float32)[None]})
    got = policy.select(view, budget)
    if name == "inf_mllm":
        assert got.shape == (1, budget)
        np.testing.assert_array_equal(got[0].numpy(), inf_mllm_reference(w_obs, budget, policy.bias))
        return
    want, scores = inf_mllm_plus_reference(w_obs, budget, hkv, policy.bias, policy.sinks, policy.pool, True)
    assert got.shape == (1, hkv, budget)
    k = budget - l_obs
    for h in range(hkv):  # max pooling ties neighbours: any of them may take the last places
        chosen = got[0, h].numpy()
        assert np.array_equal(chosen[k:], want[h, k:])  # the window
        kth = np.sort(scores[h])[::-1][k - 1]
        assert set(np.flatnonzero(scores[h] > kth)) <= set(chosen[:k]), (h, chosen, want[h])
        assert np.allclose(scores[h][chosen[:k]][scores[h][chosen[:k]] < kth], kth, rtol=1e-5), (h, chosen, want[h])
    if policy.pool == 1:  # no pooling, no ties: one right answer
        np.testing.assert_array_equal(got[0].numpy(), want)


@pytest.mark.parametrize("n,budget,sinks", [(50, 20, 4), (300, 128, 1), (300, 128, 0), (64, 64, 4)])
def test_streaming_llm_and_the_window_keep_sinks_and_the_newest(n, budget, sinks):
    """StreamingLLM (Xiao et al. 2023): the first `sinks` tokens and the budget - sinks most recent; the window:
    the `budget` most recent."""
    view = LayerView(n=n, prompt_len=10, num_kv_heads=2)
    want = np.concatenate([np.arange(sinks), np.arange(n - (budget - sinks), n)])
    np.testing.assert_array_equal(make_policy("streaming_llm", sinks=sinks).select(view, budget)[0].numpy(), want)
    np.testing.assert_array_equal(make_policy("window").select(view, budget)[0].numpy(), np.arange(n - budget, n))


# --- H2O ----------------------------------------------------------------------------------------------------


class H2OReference:
    """H2O (Zhang et al. 2023), its Algorithm 1 (greedy H2 eviction) with the budget split of its Sec. 5
    ("evenly assigns the caching budget to H2 and the most recent KV"), for one layer.

    Each head keeps a set S of tokens and, for each, F: the attention every query paid it since it arrived, each
    query's attention normalised over the set it saw (Algorithm 1's o_i, a softmax over S_{i-1} + {i}). The
    algorithm's F_score sums o_i; Sec. 4.1 and Fig. 3 make it the accumulated score ("summing up the attention
    scores of the previous tokens" at every decoding step), which is what is summed here. A new token joins S;
    while S is over budget, u = argmax_v F_score(S - {v}) goes, i.e. argmin F, among all but the `recent` newest
    tokens (the local share, always kept).

    Our deliberate choices, followed here: recent = max(1, int(budget * recent_ratio)) (0.5 is the paper's even
    split); one set per KV head scored by its group of query heads (the paper is MHA; the group's sum ranks as its
    mean); a prompt is one forward whose full causal attention is accumulated before its eviction (Algorithm 1's
    one-token-at-a-time loop is the generative process, i.e. the decode steps); then one eviction per decode step.

    Positions: our cache keeps its tokens at contiguous positions (re-rotating kept keys), so this reference
    takes raw keys and queries and places the j-th token of a head's set at position j, and a forward's m new
    queries at the last m positions; with inv_freq = 0 positions play no part, as in the paper's setting."""

    def __init__(self, budget, recent_ratio, hq, hkv, inv_freq):
        self.budget, self.recent = budget, max(1, int(budget * recent_ratio))
        self.hq, self.hkv, self.inv_freq = hq, hkv, inv_freq
        self.ids = [np.zeros(0, dtype=int) for _ in range(hkv)]
        self.f = [np.zeros(0) for _ in range(hkv)]
        self.raw = np.zeros((hkv, 0, D))  # every token's key before RoPE, by id

    def _evict(self, h):
        newest = self.ids[h].max()
        while len(self.ids[h]) > self.budget:
            old = self.ids[h] <= newest - self.recent
            u = np.flatnonzero(old)[np.argmin(self.f[h][old])]
            self.ids[h], self.f[h] = np.delete(self.ids[h], u), np.delete(self.f[h], u)

    def forward(self, q, k):
        """Raw q (Hq, m, D), k (Hkv, m, D) of m new tokens, whose queries attend causally over each head's set."""
        first, m = self.raw.shape[1], k.shape[1]
        self.raw = np.concatenate([self.raw, k], axis=1)
        g = self.hq // self.hkv
        for h in range(self.hkv):
            self.ids[h] = np.concatenate([self.ids[h], np.arange(first, first + m)])
            self.f[h] = np.concatenate([self.f[h], np.zeros(m)])
            n = len(self.ids[h])
            keys = rope(self.raw[h, self.ids[h]], np.arange(n), self.inv_freq)[None]
            queries = rope(q[h * g:(h + 1) * g], np.arange(n - m, n), self.inv_freq)
            self.f[h] += causal_softmax(queries, keys).sum(axis=(0, 1))  # (g, m, |S|) summed
            self._evict(h)

    def kept(self):
        return np.stack(self.ids)


H2O_CASES = [  # (n, budget, recent_ratio, Hq, Hkv, seed)
    (120, 40, 0.5, 4, 2, 0),
    (300, 64, 0.5, 8, 2, 1),
    (300, 100, 0.25, 6, 3, 2),
    (200, 50, 0.8, 4, 4, 3),
    (256, 33, 0.5, 8, 1, 4),
]


@pytest.mark.parametrize("case", H2O_CASES, ids=lambda c: "n{}-b{}-r{}-{}x{}-s{}".format(*c))
def test_h2o_select_matches_the_paper(case):
    n, budget, ratio, hq, hkv, seed = case
    rng = np.random.default_rng(seed)
    q, k, _ = random_tokens(rng, hq, hkv, 0, n, inv_freq_of(False))
    ref = H2OReference(budget, ratio, hq, hkv, inv_freq_of(False))
    ref.forward(q, k)
    a = causal_softmax(q, k)  # the prompt's full attention, as the accumulated observer sums it
    acc = torch.tensor(a.sum(axis=1).reshape(hkv, hq // hkv, n).sum(axis=1), dtype=torch.float32)[None]
    view = LayerView(n=n, prompt_len=n, num_kv_heads=hkv, stats={"acc": acc})
    got = make_policy("h2o", recent_ratio=ratio).select(view, budget)
    np.testing.assert_array_equal(got[0].numpy(), ref.kept())


@pytest.mark.parametrize("hq,hkv,ratio,seed,rotating", [
    (4, 2, 0.5, 20, False), (6, 3, 0.25, 21, False), (4, 1, 0.5, 22, True), (2, 2, 0.75, 23, True)])
def test_h2o_decode_steps_match_the_paper(hq, hkv, ratio, seed, rotating):
    """Through a 2-layer cache: a prompt, 12 decode steps, a second prompt, 6 more steps. After each decode step
    `StreamingCache.step()` evicts one token per KV head, at each prompt's end `evict()` brings every head back
    to budget; the reference runs Algorithm 1 on its own copy of the raw keys. With rotating keys the model's
    queries and keys are placed at the cache's positions (`get_seq_length`), which after an eviction are the
    contiguous ones the reference assumes."""
    rng = np.random.default_rng(seed)
    budget, layers = 24, 2
    inv_freq = inv_freq_of(rotating)
    fed = Fed(make_policy("h2o", recent_ratio=ratio), budget, layers, inv_freq)
    refs = [H2OReference(budget, ratio, hq, hkv, inv_freq) for _ in range(layers)]
    token = 0
    for what, count in (("prompt", 60), ("decode", 12), ("prompt", 20), ("decode", 6)):
        for _ in range(count if what == "decode" else 1):
            m = count if what == "prompt" else 1
            at = fed.cache.get_seq_length()
            for i, ref in enumerate(refs):
                q, k, v = random_tokens(rng, hq, hkv, token, m, inv_freq_of(False))  # raw, ids from `token`
                where = np.arange(at, at + m)
                fed.forward(i, rope(q, where, inv_freq), rope(k, where, inv_freq), v, decoding=what == "decode")
                ref.forward(q, k)
            token += m
            if what == "decode":
                fed.cache.step()
            else:
                fed.cache.evict()
            for i, ref in enumerate(refs):
                np.testing.assert_array_equal(fed.ids(i), ref.kept(), err_msg=f"{what} ending at token {token}")
    # heavy hitters from the first prompt survived, next to the recent window
    recent = refs[0].recent
    assert (refs[0].kept() < 60).any() and (refs[0].kept() >= token - recent).sum() == hkv * recent


# --- Elastic Cache ------------------------------------------------------------------------------------------


def elastic_reference(a, keys, values, budget, inv_freq, protect=False):
    """Elastic Cache (Liu et al. 2024), Sec. 3.3 "Instruction Encoding": importance-driven cache merging.

    a (Hq, T, T): the causal attention A of each head (its Eq. 1, read with the usual softmax normaliser over
    the keys the query sees). Importance I_n = 1/K sum_j sum_m A^j_{m,n} (K query heads: layer-wise, one layout
    shared by the heads). Anchors t_1 < ... < t_N: the top N_I = gamma * T tokens by I (N_I is our budget).
    Buckets (its Eq. 2): B_1 = {0 .. floor((t_1 + t_2) / 2)}, B_k = {floor((t_{k-1} + t_k) / 2) + 1 ..
    floor((t_k + t_{k+1}) / 2)}, B_N = {floor((t_{N-1} + t_N) / 2) + 1 .. T - 1}: every token joins its nearest
    anchor, a tie going to the earlier one. (The printed last case starts at the floor itself, which would put
    that token in two buckets of what the text calls a division of the sequence: read as a typo.)
    Merge (its Eq. 3): KV_k = mean of the bucket's K and V, per head.

    Our keys are cached after RoPE; bucket k takes position k, so each member key is rotated from its position to
    k before the mean (our documented choice: the mean of keys at one position). inv_freq = 0 is plain Eq. 3.

    protect=True adds the paper's implementation detail (Sec. 4): the first and the most recent token are
    protected, i.e. kept as they are; the other N_I - 2 anchors and their buckets are chosen among the rest.
    Returns (anchors, merged keys (Hkv, N, D), merged values (Hkv, N, D))."""
    t = a.shape[1]
    importance = a.sum(axis=1).mean(axis=0)
    lo, hi = (1, t - 1) if protect else (0, t)
    inner = budget - 2 if protect else budget
    anchors = np.sort(lo + np.argsort(-importance[lo:hi], kind="stable")[:inner])
    ends = [(anchors[k] + anchors[k + 1]) // 2 for k in range(len(anchors) - 1)] + [hi - 1]
    buckets, first = [], lo
    for end in ends:
        buckets.append(np.arange(first, end + 1))
        first = end + 1
    if protect:
        buckets = [np.array([0]), *buckets, np.array([t - 1])]
        anchors = np.concatenate([[0], anchors, [t - 1]])
    merged_k = np.stack([rope(keys[:, b], np.full(len(b), k) - b, inv_freq).mean(axis=1)
                         for k, b in enumerate(buckets)], axis=1)
    merged_v = np.stack([values[:, b].mean(axis=1) for b in buckets], axis=1)
    return anchors, merged_k, merged_v


def run_elastic(t, budget, hq, hkv, seed, rotating, protect=False):
    """One prompt of t tokens through a 1-layer elastic cache, then its turn boundary (select + merge)."""
    rng = np.random.default_rng(seed)
    inv_freq = inv_freq_of(rotating)
    fed = Fed(make_policy("elastic"), budget, 1, inv_freq)
    q, k, v = random_tokens(rng, hq, hkv, 0, t, inv_freq)
    fed.forward(0, q, k, v)
    fed.cache.evict()
    anchors, want_k, want_v = elastic_reference(causal_softmax(q, k), k, v, budget, inv_freq, protect)
    return fed.cache.layers[0], anchors, want_k, want_v


ELASTIC_CASES = [  # (T, budget, Hq, Hkv, seed, rotating keys)
    (40, 10, 4, 2, 0, False),
    (200, 64, 8, 2, 1, False),
    (150, 75, 6, 3, 2, True),
    (300, 30, 4, 4, 3, True),
    (128, 100, 8, 1, 4, True),
    (64, 3, 4, 2, 5, True),  # the two protected ends and one anchor: one bucket holds all the rest
]


@pytest.mark.parametrize("case", ELASTIC_CASES, ids=lambda c: "T{}-b{}-{}x{}-s{}-rope{}".format(*c))
def test_elastic_merge_matches_the_paper(case):
    """Eq. 1-3 with Sec. 4's protection of the first and the most recent token."""
    t, budget, hq, hkv, seed, rotating = case
    layer, anchors, want_k, want_v = run_elastic(t, budget, hq, hkv, seed, rotating, protect=True)
    assert layer.keys.shape == (1, hkv, budget, D)
    np.testing.assert_allclose(layer.values[0].numpy(), want_v, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.keys[0].numpy(), want_k, rtol=1e-4, atol=1e-4)
    # a value's channel 0 is its token id: the bucket means of the ids, checked against Eq. 2 directly (the ends
    # are buckets of their own, the inner anchors' buckets split tokens 1..T-2 at their midpoints)
    inner = anchors[1:-1]
    ends = np.concatenate([[0], (inner[:-1] + inner[1:]) // 2, [t - 2, t - 1]])
    starts = np.concatenate([[0], ends[:-1] + 1])
    np.testing.assert_allclose(layer.values[0, 0, :, 0].numpy(), (starts + ends) / 2, rtol=1e-6)
    # buckets really merged something: fewer anchors than tokens, so some bucket holds several
    assert budget < t and (ends - starts).max() >= 1 and anchors[0] == 0 and anchors[-1] == t - 1


def test_elastic_protects_the_first_and_most_recent_token():
    """T = 200, N_I = 64: accumulated causal attention favours early tokens, so without the protection the anchors
    would end at token 147 and the last bucket would average tokens 131..199; with it token 199 stays a bucket of
    its own, and so does token 0."""
    layer, anchors, want_k, want_v = run_elastic(200, 64, 8, 2, 1, rotating=False, protect=True)
    np.testing.assert_allclose(layer.values[0].numpy(), want_v, rtol=1e-5, atol=1e-5)
    assert layer.values[0, 0, 0, 0] == 0 and layer.values[0, 0, -1, 0] == 199  # ids: the ends unmerged


def elastic_generation_reference(ids, new, budget, truncation):
    """Elastic Cache's output generation, fixed-point elimination (Sec. 3.3): each new token joins the queue;
    once over budget, the token at the fixed truncation location is removed, {KV_1 .. KV_{N_tl - 1},
    KV_{N_tl + 1} .. KV_{N_C + 1}}, the location fixed at the `truncation` most recent tokens (Sec. 4: 25)."""
    ids = [*ids, new]
    if len(ids) > budget:
        del ids[len(ids) - 1 - truncation]
    return ids


def test_elastic_generation_drops_at_the_fixed_truncation_point():
    """Decode steps through a 1-layer elastic cache after its merge: the instruction's merged tokens before the
    truncation point stay, the newest `truncation` stay, the one just older than them goes at each step."""
    rng = np.random.default_rng(7)
    budget, truncation, hq, hkv, prompt = 20, 6, 4, 2, 50
    fed = Fed(make_policy("elastic", truncation=truncation), budget, 1, inv_freq_of(False))
    q, k, v = random_tokens(rng, hq, hkv, 0, prompt, inv_freq_of(False))
    fed.forward(0, q, k, v)
    fed.cache.evict()
    fed.cache.layers[0].values[0, :, :, 0] = torch.arange(-budget, 0, dtype=torch.float32)  # tag the merged slots
    ids = list(range(-budget, 0))
    for step in range(30):
        q, k, v = random_tokens(rng, hq, hkv, prompt + step, 1, inv_freq_of(False))
        fed.forward(0, q, k, v, decoding=True)
        fed.cache.step()
        ids = elastic_generation_reference(ids, prompt + step, budget, truncation)
        assert fed.ids(0).tolist() == [ids, ids]
    # 30 steps later the slots before the truncation point are still the instruction's merged ones
    assert ids[:budget - truncation] == list(range(-budget, -truncation)) and ids[-1] == prompt + 29
