"""From a dataset sample to model inputs: chat template + processor, once per prompt.

Images arrive canonical (RGB, sides multiples of 28, within min/max pixels — see
`data.images.canonicalize_image`); the family's image rule brings them to the pixels its model
sees (a no-op for Qwen2/2.5-VL), and the processor is told not to resize again: the trainer,
not the processor or the engine, decides every image's size, and the engine gets these images. Prompts are never truncated; one longer
than the limit is rejected with a reason (cutting it would cut image tokens).

Videos (`data.video.Video`) arrive canonical too (frames of one size on the family's grid, a
count the temporal patch divides); the family's rule turns them into `pixel_values_videos`,
`video_grid_thw` and `second_per_grid_ts` without resizing, and says what each video's
placeholder expands to (Qwen3-VL: a `<t seconds>` text before each temporal group).
`video_metadata` is the one description of a clip's timing both sides use: the trainer computes
timestamps and `second_per_grid_ts` from it, and the vLLM engine hands the same dict to vLLM.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.images import BadSample
from data.prompts import build_messages
from data.trajectories import render_chat

log = logging.getLogger(__name__)

SFT_TARGETS = {
    "clevr": "<answer>{answer}</answer>",
    "generic": "<answer>{answer}</answer>",
    "geo3k": "<think>\n</think>\n\\boxed{{{answer}}}",
}


@dataclass
class EncodedPrompt:
    """A prompt as the model sees it: expanded token ids plus processor outputs for its images."""

    index: int
    input_ids: torch.Tensor  # (L,) with image and video placeholders expanded
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    images: list = field(default_factory=list)
    answer: str = ""
    originals: list = field(default_factory=list)  # `images` as decoded, where the dataset keeps them (zoom tools)
    conversation: object = None  # a trajectory row's whole conversation (data.trajectories.EncodedConversation)
    videos: list = field(default_factory=list)  # data.video.Video, one per video placeholder, in order
    pixel_values_videos: torch.Tensor | None = None  # (patches, dim) of all videos, as pixel_values
    video_grid_thw: torch.Tensor | None = None  # (num_videos, 3): (temporal groups, h, w) patches
    second_per_grid_ts: torch.Tensor | None = None  # (num_videos,) float32: seconds per temporal group


def size_field(size, key: str):
    """A field of an image processor's size dict (a dict or transformers' SizeDict), or None."""
    if size is None:
        return None
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


class ImageRule:
    """How one family's images reach its model; each family module defines one and registers it.

    Built from the loaded image processor and the processor's settings (processor_config.json
    over preprocessor_config.json). `placeholder` is what the chat template writes per image.
    """

    placeholder: str = "<image>"

    def __init__(self, image_processor, config: dict):
        self.image_processor = image_processor

    def prepare(self, image):
        """The image at the pixels the model sees (one resize at most; a no-op when already there)."""
        raise NotImplementedError

    def encode(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, image_grid_thw) of prepared images, from the family's image processor."""
        raise NotImplementedError

    def expansion(self, grid_row: torch.Tensor) -> str:
        """The text one image's placeholder expands to (the adapter counts its image tokens)."""
        raise NotImplementedError

    # What the chat template writes per video; None: the family takes no video. Frames must have
    # sides that are multiples of `video_factor` and a count that `frame_multiple` divides.
    video_placeholder: str | None = None
    video_factor: int = 28
    frame_multiple: int = 2

    def encode_videos(self, videos: list) -> dict:
        """{pixel_values_videos, video_grid_thw, second_per_grid_ts} of canonical videos (data.video.Video)."""
        raise NotImplementedError

    def video_expansion(self, grid_row: torch.Tensor, video) -> str:
        """The text one video's placeholder expands to."""
        raise NotImplementedError


def video_metadata(video) -> dict:
    """The timing of a clip as vLLM's and transformers' video processors read it (`VideoMetadata`).

    `fps` is the sampling rate and `frames_indices` each frame's time in units of it, so
    `frames_indices[i] / fps` is the frame's timestamp and the sampled fps
    (`len(frames_indices) / total_num_frames * fps`) is `fps`. `do_sample_frames` is False: the
    frames were sampled once, in data/.
    """
    n = len(video.frames)
    return {"fps": float(video.fps), "total_num_frames": n, "duration": n / float(video.fps),
            "frames_indices": [int(round(t * video.fps)) for t in video.timestamps],
            "width": video.size[0], "height": video.size[1], "do_sample_frames": False}


