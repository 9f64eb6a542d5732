"""model.shared_prompts: a training row holds each prompt once and its responses after it, each response
attending to the prompt and causally to itself (models.packing.pack_shared, models.attention's
shared_prompt_attention). The logprobs and the gradients equal the unshared row's (fp32, CPU: SDPA per
segment), with images in the prompt, a tool image in a second turn, groups split over micro-batches."""

from __future__ import annotations

import pytest
import torch

from data.processing import load_processor
from grpo.config import ConfigError, ModelConfig, load_config
from grpo.update import PackedStep, packed_logprobs
from rollout.episode import episode_batch
from tests.test_episodes import ZOOM, ScriptedEngine, _call, _cfg, _prompt, _rollouts, rollouts_params


@pytest.fixture(scope="module")
def policy(tiny_model):
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    torch.manual_seed(0)
    return build_policy(ModelConfig(path=str(tiny_model), shared_prompts=True), build_parallel_dims())


@pytest.fixture(scope="module")
def batch(tiny_model, policy):
    return episode_rows(tiny_model, policy.adapter)


def episode_rows(tiny_model, adapter):
    """Three prompts x 3 episodes: some answer at once, some zoom first (a tool image in the second turn)."""
    processor = load_processor(str(tiny_model))
    answers = ["<answer>2</answer><|im_end|>", "<answer>10</answer><|im_end|>", "<answer>three</answer><|im_end|>"]
    engine = ScriptedEngine(processor.tokenizer, [[_call(ZOOM), answers[1], answers[2], _call(ZOOM), answers[0]],
                                                  answers])
    rollouts = _rollouts(_cfg(tiny_model), processor, engine)
    prompts = [_prompt(processor, i, (60 * i, 200 - 50 * i, 30)) for i in range(3)]
    try:
        _, episodes, _ = rollouts.generate_and_score(engine, prompts, rollouts_params(n=3))
    finally:
        rollouts.close()
    assert any(len(e.turns) == 2 for e in episodes) and any(len(e.turns) == 1 for e in episodes)
    return episode_batch(episodes, adapter)


def _logprobs_and_grads(policy, batch, max_tokens: int, share: bool):
    step = PackedStep(batch, max_tokens, policy.device, share)
    policy.model.zero_grad(set_to_none=True)
    seed = torch.Generator().manual_seed(1)  # a weight per scored token of each sample, whatever the plan
    step.set_per_token("w", [torch.rand(int(m[1:].sum()), generator=seed) for m in batch["loss_mask"].items])
    total = 0
    for mb, f in step:
        lp, _ = policy.logprobs(mb)
        (lp * f["w"]).sum().backward()
        total += mb.num_tokens
    grads = {n: p.grad.full_tensor().clone() if hasattr(p.grad, "full_tensor") else p.grad.clone()
             for n, p in policy.model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        packed_logprobs(policy, step, "lp")
    return step.per_sample("lp"), grads, total, step


@pytest.mark.parametrize("max_tokens", [1 << 20, 160])
def test_shared_prompts_give_the_unshared_logprobs_and_gradients(policy, batch, max_tokens):
    lp_plain, g_plain, tokens_plain, _ = _logprobs_and_grads(policy, batch, max_tokens, share=False)
    lp_shared, g_shared, tokens_shared, step = _logprobs_and_grads(policy, batch, max_tokens, share=True)
    for a, b in zip(lp_plain, lp_shared):
        assert a.shape == b.shape and a.numel() > 0
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
    assert g_plain.keys() == g_shared.keys()
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], atol=2e-5, rtol=1e-4, msg=name)
    # each prompt's tokens once per micro-batch that holds two or more of its episodes
    assert tokens_shared < tokens_plain
    if max_tokens == 160:
        assert len(step.microbatches) > 1


