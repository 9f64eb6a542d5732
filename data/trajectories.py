"""Rows that hold chat messages: DeepEyes-47k prompts and multi-turn SFT trajectories.

Two layouts are read (data/datasets.py's VLDataset hands such files here):
  - DeepEyes-47k / verl's RL parquet: `prompt` (chat messages: an optional system message and a
    user message whose text holds one `<image>` per image), `images` (list of {bytes, path}), and
    the gold answer in `reward_model.ground_truth` (else an `answer` column, else
    `extra_info.answer`). Other columns (`data_source`, `ability`, `extra_info`) are kept out of the
    sample. The user text becomes the sample's problem, so the row reaches the trainer as any
    other sample: its text already carries its instructions, and `data.task: zoom` adds none.
  - Trajectories: `messages` (system, user, assistant and tool-result turns, each content a string
    with one `<image>` per image), `images` (every image of the conversation, in order) and an
    optional `answer`. The sample's problem and images are the first user turn's (the prompt);
    `conversation` is the whole conversation, for SFT (`encode_conversation`).
A message's content may also be a list of parts ({"type": "text", "text": ...} / {"type": "image"}).

Every image is decoded and canonicalized as VLDataset does; `originals` keeps the prompt's images
as decoded (before the image rule), so a zoom tool can cut its crops from them.

`encode_conversation` renders a conversation with the chat template once, expands each image
placeholder by the family's image rule exactly as prompts are, and marks the assistant turns'
tokens (each turn's text and its end-of-turn token; never system, user or tool tokens) in a loss
mask, found by token positions: the tokens of the conversation rendered up to each assistant
turn's start, and up to its end-of-turn token, are prefixes of the whole conversation's tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from PIL import Image

from data.images import BadSample, canonicalize_image, decode_image

IMAGE_TAG = "<image>"
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ConversationSample:
    """A row of a messages file: the prompt as a Sample has it, plus the conversation for SFT."""

    index: int
    images: list  # the prompt's images, canonical
    problem: str  # the prompt's user text, one <image> per image
    answer: str
    originals: list = field(default_factory=list)  # the prompt's images as decoded
    system: str = ""
    conversation: list | None = None  # [{"role", "content": [parts]}], trajectories only
    conversation_images: list = field(default_factory=list)  # every image of the conversation, canonical


@dataclass
class EncodedConversation:
    """A whole conversation as the model sees it, with the assistant tokens marked for the loss."""

    input_ids: torch.Tensor  # (L,) image placeholders expanded
    loss_mask: torch.Tensor  # (L,) 1 on assistant tokens (text and end-of-turn)
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    images: list


def messages_layout(table: pa.Table) -> str | None:
    """"prompt" (DeepEyes), "messages" (trajectories) or None for the single-turn layout."""
    names = table.column_names
    if "messages" in names:
        return "messages"
    if "prompt" in names and pa.types.is_list(table.schema.field("prompt").type):
        return "prompt"
    return None


def _parts(content: Any, where: str) -> list[dict]:
    """A message content as parts; `<image>` tags in text become image parts in place."""
    if content is None:
        return []
    if isinstance(content, str):
        parts: list[dict] = []
        for i, piece in enumerate(content.split(IMAGE_TAG)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts
    if isinstance(content, list):
        out = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                out.extend(_parts(part["text"], where))
            elif kind == "image" or (isinstance(part, dict) and "image" in part):
                out.append({"type": "image"})
            else:
                raise BadSample("bad_message", f"{where}: unrecognised content part {str(part)[:60]}")
        return out
    raise BadSample("bad_message", f"{where}: content of type {type(content).__name__}")


def _messages(value: Any, column: str) -> list[dict]:
    """A messages cell as [{"role", "content": parts}], checked."""
    if isinstance(value, str):  # JSONL/CSV writers sometimes store the list as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise BadSample("bad_message", f"{column} is not a list of messages ({err.msg})") from None
    if not isinstance(value, list) or not value:
        raise BadSample("bad_message", f"{column} holds no messages")
    out = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise BadSample("bad_message", f"{column}[{i}] has role {role!r}; expected one of {', '.join(ROLES)}")
        out.append({"role": role, "content": _parts(message.get("content"), f"{column}[{i}]")})
    return out


def _text(parts: list[dict]) -> str:
    return "".join(IMAGE_TAG if p["type"] == "image" else p["text"] for p in parts)


def _image_count(messages: list[dict]) -> int:
    return sum(p["type"] == "image" for m in messages for p in m["content"])


def _answer(row: dict) -> str:
    """The gold answer: reward_model.ground_truth, else `answer`, else extra_info.answer."""
    for value in ((row.get("reward_model") or {}).get("ground_truth"), row.get("answer"),
                  (row.get("extra_info") or {}).get("answer") if isinstance(row.get("extra_info"), dict) else None):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return ""


class MessageRows:
    """Reads the rows of a messages file; VLDataset delegates `get` to it."""

    def __init__(self, table: pa.Table, layout: str, path: Path):
        self.table, self.layout, self.path = table, layout, path
        if "images" not in table.column_names:
            raise ValueError(f"{path}: missing required column 'images' (a messages file needs it, possibly empty "
                             f"lists); columns present: {table.column_names}")

    def _row(self, index: int) -> dict:
        names = [n for n in (self.layout, "images", "answer", "reward_model", "extra_info") if n in self.table.column_names]
        return {n: self.table.column(n)[index].as_py() for n in names}

    def get(self, index: int, dataset) -> ConversationSample:
        """Row `index`, images decoded with `dataset`'s settings (a VLDataset)."""
        row = self._row(index)
        messages = _messages(row[self.layout], self.layout)
        refs = _image_refs(row["images"])
        if _image_count(messages) != len(refs):
            raise BadSample("image_count_mismatch", f"{_image_count(messages)} {IMAGE_TAG} tags in {self.layout}, "
                                                    f"{len(refs)} images")
        first_assistant = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        prompt = messages[:first_assistant]
        users = [m for m in prompt if m["role"] == "user"]
        if not users or not _text(users[-1]["content"]).replace(IMAGE_TAG, "").strip():
            raise BadSample("empty_problem", f"{self.layout} has no user text before the first assistant turn")
        if self.layout == "messages" and first_assistant == len(messages):
            raise BadSample("bad_message", "messages has no assistant turn to train on")
        answer = _answer(row)
        if self.layout == "prompt" and not answer:
            raise BadSample("missing_answer", "no reward_model.ground_truth, answer or extra_info.answer")
        n_prompt_images = _image_count(prompt)
        originals = [_decode(data, path, dataset) for data, path in refs]
        canonical = [canonicalize_image(img, min_pixels=dataset.min_pixels, max_pixels=dataset.max_pixels)
                     for img in originals]
        system = next((_text(m["content"]) for m in prompt if m["role"] == "system"), "")
        # the prompt's images all belong to its last user turn's problem text
        problem = _text(users[-1]["content"])
        if problem.count(IMAGE_TAG) != n_prompt_images:
            raise BadSample("image_count_mismatch", "prompt images outside the last user turn before the answer")
        return ConversationSample(
            index=index, images=canonical[:n_prompt_images], problem=problem, answer=answer,
            originals=originals[:n_prompt_images], system=system,
            conversation=messages if self.layout == "messages" else None,
            conversation_images=canonical if self.layout == "messages" else [])


