"""tools/bench_turns.py's same-total baseline: each episode without its model turns, so that generating its
model tokens in one turn processes the episode's whole length."""

import torch
from PIL import Image

from rollout.base import Generation
from rollout.episode import MODEL, PROMPT, TOOL, Episode
from tools.bench_turns import same_total_inputs


def _episode():
    prompt_image, crop = Image.new("RGB", (28, 28), (1, 2, 3)), Image.new("RGB", (28, 28), (4, 5, 6))
    e = Episode(0, [11, 12, 13], [PROMPT] * 3, images=[prompt_image])
    e.add_model_turn(Generation(0, [21, 22, 23], [-0.1] * 3, "length"))
    e.add_tool_tokens([31, 32], torch.zeros(4, 3), torch.tensor([[1, 2, 2]]), [crop])
    e.add_model_turn(Generation(0, [24, 25], [-0.2] * 2, "length"))
    e.add_tool_tokens([33], None, None, [])
    e.add_model_turn(Generation(0, [26], [-0.3], "stop"))
    return e, [prompt_image, crop]


def test_same_total_prompts_hold_the_prompt_and_tool_messages_in_order():
    e, images = _episode()
    (flat,) = same_total_inputs([e], pixels=False)
    assert flat.input_ids == [11, 12, 13, 31, 32, 33]
    assert flat.images == images
    # the prompt plus the episode's model tokens is the episode's whole length
    assert len(flat.input_ids) + e.model_tokens == len(e.token_ids)
    # the episode itself is left as it was
    assert e.sources.count(MODEL) == 6 and e.sources.count(TOOL) == 3 and len(e.turns) == 3
