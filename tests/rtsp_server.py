"""An RTSP server on loopback for the tests: GStreamer's (Debian's gir1.2-gst-rtsp-server-1.0), serving a folder of
JPEG frames (0000.jpg, 0001.jpg, …) as RTP/JPEG, each client's stream from the first frame, paced at `fps` as a
camera delivers them, ending after the last. Run with the system Python that has PyGObject:

    /usr/bin/python3 tests/rtsp_server.py FRAMES_DIR PORT WIDTH HEIGHT [FPS]

(RTP/JPEG carries sides that are multiples of 8, at most 2,040.) It prints "ready rtsp://127.0.0.1:PORT/clip" once
it listens and serves until killed.
"""

import sys
import time
from pathlib import Path

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


def main(frames: str, port: str, width: str, height: str, fps: str = "5") -> None:
    Gst.init(None)
    jpegs = [path.read_bytes() for path in sorted(Path(frames).glob("*.jpg"))]
    step = Gst.SECOND // int(fps)

    def configure(_factory, media):
        source = media.get_element().get_by_name("frames")
        sent = {"n": 0, "t0": None}

        def need_data(src, _length):
            n = sent["n"]
            if n == len(jpegs):
                src.emit("end-of-stream")
                return
            sent["t0"] = sent["t0"] or time.monotonic()
            time.sleep(max(0.0, sent["t0"] + n * step / Gst.SECOND - time.monotonic()))  # a camera's pace
            buffer = Gst.Buffer.new_wrapped(jpegs[n])
            buffer.pts, buffer.duration = n * step, step
            src.emit("push-buffer", buffer)
            sent["n"] = n + 1

        source.connect("need-data", need_data)

    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(port)
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(f'( appsrc name=frames format=time caps="image/jpeg,width={width},height={height},'
                       f'framerate={fps}/1" ! rtpjpegpay name=pay0 pt=26 )')
    factory.connect("media-configure", configure)
    server.get_mount_points().add_factory("/clip", factory)
    if server.attach(None) == 0:
        raise SystemExit(f"cannot listen on 127.0.0.1:{port}")
    print(f"ready rtsp://127.0.0.1:{port}/clip", flush=True)
    GLib.MainLoop().run()


if __name__ == "__main__":
    main(*sys.argv[1:])
