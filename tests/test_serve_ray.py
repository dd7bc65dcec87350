"""The server past one machine: a real local Ray cluster, the deployment of serve/ray_app.py with 2 replicas of
tiny-vlm, 4 sessions on real video; the replica holding one of them is killed with `ray.kill` while that session's
answer is streaming. Every answer delivered and every clip stored (its file written) before the kill is there
afterwards, and the session answers again from the other replica."""

import time

import pytest

from streaming.remote import Client, RemoteError
from streaming.sources import FileSource, bundled_clip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("ray")
    from serve.ray_app import local_cluster

    folders = tmp_path_factory.mktemp("sessions")
    app = {"replicas": 2, "sessions": str(folders), "max_sessions": 4, "sse_batch_ms": 50}
    with local_cluster(app) as (ray, _, url):
        yield ray, url, folders


def on_disk(folder) -> set[int]:
    """The spans a session's store has written (a file appears, by atomic rename, once it is whole)."""
    return {int(p.stem.removeprefix("span_")) for p in (folder / "store").glob("span_*.safetensors")}


def stored(folder) -> set[int]:
    """The spans the store holds when it is opened again, its index read as after a crash."""
    from inf_mllm.store import SpanStore

    store = SpanStore(folder / "store")
    try:
        return set(store.spans)
    finally:
        store.close()


def test_a_replica_killed_mid_answer_loses_no_delivered_answer_and_no_stored_clip(cluster):
    ray, url, folders = cluster
    client = Client(url)
    frames = list(FileSource(bundled_clip(), fps=1.0))
    sessions = [client.open(budget="256", clip_seconds=2.0) for _ in range(4)]
    assert len({s.opened["replica"] for s in sessions}) == 2  # spread over both replicas
    delivered = {s.id: [] for s in sessions}
    for s in sessions:
        for frame in frames[:7]:
            s.push(frame.rgb, frame.t)
        streamed = list(s.events("is there a bicycle now?", at=4.0))  # tokens after the first come in 50 ms chunks
        delivered[s.id].append(streamed[-1][1])
        assert "".join(d["text"] for e, d in streamed if e == "token").strip() == streamed[-1][1]["answer"]
        assert s.state()["replica"] == s.opened["replica"]  # a session's requests reach the replica holding it
    victim = sessions[0]
    holder = victim.state()["replica"]
    before = {s.id: on_disk(folders / s.id) for s in sessions}

    events = victim.events("what is on screen?")  # asked; its answer streams while the replica dies
    first = next(events)
    assert first[0] == "start"
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(holder))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    killed = time.monotonic()
    with pytest.raises(RemoteError):
        list(events)  # cut off: this answer was never delivered

    again = victim.answer("what was on screen at the start?")  # continued on the other replica from its folder
    back_in = time.monotonic() - killed
    delivered[victim.id].append(again)
    assert victim.state()["replica"] != holder and again["answer"]
    assert back_in < 5.0  # the other replica had the model loaded: only the session's own resume

    for s in sessions:  # every session: its delivered answers in its transcript, and it goes on
        for frame in frames[7:]:
            s.push(frame.rgb, frame.t)
        s.end()
        transcript = s.transcript()
        assert transcript[: len(delivered[s.id])] == delivered[s.id]
        s.close()
    client.close()
    for s in sessions:  # closed, their folders free: every span stored before the kill is still stored
        assert len(before[s.id]) >= 2 and before[s.id] <= stored(folders / s.id)


def test_the_url_policy_holds_behind_ray(cluster):
    """A replica opens source URLs by the same policy as `python -m serve`: a loopback or private address is refused
    in one line before any request is made (the listener here counts 0), and a password never comes back."""
    from jetson.reliability.hostile import listener

    _, url, _ = cluster
    client = Client(url)
    with listener("127.0.0.2") as (inside, hits):
        for source in (f"{inside}/x.mp4", "http://admin:hunter2@10.1.2.3/cam", "http://169.254.169.254/latest"):
            with pytest.raises(RemoteError) as refused:
                client.open(budget="256", source={"url": source})
            assert refused.value.status == 400 and "hunter2" not in str(refused.value)
    assert hits == []
