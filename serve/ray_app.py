"""The server past one machine, on Ray Serve: a deployment whose replicas each hold a model and a session pool.

Each replica runs the same API (api.py) over its own sessions. A session's requests go to the replica that holds
it through Ray Serve's model multiplexing, with the session id as the "model": every request of a session carries
the header `serve_multiplexed_model_id: ID` (the Python client and `stream-qa --server` send it), and a replica
that serves a session tells the router so (`create_app(held=…)`). Session folders live on storage every replica
reaches (`sessions`: a path; a mounted S3-compatible bucket works the same way, e.g. through s3fs or mountpoint):
when a replica dies, the session's next request goes to another one, which continues it from its folder, as a
restarted `python -m serve` does. A new session goes to the replica holding the fewest (`FewestSessionsRouter`); a
replica takes `max_sessions` (429 with Retry-After past that). With `max_replicas`, Ray Serve's autoscaling keeps as
many replicas as the open sessions need (`SessionsPerReplica`).

`serve run serve/ray_config.yaml` (one machine), or `serve deploy serve/ray_config.yaml` on a running cluster; a
test or a script calls `build({...})` and `serve.run` it.
"""

import contextlib
import math
import socket
import time

from ray import serve
from ray.serve.request_router import FIFOMixin, MultiplexMixin, RequestRouter

from .api import create_app
from .limits import ServerConfig

DEPLOYMENT_ARGS = ("replicas", "max_replicas", "replica_cpus", "downscale_delay_s")


def server_config(args: dict) -> ServerConfig:
    """A `ServerConfig` from the deployment's arguments (strings as a YAML file or `serve run k=v` gives them)."""
    return ServerConfig.parse({k: v for k, v in args.items() if k not in DEPLOYMENT_ARGS})


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

    def sessions_held(self) -> dict[str, float]:
        """The sessions this replica holds or is opening: what the router and the autoscaler count."""
        api = getattr(self, "api", None)
        return {"sessions": float(api.state.sessions.count()) if api is not None else 0.0}

    record_autoscaling_stats = record_routing_stats = sessions_held


class FewestSessionsRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """A session's requests go to the replica holding it (multiplexing on its id); anything else, a new session
    above all, to the replica holding the fewest. Replicas report their count every `STATS_S`; a session this router
    sent somewhere in the last `RECENT_S` counts there already, so opens in quick succession spread out."""

    STATS_S, RECENT_S = 0.5, 1.5

    def initialize_state(self, **kwargs):
        self.sent: dict = {}  # replica id -> times this router sent it a request outside any session

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            ids = self.apply_multiplex_routing(pending_request=pending_request)
            holding = [r for r in candidate_replicas if r.replica_id in ids]
            return [holding] if holding else []
        now = time.monotonic()

        def load(replica):
            recent = [t for t in self.sent.get(replica.replica_id, []) if now - t < self.RECENT_S]
            self.sent[replica.replica_id] = recent
            return (replica.routing_stats or {}).get("sessions", 0) + len(recent)

        return [[r] for r in sorted(candidate_replicas, key=load)]

    def on_request_routed(self, pending_request, replica_id, result):
        if not pending_request.metadata.multiplexed_model_id:
            self.sent.setdefault(replica_id, []).append(time.monotonic())


class SessionsPerReplica:
    """Ray Serve's autoscaling policy for this deployment: as many replicas as the open sessions need, with room for
    one more. A session is a long-lived thing with a bounded cache, not a request: the default policy follows requests
    in flight, so a replica full of sessions that are playing and not being asked looks idle to it, and new sessions
    find no room while it waits for questions."""

    def __init__(self, sessions_per_replica: int):
        self.per_replica = max(1, int(sessions_per_replica))

    def __call__(self, ctx) -> tuple[int, dict]:
        held = sum((ctx.aggregated_metrics or {}).get("sessions", {}).values())
        return math.ceil((round(held) + 1) / self.per_replica), ctx.policy_state


def build(args: dict):
    """The application `serve run` starts: `replicas` fixed (default 2), or, with `max_replicas`, from `replicas` up
    to `max_replicas` on the sessions open (`SessionsPerReplica`, each replica taking `max_sessions`); a replica
    with no session left goes after `downscale_delay_s` (default 60)."""
    args = dict(args)
    replicas, most = int(args.pop("replicas", 2)), args.pop("max_replicas", None)
    cpus = float(args.pop("replica_cpus", 1))  # Ray gives a replica's torch this many threads
    downscale_s = float(args.pop("downscale_delay_s", 60))
    config = server_config(args)  # a bad setting fails here, in one line, before any replica starts
    options = {"ray_actor_options": {"num_cpus": cpus}, "request_router_config": {
        "request_router_class": FewestSessionsRouter, "request_routing_stats_period_s": FewestSessionsRouter.STATS_S}}
    if most is not None:
        options |= {"num_replicas": "auto", "autoscaling_config": {
            "min_replicas": replicas, "max_replicas": int(most), "upscale_delay_s": 0.5,
            "downscale_delay_s": downscale_s, "metrics_interval_s": 0.5, "look_back_period_s": 1.0,
            "policy": {"policy_function": SessionsPerReplica,
                       "policy_kwargs": {"sessions_per_replica": config.max_sessions}}}}
    else:
        options["num_replicas"] = replicas
    return StreamServer.options(**options).bind(args)


@contextlib.contextmanager
def local_cluster(app: dict, name: str = "stream-qa"):
    """A local Ray cluster of this machine's 2 cores serving the deployment `build(app)` on a free loopback port
    (tests, benchmarks); yields (ray, Ray's serve module, url)."""
    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the node's address given: Ray would find it by a connect() to a public address
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(app), name=name, route_prefix="/")
        yield ray, serve, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
