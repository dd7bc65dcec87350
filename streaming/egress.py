"""Every HTTP(S) request FFmpeg makes for a stream goes through a proxy in this process that applies the URL policy
again (issue 61).

Checking a URL before it opens is not enough: FFmpeg follows an HLS segment's redirect, reloads a live playlist whose
next version may name a new host, and resolves names itself. So FFmpeg is given `http_proxy` pointing here; each
request it sends (absolute-form GET/HEAD, or CONNECT for HTTPS) is checked against the policy, sent on to the very
address that was checked (no second resolution: no DNS rebinding) or refused with 403. The HLS and DASH demuxers
hand `http_proxy` on to every segment, key and playlist they open. RTSP is not HTTP: it is checked once, at open.
"""

import contextlib
import http.server
import select
import socket
import threading
from urllib.parse import urlsplit

from .urls import PORTS, UrlPolicy, UrlRefused

CHUNK = 64 * 1024
TIMEOUT_S = 10.0
HOP_HEADERS = {"connection", "proxy-connection", "proxy-authorization", "keep-alive", "te", "trailer",
               "transfer-encoding", "upgrade"}


def address_for(policy: UrlPolicy, url: str) -> tuple[str, int]:
    """(address, port) to connect to for `url`: an address the policy checked, from its one resolution (no second
    lookup that could answer differently)."""
    parts = urlsplit(url)
    return policy.addresses(url)[0], parts.port or PORTS.get(parts.scheme.lower(), 80)


class _Relay(http.server.BaseHTTPRequestHandler):
    policy: UrlPolicy
    refused: list  # the URLs this proxy refused (tests read it)

    def do_GET(self):  # noqa: N802 (the standard library's name)
        url = self.path
        if urlsplit(url).scheme.lower() not in ("http", "https"):
            return self._refuse(400, "an absolute http:// URL is expected")
        try:
            target = address_for(self.policy, url)
        except (UrlRefused, OSError, ValueError) as err:
            self.refused.append(url)
            return self._refuse(403, str(err))
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            upstream = socket.create_connection(target, timeout=TIMEOUT_S)
        except OSError as err:
            return self._refuse(502, str(err))
        with upstream:
            headers = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items() if k.lower() not in HOP_HEADERS)
            upstream.sendall(f"{self.command} {path} HTTP/1.1\r\n{headers}Connection: close\r\n\r\n".encode("latin-1"))
            self.close_connection = True
            with contextlib.suppress(OSError):
                while data := upstream.recv(CHUNK):  # the answer as it came, status line and all
                    self.wfile.write(data)

    do_HEAD = do_GET  # noqa: N815

    def do_CONNECT(self):  # noqa: N802
        host, _, port = self.path.rpartition(":")
        try:
            target = address_for(self.policy, f"https://{host}:{port}/")
        except (UrlRefused, OSError, ValueError) as err:
            self.refused.append(self.path)
            return self._refuse(403, str(err))
        try:
            upstream = socket.create_connection(target, timeout=TIMEOUT_S)
        except OSError as err:
            return self._refuse(502, str(err))
        self.send_response(200, "Connection established")
        self.end_headers()
        self.close_connection = True
        with upstream:
            _pipe(self.connection, upstream)

    def _refuse(self, status: int, why: str) -> None:
        body = why.encode("utf-8", "replace")
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args):
        """Quiet: what it refused is in `refused`, and FFmpeg reports what it could not open."""


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Bytes both ways until either side closes (a TLS tunnel)."""
    while True:
        ready, _, _ = select.select([a, b], [], [], TIMEOUT_S * 6)
        if not ready:
            return
        for s in ready:
            data = s.recv(CHUNK)
            if not data:
                return
            (b if s is a else a).sendall(data)


class EgressProxy:
    """The proxy for one policy, on a loopback port of its own, for the life of the process."""

    def __init__(self, policy: UrlPolicy):
        handler = type("Relay", (_Relay,), {"policy": policy, "refused": []})
        self.refused = handler.refused
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="egress-proxy", daemon=True).start()


_PROXIES: dict[UrlPolicy, EgressProxy] = {}
_LOCK = threading.Lock()


def proxy_for(policy: UrlPolicy) -> EgressProxy:
    with _LOCK:
        if policy not in _PROXIES:
            _PROXIES[policy] = EgressProxy(policy)
        return _PROXIES[policy]
