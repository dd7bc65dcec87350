"""The URL policy (streaming/urls.py): what a source URL may resolve to, where its redirects and playlists lead, and
that credentials never reach a message. Listeners on loopback only (127.0.0.1 and 127.0.0.2), started here; they
count every request they get."""

import pytest

from jetson.reliability.forgery import listener
from streaming.urls import LOCAL, SERVER, UrlPolicy, UrlRefused, playlist_entries, redact


@pytest.mark.parametrize("url, words", [
    ("http://127.0.0.1:9/x.mp4", "a loopback address"),
    ("http://localhost:9/x.mp4", "a loopback address"),
    ("rtsp://10.1.2.3/stream", "a private address"),
    ("http://192.168.1.20/cam", "a private address"),
    ("http://169.254.169.254/latest/meta-data", "a link-local address"),
    ("http://[::1]:8080/x", "a loopback address"),
    ("http://[fe80::1]/x", "a link-local address"),
    ("http://224.0.0.1/x", "a multicast address"),
    ("http://0.0.0.0:8000/x", "an unspecified address"),
    ("file:///etc/passwd", "must be rtsp, rtsps, http, https"),
    ("ftp://example.com/x.mp4", "must be rtsp, rtsps, http, https"),
    ("http://[::1/x", "not a URL that can be read"),
    ("http://host.invalid/x", "cannot be resolved"),
    ("http:///x", "names no host"),
    ("http://1.2.3.4:99999/x", "not a URL that can be read"),
])
def test_the_server_refuses_what_is_not_public(url, words):
    with pytest.raises(UrlRefused, match=words):
        SERVER.check(url)


def test_allowed_hosts_and_ranges_are_the_operators_choice():
    assert UrlPolicy(allow_hosts=frozenset({"127.0.0.1"})).check("http://127.0.0.1:9/x") == "http://127.0.0.1:9/x"
    assert UrlPolicy(allow_private=True).check("rtsp://10.1.2.3/s") == "rtsp://10.1.2.3/s"
    with pytest.raises(UrlRefused, match="loopback"):
        UrlPolicy(allow_private=True).check("http://127.0.0.1/x")  # loopback needs its own allowance
    assert LOCAL.check("http://127.0.0.1:9/x")  # stream-qa, run by its own user


def test_credentials_never_reach_a_message():
    url = "rtsp://admin:hunter2@10.0.0.7:554/live"
    assert redact(url) == "rtsp://***@10.0.0.7:554/live"
    with pytest.raises(UrlRefused) as refused:
        SERVER.check(url)
    assert "hunter2" not in str(refused.value) and "admin" not in str(refused.value)
    assert redact("http://[::1/x") == "http://[::1/x" and redact("rtsp://u:p@[::1") == "***@[::1"


def test_a_redirect_or_a_playlist_to_a_refused_place_is_not_followed():
    inside_routes = {"/secret.mp4": (200, {}, b"internal")}
    with listener("127.0.0.2", inside_routes) as (inside, inside_hits):
        playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:2\n#EXTINF:2,\n{inside}/secret.mp4\n".encode()
        routes = {"/moved": (302, {"Location": f"{inside}/secret.mp4"}, b""),
                  "/live.m3u8": (200, {"Content-Type": "application/vnd.apple.mpegurl"}, playlist),
                  "/sneaky": (200, {"Content-Type": "text/plain"}, b"#EXTM3U\n#EXTINF:2,\nfile:///etc/passwd\n"),
                  "/ok.m3u8": (200, {}, b"#EXTM3U\n#EXTINF:2,\nseg1.ts\n")}
        with listener("127.0.0.1", routes) as (outside, outside_hits):
            policy = UrlPolicy(allow_hosts=frozenset({"127.0.0.1"}))  # the camera host the operator allowed
            for path, words in (("/moved", "127.0.0.2"), ("/live.m3u8", "127.0.0.2"), ("/sneaky", "must be rtsp")):
                with pytest.raises(UrlRefused, match=words):
                    policy.open_check(outside + path)
            policy.open_check(outside + "/ok.m3u8")  # entries on the allowed host itself
    assert inside_hits == []  # nothing ever reached the refused address
    assert outside_hits == ["/moved", "/live.m3u8", "/sneaky", "/ok.m3u8"]


def test_playlist_entries_are_read_from_hls_and_dash():
    hls = '#EXTM3U\n#EXT-X-KEY:METHOD=AES-128,URI="https://keys.example/k"\nseg.ts\n#EXTINF:2\nhttp://x.example/a.ts\n'
    assert playlist_entries(hls, "http://cam.example/live/index.m3u8") == [
        "http://cam.example/live/seg.ts", "http://x.example/a.ts", "https://keys.example/k"]
    dash = '<MPD><BaseURL>http://10.0.0.1/v/</BaseURL><SegmentTemplate media="seg-$Number$.m4s"/></MPD>'
    assert playlist_entries(dash, "http://cam.example/m.mpd") == ["http://10.0.0.1/v/"]


def test_an_ipv4_mapped_address_is_judged_as_the_address_it_carries():
    with pytest.raises(UrlRefused, match="a loopback address"):
        UrlPolicy(allow_private=True).check("http://[::ffff:127.0.0.1]:9/x")
    with pytest.raises(UrlRefused, match="a private address"):
        SERVER.check("http://[::ffff:10.0.0.1]/x")


def test_the_egress_proxy_checks_every_request_ffmpeg_sends_through_it():
    """What FFmpeg asks after the open (a segment's redirect, a playlist's reload) goes through `egress.py`: a
    refused place gets a 403 from the proxy and never a request; an allowed one is relayed as it answered."""
    import httpx

    from streaming.egress import EgressProxy

    proxy = EgressProxy(UrlPolicy(allow_hosts=frozenset({"127.0.0.1"})))
    with listener("127.0.0.2") as (inside, inside_hits), \
            listener("127.0.0.1", {"/a": (200, {"X-Seen": "yes"}, b"hello")}) as (outside, outside_hits):
        with httpx.Client(proxy=proxy.url, timeout=10) as client:
            relayed = client.get(f"{outside}/a", headers={"Range": "bytes=1-"})
            refused = client.get(f"{inside}/secret")
    assert relayed.status_code == 206 and relayed.content == b"ello" and relayed.headers["x-seen"] == "yes"
    assert outside_hits == ["/a"] and refused.status_code == 403 and "loopback" in refused.text
    assert inside_hits == [] and proxy.refused == [f"{inside}/secret"]