def _image_refs(value: Any) -> list[tuple[bytes | None, str | None]]:
    if value is None:
        return []
    refs = []
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, dict):
            refs.append((item.get("bytes"), item.get("path")))
        elif isinstance(item, str):
            refs.append((None, item))
        else:
            raise BadSample("missing_image", f"unrecognised image entry of type {type(item).__name__}")
    return refs


def _decode(data: bytes | None, path: str | None, dataset) -> Image.Image:
    if data:
        return decode_image(data, max_image_pixels=dataset.max_image_pixels)
    if path:
        full = Path(path) if Path(path).is_absolute() else dataset.path.resolve().parent / path
        return decode_image(full, max_image_pixels=dataset.max_image_pixels)
    raise BadSample("missing_image", "image entry has neither bytes nor path")


# --- the tools' schemas in the system turn ---------------------------------------------------------

@dataclass(frozen=True)
class ToolPrompt:
    """The configured tools' OpenAI function schemas, rendered into the system turn of every prompt
    and every SFT conversation, so that rollout and training prompts match.

    A chat template that takes `tools=` (`template_takes_tools`; Qwen2.5's and Qwen3-VL's do) renders
    them itself, after the conversation's system text. Otherwise `system_with_tools(system, schemas)`,
    the family's rule (models/family.py `ToolFormat`), writes the system turn's text.

    A conversation's own system message is kept, and the schemas follow it; but one whose text already
    holds every configured tool's schema (`"name": "<tool>"`, as DeepEyes-47k's system prompt does)
    wins as it is, and nothing is added.
    """

    schemas: tuple[dict, ...]
    template_takes_tools: bool
    system_with_tools: Callable[[str, list[dict]], str] | None = None

    def describes_tools(self, system: str) -> bool:
        """Whether `system` already holds each tool's schema (its JSON `"name": "<tool>"`)."""
        names = [s.get("function", s).get("name", "") for s in self.schemas]
        return all(re.search(r'"name"\s*:\s*"' + re.escape(n) + '"', system) for n in names)

    def apply(self, messages: list[dict]) -> tuple[list[dict], dict]:
        """(messages, chat-template kwargs) with the schemas in the system turn."""
        has_system = bool(messages) and messages[0]["role"] == "system"
        system = _plain(messages[0]["content"]) if has_system else ""
        rest = messages[1:] if has_system else messages
        if has_system and self.describes_tools(system):
            return [{"role": "system", "content": system}, *rest], {}
        if self.template_takes_tools:
            head = [{"role": "system", "content": system}] if has_system else []
            return head + rest, {"tools": list(self.schemas)}
        return [{"role": "system", "content": self.system_with_tools(system, list(self.schemas))}, *rest], {}


