"""An episode: one rollout of one prompt, as a growing token sequence.

An episode holds the prompt's tokens, then turns: the model's sampled tokens, and between them
the tokens of each tool result. Every token has a source (prompt, model or tool); every model
token has the engine's logprob; the images are kept in order (the prompt's, then each tool
result's) with their processor outputs; the episode ends with one finish reason. A single-turn
rollout is an episode with one model turn.

Token in, token out: the model's sampled ids are appended exactly as sampled (they are decoded
only to find tool calls and to score the final answer). A tool result is appended as the tokens
the family's chat template renders for its message: the template's text after the model's
end-of-turn token, with each image placeholder expanded by the family's image rule, exactly as a
prompt is (`ToolResultEncoder`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from data.batch import Batch, PackedGenericDataItem
from data.images import canonicalize_image, image_key
from models.family import FamilyAdapter, ToolFormat
from rollout.base import Generation, PromptInput

PROMPT, MODEL, TOOL = 0, 1, 2  # token sources
FINISH_REASONS = ("answered", "max_turns", "max_tool_images", "max_tokens", "tool_error_limit")


@dataclass
class Episode:
    """One prompt's rollout (see the module docstring)."""

    prompt_index: int
    token_ids: list[int]
    sources: list[int]
    logprobs: list[float] = field(default_factory=list)  # the engine's, one per model token, in order
    images: list = field(default_factory=list)  # PIL images as the model saw them, prompt's first
    # The prompt's processor outputs (the tensor the prompt's other episodes share) and, per tool
    # message with images, its own.
    prompt_pixels: torch.Tensor | None = None
    prompt_grid: torch.Tensor | None = None
    tool_pixels: list[torch.Tensor] = field(default_factory=list)
    tool_grids: list[torch.Tensor] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each model turn
    finish_reason: str | None = None
    engine_finish: str = "stop"  # how the engine ended the last model turn: stop | length
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)
    # The prompt's videos (data.video.Video) and their processor outputs, shared like its images.
    videos: list = field(default_factory=list)
    video_pixels: torch.Tensor | None = None
    video_grid: torch.Tensor | None = None
    video_seconds: torch.Tensor | None = None
    # MoE routing replay: the experts the engine routed each token to, (tokens so far, layers, k); the
    # last turn's generation reports the whole episode up to its end (its prompt was the episode so far)
    routed_experts: torch.Tensor | None = None

    @classmethod
    def start(cls, index: int, prompt) -> "Episode":
        """An episode holding only `prompt` (an EncodedPrompt)."""
        ids = prompt.input_ids.tolist()
        return cls(index, ids, [PROMPT] * len(ids), images=list(prompt.images), prompt_pixels=prompt.pixel_values,
                   prompt_grid=prompt.image_grid_thw, videos=list(getattr(prompt, "videos", None) or []),
                   video_pixels=getattr(prompt, "pixel_values_videos", None),
                   video_grid=getattr(prompt, "video_grid_thw", None),
                   video_seconds=getattr(prompt, "second_per_grid_ts", None))

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def model_tokens(self) -> int:
        return len(self.logprobs)

    @property
    def prompt_images(self) -> int:
        return 0 if self.prompt_grid is None else int(self.prompt_grid.shape[0])

    @property
    def tool_images(self) -> int:
        return sum(int(g.shape[0]) for g in self.tool_grids)

    @property
    def errors(self) -> int:
        return sum(self.tool_errors.values())

    def add_model_turn(self, gen: Generation) -> None:
        """Append the engine's sampled ids and logprobs as they are."""
        start = len(self.token_ids)
        self.token_ids += list(gen.token_ids)
        self.sources += [MODEL] * len(gen.token_ids)
        self.logprobs += list(gen.logprobs)
        self.turns.append((start, len(self.token_ids)))
        self.engine_finish = gen.finish_reason
        if gen.routed_experts is not None:
            self.routed_experts = gen.routed_experts[: len(self.token_ids)]

    def add_tool_tokens(self, ids: list[int], pixels: torch.Tensor | None, grid: torch.Tensor | None,
                        images: list) -> None:
        """Append a rendered tool message (its expanded ids) and the images it carries."""
        self.token_ids += list(ids)
        self.sources += [TOOL] * len(ids)
        if grid is not None:
            self.tool_pixels.append(pixels)
            self.tool_grids.append(grid)
            self.images += list(images)

    def count_error(self, kind: str) -> None:
        self.tool_errors[kind] = self.tool_errors.get(kind, 0) + 1

    def last_turn_ids(self) -> list[int]:
        if not self.turns:
            return []
        start, end = self.turns[-1]
        return self.token_ids[start:end]

    def pixel_values(self) -> torch.Tensor | None:
        """All images' pixel rows in order (what an engine takes for the whole sequence)."""
        parts = [p for p in [self.prompt_pixels, *self.tool_pixels] if p is not None]
        return torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else None)

    def image_grid_thw(self) -> torch.Tensor | None:
        parts = [g for g in [self.prompt_grid, *self.tool_grids] if g is not None]
        return torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else None)

    def tool_pixel_values(self) -> torch.Tensor | None:
        return torch.cat(self.tool_pixels) if self.tool_pixels else None

    def tool_image_grid_thw(self) -> torch.Tensor | None:
        return torch.cat(self.tool_grids) if self.tool_grids else None

    def engine_input(self, pixels: bool = True) -> PromptInput:
        """The whole sequence so far as an engine prompt (its ids and every image in order).

        `pixels=False` leaves out the processor outputs (pixel rows and grids) for an engine that
        processes the images itself (vLLM): joining every image's pixel rows costs a copy of all of
        them on every turn (~10 MB per 448x448 crop), which such an engine never reads."""
        if not pixels:
            return PromptInput(list(self.token_ids), list(self.images), videos=list(self.videos))
        return PromptInput(list(self.token_ids), list(self.images), self.pixel_values(), self.image_grid_thw(),
                           list(self.videos), self.video_pixels, self.video_grid, self.video_seconds)

    def routes(self) -> torch.Tensor | None:
        """The engine's routing of every token, (tokens, layers, k); -1 rows where it ran none (tool
        tokens appended after the last model turn, the last sampled token)."""
        r = self.routed_experts
        if r is None or r.shape[0] >= len(self.token_ids):
            return None if r is None else r[: len(self.token_ids)]
        return torch.cat([r, r.new_full((len(self.token_ids) - r.shape[0], *r.shape[1:]), -1)])

    def loss_mask(self) -> torch.Tensor:
        """1 on model tokens, 0 on prompt and tool tokens."""
        return (torch.tensor(self.sources, dtype=torch.long) == MODEL).long()


