"""vLLM generation throughput of multi-turn episodes against single-turn generation of the same tokens.

    python tools/bench_turns.py --model DIR [--prompts 16 --n 8 --turns 3 --turn-tokens 128] [--json-out F]

Single-turn: each prompt, n samples, `turns × turn_tokens` new tokens. Multi-turn: the same prompts
and samples, `turn_tokens` per turn; between turns every episode gets a tool message holding a
zoomed crop of its prompt image (rendered by the family's chat template, as `rollout/rollouts.py`
appends it), and the next turn sends each whole episode to the engine in one call. Generation is
forced to its full length (no stop tokens) so both sides generate the same number of tokens.
Tokens/s count generated tokens over the engine's generate calls only. Weights are vLLM's dummy
ones: throughput does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _prompts(processor, count: int, side: int):
    from PIL import Image

    from data.processing import EncodedPrompt

    out = []
    for i in range(count):
        image = Image.new("RGB", (side, side), (37 * i % 255, 90, 200 - 11 * i % 200))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many objects?"}]}]
        images = processor.prepare_images([image])
        enc = processor(processor.apply_chat_template(messages), images)
        out.append(EncodedPrompt(i, enc["input_ids"], enc["pixel_values"], enc["image_grid_thw"], images, "0"))
    return out


def _timed(engine, inputs, params) -> tuple[list, float]:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    gens = engine.generate(inputs, params)
    torch.cuda.synchronize()
    return gens, time.perf_counter() - t


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=128)
    p.add_argument("--side", type=int, default=448)
    p.add_argument("--text-tools", action="store_true", help="tool messages hold text only (no crop)")
    p.add_argument("--processor-cache-gb", type=float, default=4.0, help="vLLM's processed-image cache; 0: off")
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)

    from data.processing import load_processor
    from models.family import build_adapter
    from models.policy import load_model_config
    from rollout.base import SamplingParams
    from rollout.episode import Episode, ToolResultEncoder
    from rollout.vllm_engine import VLLMEngine

    config = load_model_config(args.model)
    adapter = build_adapter(config)
    processor = load_processor(args.model)
    pixels = args.side * args.side
    prompts = _prompts(processor, args.prompts, args.side)
    longest = max(p.input_ids.numel() for p in prompts)
    context = longest + args.turns * (args.turn_tokens + 64 + pixels // 784)
    engine = VLLMEngine(args.model, gpu_memory_utilization=0.5, max_model_len=context, seed=0, dtype="bfloat16",
                        min_pixels=784, max_pixels=pixels, image_pad_id=adapter.image_token_id,
                        adapter=adapter, max_images_per_prompt=args.turns, max_num_seqs=args.prompts * args.n,
                        processor_cache_gb=args.processor_cache_gb)
    encoder = ToolResultEncoder(processor, adapter.tool_format, adapter.end_of_turn, 784, pixels)
    banned = adapter.banned_token_ids
    whole = SamplingParams(n=args.n, max_new_tokens=args.turns * args.turn_tokens, banned_token_ids=banned, seed=1)
    turn = SamplingParams(n=args.n, max_new_tokens=args.turn_tokens, banned_token_ids=banned, seed=1)
    inputs = [Episode.start(i, p).engine_input() for i, p in enumerate(prompts)]
    engine.generate(inputs[:2], SamplingParams(n=2, max_new_tokens=8, banned_token_ids=banned))  # warm-up

    gens, single_s = _timed(engine, inputs, whole)
    single_tokens = sum(len(g.token_ids) for g in gens)

    episodes = [Episode.start(i, p) for i, p in enumerate(prompts) for _ in range(args.n)]
    multi_s, multi_tokens, tool_s, turn_s = 0.0, 0, 0.0, []
    end_id = processor.tokenizer.convert_tokens_to_ids(adapter.end_of_turn)
    for t in range(args.turns):
        if t == 0:
            gens, s = _timed(engine, inputs, turn)
        else:
            gens, s = _timed(engine, [e.engine_input() for e in episodes],
                             SamplingParams(n=1, max_new_tokens=args.turn_tokens, banned_token_ids=banned, seed=1 + t))
        multi_s += s
        turn_s.append(round(s, 3))
        multi_tokens += sum(len(g.token_ids) for g in gens)
        for e, g in zip(episodes, gens):
            e.add_model_turn(g)
        if t < args.turns - 1:
            start = time.perf_counter()
            for e in episodes:
                crop = e.images[0].crop((0, 0, args.side // 2, args.side // 2)).resize((args.side, args.side))
                # generation was forced to full length: the turn's last token stands in for the
                # end-of-turn token a stopping model writes before a tool message
                e.token_ids[-1] = end_id
                ids, pix, grid, images = encoder.encode([("zoomed", [] if args.text_tools else [crop])])
                e.add_tool_tokens(ids, pix, grid, images)
            tool_s += time.perf_counter() - start
    hit = engine.last_stats.get("cached_prompt_tokens", 0) / max(engine.last_stats.get("prompt_tokens", 1), 1)
    result = {
        "multi_turn": True, "model": Path(args.model).name, "prompts": args.prompts, "n": args.n,
        "turns": args.turns, "turn_tokens": args.turn_tokens, "image_side": args.side,
        "processor_cache_gb": args.processor_cache_gb,
        "single_turn_tokens": single_tokens, "single_turn_s": round(single_s, 3),
        "single_turn_tokens_per_s": round(single_tokens / single_s, 1),
        "multi_turn_tokens": multi_tokens, "multi_turn_s": round(multi_s, 3),
        "multi_turn_tokens_per_s": round(multi_tokens / multi_s, 1),
        "ratio": round((multi_tokens / multi_s) / (single_tokens / single_s), 3),
        "turn_s": turn_s, "tool_images": not args.text_tools, "tool_message_s": round(tool_s, 3), "last_turn_prefix_cache_hit": round(hit, 3),
        "episode_tokens_max": max(len(e.token_ids) for e in episodes),
    }
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
