"""Frames by policy (issue 61): a frame's announced size is checked before it is decoded, a camera that changes size
keeps its stream, a frame of any shape costs perception a bounded number of views."""

import threading
import time

import numpy as np
import pytest

from jetson.reliability.hostile import image, jpeg_announcing, png_announcing, strip
from models.tiny_vlm.perception import MAX_TILES, tile_boxes, views
from serve.guards import FrameRefused, decode_frame
from streaming.pushed import PushedFrames


@pytest.mark.parametrize("data, status", [
    (png_announcing(20000, 20000), 413), (png_announcing(65500, 65500), 413), (jpeg_announcing(65500, 65500), 413),
    (png_announcing(0, 0), 400), (strip(1, 2000), 422), (strip(2000, 1), 422), (image("GIF"), 415),
])
def test_a_frames_announced_size_is_refused_before_decoding(data, status):
    began = time.process_time()
    with pytest.raises(FrameRefused) as refused:
        decode_frame(data)
    assert refused.value.status == status and "\n" not in str(refused.value)
    assert time.process_time() - began < 0.1  # nothing was decoded


def test_a_94_byte_frame_costs_next_to_nothing():
    data = strip(1, 2000)
    assert len(data) < 120
    began = time.process_time()
    for _ in range(10):
        with pytest.raises(FrameRefused):
            decode_frame(data)
    assert (time.process_time() - began) / 10 < 0.1


def test_a_thin_frame_costs_perception_a_bounded_number_of_views():
    assert len(tile_boxes(1, 2000)) == MAX_TILES and len(tile_boxes(2000, 1)) == MAX_TILES
    assert len(tile_boxes(272, 640)) == 3  # a street scene keeps its three tiles
    x = views(np.zeros((2, 1, 2000, 3), np.uint8), 224, tiles=True)
    assert x.shape == (2 * (1 + MAX_TILES), 3, 224, 224)


def test_a_camera_that_changes_size_is_resized_to_the_sessions():
    pushed = PushedFrames(threading.Event())
    for t, (h, w) in enumerate([(48, 64), (240, 320), (48, 64)]):
        assert pushed.push(np.full((h, w, 3), 9, np.uint8), float(t))
    pushed.end()
    assert [f.rgb.shape for f in pushed] == [(48, 64, 3)] * 3


def test_pushed_frames_wait_on_decoded_bytes_not_only_their_count():
    pushed = PushedFrames(threading.Event(), capacity=16, max_bytes=3 * 480 * 640 * 3)
    frame = np.zeros((480, 640, 3), np.uint8)
    assert all(pushed.push(frame, float(t), wait=0.05) for t in range(3))
    assert not pushed.push(frame, 3.0, wait=0.05)  # a fourth would pass the bytes: the client is told to wait
    next(iter(pushed))  # the engine takes one
    assert pushed.push(frame, 3.0, wait=0.05)