class ToolResultEncoder:
    """Tool results → the tokens the family's chat template renders for them, images expanded.

    The template's rendering of a conversation that ends with an assistant message is cut right
    after the assistant's end-of-turn token (where generation stopped); rendering the same
    conversation with the tool messages appended (and the next assistant header) must start with
    that cut, and what follows it is what the episode appends.
    """

    def __init__(self, processor, fmt: ToolFormat, end_of_turn: str, min_pixels: int, max_pixels: int):
        self.processor = processor
        self.format = fmt
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
        text = processor.apply_chat_template(self.base, add_generation_prompt=False)
        if not end_of_turn or end_of_turn not in text:
            raise ValueError(f"the chat template does not end an assistant message with {end_of_turn!r}: tool "
                             "results cannot be appended after a model turn")
        self.prefix = text[: text.rindex(end_of_turn) + len(end_of_turn)]

    def encode(self, results: list[tuple[str, list]]) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None, list]:
        """(ids, pixel_values, image_grid_thw, images) of the messages for `results` ((text, images) each)."""
        return self.encode_many([results])[0]

    def encode_many(self, batch: list[list[tuple[str, list]]]) -> list[tuple]:
        """`encode` of each episode's results in `batch`: a turn's episodes together.

        Episodes whose messages carry the same images (by content: a group's episodes are often sent
        the same crop) share one processor call and its tensors; the same messages' text is rendered
        and tokenized once. Each episode's outputs are bit for bit what `encode` gives it alone; its id
        list and its images are its own, only the processor's tensors are shared.
        """
        deltas: dict[tuple, str] = {}  # (text, image count) of each message -> the template's delta
        encoded: dict[tuple, tuple] = {}  # the images' content keys -> (pixel_values, image_grid_thw)
        tokens: dict[str, list[int]] = {}  # expanded delta -> ids
        out = []
        for results in batch:
            shape = tuple((text, len(images)) for text, images in results)
            if shape not in deltas:
                deltas[shape] = self._delta(results)
            images = self.processor.prepare_images([
                canonicalize_image(img, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
                for _, imgs in results for img in imgs])
            # keyed by content hash, the bytes not kept: a turn of distinct crops holds no copy of them
            key = tuple(image_key(img) for img in images)
            entry = encoded.get(key)
            if entry is None:
                entry = encoded[key] = self.processor.images.encode(images) if images else (None, None)
            pixels, grid = entry
            text = deltas[shape] if grid is None else self.processor.expand_images(deltas[shape], grid)
            if text not in tokens:
                tokens[text] = self.processor.tokenizer.encode(text, add_special_tokens=False)
            out.append((list(tokens[text]), pixels, grid, images))
        return out

    def _delta(self, results: list[tuple[str, list]]) -> str:
        """The template's text for the results' messages and the next assistant header (placeholders unexpanded)."""
        messages = [self.format.result_message(text, len(images)) for text, images in results]
        full = self.processor.apply_chat_template(self.base + messages, add_generation_prompt=True)
        if not full.startswith(self.prefix):
            raise ValueError("the chat template renders the conversation before a tool message differently once "
                             "the message is added; the tool message's tokens cannot be appended")
        return full[len(self.prefix):]


def episode_batch(episodes: list[Episode], adapter: FamilyAdapter) -> Batch:
    """The episodes as training sequences: ids, the model-token loss mask, positions over the whole
    episode with all its images, the prompt's pixel tensor (shared by the prompt's episodes, so the
    vision tower encodes it once per group) and the episode's own tool images."""
    ids, masks, pos, pix, grids, tpix, tgrids = [], [], [], [], [], [], []
    for e in episodes:
        seq = torch.tensor(e.token_ids, dtype=torch.long)
        ids.append(seq)
        masks.append(e.loss_mask())
        pos.append(adapter.position_ids(seq, e.image_grid_thw(), e.video_grid, e.video_seconds))
        pix.append(e.prompt_pixels)
        grids.append(e.prompt_grid)
        tpix.append(e.tool_pixel_values())
        tgrids.append(e.tool_image_grid_thw())
    fields = {"input_ids": ids, "loss_mask": masks, "image_grid_thw": grids, "pixel_values": pix,
              "position_ids": PackedGenericDataItem(pos, dim=1),
              "pixel_values_videos": [e.video_pixels for e in episodes],
              "video_grid_thw": [e.video_grid for e in episodes]}
    if any(t is not None for t in tpix):
        fields.update(tool_pixel_values=tpix, tool_image_grid_thw=tgrids)
    routes = [e.routes() for e in episodes]
    if any(r is not None for r in routes):  # MoE routing replay: the policy routes as the engine did
        if any(r is None for r in routes):
            raise ValueError("routing replay: some episodes of the batch carry the engine's routing and some do not")
        fields["routed_experts"] = routes
    return Batch(fields)