def test_a_shared_row_lays_out_prompt_then_responses(policy, batch):
    from models.packing import pack, pack_shared, prompt_groups

    groups = prompt_groups(batch)
    assert [len(m) for m, _ in groups] == [3, 3, 3] and all(p > 0 for _, p in groups)
    indices = list(range(len(batch)))
    shared, plain = pack_shared(batch.slice(indices), indices), pack(batch, indices)
    ids = batch["input_ids"].items
    members, prefix = groups[0]
    row = shared.input_ids[0]
    assert torch.equal(row[:prefix], ids[members[0]][:prefix])
    assert torch.equal(row[prefix:ids[members[0]].numel()], ids[members[0]][prefix:])
    # segments: the prompt, then each member's remaining tokens; a response's keys start with its prompt's
    cu, cu_k = shared.cu_seqlens.tolist(), shared.cu_seqlens_k.tolist()
    assert cu[1] == prefix and shared.kv_index[cu_k[1]:cu_k[1] + prefix].tolist() == list(range(prefix))
    assert shared.input_ids.shape[1] == plain.input_ids.shape[1] - sum(p * (len(m) - 1) for m, p in groups)
    # the same scored tokens in the same order, and each prompt's image once
    assert torch.equal(shared.target_ids, plain.target_ids) and torch.equal(shared.target_seq, plain.target_seq)
    image = policy.adapter.image_token_id
    assert int((shared.input_ids == image).sum()) < int((plain.input_ids == image).sum())


def test_shared_prompts_refuse_what_cannot_share(tiny_model):
    with pytest.raises(ConfigError, match="model.attn_implementation' is sdpa with model.shared_prompts"):
        load_config(None, [f"model.path={tiny_model}", "model.shared_prompts=true", "model.attn_implementation=sdpa"])
    with pytest.raises(ConfigError, match="'model.shared_prompts' is on with rollout.exact=true"):
        load_config(None, [f"model.path={tiny_model}", "model.shared_prompts=on", "rollout.exact=true",
                           "rollout.engine=vllm"])


def test_auto_settles_off_where_the_config_rules_sharing_out(tiny_model):
    """The default `auto` is no error where `on` would be one: it settles to off at load; true/false read
    as on/off; other values are refused with the key's choices."""
    base = [f"model.path={tiny_model}"]
    assert load_config(None, base).model.shared_prompts == "auto"
    assert load_config(None, [*base, "model.attn_implementation=sdpa"]).model.shared_prompts == "off"
    assert load_config(None, [*base, "rollout.exact=true", "rollout.engine=vllm"]).model.shared_prompts == "off"
    assert load_config(None, [*base, "model.shared_prompts=true"]).model.shared_prompts == "on"
    assert load_config(None, [*base, "model.shared_prompts=false"]).model.shared_prompts == "off"
    with pytest.raises(ConfigError, match="model.shared_prompts"):
        load_config(None, [*base, "model.shared_prompts=sometimes"])


def test_the_family_and_the_device_settle_auto(tiny_model):
    """`auto` shares with attention auto or varlen for a family that can, on CUDA in bf16/fp16 (the varlen
    kernel) and off CUDA; `on` insists and names a family that cannot."""
    from dataclasses import replace

    from models.family import build_adapter
    from models.policy import load_model_config, shares_prompts

    adapter = build_adapter(load_model_config(str(tiny_model)))
    assert adapter.shares_prompts
    assert shares_prompts("auto", adapter, "auto", "cuda") and shares_prompts("auto", adapter, "varlen", "cuda")
    # off CUDA a row runs SDPA per segment either way: sharing saves the repeated prompts, in any dtype
    assert shares_prompts("auto", adapter, "auto", "cpu") and shares_prompts("auto", adapter, "auto", "cpu",
                                                                             torch.float32)
    assert not shares_prompts("auto", adapter, "sdpa", "cpu")
    assert not shares_prompts("auto", adapter, "sdpa", "cuda")
    assert shares_prompts("on", adapter, "auto", "cpu") and shares_prompts(True, adapter, "auto", "cpu")
    assert not shares_prompts("off", adapter, "auto", "cuda") and not shares_prompts(False, adapter, "auto", "cuda")
    cannot = replace(adapter, shares_prompts=False)
    assert not shares_prompts("auto", cannot, "auto", "cuda") and not shares_prompts("auto", cannot, "auto", "cpu")
    with pytest.raises(ValueError, match="model.shared_prompts' is on, but model family"):
        shares_prompts("on", cannot, "auto", "cuda")
    # an fp32 forward on CUDA: the varlen kernel takes bf16/fp16 only, so auto does not share and on is refused
    assert not shares_prompts("auto", adapter, "auto", "cuda", torch.float32)
    assert shares_prompts("on", adapter, "auto", "cpu", torch.float32)
    with pytest.raises(ValueError, match="shared_prompts' is on with model.dtype float32"):
        shares_prompts("on", adapter, "auto", "cuda", torch.float32)


