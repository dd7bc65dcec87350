"""Offline by construction: the switches that stop the libraries under the product from calling out by themselves.

The product opens a connection off the machine only to a source a user names (streaming/urls.py decides which).
The libraries it loads would otherwise reach out on their own, each read from the environment when it loads or
when it first acts, so this module sets them before any of those loads: streaming/__init__.py imports it first,
and the app's and the server's mains import it before anything else. A value the user set already wins (setting
one is asking for what it turns on). Hub downloads stay possible: a checkpoint the user names by its hub id
(`--hf owner/name`, `--model hf owner/name`) is fetched because they asked, so HF_HUB_OFFLINE is left alone.
"""

import os

SWITCHES = {
    # gradio: a Blocks made with analytics on checks api.gradio.app for a newer version, and the Blocks and its
    # launch report themselves to huggingface.co (app/ui.py also builds its Blocks with analytics off)
    "GRADIO_ANALYTICS_ENABLED": "False",
    # huggingface_hub: the user agent of every hub request fetches a registry of "agent harnesses" from
    # huggingface.co once a day, and its telemetry pings the hub; both stop here
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # ray: a cluster started here (serve/ray_app.py's local cluster) reports usage to Ray's collector
    "RAY_USAGE_STATS_ENABLED": "0",
}
LOOPBACK = ("localhost", "127.0.0.1", "::1")
PROXIES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def stay_offline(environ=os.environ) -> None:
    """Set every switch the user has not set; with a proxy configured, keep loopback off it (gradio checks its
    own page over HTTP, and httpx would send 127.0.0.1 to the proxy)."""
    for name, value in SWITCHES.items():
        environ.setdefault(name, value)
    if any(environ.get(name) for name in PROXIES):  # both spellings get the union: urllib reads either
        hosts = [h.strip() for name in ("no_proxy", "NO_PROXY") for h in environ.get(name, "").split(",")]
        merged = ",".join(dict.fromkeys(h for h in [*hosts, *LOOPBACK] if h))
        environ["no_proxy"] = environ["NO_PROXY"] = merged


stay_offline()
