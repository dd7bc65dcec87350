"""Ray Serve's replicas following the sessions open: a real local Ray cluster, the deployment of serve/ray_app.py
autoscaled on sessions (`max_replicas`), tiny-vlm replicas taking 2 sessions each, real video frames pushed."""

import time

import pytest

from streaming.remote import Client
from streaming.sources import FileSource, bundled_clip

pytestmark = pytest.mark.slow
ray_app = pytest.importorskip("serve.ray_app")  # Ray Serve


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory):
    app = {"replicas": 1, "max_replicas": 2, "max_sessions": 2, "downscale_delay_s": 2,
           "sessions": str(tmp_path_factory.mktemp("sessions"))}
    with ray_app.local_cluster(app, name="auto") as (_, serve, url):
        yield serve, url


def running(serve) -> int:
    states = serve.status().applications["auto"].deployments["StreamServer"].replica_states
    return sum(count for state, count in states.items() if str(getattr(state, "value", state)) == "RUNNING")


def wait_for(condition, seconds: float) -> None:
    """Until `condition()` holds; fails past `seconds` (a hang guard, not a timing claim)."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < seconds, "timed out"
        time.sleep(0.25)


def test_replicas_follow_the_sessions_open_and_new_sessions_go_where_there_is_room(autoscaled):
    """One replica while it has room for one more session, a second once it is full, new sessions routed to the
    replica holding fewer, back to one replica when they close; each session answers from the replica holding it."""
    serve, url = autoscaled
    client = Client(url)
    frames = list(FileSource(bundled_clip(), fps=1.0))[:3]

    def opened(by=client):
        session = by.open(budget="128", clip_seconds=2.0)
        for frame in frames:
            session.push(frame.rgb, frame.t)
        return session

    first = opened()
    time.sleep(2)  # past the autoscaler's look-back: one session leaves room for one more
    assert running(serve) == 1
    second = opened()
    assert second.opened["replica"] == first.opened["replica"]  # the only replica
    wait_for(lambda: running(serve) == 2, 120)  # full: a second replica, its model loaded
    # Ray's proxy learns of the new replica a moment after the controller: until a request outside any session (the
    # router sends it to the replica holding the fewest) is answered there
    wait_for(lambda: client.health()["replica"] != first.opened["replica"], 60)
    once = Client(url, retries=0)  # a full replica's 429 would fail the open: routed where the room is, not retried
    router = ray_app.FewestSessionsRouter
    settle = router.STATS_S + router.RECENT_S + 1  # each replica's count reported, the recent sends expired
    time.sleep(settle)
    third = opened(once)
    time.sleep(settle)
    fourth = opened(once)
    assert third.opened["replica"] == fourth.opened["replica"] != first.opened["replica"]
    for s in (first, second, third, fourth):
        assert s.answer("what is on screen?", at=2.0)["answer"] and s.state()["replica"] == s.opened["replica"]
    for s in (third, fourth, second):
        s.close()
    wait_for(lambda: running(serve) == 1, 60)  # one session left: one replica again
    assert first.answer("is there a bicycle now?")["answer"]
    first.close()
    client.close()
    once.close()