def build_tool_prompt(processor, schemas: list[dict], system_with_tools: Callable | None,
                      family: str = "") -> ToolPrompt | None:
    """The ToolPrompt of `schemas` for `processor`'s chat template; None without schemas. Whether the
    template takes `tools=` is seen by rendering a conversation with and without them."""
    if not schemas:
        return None
    probe = [{"role": "user", "content": "?"}]
    plain = processor.apply_chat_template(probe, add_generation_prompt=True)
    with_tools = processor.apply_chat_template(probe, add_generation_prompt=True, tools=list(schemas))
    takes = with_tools != plain
    if not takes and system_with_tools is None:
        raise ValueError(f"rollout.tools: the chat template does not take tools= and model family '{family}' does not "
                         "say how tool schemas enter the system turn (ToolFormat.tools_intro)")
    return ToolPrompt(tuple(schemas), takes, system_with_tools)


def _plain(content: Any) -> str:
    """A message content (a string or parts) as text; images are not allowed in a system turn."""
    if isinstance(content, str):
        return content
    if any(p["type"] == "image" for p in content):
        raise BadSample("bad_message", "an image in the system message")
    return _text(content)


def render_chat(processor, messages: list[dict], generation_prompt: bool, tool_prompt: ToolPrompt | None = None) -> str:
    """The chat template's text for `messages`, with the tools' schemas in the system turn."""
    kwargs = {}
    if tool_prompt is not None:
        messages, kwargs = tool_prompt.apply(messages)
    text = processor.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs)
    return text[0] if isinstance(text, list) else text


# --- encoding a conversation for SFT ---------------------------------------------------------------

def _expanded_ids(processor, text: str, grids: torch.Tensor | None) -> list[int]:
    """Token ids of `text` with its image placeholders expanded by the family's image rule (the
    first placeholders take the first grids), as VLProcessor does for prompts."""
    parts = text.split(processor.image_pad)
    if len(parts) > 1:
        text = parts[0] + "".join(processor.images.expansion(g) + rest for g, rest in zip(grids, parts[1:]))
    return processor.tokenizer.encode(text, add_special_tokens=False)


def _prefix_len(full: list[int], prefix: list[int], what: str) -> int:
    if full[:len(prefix)] != prefix:
        raise BadSample("template_not_prefix", f"the tokens up to {what} are not a prefix of the conversation's "
                                               "(the chat template renders earlier turns differently later)")
    return len(prefix)


def encode_conversation(processor, sample: ConversationSample, max_tokens: int,
                        tool_prompt: ToolPrompt | None = None) -> EncodedConversation:
    """The conversation's token ids (chat template once, placeholders expanded), its image tensors,
    and a loss mask on each assistant turn's tokens: its text and the end-of-turn token the
    template closes it with. Raises BadSample("conversation_too_long") past `max_tokens`."""
    messages = sample.conversation
    images = processor.prepare_images(list(sample.conversation_images))
    pixel_values, grids = processor.images.encode(images) if images else (None, None)
    full_text = render_chat(processor, messages, False, tool_prompt)
    if full_text.count(processor.image_pad) != len(images):
        raise BadSample("image_count_mismatch", f"{full_text.count(processor.image_pad)} image placeholders "
                                                f"rendered, {len(images)} images")
    ids = _expanded_ids(processor, full_text, grids)
    if len(ids) > max_tokens:
        raise BadSample("conversation_too_long", f"{len(ids)} tokens > data.max_prompt_tokens={max_tokens}")
    mask = torch.zeros(len(ids), dtype=torch.long)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = render_chat(processor, messages[:k], True, tool_prompt)
        closed = render_chat(processor, messages[:k + 1], False, tool_prompt)
        body = _text(message["content"])
        if not closed.startswith(head + body):
            raise BadSample("template_not_prefix", f"assistant turn {k} is not rendered as its text after the "
                                                   "generation prompt")
        # the end-of-turn token: the first token of what the template writes after the text
        closing = processor.tokenizer.encode(closed[len(head) + len(body):], add_special_tokens=False)
        end_token = processor.tokenizer.decode(closing[:1]) if closing else ""
        start = _prefix_len(ids, _expanded_ids(processor, head, grids), f"assistant turn {k}")
        end = _prefix_len(ids, _expanded_ids(processor, head + body + end_token, grids),
                          f"the end of assistant turn {k}")
        mask[start:end] = 1
    return EncodedConversation(torch.tensor(ids, dtype=torch.long), mask, pixel_values, grids, images)
