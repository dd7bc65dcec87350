"""Which stream URLs a source may open, and what FFmpeg may do once it has (issue 61).

A server that opens any URL it is given is a way into its own network: `http://127.0.0.1:<port>/…` reaches a
loopback-only service, a private address an internal camera, a 302 or an HLS playlist a second place the client
chose. So a URL is opened only after (OWASP's SSRF rules):
- its scheme is allowed (`rtsp`, `rtsps`, `http`, `https`);
- every address its host resolves to is public: none loopback, link-local, private, multicast, reserved or
  unspecified, unless the operator allows that host (`allow_hosts`: names or addresses, e.g. a camera's) or private
  ranges (`allow_private`); loopback needs `allow_loopback` (the server refuses it by default; `stream-qa`, run by
  its own user on their own machine, allows loopback and private addresses);
- for HTTP(S), a first request that follows no redirect: a redirect is opened only if its target passes the same
  check, and a playlist (HLS, DASH) only if every entry does (one level of nested playlists is read too);
- FFmpeg is then held to the network protocols (`protocol_whitelist`: no `file:`, no `pipe:`, no `data:`), so no
  playlist entry can read a file, and every HTTP(S) request it makes afterwards (a segment's redirect, a live
  playlist's reload, a key) goes through `egress.py`'s proxy, which checks it again and connects to the address
  it checked (no second resolution).
What remains: RTSP is checked once, at open (an RTSP server's own redirect is FFmpeg's to follow); an operator who
needs that closed too puts the server behind an egress firewall.

Credentials in a URL (`rtsp://user:secret@camera/…`) are kept in memory only: every message, log line, session
record and folder says the URL with them replaced by `***` (`redact`).
"""

import contextlib
import ipaddress
import os
import socket
import threading
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit, urlunsplit

from .frames import SourceError

SCHEMES = ("rtsp", "rtsps", "http", "https")
PORTS = {"rtsp": 554, "rtsps": 322, "http": 80, "https": 443}
FFMPEG_PROTOCOLS = "http,https,httpproxy,tcp,tls,rtp,rtsp,rtsps,udp,srtp,crypto,hls"
PLAYLIST_BYTES = 256 * 1024  # what the first request reads of a playlist, at most
PREFLIGHT_S = 5.0
_OPEN_LOCK = threading.Lock()  # OpenCV reads FFmpeg's options from the environment when it opens a capture


class UrlRefused(SourceError):
    """A URL the policy does not open: one line, a 400 from the server, exit 2 from `stream-qa`."""


