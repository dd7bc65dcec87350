"""One way to open a stream: `open_stream(config, source, pool, adapter)`, used by `stream-qa` (one source and
several), the hosted sessions of the app and the server (and so Ray's replicas), and the soak.

A stream is its own fork of the model's adapter, a session admitted to the model's pool (the pool runs every model
call; a lone stream is a pool of one) and a turn engine over it. `config` holds everything that decides the session:
the settings (parsed once, `streaming/settings.py`) and this machine's options. What a session folder implies is
decided here and nowhere else: a folder's session is its store, so it recalls.
"""

from dataclasses import dataclass

from .budgets import headroom, open_session
from .engine import TurnEngine
from .settings import Settings, folder_spec


@dataclass(frozen=True)
class StreamConfig:
    """A stream's settings and this machine's options for it: `device`, where `--budget auto` measures free memory
    (None: the adapter's); `compile_decode`, decode steps compiled on fixed shapes where the cache allows."""

    settings: Settings
    device: str | None = None
    compile_decode: bool = False

    def spec(self, folder=None):
        """The policy the session runs: the settings' own, with recall when it keeps a session folder."""
        return folder_spec(self.settings.spec(), folder)


@dataclass
class Stream:
    """An opened stream: its adapter (its own fork), its session in the pool, its engine, and the auto budget's
    sizing (None unless the budget was `auto`)."""

    adapter: object
    session: object
    engine: TurnEngine
    auto: object = None


def open_stream(config: StreamConfig, source, pool, adapter, folder=None, prepare=None) -> Stream:
    """Open a stream of `adapter`'s model on `pool` for `source` (anything `TurnEngine.run` takes; None: no source
    yet). With `folder` (a `SessionDir`) its clips go to the folder's store; `prepare(session)` runs on the pool's
    thread before the session is admitted (a resumed session's exchanges put back). A session the pool cannot take,
    or settings the model refuses, raise one line (`PoolFull`, `ConfigError`); the folder's store is the caller's to
    close."""
    settings = config.settings
    own = adapter.fork()
    if getattr(source, "frame_size", None):  # token counts (the budget's floor) from the real frames
        own.expect_frames(*source.frame_size)
    extra = {"store": folder.open_store()} if folder is not None else {}
    if config.compile_decode:
        extra["compile_decode"] = True
    sized = {}

    def make():
        session, sized["auto"] = open_session(own, config.spec(folder), settings.budget_value(),
                                              settings.max_new_tokens, config.device, **extra)
        return session

    session = pool.open(make=make, headroom=headroom(own, settings.max_new_tokens), prepare=prepare)
    engine = TurnEngine(own, session, clip_seconds=settings.clip_seconds, max_new_tokens=settings.max_new_tokens,
                        drop_when_full=bool(getattr(source, "live", False)),  # a camera or a paced file cannot wait
                        gate=settings.gate)
    return Stream(own, session, engine, sized.get("auto"))
