"""Gemma4 on a tiny checkpoint: what is particular to it beyond tests/test_families.py.

Its per-layer inputs, its masks (image blocks only in the sliding layers, cut by a window smaller
than an image) and its KV-sharing layers must give a packed row the logprobs and gradients of
each sequence alone, and the policy must score what transformers' own forward scores; its images
are padded patch sequences whose positions the adapter rebuilds as the processor writes them, at
sizes the processor (and vLLM's token count) keep; its weight names are vLLM's, and its prompts
collapse to one `<|image|>` per image.
"""

import math

import pytest
import torch
from PIL import Image

from grpo.config import ModelConfig
from models.families.gemma4 import Gemma4Images, patch_positions, target_size
from models.packing import pack, unpack_per_sequence
from models.parallel import build_parallel_dims, full_value, init_distributed
from models.policy import build_policy
from rollout.base import Generation
from rollout.weight_names import vllm_param_for
from tests.test_families import _prompts
from tests.test_torch_engine import generation_batch


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gemma4") / "tiny", family="gemma4", size="tiny", seed=0)


def _policy(folder, activation_checkpointing=False):
    init_distributed()
    return build_policy(ModelConfig(path=str(folder), dtype="float32", attn_implementation="sdpa",
                                    activation_checkpointing=activation_checkpointing), build_parallel_dims())


def _generations():
    """Responses of different lengths after two image prompts of different sizes and a text-only one."""
    g = torch.Generator().manual_seed(0)
    lengths = [9, 23, 5, 14]
    return [Generation(i % 3, torch.randint(10, 1400, (n,), generator=g).tolist(), [0.0] * n, "length")
            for i, n in enumerate(lengths)]


def _logprobs_and_grads(policy, batch, bins):
    """Logprobs per sequence and the gradient of a weighted sum of them, one micro-batch per bin."""
    policy.model.zero_grad(set_to_none=True)
    out = {}
    for b in bins:
        mb = pack(batch, b)
        lp, _ = policy.logprobs(mb)
        per_seq = unpack_per_sequence(lp, mb)
        sum((t * torch.linspace(-1.0, 1.0, t.numel()) * (1 + i)).sum() for i, t in zip(b, per_seq)).backward()
        out.update(zip(b, (t.detach() for t in per_seq)))
    grads = {n: full_value(p.grad).detach().clone() for n, p in policy.model.named_parameters()
             if p.grad is not None}
    return [out[i] for i in sorted(out)], grads


def test_packed_row_equals_each_sequence_alone(folder):
    policy = _policy(folder)
    prompts, gens = _prompts(folder), _generations()
    batch = generation_batch(policy.adapter, prompts, gens)
    packed_lp, packed_grad = _logprobs_and_grads(policy, batch, [list(range(len(gens)))])
    single_lp, single_grad = _logprobs_and_grads(policy, batch, [[i] for i in range(len(gens))])
    assert (torch.cat(packed_lp) - torch.cat(single_lp)).abs().max().item() < 1e-5
    assert set(packed_grad) == set(single_grad)
    for name in ("model.language_model.embed_tokens_per_layer.weight",
                 "model.language_model.per_layer_model_projection.weight",
                 "model.language_model.layers.0.self_attn.k_proj.weight",  # read by the KV-sharing layer 2 too
                 "model.vision_tower.patch_embedder.input_proj.weight"):
        assert packed_grad[name].abs().max() > 0, name
    _assert_close(packed_grad, single_grad)


def test_activation_checkpointing_keeps_the_packed_row_exact(folder):
    """Checkpointed layers recompute in backward; the KV-sharing layers read keys and values another
    layer stored in forward."""
    prompts, gens = _prompts(folder), _generations()
    results = []
    for checkpointing in (False, True):
        policy = _policy(folder, activation_checkpointing=checkpointing)
        batch = generation_batch(policy.adapter, prompts, gens)
        results.append(_logprobs_and_grads(policy, batch, [list(range(len(gens)))]))
    (plain_lp, plain_grad), (ac_lp, ac_grad) = results
    assert (torch.cat(plain_lp) - torch.cat(ac_lp)).abs().max().item() < 1e-5
    assert set(plain_grad) == set(ac_grad)
    _assert_close(ac_grad, plain_grad)


