"""A decode step on fixed shapes, compiled once and replayed (issue 23, item 2).

A bounded cache keeps each layer's K/V in a buffer of fixed capacity (buffer.py), so a decode step can
run on shapes that never change: the new row is written at index n (a tensor, so a new n is not a new
graph), attention reads the whole buffer with the rows past n masked, and the token's position is n.
transformers' `StaticLayer` works the same way; here the buffers stay the streaming cache's own, viewed
through `BufferView` for the step. On such shapes `torch.compile` traces the model's own forward once: on a
CPU into inductor's C++ kernels, on a GPU into CUDA graphs of autotuned kernels.

Only a plain step of a bounded cache can run this way (an unbounded one keeps growing its buffers, and each
new shape is a new compile): every layer holds the same rows from position 0 under 1-D RoPE, and no policy or
observer acts while decoding (H2O, Elastic and PrefixKV score every step; per-layer budgets and
multimodal RoPE place rows apart from positions). `CompiledDecode.step` says None for any other, and the
session runs the eager step instead. Compiling costs time once per model and buffer shape (30 s to 2 min for
SmolLM2-135M on 2 CPU cores, less once inductor's on-disk cache holds it), and on a CPU the compiled step is
no faster (a decode step there is matrix-vector products at memory bandwidth: `python -m benchmarks
compiled_decode`), so it is an option of the session, off by default; `stream-qa` turns it on with a CUDA device,
where the step is 5-9x faster than eager (a 7B model on an H200). On a GPU the session launches the step for
an answer token before handing the token over (`launch`), and the layers count the new row only if the answer goes
on (`commit`), so the graph runs while the host hands the token over and prepares the next one.
"""

import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class BufferView(CacheLayerMixin):
    """One layer's whole K/V buffers (B, H, capacity, D) for a compiled step, the new row written at `row`."""

    is_compileable = True
    is_sliding = False

    def __init__(self, row: torch.Tensor):
        super().__init__()
        self.row = row
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        raise RuntimeError("a BufferView is bound to a layer's buffers before the step")

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.row, key_states)
        self.values.index_copy_(2, self.row, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0  # the whole buffer; the causal mask hides the rows past `row`

    def get_seq_length(self) -> torch.Tensor:
        return self.row[0]  # a tensor, as StaticLayer's: the mask's query offset, without a recompile per step

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class CompiledDecode:
    """The compiled decode step of one model, shared by its sessions (one trace serves them all while their
    buffers have one shape). `step(cache, token)` runs it on `cache`'s buffers once `why_not(cache)` has found
    the step plain (see the module docstring), or returns None when the buffers are full."""

    def __init__(self, model):
        self.model = model
        self.row = torch.zeros(1, dtype=torch.long, device=model.device)
        self.steps = 0  # steps run compiled, all sessions together
        self.failed: str | None = None  # why compiling failed: every later step runs eagerly
        layers = model.config.get_text_config().num_hidden_layers
        self.view = Cache(layers=[BufferView(self.row) for _ in range(layers)])
        # on a GPU, CUDA graphs with autotuned kernels: Vicuna-7B's step on an H200 took 5.27 ms a replay with
        # inductor's default kernels, and 4.27 ms of kernel time autotuned (benchmarks/results/README.md)
        self._forward = torch.compile(self._step, dynamic=False,
                                      mode="max-autotune" if model.device.type == "cuda" else None)

    def _step(self, token: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=token, past_key_values=self.view, cache_position=self.row,
                          position_ids=self.row[None], use_cache=True).logits

    @staticmethod
    def why_not(cache) -> str | None:
        """Why `cache`'s next decode step cannot run compiled (None: it can)."""
        layers = cache.layers
        if not cache.static:
            return "its K/V are not in buffers"
        if cache.budgets is None:
            return "an unbounded cache grows its buffers, and each new shape is a new compile"
        if cache.multimodal:
            return "multimodal RoPE places rows apart from positions"
        if cache.policy.evict_while_decoding:
            return f"{type(cache.policy).name} evicts while decoding"
        if not layers or not all(layer.is_initialized for layer in layers):
            return "the cache is empty"
        if cache.decode_observers:
            return "an observer scores decode steps"
        n = layers[0].get_seq_length()
        if any(layer.start or layer.get_seq_length() != n for layer in layers):
            return "its layers hold different rows (per-layer budgets)"
        return None

    def step(self, cache, token: torch.Tensor) -> torch.Tensor | None:
        """The logits (B, V) after `token` (B,), its K/V written into `cache`, whose step the caller found plain
        (`why_not` is None: nothing it checks changes within an answer); None if the buffers have no free row."""
        logits = self.launch(cache, token)
        if logits is not None:
            self.commit(cache)
        return logits

    def launch(self, cache, token: torch.Tensor) -> torch.Tensor | None:
        """`step` without its bookkeeping: `token`'s K/V go into the buffers' first free row, but the cache holds
        them only after `commit`. Until then the step may be dropped (the answer ended at `token`), and the next
        turn overwrites the row. On a GPU this returns once the work is queued."""
        if self.failed:
            return None
        if cache.free_rows() <= 0:
            return None  # no free row: the eager step grows the buffers (and the next trace takes the new shape)
        for view, (keys, values) in zip(self.view.layers, cache.buffers(), strict=True):
            if view.keys is not keys or view.values is not values:
                view.keys, view.values = keys, values
                if keys.is_cuda:  # CUDA graphs replay on fixed addresses
                    torch._dynamo.mark_static_address(keys)
                    torch._dynamo.mark_static_address(values)
        self.row.fill_(cache.get_seq_length())  # every layer holds the same rows from position 0 (`why_not`)
        try:
            logits = self._forward(token[:, None])
        except Exception as err:  # noqa: BLE001 - no compiler here (a GPU without Triton), an op it cannot trace…
            # whatever the step wrote is past the cache's end: the eager step writes that row again
            self.failed = failed("compiled decode", err)
            return None
        return logits[:, -1].clone()  # a CUDA graph's output is overwritten next replay

    def commit(self, cache) -> None:
        """The launched step's row is the cache's."""
        cache.written(1)
        self.steps += 1


def failed(what: str, err: Exception) -> str:
    """Why a compiled step failed, in one line, warned once: its caller decodes eagerly from then on."""
    lines = str(err).strip().splitlines()
    why = f"{type(err).__name__}: {lines[0] if lines else ''}"
    warnings.warn(f"{what} failed ({why[:200]}); decoding eagerly from now on", stacklevel=3)
    return why


def compiled_decode(model) -> CompiledDecode:
    """The model's compiled decode step, made on first use and kept on the model (it refers to the model, so
    a table keyed by model would keep every model alive; an attribute goes with it)."""
    if getattr(model, "_inf_mllm_compiled_decode", None) is None:
        model._inf_mllm_compiled_decode = CompiledDecode(model)
    return model._inf_mllm_compiled_decode
