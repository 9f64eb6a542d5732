"""Video inputs: a decoded, canonical clip as the rest of vlrl sees it.

`Video` is the contract between the data side (decoding, sampling, canonicalization, bad input)
and the model side (processor fields, positions, engines). The decoder fills it; nothing after it
reads a file again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

VIDEO_TAG = "<video>"


@dataclass
class Video:
    """One clip, decoded once per prompt.

    frames: RGB PIL images, all the same size, sides multiples of the family's factor, their total
        pixels within the video's budget, and their count a multiple of the family's temporal patch.
    fps: the rate at which `frames` were sampled (frames per second of source time).
    timestamps: each frame's time in the source, in seconds (len(timestamps) == len(frames)).
    source: where it came from, for messages (a path, or "<bytes>" / "<frames>").
    """

    frames: list[Image.Image]
    fps: float
    timestamps: list[float] = field(default_factory=list)
    source: str = ""

    def __post_init__(self) -> None:
        if not self.timestamps:
            self.timestamps = [i / self.fps for i in range(len(self.frames))]
        if len(self.timestamps) != len(self.frames):
            raise ValueError(f"{len(self.timestamps)} timestamps for {len(self.frames)} frames ({self.source})")

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of every frame."""
        return self.frames[0].size
