"""The server past one machine, on Ray Serve: a deployment whose replicas each hold a model and a session pool.

Each replica runs the same API (api.py) over its own sessions. A session's requests go to the replica that holds
it through Ray Serve's model multiplexing, with the session id as the "model": every request of a session carries
the header `serve_multiplexed_model_id: ID` (the Python client and `stream-qa --server` send it), and a replica
that serves a session tells the router so (`create_app(held=…)`). Session folders live on storage every replica
reaches (`sessions`: a path; a mounted S3-compatible bucket works the same way, e.g. through s3fs or mountpoint):
when a replica dies, the session's next request goes to another one, which continues it from its folder, as a
restarted `python -m serve` does. A replica takes `max_sessions` sessions; past that the least recently used is
closed (its folder kept, so its next request continues it wherever it lands).

`serve run serve/ray_config.yaml` (one machine), or `serve deploy serve/ray_config.yaml` on a running cluster; a
test or a script calls `build({...})` and `serve.run` it.
"""

from pathlib import Path

from ray import serve

from .api import create_app
from .limits import ServerConfig


def server_config(args: dict) -> ServerConfig:
    """A `ServerConfig` from the deployment's arguments (strings as a YAML file or `serve run k=v` gives them)."""
    known = set(ServerConfig.__dataclass_fields__)
    unknown = set(args) - known - {"replicas", "max_replicas", "replica_cpus"}
    if unknown:
        raise ValueError(f"unknown server settings: {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    out = {}
    for key, value in args.items():
        if key in ("media", "sessions"):
            out[key] = Path(value) if value else None
        elif key in ("max_sessions", "max_questions"):
            out[key] = int(value)
        elif key in ("max_upload_mb", "push_wait_s", "idle_s", "sse_batch_ms"):
            out[key] = float(value)
        elif key == "preload":
            out[key] = tuple(value.split(",")) if isinstance(value, str) else tuple(value)
        elif key == "token":
            out[key] = value or None
    return ServerConfig(**out)


class _Held:
    """A session as the replica's multiplexing keeps it: evicted, its session is closed and its folder kept."""

    def __init__(self, sessions, session_id: str):
        self.sessions, self.session_id = sessions, session_id

    def __del__(self):
        try:
            self.sessions.close(self.session_id, final=False)
        except Exception:  # already closed by its client, or the replica is going down
            return


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=256, health_check_period_s=2,
                  health_check_timeout_s=30, graceful_shutdown_timeout_s=10)
@serve.ingress()
class StreamServer:
    def __init__(self, config: dict):
        self.config = server_config(config)
        self.config.replica = serve.get_replica_context().replica_id.unique_id
        if self.config.sessions is not None:
            self.config.sessions.mkdir(parents=True, exist_ok=True)

    def __serve_build_asgi_app__(self):
        self.api = create_app(self.config, held=self.hold)
        return self.api

    @serve.multiplexed(max_num_models_per_replica=64)
    async def hold(self, session_id: str) -> _Held:
        return _Held(self.api.state.sessions, session_id)


def build(args: dict):
    """The application `serve run` starts: `replicas` fixed (default 2), or autoscaled up to `max_replicas` on the
    requests in flight (a question's answer streams for its whole length, so sessions being asked are what
    scales it)."""
    args = dict(args)
    replicas, most = int(args.pop("replicas", 2)), args.pop("max_replicas", None)
    cpus = float(args.pop("replica_cpus", 1))  # Ray gives a replica's torch this many threads
    server_config(args)  # a bad setting fails here, in one line, before any replica starts
    options = {"ray_actor_options": {"num_cpus": cpus}}
    if most is not None:
        options |= {"num_replicas": "auto", "autoscaling_config": {
            "min_replicas": replicas, "max_replicas": int(most), "target_ongoing_requests": 4}}
    else:
        options["num_replicas"] = replicas
    return StreamServer.options(**options).bind(args)
