"""KV admission: a bounded cache's size is known before its first token, so a pool takes a stream only if the cache's
bound (budget plus headroom, every layer) fits in what is left of the pool's memory. A stream that would not fit is
refused at the door (`PoolFull`, one line), never halfway through."""

from .budget import KVShape


class PoolFull(ValueError):
    """A stream the pool cannot take (memory, or its count of streams); the message is one line."""


class Admission:
    """`kv_bytes`: memory the streams' caches may take together (None: no limit); `max_streams`: the most streams;
    `unbounded`: whether a stream with an unbounded cache (policy full, the app's comparison) is admitted beside a
    memory limit, counted at nothing, its growth its own risk; `counted`: how many times a bound counts (2 with a
    slot arena: a stream's slot, and its own buffers, which it holds until its first answer moves it into the slot)."""

    def __init__(self, model, kv_bytes: int | None = None, max_streams: int = 64, unbounded: bool = False,
                 counted: int = 1):
        self.kv_bytes, self.max_streams, self.unbounded, self.counted = kv_bytes, max_streams, unbounded, counted
        self.shape = KVShape.from_config(model.config, model.dtype.itemsize)
        # each admitted session -> its bound in bytes; held until released, so a stream dropped without `close`
        # stays counted (its cache is alive) and no new session can take over its entry by reusing its id()
        self.streams: dict = {}

    def bound(self, session) -> int | None:
        """The most bytes a session's cache holds: its budgets plus the headroom reserved (None: unbounded)."""
        cache = session.cache
        if cache.budgets is None:
            return None
        return sum(b + cache.headroom for b in cache.budgets) * self.shape.bytes_per_token_layer

    def take(self, session) -> None:
        """Count the session in (its headroom reserved first), or refuse it with one line (`PoolFull`)."""
        need = self.bound(session)
        need = None if need is None else need * self.counted
        if len(self.streams) >= self.max_streams:
            raise PoolFull(f"stream refused: the pool serves {self.max_streams} streams at most")
        if self.kv_bytes is not None:
            if need is None and not self.unbounded:
                raise PoolFull("stream refused: an unbounded cache (policy full) cannot be admitted to a pool "
                               "with a memory limit; give it a budget")
            left = self.kv_bytes - sum(self.streams.values())
            if need is not None and need > left:
                raise PoolFull(f"stream refused: its cache needs up to {need / 2**20:.0f} MB, {left / 2**20:.0f} "
                               f"MB of the pool's {self.kv_bytes / 2**20:.0f} MB are left; lower the budget or "
                               "close a stream")
        self.streams[session] = need or 0

    def release(self, session) -> None:
        self.streams.pop(session, None)
