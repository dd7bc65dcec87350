"""A frame as a JPEG with the detector's boxes drawn on it: what an alert shows of the moment it fired."""

import cv2
import numpy as np

QUALITY = 85  # JPEG quality: a 640-wide frame in about 40-80 KB


def jpeg(frame: np.ndarray, boxes=()) -> bytes:
    """`frame` (RGB, H×W×3) with each box ({"word", "score", "box": normalised x0, y0, x1, y1}) drawn and labelled."""
    image = cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2BGR)
    height, width = image.shape[:2]
    for box in boxes:
        x0, y0, x1, y1 = (round(v * s) for v, s in zip(box["box"], (width, height, width, height), strict=True))
        cv2.rectangle(image, (x0, y0), (x1, y1), (0, 200, 255), 2)
        label = f"{box['word']} {box.get('score', 0):.2f}"
        cv2.putText(image, label, (x0 + 2, max(12, y0 - 4)), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 200, 255), 1,
                    cv2.LINE_AA)
    ok, data = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, QUALITY])
    if not ok:
        raise ValueError("the frame could not be encoded as a JPEG")
    return data.tobytes()
