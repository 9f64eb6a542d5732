"""Every registered family, on a tiny checkpoint built here: the built-in engine's logprobs equal the
policy's (packed, and one sequence per micro-batch), one SFT and one GRPO step run through the
trainer, an image changes the logprobs of what follows it, and every weight has exactly one home
in vLLM's model. A new family's module gets these tests by registering.

The measured token_mult_prob_error of each family is printed (`pytest -s`); the README's family
table quotes these numbers.
"""

import json

import pytest
import torch

from data.processing import VLProcessor
from data.prompts import build_messages
from grpo.config import ModelConfig, load_config
from models.family import FAMILIES as REGISTERED
from models.packing import pack, unpack_per_sequence
from models.parallel import build_parallel_dims, init_distributed
from models.policy import build_policy
from rollout.base import PromptInput, SamplingParams
from rollout.torch_engine import TorchEngine
from rollout.weight_names import ExpertShard, vllm_param_for
from tests.test_torch_engine import generation_batch

FAMILIES = sorted(REGISTERED)
HEAD_SCALE = 40.0  # sharpens the random model's near-uniform next-token distribution


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    family = request.param
    return family, make_tiny_model(tmp_path_factory.mktemp("families") / family, family=family, size="tiny", seed=0)


def _prompts(path):
    """Two image prompts of different sizes and one text-only prompt, through the real data path."""
    from PIL import Image

    processor = VLProcessor(str(path))
    prompts = []
    for k, size in enumerate([(56, 56), (84, 56), None]):
        images = [] if size is None else [Image.new("RGB", size, (40 * k + 20, 200, 30 * k))]
        problem = ("<image>" if images else "") + f"How many objects are there, case {k}?"
        text = processor.apply_chat_template(build_messages((problem, images), "clevr"))
        images = processor.prepare_images(images)
        out = processor(text, images)
        prompts.append(PromptInput(out["input_ids"].tolist(), images, out["pixel_values"], out["image_grid_thw"]))
    return prompts


def test_the_image_rule_and_the_adapter_count_the_same_placeholders(family_model):
    from transformers import AutoConfig

    from models.family import build_adapter

    _, path = family_model
    adapter = build_adapter(AutoConfig.from_pretrained(str(path), local_files_only=True))
    for prompt in _prompts(path)[:2]:
        have = prompt.input_ids.count(adapter.image_token_id)
        assert have > 0 and have == sum(adapter.image_token_count(g) for g in prompt.image_grid_thw)


def _policy_logprobs(policy, prompts, gens, max_per_bin):
    """The trainer's logprobs of each generation; samples of a prompt share its pixel tensor."""
    batch = generation_batch(policy.adapter, prompts, gens)
    out = []
    for first in range(0, len(gens), max_per_bin):
        mb = pack(batch, list(range(first, min(first + max_per_bin, len(gens)))))
        with torch.no_grad():
            lp, _ = policy.logprobs(mb)
        out += unpack_per_sequence(lp, mb)
    return out


def test_engine_logprobs_match_policy(family_model):
    family, path = family_model
    init_distributed()
    policy = build_policy(ModelConfig(path=str(path), dtype="float32", attn_implementation="sdpa"),
                          build_parallel_dims())
    engine = TorchEngine(str(path))
    with torch.no_grad():
        policy.adapter.lm_head(policy.model).weight.mul_(HEAD_SCALE)
    engine.refit(policy.full_state_dict())
    prompts = _prompts(path)
    gens = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0))
    assert len(gens) == 6 and all(len(g.token_ids) == 8 for g in gens)
    banned = set(policy.adapter.banned_token_ids)
    assert not any(banned & set(g.token_ids) for g in gens)

    packed = _policy_logprobs(policy, prompts, gens, max_per_bin=len(gens))
    single = _policy_logprobs(policy, prompts, gens, max_per_bin=1)
    ours = torch.cat([torch.tensor(g.logprobs) for g in gens])
    delta = (ours - torch.cat(packed)).abs()
    tmpe = torch.exp(delta).mean().item()
    print(f"\n{family}: token_mult_prob_error {tmpe:.7f}, max |dlogp| {delta.max().item():.2e}")
    assert ours.min() < -0.5  # not a degenerate, near-certain distribution
    assert delta.max().item() < 1e-4 and tmpe <= 1.0001
    assert (torch.cat(packed) - torch.cat(single)).abs().max().item() < 1e-5
    # The path a family that cannot pack takes: one language-model call per sequence of the row.
    policy.adapter.packable = False
    unpacked = _policy_logprobs(policy, prompts, gens, max_per_bin=len(gens))
    assert (torch.cat(unpacked) - torch.cat(single)).abs().max().item() < 1e-5


def _train(path, data, run_dir, mode):
    from grpo.trainer import Trainer

    init_distributed()
    cfg = load_config(None, [
        f"trainer.mode={mode}", f"model.path={path}", f"data.train_path={data}", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "rollout.max_new_tokens=6", "data.min_pixels=3136",
        "data.max_pixels=3136", f"trainer.run_dir={run_dir}", "logging.tensorboard=false", "checkpoint.resume=never",
        "checkpoint.every_steps=0", "trainer.max_steps=1", "optim.max_tokens_per_microbatch=256",
    ])
    Trainer(cfg).train()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_and_grpo_steps_run(family_model, clevr_parquet, tmp_path):
    family, path = family_model
    (sft,) = _train(path, clevr_parquet, tmp_path / "sft", "sft")
    assert torch.isfinite(torch.tensor(sft["loss/total"])) and sft["loss/grad_norm"] > 0
    (grpo,) = _train(path, clevr_parquet, tmp_path / "grpo", "grpo")
    assert 1.0 <= grpo["fidelity/token_mult_prob_error"] <= 1.0001, grpo["fidelity/token_mult_prob_error"]
    assert grpo["rollout/response_len_mean"] > 0 and grpo["loss/entropy"] > 0