def test_an_fp32_forward_on_cuda_settles_attention_to_sdpa():
    """model.dtype=float32 on CUDA: auto builds with SDPA (the flash kernels take bf16/fp16 only, and failed
    at the first vision block on an H200); a flash implementation named outright is refused at build."""
    from models.policy import resolve_attn_implementation

    assert resolve_attn_implementation("auto", "cuda", True, torch.float32) == "sdpa"
    assert resolve_attn_implementation("sdpa", "cuda", True, torch.float32) == "sdpa"
    # off CUDA the varlen implementation runs SDPA per sequence, in any dtype; a family without it takes sdpa
    assert resolve_attn_implementation("auto", "cpu", True, torch.float32) == "varlen"
    assert resolve_attn_implementation("auto", "cpu", False, torch.float32) == "sdpa"
    for name in ("varlen", "flash_attention_2", "vllm_paged"):
        with pytest.raises(ValueError, match=f"attn_implementation' is {name} with model.dtype float32"):
            resolve_attn_implementation(name, "cuda", True, torch.float32)


def test_activation_checkpointing_recomputes_a_shared_row(tiny_model, batch):
    """The backward's recompute of each block sees the row's segments (`checkpoint_context`): the same
    gradients as without checkpointing."""
    from models.parallel import build_parallel_dims
    from models.policy import build_policy

    torch.manual_seed(0)
    plain = build_policy(ModelConfig(path=str(tiny_model), shared_prompts=True), build_parallel_dims())
    torch.manual_seed(0)
    checkpointed = build_policy(ModelConfig(path=str(tiny_model), shared_prompts=True,
                                            activation_checkpointing=True), build_parallel_dims())
    _, g_plain, _, _ = _logprobs_and_grads(plain, batch, 1 << 20, share=True)
    _, g_ckpt, _, _ = _logprobs_and_grads(checkpointed, batch, 1 << 20, share=True)
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], atol=2e-5, rtol=1e-4, msg=name)


def _episodes_of(processor, adapter, prompts: int, responses: int, seed: int):
    """`prompts` one-image prompts x `responses` one-turn episodes of random lengths and ids (any family)."""
    from rollout.base import Generation
    from rollout.episode import Episode

    g = torch.Generator().manual_seed(seed)
    vocab = len(processor.tokenizer) - 64
    episodes = []
    for i in range(prompts):
        prompt = _prompt(processor, i, (70 * i, 180 - 60 * i, 40))
        for _ in range(responses):
            e = Episode.start(i, prompt)
            n = int(torch.randint(3, 30, (1,), generator=g))
            e.add_model_turn(Generation(i, torch.randint(300, vocab, (n,), generator=g).tolist(), [0.0] * n, "stop"))
            episodes.append(e)
    return episode_batch(episodes, adapter)


def test_qwen3_vl_shares_prompts_with_deepstack(tmp_path_factory):
    """Qwen3-VL adds DeepStack's vision features to the image tokens of early layers: with each prompt (its
    image tokens among them) once per row, logprobs and gradients are still the unshared row's."""
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tools.make_tiny_model import make_tiny_model

    init_distributed()
    folder = make_tiny_model(tmp_path_factory.mktemp("q3vl") / "m", family="qwen3_vl", size="tiny", seed=0)
    torch.manual_seed(0)
    policy = build_policy(ModelConfig(path=str(folder), shared_prompts=True), build_parallel_dims())
    batch = _episodes_of(load_processor(str(folder)), policy.adapter, prompts=2, responses=3, seed=2)
    lp_plain, g_plain, tokens_plain, _ = _logprobs_and_grads(policy, batch, 1 << 20, share=False)
    lp_shared, g_shared, tokens_shared, _ = _logprobs_and_grads(policy, batch, 1 << 20, share=True)
    assert tokens_shared < tokens_plain
    for a, b in zip(lp_plain, lp_shared):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], atol=2e-5, rtol=1e-4, msg=name)