def _assert_close(grads, reference):
    """Each gradient within 3e-5 of its largest entry, or of the largest gradient of its part (vision
    tower, decoder): a parameter's gradient sums every token of the row, in another order when packed
    (measured: 1e-5 at most). The vision attention's q/k gradients are about 1e-7 of the tower's
    others (near-uniform attention at random init), what is left of terms the size of the others;
    their rounding is measured against those (1.1e-7 of the tower's largest, 1.8 of their own)."""
    part = {}
    for name, g in grads.items():
        key = ".".join(name.split(".")[:2])
        part[key] = max(part.get(key, 0.0), g.abs().max().item())
    for name, g in grads.items():
        scale = max(g.abs().max().item(), part[".".join(name.split(".")[:2])])
        assert (g - reference[name]).abs().max().item() <= 3e-5 * scale + 1e-6, name


def test_the_policy_scores_what_transformers_forward_scores(folder):
    """Per-layer inputs, the image features, both masks and the soft cap against the model's own forward."""
    from transformers import AutoModelForImageTextToText

    policy = _policy(folder)
    prompts = _prompts(folder)
    gens = [Generation(0, list(range(40, 52)), [0.0] * 12, "length"), Generation(1, [7, 8, 9], [0.0] * 3, "length")]
    mb = pack(generation_batch(policy.adapter, prompts, gens), [0, 1])
    with torch.no_grad():
        ours = unpack_per_sequence(policy.logprobs(mb)[0], mb)
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32,
                                                        attn_implementation="sdpa").eval()
    a = policy.adapter
    for gen, lp in zip(gens, ours):
        prompt = prompts[gen.prompt_index]
        ids = torch.tensor([prompt.input_ids + gen.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=prompt.pixel_values,
                           image_position_ids=patch_positions(prompt.image_grid_thw, prompt.pixel_values.shape[1]),
                           mm_token_type_ids=(ids == a.image_token_id).long()).logits[0].float()
        assert logits.abs().max() <= 30.0  # the soft cap
        ref = torch.log_softmax(logits, -1)[len(prompt.input_ids) - 1 : -1].gather(
            -1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        assert (lp - ref).abs().max().item() < 1e-5


def test_masks_are_transformers_own_and_packing_keeps_sequences_apart(folder):
    """One sequence: the adapter's masks equal `create_masks_for_vision_model` (an image of 64 soft
    tokens against a 16-token window). A packed row: each sequence's block is its own mask, nothing
    crosses; transformers' builder given the same row puts the second image's block elsewhere."""
    from transformers import AutoConfig
    from transformers.models.gemma4.modeling_gemma4 import (
        create_masks_for_vision_model, get_block_sequence_ids_for_mask,
    )

    from models.families.gemma3 import _mask_cache_arg
    from models.family import build_adapter

    config = AutoConfig.from_pretrained(str(folder)).text_config
    config._attn_implementation = "sdpa"
    adapter = build_adapter(AutoConfig.from_pretrained(str(folder)))
    prompts = _prompts(folder)
    seqs = [torch.tensor(p.input_ids + [5, 6, 7]) for p in prompts[:2]]

    def reference(ids, positions):
        image = (ids == adapter.image_token_id)[None]
        embeds = torch.zeros(1, ids.numel(), 4)
        masks = create_masks_for_vision_model(
            config=config, inputs_embeds=embeds, attention_mask=None, position_ids=positions[None],
            block_sequence_ids=get_block_sequence_ids_for_mask(image.long(), embeds.device),
            **{_mask_cache_arg(create_masks_for_vision_model): None})
        return {k: (torch.ones(ids.numel(), ids.numel()).tril().bool() if v is None else v[0, 0])
                for k, v in masks.items()}

    def ours(ids, positions):
        masks = adapter.attention_masks(config, torch.zeros(1, ids.numel(), 4), positions[None],
                                        (ids == adapter.image_token_id)[None])
        return {k: v[0, 0] for k, v in masks.items()}

    for ids in seqs:
        positions = torch.arange(ids.numel())
        assert int((ids == adapter.image_token_id).sum()) > 2 * config.sliding_window
        want, have = reference(ids, positions), ours(ids, positions)
        assert torch.equal(want["full_attention"], have["full_attention"])
        assert torch.equal(want["sliding_attention"], have["sliding_attention"])
        assert not torch.equal(want["sliding_attention"], want["sliding_attention"].tril())  # images see ahead
    row = torch.cat(seqs)
    positions = torch.cat([torch.arange(s.numel()) for s in seqs])
    have = ours(row, positions)
    n = seqs[0].numel()
    for kind in ("full_attention", "sliding_attention"):
        assert torch.equal(have[kind][:n, :n], reference(seqs[0], positions[:n])[kind])
        assert torch.equal(have[kind][n:, n:], reference(seqs[1], positions[n:])[kind])
        assert not have[kind][n:, :n].any() and not have[kind][:n, n:].any()
    transformers_packed = reference(row, positions)["sliding_attention"]
    assert not torch.equal(transformers_packed[n:, n:], have["sliding_attention"][n:, n:])


def _vllm_triton_mask(n: int, window: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """vLLM 0.26's Triton attention mask over one sequence of n tokens (v1/attention/ops/
    triton_attention_helpers.py `compute_kv_seq_mask`; the window is `1 + window_size[0]` =
    the layer's sliding_window, MM_PREFIX_CLAMP_SW on Gemma4's sliding layers): (causal AND
    q - kv < window) OR, for each image range [s, e] (inclusive, s < e), (q and kv in it AND
    q - kv < window). window 0: a full-attention layer (gemma4_mm.py clears its ranges)."""
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = kv <= q
    if window:
        mask &= (q - kv) < window
    for s, e in ranges:
        if s < e:
            mask |= (q >= s) & (q <= e) & (kv >= s) & (kv <= e) & (((q - kv) < window) if window else True)
    return mask


def _image_ranges(ids: torch.Tensor, image_token_id: int) -> list[tuple[int, int]]:
    """Each image's soft-token run, [first, last]: `PlaceholderRange.extract_embeds_range` of vLLM's
    Gemma4 prompt update (is_embed: the `<|image|>` tokens between `<|image>` and `<image|>`)."""
    image = (ids == image_token_id).long()
    starts = torch.nonzero(torch.diff(image, prepend=image.new_zeros(1)) == 1).flatten().tolist()
    ends = torch.nonzero(torch.diff(image, append=image.new_zeros(1)) == -1).flatten().tolist()
    return list(zip(starts, ends))


def test_the_policys_masks_are_what_vllms_v1_runner_and_triton_kernel_compute(folder):
    """Per sequence, the policy's sliding and full masks equal vLLM's Triton rule with the V1 model
    runner's image ranges (all kept, gpu_model_runner.py). The V2 runner (attn_utils.py
    `compute_mm_prefix_ranges`) drops a range longer than the window: every tiny image (60-64 soft
    tokens, window 16) then attends causally, unless the window holds the image."""
    import dataclasses

    from transformers import AutoConfig

    from models.family import build_adapter

    config = AutoConfig.from_pretrained(str(folder)).text_config
    config._attn_implementation = "sdpa"
    adapter = build_adapter(AutoConfig.from_pretrained(str(folder)))
    for prompt in _prompts(folder)[:2]:
        ids = torch.tensor(prompt.input_ids + [5, 6, 7])
        ranges = _image_ranges(ids, adapter.image_token_id)
        assert ranges and all(e - s + 1 > config.sliding_window for s, e in ranges)
        for window in (config.sliding_window, 128):
            a = dataclasses.replace(adapter, sliding_window=window)
            masks = a.attention_masks(config, torch.zeros(1, ids.numel(), 4), torch.arange(ids.numel())[None],
                                      (ids == a.image_token_id)[None])
            sliding, full = masks["sliding_attention"][0, 0], masks["full_attention"][0, 0]
            assert torch.equal(full, _vllm_triton_mask(ids.numel(), 0, []))
            assert torch.equal(sliding, _vllm_triton_mask(ids.numel(), window, ranges))  # V1 runner
            v2_ranges = [(s, e) for s, e in ranges if e - s + 1 <= window]
            v2 = _vllm_triton_mask(ids.numel(), window, v2_ranges)
            assert torch.equal(sliding, v2) == (window == 128)


def test_vllm_runs_gemma4_on_the_v1_runner_when_an_image_can_outgrow_the_window(folder):
    import dataclasses
    import os

    from transformers import AutoConfig

    from models.family import build_adapter
    from rollout.vllm_engine import apply_vllm_env

    adapter = build_adapter(AutoConfig.from_pretrained(str(folder)))
    assert adapter.max_soft_tokens > adapter.sliding_window  # 70 soft tokens at most, a 16-token window
    assert adapter.vllm_env() == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    # released sizes at the default 280 soft tokens (windows 512 and 1024) keep vLLM's default runner
    assert dataclasses.replace(adapter, sliding_window=512, max_soft_tokens=280).vllm_env() == {}
    assert dataclasses.replace(adapter, bidirectional_images=False).vllm_env() == {}
    before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    try:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        apply_vllm_env(adapter.vllm_env())
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    finally:
        if before is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = before


def test_the_soft_cap_rounds_as_transformers_and_vllm_do_in_bf16(folder):
    """In bf16 the policy's capped logits are bitwise transformers' own (divide, tanh, multiply in the
    head's dtype, as vLLM's LogitsProcessor does too), at a trained model's logit scale (std ~5 here)."""
    from transformers import AutoModelForImageTextToText

    from models.family import build_adapter

    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(200.0)
        ids = torch.tensor([list(range(40, 72))])
        hidden = model.model(input_ids=ids).last_hidden_state
        reference = model(input_ids=ids).logits
        ours = build_adapter(model.config).lm_head(model)(hidden)
    assert 2.0 < float(reference.float().std()) < 20.0
    assert torch.equal(ours.float(), reference.float())


def test_features_and_patch_positions_are_the_models_own(folder):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from models.family import build_adapter

    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    adapter = build_adapter(model.config)
    rule = Gemma4Images(AutoImageProcessor.from_pretrained(str(folder)), {})
    images = [rule.prepare(Image.new("RGB", size, (200, 40 * k, 30))) for k, size in enumerate([(56, 56), (84, 56)])]
    out = rule.image_processor(images=images, return_tensors="pt")
    pixels, grid = rule.encode(images)
    assert torch.equal(pixels, out["pixel_values"])
    assert torch.equal(patch_positions(grid, pixels.shape[1]), out["image_position_ids"].long())
    assert pixels.shape[1] > int(grid[:, 1:].prod(dim=1).max())  # padded patches are present
    with torch.no_grad():
        ours = adapter.image_features(model, pixels, grid)[0]
        theirs = torch.cat(model.model.get_image_features(pixels, out["image_position_ids"]).pooler_output)
    assert ours.shape[0] == sum(adapter.image_token_count(g) for g in grid) and torch.equal(ours, theirs)


def _vllm_soft_tokens(width, height, patch, pooling, max_soft_tokens):
    """vLLM's `Gemma4ProcessingInfo._compute_num_soft_tokens` (gemma4_mm.py), the count it expands to."""
    unit = patch * pooling
    scale = math.sqrt(max_soft_tokens * pooling**2 / ((height / patch) * (width / patch)))
    th = max(unit, int(math.floor(height * scale / unit)) * unit)
    tw = max(unit, int(math.floor(width * scale / unit)) * unit)
    return min((th // patch) * (tw // patch) // pooling**2, max_soft_tokens)


@pytest.mark.parametrize("size", [(56, 56), (84, 56), (56, 308), (28, 280), (300, 20), (1000, 33)])
def test_images_come_at_a_size_the_processor_and_vllm_keep(folder, size):
    from transformers import AutoImageProcessor

    rule = Gemma4Images(AutoImageProcessor.from_pretrained(str(folder)), {})
    image = rule.prepare(Image.new("RGB", size, (10, 120, 240)))
    w, h = image.size
    assert target_size(h, w, rule.patch, rule.max_patches, rule.pooling) == (h, w)  # the processor does not resize
    _, grid = rule.encode([image])
    tokens = grid[0].prod().item() // rule.pooling**2
    assert 0 < tokens <= rule.image_processor.max_soft_tokens
    assert _vllm_soft_tokens(w, h, rule.patch, rule.pooling, rule.image_processor.max_soft_tokens) == tokens


def test_expansion_is_the_processors_and_the_prompt_collapses_for_vllm(folder):
    from transformers import AutoConfig, AutoTokenizer, Gemma4Processor

    from models.family import build_adapter

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    adapter = build_adapter(AutoConfig.from_pretrained(str(folder)))
    stub = type("P", (), {"boi_token": tokenizer.boi_token, "eoi_token": tokenizer.eoi_token,
                          "image_token": tokenizer.image_token})()
    prompt = _prompts(folder)[1]
    rule_text = Gemma4Images.expansion(type("R", (), {"pooling": adapter.pooling})(), prompt.image_grid_thw[0])
    n = adapter.image_token_count(prompt.image_grid_thw[0])
    assert rule_text == Gemma4Processor.replace_image_token(stub, {"num_soft_tokens_per_image": [n]}, 0)
    assert tokenizer.image_token_id == adapter.image_token_id
    vocab = tokenizer.get_vocab()
    ids = prompt.input_ids + [11, 12] + prompt.input_ids
    collapsed, blocks = adapter.vllm_collapse(ids, vocab)
    assert collapsed.count(adapter.image_token_id) == 2 and len(collapsed) == len(ids) - 2 * (n + 1)
    assert blocks[0] == [adapter.extra_banned_ids[0]] + [adapter.image_token_id] * n + [adapter.extra_banned_ids[1]]
    assert adapter.vllm_expand(collapsed, blocks, vocab) == ids
    assert adapter.vllm_processor_kwargs(0, 0) == {"max_soft_tokens": 70}
    with pytest.raises(ValueError, match="default_output_length 100"):
        type(adapter)(**{**adapter.__dict__, "max_soft_tokens": 100}).vllm_processor_kwargs(0, 0)
    with pytest.raises(ValueError, match="outside"):
        adapter.vllm_collapse([adapter.image_token_id], vocab)


@pytest.mark.parametrize("hf_name, vllm_name, shard", [
    ("model.language_model.layers.0.self_attn.q_proj.weight",
     "language_model.model.layers.0.self_attn.qkv_proj.weight", "q"),
    ("model.language_model.layers.1.self_attn.v_proj.weight",
     "language_model.model.layers.1.self_attn.qkv_proj.weight", "v"),
    ("model.language_model.layers.2.self_attn.q_proj.weight",  # KV-sharing layer: q alone
     "language_model.model.layers.2.self_attn.qkv_proj.weight", "q"),
    ("model.language_model.layers.3.mlp.up_proj.weight", "language_model.model.layers.3.mlp.gate_up_proj.weight", 1),
    ("model.language_model.layers.0.per_layer_input_gate.weight",
     "language_model.model.layers.0.per_layer_input_gate.weight", None),
    ("model.language_model.layers.0.layer_scalar", "language_model.model.layers.0.layer_scalar", None),
    ("model.language_model.embed_tokens_per_layer.weight", "language_model.model.embed_tokens_per_layer.weight", None),
    ("model.vision_tower.encoder.layers.1.self_attn.q_proj.linear.weight",
     "vision_tower.encoder.layers.1.self_attn.q_proj.linear.weight", None),
    ("model.vision_tower.patch_embedder.position_embedding_table",
     "vision_tower.patch_embedder.position_embedding_table", None),
    ("model.embed_vision.embedding_projection.weight", "embed_vision.embedding_projection.weight", None),
    ("lm_head.weight", "language_model.lm_head.weight", None),
])
def test_vllm_names(hf_name, vllm_name, shard):
    assert vllm_param_for("gemma4", hf_name) == (vllm_name, shard)


def test_the_tiny_checkpoint(folder):
    import json

    from transformers import AutoConfig

    from models.family import build_adapter
    from rollout.weight_names import VLLM_UNVERIFIED

    config = AutoConfig.from_pretrained(str(folder))
    text = config.text_config
    assert text.use_bidirectional_attention == "vision" and text.num_kv_shared_layers == 2
    assert text.final_logit_softcapping == 30.0 and text.hidden_size_per_layer_input == 8
    assert text.per_layer_config[1].head_dim == 2 * text.per_layer_config[0].head_dim
    assert json.loads((folder / "config.json").read_text())["text_config"]["global_head_dim"] == 64
    assert text.per_layer_config[0].head_dim == 32  # vLLM 0.26's Triton attention takes >= 32
    adapter = build_adapter(config)
    assert adapter.max_soft_tokens == json.loads((folder / "processor_config.json").read_text())[
        "image_processor"]["max_soft_tokens"]
    assert adapter.pad_token_id == 0  # vLLM reads image tokens as token 0 for the per-layer inputs
    # measured on an H200 (vLLM's V1 runner, Triton attention): token_mult_prob_error 1.0078 mean, so auto picks vLLM
    assert adapter.end_of_turn == "<turn|>" and "gemma4" not in VLLM_UNVERIFIED
    assert not adapter.batch_with_padding and adapter.packable
    from transformers import AutoTokenizer

    from data.processing import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    turns = [{"role": "user", "content": [{"type": "text", "text": "How many?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "MARK"}]}]
    text = tokenizer.apply_chat_template(turns, tokenize=False)
    after = tokenizer.encode(text[text.index("MARK") + 4:], add_special_tokens=False)[0]
    assert tokenizer.convert_ids_to_tokens(after) == "<turn|>"
    assert stop_token_ids(str(folder), tokenizer, adapter.end_of_turn)[0] == after
    with pytest.raises(ValueError, match="parallel.tp"):
        adapter.tp_plan()


@pytest.mark.parametrize("key, value, message", [
    ("enable_moe_block", True, "enable_moe_block"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention='all'"),
])
def test_unsupported_variants_are_refused_by_name(folder, key, value, message):
    from transformers import AutoConfig

    from models.family import build_adapter

    config = AutoConfig.from_pretrained(str(folder))
    setattr(config.text_config, key, value)
    with pytest.raises(ValueError, match=message):
        build_adapter(config)


def test_the_decoder_needs_the_rows_token_ids(folder):
    policy = _policy(folder)
    a = policy.adapter
    embeds = torch.zeros(1, 5, policy.model.config.text_config.hidden_size)
    a._row[:] = [None, 0]
    with pytest.raises(RuntimeError, match="token ids"):
        a.run_language_model(policy.model, embeds, torch.arange(5)[None, None], torch.zeros(1, 5, dtype=torch.bool), [])


# --- vLLM 0.26.0: names, config, KV bytes --------------------------------------------------------
# Read from vLLM 0.26.0's gemma4_mm.py (Gemma4ForConditionalGeneration) and gemma4.py (Gemma4Model):
# its mapper's prefixes, applied one after another (WeightsMapper._map_name_with_shard), and the
# (param, shard name, shard id) table of Gemma4Model.load_weights, which stacks when the fused
# parameter exists.
VLLM_PREFIXES = {"model.vision_tower": "vision_tower", "model.embed_vision": "embed_vision",
                 "model.audio_tower.": "audio_tower.", "model.embed_audio.": "embed_audio.",
                 "model.language_model.": "language_model.model.", "lm_head.": "language_model.lm_head.",
                 "model": "language_model.model"}
VLLM_STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


def _vllm_0_26_parameters(config) -> set[str]:
    """The parameters (and the layer_scalar buffers) vLLM 0.26 builds for a Gemma4 config without MoE or audio."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel

    text = config.text_config
    lm = "language_model.model."
    names = {f"{lm}embed_tokens.weight", f"{lm}norm.weight"}
    if text.hidden_size_per_layer_input:
        names |= {f"{lm}embed_tokens_per_layer.weight", f"{lm}per_layer_model_projection.weight",
                  f"{lm}per_layer_projection_norm.weight"}
    for i in range(text.num_hidden_layers):
        layer = f"{lm}layers.{i}."
        # every layer, KV-sharing or not, builds qkv_proj, q_norm and k_norm (v_norm has no weight)
        names |= {layer + n for n in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                                      "self_attn.k_norm.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
                                      "input_layernorm.weight", "post_attention_layernorm.weight",
                                      "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                                      "layer_scalar")}
        if text.hidden_size_per_layer_input:
            names |= {layer + n for n in ("per_layer_input_gate.weight", "per_layer_projection.weight",
                                          "post_per_layer_input_norm.weight")}
    if not text.tie_word_embeddings:
        names.add("language_model.lm_head.weight")
    # the tower is transformers' own module (AutoModel.from_config), its nn.Linear swapped for vLLM's
    # ReplicatedLinear under the same names; the embedder keeps only embedding_projection's weight
    names |= {f"vision_tower.{n}" for n in Gemma4VisionModel(config.vision_config).state_dict()}
    names.add("embed_vision.embedding_projection.weight")
    return names


def _vllm_0_26_home(name: str, parameters: set[str]) -> tuple[str, str | int | None]:
    for prefix, new in VLLM_PREFIXES.items():
        if name.startswith(prefix):
            name = name.replace(prefix, new, 1)
    for param, shard_name, shard in VLLM_STACKED:
        if shard_name in name and name.replace(shard_name, param) in parameters:
            return name.replace(shard_name, param), shard
    return name, None


def test_every_checkpoint_tensor_lands_where_vllm_0_26_loads_it(folder):
    from safetensors import safe_open
    from transformers import AutoConfig

    parameters = _vllm_0_26_parameters(AutoConfig.from_pretrained(str(folder)))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    homes = {}
    for name in names:
        home = vllm_param_for("gemma4", name)
        assert home == _vllm_0_26_home(name, parameters), name
        assert home[0] in parameters, name
        assert home not in homes, f"{name} and {homes[home]} both land in {home}"
        homes[home] = name
    # every parameter vLLM builds gets a tensor but the KV-sharing layers' (2, 3) k_norm, which vLLM
    # never applies there; those layers fill only the q slot of qkv_proj
    assert parameters - {param for param, _ in homes} == {f"language_model.model.layers.{i}.self_attn.k_norm.weight"
                                                           for i in (2, 3)}
    assert {s for (p, s) in homes if p.endswith("layers.2.self_attn.qkv_proj.weight")} == {"q"}
    assert {s for (p, s) in homes if p.endswith("layers.1.self_attn.qkv_proj.weight")} == {"q", "k", "v"}


def test_refit_counts_only_the_models_own_tensors_as_loaded():
    """vLLM 0.26's Gemma4Model.load_weights reports `q_proj.weight` beside `qkv_proj.weight`."""
    from rollout.vllm_engine import check_loaded, load_into

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = torch.nn.Linear(2, 6, bias=False)
            self.other = torch.nn.Linear(2, 2, bias=False)
            self.register_buffer("layer_scalar", torch.ones(1))

        def load_weights(self, stream):
            return {name for name, _ in stream}

    stream = [("qkv_proj.weight", None), ("q_proj.weight", None), ("layer_scalar", None)]
    loaded = load_into(Model(), iter(stream))
    assert loaded == {"qkv_proj.weight", "layer_scalar"}
    check_loaded(loaded, {"qkv_proj.weight", "layer_scalar"})
    with pytest.raises(RuntimeError, match=r"loaded unexpected \['other.weight'\]"):
        check_loaded(load_into(Model(), iter(stream + [("other.weight", None)])), {"qkv_proj.weight", "layer_scalar"})


def test_vllm_reads_plain_head_sizes_from_the_engines_config(folder):
    """vLLM 0.26 reads `head_dim` and `global_head_dim` off the text config (model_arch_config_convertor.py,
    gemma4.py); transformers keeps them per layer and refuses the global read."""
    from transformers import AutoConfig

    from models.family import build_adapter

    config = AutoConfig.from_pretrained(str(folder))
    with pytest.raises(Exception, match="per-layer attribute"):
        getattr(config.text_config, "head_dim", 0)
    override = build_adapter(config).vllm_engine_kwargs()["hf_overrides"]
    text = override(config).text_config
    head_dim, global_head_dim = getattr(text, "head_dim", 0), getattr(text, "global_head_dim", text.head_dim)
    assert (head_dim, global_head_dim) == (32, 64) and max(head_dim, global_head_dim) == 64
    assert text.num_global_key_value_heads == text.num_key_value_heads == 1
    twice = override(override(AutoConfig.from_pretrained(str(folder)))).text_config  # applying it again changes nothing
    assert (twice.head_dim, twice.global_head_dim, twice.num_global_key_value_heads) == (32, 64, 1)

    other = AutoConfig.from_pretrained(str(folder))
    other.text_config._heterogeneity_spec.per_layer_overrides[3] = {"head_dim": 128}
    with pytest.raises(ValueError, match="layers of one attention type differ"):
        override(other)


def test_kv_bytes_count_each_layers_heads_and_skip_kv_sharing_layers(folder):
    import json

    from transformers import AutoConfig

    from rollout.colocation import kv_bytes_per_token

    # layer 0 (sliding): one KV head of 32; layer 1 (full): one of 64; layers 2 and 3 reuse their caches
    expected = 2 * (32 + 64) * 2
    assert kv_bytes_per_token(json.loads((folder / "config.json").read_text()), 2) == expected
    assert kv_bytes_per_token(AutoConfig.from_pretrained(str(folder)).to_dict(), 2) == expected  # per_layer_config
    # a released layout: head_dim 256, global_head_dim 512, one KV head, 35 layers, the last 20 sharing
    types = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    released = {"text_config": {"num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1,
                                "head_dim": 256, "global_head_dim": 512, "layer_types": types,
                                "num_kv_shared_layers": 20, "hidden_size": 1536}}
    assert kv_bytes_per_token(released, 2) == 2 * (12 * 256 + 3 * 512) * 2
    # attention_k_eq_v: the full-attention layers have their own KV head count
    keqv = {"text_config": {**released["text_config"], "attention_k_eq_v": True, "num_global_key_value_heads": 4,
                            "num_kv_shared_layers": 0}}
    assert kv_bytes_per_token(keqv, 2) == 2 * (28 * 256 + 7 * 4 * 512) * 2
    assert kv_bytes_per_token(keqv, 2, tensor_parallel_size=2) == 2 * (28 * 256 + 7 * 2 * 512) * 2