def group_timestamps(metadata: dict, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal group of a clip: the mean of its first and last frame's time
    (the rule of Qwen3-VL's processor in transformers and vLLM, from the same metadata)."""
    idx = list(metadata["frames_indices"])
    if len(idx) % temporal_patch_size:
        idx += [idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size)
    times = [i / metadata["fps"] for i in idx]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


# Image rules by the checkpoint's processor class (processor_config.json / preprocessor_config.json).
# The family modules (models/families/) fill it when they register; data/ imports no model code.
IMAGE_RULES: dict[str, type[ImageRule]] = {}


def register_image_rule(processor_class: str, rule: type[ImageRule]) -> None:
    """Make `rule` the image rule of checkpoints whose processor class is `processor_class`."""
    if IMAGE_RULES.get(processor_class, rule) is not rule:
        raise ValueError(f"processor class {processor_class!r} already has the image rule "
                         f"{IMAGE_RULES[processor_class].__name__}")
    IMAGE_RULES[processor_class] = rule


def _processor_config(folder: Path) -> dict:
    """The processor's settings: processor_config.json over preprocessor_config.json (either may be absent)."""
    merged: dict = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        f = folder / name
        if f.is_file():
            data = json.loads(f.read_text(encoding="utf-8"))
            merged.update({k: v for k, v in data.items() if k != "image_processor"})
    return merged


class VLProcessor:
    """Tokenizer + image processor of a model folder, with placeholder expansion done here.

    Loading the pieces directly (not through AutoProcessor) keeps the image path free of the
    video processor, which needs torchvision. The family's image rule (`IMAGE_RULES`, chosen
    by the checkpoint's processor class, filled by the family modules) says which size every image is brought to (the pixels
    the trainer and the engine both see), which tensors the processor emits, and what each
    image's placeholder in the chat-templated text expands to.
    """

    def __init__(self, model_path: str, trust_remote_code: bool = False):
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = Path(model_path)
        if not folder.is_dir():
            raise FileNotFoundError(f"model folder not found: {model_path}")
        kw = dict(local_files_only=True, trust_remote_code=trust_remote_code)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, **kw)
        self.image_processor = AutoImageProcessor.from_pretrained(model_path, **kw)
        config = _processor_config(folder)
        kind = config.get("processor_class", "Qwen2VLProcessor")
        if kind not in IMAGE_RULES:
            raise ValueError(f"{model_path}: processor class {kind!r} is not supported; supported: {sorted(IMAGE_RULES)} "
                             "(families register their image rules when models.family is imported)")
        self.images = IMAGE_RULES[kind](self.image_processor, config)
        self.image_pad = self.images.placeholder
        if self.tokenizer.chat_template is None:
            raise ValueError(f"the tokenizer in {model_path} has no chat template")
        self._max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: the longest vocabulary entry.

        A byte-level vocabulary writes one character per byte and a text's characters are never
        more than its UTF-8 bytes, so a text of more than `max_prompt_tokens * max_token_chars`
        characters cannot fit in `max_prompt_tokens` tokens; that is known without tokenizing it.
        """
        if self._max_token_chars is None:
            self._max_token_chars = max(1, max((len(t) for t in self.tokenizer.get_vocab()), default=1))
        return self._max_token_chars

    def max_text_chars(self, max_prompt_tokens: int) -> int:
        """The longest text (in characters) that could still fit in `max_prompt_tokens` tokens."""
        return max_prompt_tokens * self.max_token_chars

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """The template's text; `kwargs` go to the template (e.g. `tools=`)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                  **kwargs)

    def video_options(self) -> dict:
        """The `VLDataset` arguments that decode videos onto this family's grid and temporal patch."""
        return {"video_factor": self.images.video_factor, "frame_multiple": self.images.frame_multiple}

    def prepare_images(self, images: list) -> list:
        """The images at the pixels the model sees (a no-op for images already at them)."""
        return [self.images.prepare(img) for img in images]

    def __call__(self, text: str, images: list, videos: list = ()) -> dict:
        """Token ids with every image and video placeholder expanded, and the processor's tensors.

        `images` must already be prepared (`prepare_images`); `videos` are canonical clips.
        """
        out = {"pixel_values": None, "image_grid_thw": None, "pixel_values_videos": None, "video_grid_thw": None,
               "second_per_grid_ts": None}
        if videos:
            tag = self.images.video_placeholder
            if tag is None:
                raise ValueError(f"processor class {type(self.images).__name__} takes no video; "
                                 f"{len(videos)} videos were given")
            out.update(self.images.encode_videos(list(videos)))
            parts = text.split(tag)
            if len(parts) - 1 != len(videos):
                raise BadSample("video_count_mismatch", f"{len(parts) - 1} video parts for {len(videos)} videos")
            text = parts[0] + "".join(self.images.video_expansion(g, v) + rest
                                      for g, v, rest in zip(out["video_grid_thw"], videos, parts[1:]))
        if images:
            out["pixel_values"], out["image_grid_thw"] = self.images.encode(images)
            text = self.expand_images(text, out["image_grid_thw"])
        out["input_ids"] = torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
        return out

    def expand_images(self, text: str, grid: torch.Tensor) -> str:
        """`text` with its image placeholders expanded by the image rule, one per row of `grid`."""
        parts = text.split(self.image_pad)
        if len(parts) - 1 != len(grid):
            raise BadSample("image_count_mismatch", f"{len(parts) - 1} image parts for {len(grid)} images")
        return parts[0] + "".join(self.images.expansion(g) + rest for g, rest in zip(grid, parts[1:]))


def load_processor(model_path: str, trust_remote_code: bool = False) -> VLProcessor:
    return VLProcessor(model_path, trust_remote_code)


def encode_prompt(processor: VLProcessor, sample, task: str, max_prompt_tokens: int, tool_prompt=None) -> EncodedPrompt:
    """Chat template + image processing on one sample; raises BadSample('prompt_too_long') instead of truncating.

    A problem too long to fit at all is refused from its length, before the chat template and the
    tokenizer, whose time and memory grow linearly with the text. A row's own system message
    (`sample.system`, messages rows) comes first; `tool_prompt` (data/trajectories.py `ToolPrompt`)
    renders the configured tools' schemas into the system turn.
    """
    limit = processor.max_text_chars(max_prompt_tokens)
    if len(sample.problem) > limit:
        raise BadSample("prompt_too_long", f"problem has {len(sample.problem)} characters > {limit} "
                                           f"(data.max_prompt_tokens={max_prompt_tokens} × the longest token's "
                                           f"{processor.max_token_chars} characters); checked before tokenizing")
    messages = build_messages(sample, task)
    if getattr(sample, "system", ""):
        messages = [{"role": "system", "content": sample.system}, *messages]
    text = render_chat(processor, messages, True, tool_prompt)
    images = processor.prepare_images(list(sample.images))
    videos = list(getattr(sample, "videos", None) or [])
    out = processor(text, images, videos)
    ids = out["input_ids"]
    if ids.numel() > max_prompt_tokens:
        raise BadSample("prompt_too_long", f"{ids.numel()} tokens > data.max_prompt_tokens={max_prompt_tokens}")
    conversation = None
    if getattr(sample, "conversation", None) is not None:  # a trajectory row, for SFT
        from data.trajectories import encode_conversation
        conversation = encode_conversation(processor, sample, max_prompt_tokens, tool_prompt)
    return EncodedPrompt(sample.index, ids, out["pixel_values"], out["image_grid_thw"], images, sample.answer,
                         list(getattr(sample, "originals", None) or []), conversation, videos,
                         out["pixel_values_videos"], out["video_grid_thw"], out["second_per_grid_ts"])


def token_id(tokenizer, token: str) -> int | None:
    """The id of `token` if the tokenizer has it as one token of its vocabulary, else None."""
    if not token:
        return None
    tid = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(tid, int) or tid < 0 or tid == tokenizer.unk_token_id:
        return None
    return tid


def _generation_eos_ids(folder: Path) -> list[int]:
    """`eos_token_id` of the folder's generation_config.json (an int or a list); [] when absent."""
    f = folder / "generation_config.json"
    if not f.is_file():
        return []
    try:
        value = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        log.warning("%s: unreadable (%s); its eos ids are not used as stop tokens", f, err)
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def stop_token_ids(model_path: str, tokenizer, end_of_turn: str) -> list[int]:
    """The tokens that end a response of the model in `model_path`, first seen first.

    The union of what the folder declares: the family's end-of-turn token (`end_of_turn`, what its
    chat template writes after an assistant message), generation_config.json's `eos_token_id`
    (an int or a list) and the tokenizer's eos token. Tokens the tokenizer does not have and ids
    outside it are skipped; a folder that declares none at all is an error.
    """
    found = [token_id(tokenizer, end_of_turn), *_generation_eos_ids(Path(model_path)),
             token_id(tokenizer, tokenizer.eos_token or "")]
    ids = list(dict.fromkeys(t for t in found if t is not None and 0 <= t < len(tokenizer)))
    if not ids:
        raise ValueError(
            f"{model_path}: no stop token: the tokenizer has no end-of-turn token {end_of_turn!r} and no eos "
            "token, and generation_config.json lists no eos_token_id; set one of them in the model folder"
        )
    return ids


def encode_response(tokenizer, text: str, end_of_turn: str) -> torch.Tensor:
    """Token ids of an assistant turn as the engine would generate it: `text`, then the end-of-turn token.

    `end_of_turn` is the family's (`FamilyAdapter.end_of_turn`), the token its chat template writes
    after an assistant message and generation stops on; "" leaves the turn open (a prefix).
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    if end_of_turn:
        tid = token_id(tokenizer, end_of_turn)
        if tid is None:
            raise ValueError(f"the tokenizer has no end-of-turn token {end_of_turn!r}: a response cannot end its turn")
        ids.append(tid)
    return torch.tensor(ids, dtype=torch.long)


def sft_target(task: str, answer: str) -> str:
    """The assistant text SFT teaches for `task` (`encode_response` adds the end-of-turn token)."""
    return SFT_TARGETS.get(task, SFT_TARGETS["generic"]).format(answer=answer)


def videos_per_row(path: str) -> int:
    """The most videos one row of the dataset at `path` holds (0 for an image or text dataset), read
    from the table's columns without decoding anything: the video limit the engine is built with."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from data.datasets import COLUMN_ALIASES, read_table

    table = read_table(path)
    names = table.column_names
    column = next((n for n in COLUMN_ALIASES.get("videos", ()) if n in names), None)
    if column is None:
        if {"path", "data_type"} <= set(names):  # Video-R1's schema: one image or video per row
            return int(pc.any(pc.equal(table.column("data_type"), "video")).as_py() or False)
        return 0
    values = table.column(column)
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        return int(pc.max(pc.list_value_length(values)).as_py() or 0)
    return 1
