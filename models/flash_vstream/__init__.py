"""Flash-VStream (IVGSZ/Flash-VStream): STAR memory of a video stream, read out per question.

`star_memory` (the memory), `modules` (projector, abstract-memory attention), `vision` (CLIP tower),
`checkpoint` (offline loading), `adapter` (memory ↔ session turns), `model` (Flash-VStream-7B),
`tiny` (the same memory on tiny-vlm). Modules with torch models are imported on use.
"""

from .star_memory import StarConfig, StarMemory

__all__ = ["StarConfig", "StarMemory"]