def test_an_episode_without_model_tokens_adds_no_segment(tiny_model, policy):
    """A member whose sequence ends with its prompt (an empty generation) shares the prefix and leaves no
    empty segment in the row; the others' targets are unchanged."""
    from models.packing import pack, pack_shared, prompt_groups
    from rollout.base import Generation
    from rollout.episode import Episode

    processor = load_processor(str(tiny_model))
    prompt = _prompt(processor, 0)
    episodes = []
    for ids in ([400, 401, 402], [], [500, 501]):
        e = Episode.start(0, prompt)
        e.add_model_turn(Generation(0, ids, [0.0] * len(ids), "stop"))
        episodes.append(e)
    batch = episode_batch(episodes, policy.adapter)
    (members, prefix), = prompt_groups(batch)
    assert members == [0, 1, 2] and prefix == prompt.input_ids.numel()
    shared, plain = pack_shared(batch.slice([0, 1, 2]), [0, 1, 2]), pack(batch, [0, 1, 2])
    lengths = (shared.cu_seqlens[1:] - shared.cu_seqlens[:-1]).tolist()
    assert lengths == [prefix, 3, 2] and shared.cu_seqlens_k[-1] == 3 * prefix + 5  # keys: the prompt, each member
    assert torch.equal(shared.target_ids, plain.target_ids)
    lp_plain, _, _, _ = _logprobs_and_grads(policy, batch, 1 << 20, share=False)
    lp_shared, _, _, _ = _logprobs_and_grads(policy, batch, 1 << 20, share=True)
    for a, b in zip(lp_plain, lp_shared):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)


@pytest.mark.parametrize("aligned_to_end", [True, False])
def test_the_kernel_alignment_check_catches_a_mask_aligned_to_the_first_key(monkeypatch, aligned_to_end):
    """The varlen kernel is checked once per device before a shared row uses it: a causal mask aligned to the
    first key (the last query seeing only as many keys as there are queries) is refused."""
    from models import attention

    def fake_kernel(q, k, v, cu, longest, scaling, causal, keys):
        lq, lk = q.shape[2], keys[1][-1].item()
        visible = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq if aligned_to_end else 0)
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible)
        return out.transpose(1, 2)

    monkeypatch.setattr(attention, "_run_kernel", fake_kernel)
    check = attention._check_end_alignment.__wrapped__
    if aligned_to_end:
        check(torch.device("cpu"))
    else:
        with pytest.raises(RuntimeError, match="does not align a causal mask to the last key"):
            check(torch.device("cpu"))


def test_text_only_prompts_share_by_their_ids(tiny_model, policy):
    """Text-only samples have no pixel tensor to group by: samples whose ids agree up to their first scored
    token share that prefix; different prompts do not."""
    from data.processing import EncodedPrompt
    from models.packing import prompt_groups
    from rollout.base import Generation
    from rollout.episode import Episode

    processor = load_processor(str(tiny_model))
    episodes = []
    for i, question in enumerate(["How many red cubes are there?", "Is the sphere left of the cube?"]):
        ids = processor.tokenizer(question, return_tensors="pt")["input_ids"][0]
        prompt = EncodedPrompt(i, ids, None, None, [], "1")
        for j in range(3):
            e = Episode.start(i, prompt)
            new = [300 + 7 * j + k for k in range(4 + j)]
            e.add_model_turn(Generation(i, new, [0.0] * len(new), "stop"))
            episodes.append(e)
    batch = episode_batch(episodes, policy.adapter)
    groups = prompt_groups(batch)
    assert [m for m, _ in groups] == [[0, 1, 2], [3, 4, 5]] and all(p > 0 for _, p in groups)
    lp_plain, _, tokens_plain, _ = _logprobs_and_grads(policy, batch, 1 << 20, share=False)
    lp_shared, _, tokens_shared, _ = _logprobs_and_grads(policy, batch, 1 << 20, share=True)
    assert tokens_shared == tokens_plain - sum(p * (len(m) - 1) for m, p in groups)
    for a, b in zip(lp_plain, lp_shared):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