def test_every_weight_has_one_vllm_home(family_model):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForImageTextToText

    family, path = family_model
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
    memory = list(model.state_dict())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = list(f.keys())
    homes = {}
    for name in memory:
        home = vllm_param_for(family, name)
        assert home not in homes, f"{name} and {homes.get(home)} both map to {home}"
        homes[home] = name
    # A hub file's per-expert tensor fills one slice (an ExpertShard) of the parameter that the
    # fused in-memory tensor fills whole.
    saved_homes = {vllm_param_for(family, n) for n in saved}
    assert {(p, None if isinstance(s, ExpertShard) else s) for p, s in saved_homes} == set(homes)
    stacked = {}
    for param, shard in homes:
        if shard is not None:
            stacked.setdefault(param, set()).add(shard)
    assert stacked, "nothing was stacked"
    for param, shards in stacked.items():
        # Gemma4's KV-sharing layers have q_proj alone (they reuse an earlier layer's keys and values).
        shared = family == "gemma4" and shards == {"q"}
        assert shards in ({"q", "k", "v"}, {0, 1}, {(0, 1, 2), 3}) or shared, (param, shards)


def test_no_weight_matrix_is_all_zeros(family_model):
    """A zero matrix would cut a path: Gemma3's image projection starts at zeros in transformers,
    and with it every image feature was zero, so no test of the image path could fail."""
    from safetensors import safe_open

    _, path = family_model
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        zero = [name for name in f.keys() if f.get_tensor(name).dim() >= 2 and not f.get_tensor(name).any()]
    assert not zero, f"all-zero weight matrices in the tiny checkpoint: {zero}"


def _image_prompt(path, color):
    from PIL import Image

    processor = VLProcessor(str(path))
    images = processor.prepare_images([Image.new("RGB", (56, 56), color)])
    text = processor.apply_chat_template(build_messages(("<image>How many objects?", images), "clevr"))
    out = processor(text, images)
    return PromptInput(out["input_ids"].tolist(), images, out["pixel_values"], out["image_grid_thw"])


def test_the_image_reaches_the_decoder(family_model):
    """The same tokens scored after two different images must get different logprobs."""
    from rollout.base import Generation

    family, path = family_model
    init_distributed()
    policy = build_policy(ModelConfig(path=str(path), dtype="float32", attn_implementation="sdpa"),
                          build_parallel_dims())
    prompts = [_image_prompt(path, (230, 20, 20)), _image_prompt(path, (20, 20, 230))]
    assert prompts[0].input_ids == prompts[1].input_ids
    response = [5, 6, 7, 8]
    gens = [Generation(i, response, [0.0] * 4, "length") for i in range(2)]
    red, blue = _policy_logprobs(policy, prompts, gens, max_per_bin=1)
    assert (red - blue).abs().max().item() > 1e-4, f"{family}: the image does not change what follows it"


def test_gemma3_masks_with_the_older_transformers_cache_argument(monkeypatch, tmp_path):
    """transformers <= 5.17 names create_causal_mask's cache argument past_key_values (later: cache)."""
    import transformers.masking_utils as masking
    from rollout.base import Generation
    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "gemma3", family="gemma3", size="tiny", seed=0)
    init_distributed()
    policy = build_policy(ModelConfig(path=str(path), dtype="float32", attn_implementation="sdpa"),
                          build_parallel_dims())
    prompts = [_image_prompt(path, (230, 20, 20))]
    gens = [Generation(0, [5, 6, 7, 8], [0.0] * 4, "length")]
    current = _policy_logprobs(policy, prompts, gens, max_per_bin=1)[0]
    new_api = masking.create_causal_mask
    calls = []

    def create_causal_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids=None,
                           or_mask_function=None, and_mask_function=None, block_sequence_ids=None, layer_idx=None,
                           allow_is_causal_skip=True):
        calls.append(past_key_values)
        return new_api(config, inputs_embeds, attention_mask, past_key_values, position_ids, or_mask_function,
                       and_mask_function, block_sequence_ids, layer_idx, allow_is_causal_skip)

    monkeypatch.setattr(masking, "create_causal_mask", create_causal_mask)
    older = _policy_logprobs(policy, prompts, gens, max_per_bin=1)[0]
    assert calls and torch.equal(current, older)


def test_every_registered_family_is_whole():
    """One registration holds the adapter, the image rule data/ uses, the vLLM names and the tiny spec."""
    import transformers

    from data.processing import IMAGE_RULES
    from models.family import FAMILIES, family

    assert set(FAMILIES) >= {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "idefics3", "gemma3"}
    for name, spec in FAMILIES.items():
        assert spec.model_type == name and callable(spec.adapter)
        assert spec.tiny.processor_class in spec.image_rules
        assert all(IMAGE_RULES[k] is rule for k, rule in spec.image_rules.items())
        assert hasattr(transformers, spec.tiny.model_class)
        assert spec.vllm.prefixes and spec.vllm.stacking_scopes
    with pytest.raises(ValueError, match="'blip2' is not supported; supported families: .*gemma3"):
        family("blip2")