@dataclass(frozen=True)
class UrlPolicy:
    schemes: tuple[str, ...] = SCHEMES
    allow_hosts: frozenset[str] = field(default_factory=frozenset)  # opened whatever they resolve to
    allow_private: bool = False  # private, link-local and other non-public addresses (not loopback)
    allow_loopback: bool = False

    def check(self, url: str) -> str:
        """The URL, if the policy opens it (its host resolved now, every address checked); else `UrlRefused`."""
        self.addresses(url)
        return url

    def addresses(self, url: str) -> list[str]:
        """Where the URL's host resolves now, every address checked (an allowed host: its name); else
        `UrlRefused`."""
        parts = parse(url)
        if parts.scheme.lower() not in self.schemes:
            raise UrlRefused(f"{redact(url)}: a source URL must be {', '.join(self.schemes)}")
        host = parts.hostname
        if not host:
            raise UrlRefused(f"{redact(url)}: the URL names no host")
        if host.lower() in self.allow_hosts:
            return [host]
        try:
            port = parts.port or PORTS.get(parts.scheme.lower(), 0)
        except ValueError:
            raise UrlRefused(f"{redact(url)}: its port is not a number from 0 to 65535") from None
        try:
            found = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            raise UrlRefused(f"{redact(url)}: its host {host!r} cannot be resolved") from None
        for address in sorted(found):
            why = self.refuses(ipaddress.ip_address(address.split("%")[0]))
            if why:
                raise UrlRefused(f"{redact(url)}: its host resolves to {address}, {why}; the server opens only "
                                 f"public addresses unless its operator allows this host (--allow-url-host) or "
                                 f"private ones (--allow-private-urls)")
        return sorted(found)

    def refuses(self, address) -> str | None:
        """Why an address is not opened, or None (Python counts multicast as global: it is checked first; an
        IPv4-mapped IPv6 address is judged as the IPv4 address it carries)."""
        address = getattr(address, "ipv4_mapped", None) or address
        if address.is_loopback:
            return None if self.allow_loopback else "a loopback address"
        if address.is_multicast or address.is_unspecified:
            return "a multicast address" if address.is_multicast else "an unspecified address"
        if address.is_global or self.allow_private:
            return None
        kind = "a link-local" if address.is_link_local else "a private" if address.is_private else "a reserved"
        return f"{kind} address"

    def preflight(self, url: str, depth: int = 0) -> None:
        """For HTTP(S): where a first request without redirects leads, checked (a redirect's target, a playlist's
        entries) before FFmpeg follows it. Other schemes have nothing to read first."""
        if urlsplit(url).scheme.lower() not in ("http", "https") or depth > 3:
            return
        import httpx

        try:
            with httpx.stream("GET", url, follow_redirects=False, timeout=PREFLIGHT_S) as reply:
                if reply.is_redirect:
                    target = urljoin(url, reply.headers.get("location", ""))
                    self.preflight(self.check(target), depth + 1)
                    return
                kind = reply.headers.get("content-type", "").lower()
                head = b""
                for chunk in reply.iter_bytes():
                    head += chunk
                    if len(head) >= PLAYLIST_BYTES or not _maybe_playlist(url, kind, head):
                        break
        except httpx.HTTPError as err:  # as OpenCV would have said it
            raise UrlRefused(f"cannot open stream {redact(url)}: check that it exists and answers "
                             f"({type(err).__name__})") from None
        if _maybe_playlist(url, kind, head):
            for entry in playlist_entries(head.decode("utf-8", "replace"), url):
                self.check(entry)
                if depth < 1 and entry.lower().split("?")[0].endswith((".m3u8", ".m3u", ".mpd")):
                    self.preflight(entry, depth + 1)

    def open_check(self, url: str) -> str:
        """`check` and `preflight`: what every caller runs before a URL is opened."""
        self.check(url)
        self.preflight(url)
        return url


SERVER = UrlPolicy()  # the server: public addresses only, unless its operator allows more
LOCAL = UrlPolicy(allow_private=True, allow_loopback=True)  # stream-qa and the app, run by their own user


def parse(url: str):
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (a broken IPv6 literal or port raises here, as one line below)
        return parts
    except ValueError:
        raise UrlRefused(f"{redact(url)}: not a URL that can be read (a broken address or port)") from None


def redact(url: str) -> str:
    """The URL with any user name and password replaced by *** (for messages, logs and records)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        at = url.rfind("@")
        return ("***" + url[at:]) if at >= 0 else url
    if parts.username is None and parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, f"***@{host}", parts.path, parts.query, parts.fragment))


def _maybe_playlist(url: str, kind: str, head: bytes) -> bool:
    path = urlsplit(url).path.lower()
    return ("mpegurl" in kind or "dash+xml" in kind or path.endswith((".m3u8", ".m3u", ".mpd"))
            or head.lstrip()[:7] == b"#EXTM3U" or b"<MPD" in head[:512])


def playlist_entries(text: str, base: str) -> list[str]:
    """The URIs an HLS playlist (lines not starting with #, and URI="…" attributes) or a DASH manifest (BaseURL,
    media and initialization attributes) names, resolved against the playlist's own URL."""
    import re

    if "<MPD" in text[:4096]:
        found = re.findall(r"<BaseURL>\s*([^<\s]+)\s*</BaseURL>", text)
        found += [m for m in re.findall(r'(?:media|initialization)="([^"]+)"', text) if "$" not in m]
    else:
        found = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
        found += re.findall(r'URI="([^"]+)"', text)
    return [urljoin(base, entry) for entry in found]


@contextlib.contextmanager
def network_only(proxy: str | None = None):
    """FFmpeg held to network protocols while OpenCV opens a URL (no `file:` entry in a playlist, no `pipe:`), its
    HTTP requests sent through `proxy` (`egress.py`: the policy applied to every one of them)."""
    key = "OPENCV_FFMPEG_CAPTURE_OPTIONS"
    with _OPEN_LOCK:
        before = os.environ.get(key)
        os.environ[key] = f"protocol_whitelist;{FFMPEG_PROTOCOLS}" + (f"|http_proxy;{proxy}" if proxy else "")
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = before
