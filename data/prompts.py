"""Per-task instructions and the chat messages a sample becomes.

The instructions are kept short on purpose: tiny demo models with small contexts train on
them, and every token of instruction is repeated in every prompt of every step.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from data.video import VIDEO_TAG

IMAGE_TAG = "<image>"
_TAGS = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")

# "{problem}" is substituted with str.replace, not str.format, because problems and
# instructions contain LaTeX braces (\frac{7}{2}, \boxed{}).
TASK_INSTRUCTIONS: dict[str, str] = {
    "clevr": "{problem} Answer with a number in <answer> </answer>.",
    "geo3k": "{problem} Think in <think> </think>, then give the final answer in \\boxed{}.",
    "generic": "{problem} Give the final answer in <answer> </answer>.",
    "video": "{problem} Give the final answer in <answer> </answer>.",
    # DeepEyes-style rows (data/trajectories.py) carry their instructions in their own text
    "zoom": "{problem}",
}


def check_task(task: str) -> str:
    """Return `task` if it is known, else raise ValueError listing the known tasks."""
    if task not in TASK_INSTRUCTIONS:
        known = ", ".join(sorted(TASK_INSTRUCTIONS))
        raise ValueError(f"unknown task {task!r}; known tasks: {known}")
    return task


def build_prompt_text(problem: str, task: str) -> str:
    """The problem with the task's instruction applied; `<image>` tags are kept in place."""
    return TASK_INSTRUCTIONS[check_task(task)].replace("{problem}", problem)


def _problem_and_image_count(source: Any) -> tuple[str, int | None]:
    """Accept a Sample-like object, a (problem, images) pair, or a bare problem string."""
    if isinstance(source, str):
        return source, None
    if isinstance(source, tuple) and len(source) == 2:
        problem, images = source
        return problem, len(images) if images is not None else 0
    if hasattr(source, "problem") and hasattr(source, "images"):
        videos = getattr(source, "videos", None) or []
        if source.problem.count(VIDEO_TAG) != len(videos):
            raise ValueError(f"problem has {source.problem.count(VIDEO_TAG)} {VIDEO_TAG} tags but "
                             f"{len(videos)} videos are given")
        return source.problem, len(source.images)
    raise TypeError(
        "build_messages takes a Sample, a (problem, images) tuple or a problem string, "
        f"got {type(source).__name__}"
    )


def _content_parts(text: str) -> list[dict]:
    """Split text at each <image> and <video> tag into text, image and video parts, in order."""
    parts: list[dict] = []
    for piece in _TAGS.split(text):
        if piece == IMAGE_TAG:
            parts.append({"type": "image"})
        elif piece == VIDEO_TAG:
            parts.append({"type": "video"})
        # Whitespace-only text between images carries nothing and would cost tokens.
        elif piece.strip():
            parts.append({"type": "text", "text": piece})
    return parts


def build_messages(source: Any, task: str) -> list[dict]:
    """One user message in the transformers multimodal chat format.

    `source` is a Sample (anything with `.problem` and `.images`, and `.videos` where it has
    them), a `(problem, images)` tuple, or a problem string. Each `<image>` tag in the problem
    becomes an `{"type": "image"}` part at its position, each `<video>` tag a `{"type": "video"}`
    part, with the text split around them. If the problem has no image tags but images are
    given, the images go first. A tag count that differs from a non-zero image count, or from
    the video count, raises ValueError.
    """
    problem, n_images = _problem_and_image_count(source)
    n_tags = problem.count(IMAGE_TAG)
    if n_images is not None and n_tags == 0 and n_images > 0:
        problem = IMAGE_TAG * n_images + problem
    elif n_images is not None and n_tags != n_images:
        raise ValueError(f"problem has {n_tags} {IMAGE_TAG} tags but {n_images} images are given")
    text = build_prompt_text(problem, task)
    return [{"role": "user", "content": _content_parts(text)}]


def render_messages_plain(messages: Sequence[dict]) -> str:
    """Messages as readable plain text (for inspection without a model's chat template)."""
    lines = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            body = content
        else:
            body = "".join(
                {"image": IMAGE_TAG, "video": VIDEO_TAG}.get(part["type"], part.get("text", "")) for part in content
            )
        lines.append(f"{message['role']}: {body}")
    return "\n".join(lines)
