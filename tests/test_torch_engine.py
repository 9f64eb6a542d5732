"""Tests for rollout/torch_engine.py on a tiny random Qwen2.5-VL checkpoint built in-process.

The central check: the engine's logprobs equal the trainer's (`Policy.logprobs` on the packed
prompt + response sequences) to fp32 rounding, for batched prompts of different lengths, with
and without images, through KV-cache decoding and rows finishing early.
"""

import math

import pytest
import torch
from torch import nn

from data.batch import Batch
from grpo.config import ModelConfig
from models.packing import pack, unpack_per_sequence
from models.parallel import build_parallel_dims, init_distributed
from models.policy import build_policy
from rollout.base import PromptInput, SamplingParams
from rollout.torch_engine import TorchEngine, sample_tokens

GRIDS = ([(1, 4, 4)], [], [(1, 4, 6)])  # two image sizes and one text-only prompt
HEAD_SCALE = 40.0  # sharpens the random model's near-uniform next-token distribution


@pytest.fixture(scope="module")
def model_path(tiny_model):
    """The session's tiny checkpoint (conftest: make_tiny_model(family="qwen2_5_vl", size="tiny", seed=0))."""
    return str(tiny_model)


@pytest.fixture(scope="module")
def engine(model_path):
    return TorchEngine(model_path)


@pytest.fixture(scope="module")
def policy(model_path):
    init_distributed()
    cfg = ModelConfig(path=model_path, dtype="float32", attn_implementation="sdpa")
    return build_policy(cfg, build_parallel_dims())


@pytest.fixture(scope="module")
def sharp(engine, policy):
    """Engine and policy sharing weights whose lm_head is scaled up, so logprobs are far from uniform.

    A flat distribution would hide hidden-state errors (wrong positions, leaked padding) in tiny
    logprob differences; a sharp one magnifies them.
    """
    with torch.no_grad():
        policy.adapter.lm_head(policy.model).weight.mul_(HEAD_SCALE)
    engine.refit(policy.full_state_dict())
    return engine, policy


def make_prompts(adapter, grids_per_prompt=GRIDS, seed=0, text=5):
    """Prompts of plain byte-range tokens around expanded image placeholders, with random pixels."""
    g = torch.Generator().manual_seed(seed)
    dim = 3 * adapter.temporal_patch_size * adapter.patch_size**2
    prompts = []
    for k, grids in enumerate(grids_per_prompt):
        ids = torch.randint(0, 256, (text + k,), generator=g).tolist()
        for t, h, w in grids:
            count = t * h * w // adapter.spatial_merge_size**2
            ids += [adapter.vision_start_token_id] + [adapter.image_token_id] * count + [adapter.vision_end_token_id]
            ids += torch.randint(0, 256, (text,), generator=g).tolist()
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), dim, generator=g) if grids else None
        prompts.append(PromptInput(ids, pixel_values=pixels, image_grid_thw=torch.tensor(grids) if grids else None))
    return prompts


def generation_batch(adapter, prompts, gens) -> Batch:
    """Prompt + response sequences of the generations; samples of a prompt share its pixel tensor."""
    ids, masks, pixels, grids = [], [], [], []
    for gen in gens:
        p = prompts[gen.prompt_index]
        seq = torch.tensor(p.input_ids + gen.token_ids)
        mask = torch.zeros_like(seq)
        mask[len(p.input_ids) :] = 1
        ids.append(seq)
        masks.append(mask)
        pixels.append(p.pixel_values)
        grids.append(p.image_grid_thw)
    batch = Batch({"input_ids": ids, "loss_mask": masks, "pixel_values": pixels, "image_grid_thw": grids})
    batch["position_ids"] = [adapter.position_ids(s, g) for s, g in zip(ids, grids)]
    return batch


def policy_logprobs(policy, prompts, gens, temperature):
    """The trainer's logprobs of each generation's tokens: prompt + response packed into one row."""
    mb = pack(generation_batch(policy.adapter, prompts, gens), list(range(len(gens))))
    with torch.no_grad():
        lp, _ = policy.logprobs(mb, temperature=temperature)
    return unpack_per_sequence(lp, mb)


def test_n_per_prompt_order_and_length(engine):
    prompts = make_prompts(engine.adapter)
    gens = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=5, seed=0))
    assert [g.prompt_index for g in gens] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for g in gens:
        assert g.finish_reason == "length"
        assert len(g.token_ids) == len(g.logprobs) == 5
        assert all(math.isfinite(x) and x <= 0.0 for x in g.logprobs)
    assert len({tuple(g.token_ids) for g in gens}) > 3  # the n samples of a prompt are not copies
    stats = engine.last_stats
    assert stats["gen_tokens"] == 45 and stats["sequences"] == 9 and stats["seconds"] > 0
    assert stats["tokens_per_s"] == pytest.approx(45 / stats["seconds"])


def test_seed_reproducible_and_varies(engine):
    prompts = make_prompts(engine.adapter)
    run = lambda seed: engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=seed))  # noqa: E731
    a, b, c = run(11), run(11), run(12)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_top_k_1_and_tiny_top_p_equal_greedy(engine):
    prompts = make_prompts(engine.adapter)
    greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=4))
    top1 = engine.generate(prompts, SamplingParams(n=2, top_k=1, max_new_tokens=4, seed=3))
    nucleus = engine.generate(prompts, SamplingParams(n=2, top_p=1e-6, max_new_tokens=4, seed=4))
    assert [g.token_ids for g in top1] == [g.token_ids for g in greedy]
    assert [g.token_ids for g in nucleus] == [g.token_ids for g in greedy]
    assert greedy[0].token_ids == greedy[1].token_ids  # greedy rows of one prompt agree
    for g, t in zip(greedy, top1):  # at temperature 1 both report log_softmax(logits)
        assert g.logprobs == pytest.approx(t.logprobs, abs=1e-6)


def test_chunked_batches_match_one_batch(engine, monkeypatch):
    prompts = make_prompts(engine.adapter)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=4)
    whole = engine.generate(prompts, params)
    monkeypatch.setattr(engine, "max_batch_size", 2)  # one prompt (n=2 rows) per prefill
    alone = engine.generate(prompts, params)
    assert [g.token_ids for g in alone] == [g.token_ids for g in whole]
    for x, y in zip(alone, whole):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


class _Favour(nn.Module):
    """lm_head plus a large bonus on some tokens, making them the most likely ones by far."""

    def __init__(self, head, token_ids, bonus=1e4):
        super().__init__()
        self.head = head
        self.bonus = torch.zeros(head.weight.shape[0])
        self.bonus[token_ids] = bonus

    def forward(self, hidden):
        return self.head(hidden) + self.bonus.to(hidden.dtype)


def test_banned_tokens_never_sampled(engine):
    a = engine.adapter
    extra = 7  # a caller-banned ordinary token
    favoured = a.banned_token_ids + [extra]
    prompts = make_prompts(a)
    head = engine.model.lm_head
    engine.model.lm_head = _Favour(head, favoured)
    try:
        runs = [
            engine.generate(
                prompts, SamplingParams(n=2, temperature=t, max_new_tokens=4, seed=1, banned_token_ids=[extra])
            )
            for t in (1.0, 0.0)
        ]
    finally:
        engine.model.lm_head = head
    for gens in runs:
        for g in gens:
            assert not set(g.token_ids) & set(favoured)
            # Reported logprobs come from the unbanned distribution, where the favoured tokens take the mass.
            assert max(g.logprobs) < -1e3


def first_stop_step(token_ids, stop):
    return token_ids.index(stop) if stop in token_ids else len(token_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_policy_through_stops(sharp, temperature):
    engine, policy = sharp
    prompts = make_prompts(engine.adapter)
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=8, seed=2)
    free = engine.generate(prompts, params)
    stop = free[0].token_ids[2]
    params.stop_token_ids = [stop]
    gens = engine.generate(prompts, params)

    # Until the first row stops, the stop token changes nothing (same seed, same random stream).
    early = min(first_stop_step(g.token_ids, stop) for g in free)
    assert early <= 2
    for g, f in zip(gens, free):
        assert g.token_ids[: early + 1] == f.token_ids[: early + 1]
        if g.finish_reason == "stop":  # the stop token is kept, and nothing after it
            assert g.token_ids[-1] == stop and stop not in g.token_ids[:-1]
        else:
            assert len(g.token_ids) == params.max_new_tokens and stop not in g.token_ids
        assert len(g.logprobs) == len(g.token_ids)
    assert gens[0].finish_reason == "stop" and any(g.finish_reason == "length" for g in gens)

    # The key property: rows kept decoding after others left the batch, and still match the trainer.
    theirs = policy_logprobs(policy, prompts, gens, temperature)
    ours = [torch.tensor(g.logprobs) for g in gens]
    delta = torch.cat([o - t for o, t in zip(ours, theirs)]).abs()
    assert torch.cat(ours).min() < -0.5  # not a degenerate, near-certain distribution
    assert delta.max().item() < 1e-4
    assert torch.exp(delta).mean().item() <= 1.0001


def test_refit_copies_policy_weights_bitwise(sharp):
    engine, policy = sharp
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(torch.randn(local.shape, generator=g) * 1e-3)
    before = {n: t.data_ptr() for n, t in engine.model.named_parameters()}
    engine.refit(policy.full_state_dict())
    engine_params = dict(engine.model.named_parameters(remove_duplicate=False))
    checked = 0
    for name, full in policy.full_state_dict():
        assert torch.equal(engine_params[name], full.to(engine.dtype)), name
        checked += 1
    assert checked == len(engine_params)
    assert {n: t.data_ptr() for n, t in engine.model.named_parameters()} == before  # updated in place


def test_refit_casts_to_engine_dtype(model_path, policy):
    engine = TorchEngine(model_path, dtype=torch.bfloat16)
    engine.refit(policy.full_state_dict())
    engine_params = dict(engine.model.named_parameters())
    for name, full in policy.full_state_dict():
        assert engine_params[name].dtype == torch.bfloat16
        assert torch.equal(engine_params[name], full.to(torch.bfloat16)), name


def test_refit_rejects_unknown_and_misshapen(engine):
    with pytest.raises(KeyError, match="model.language_model.nope"):
        engine.refit([("model.language_model.nope", torch.zeros(1))])
    name, param = next(iter(engine.model.named_parameters()))
    with pytest.raises(ValueError, match=name):
        engine.refit([(name, torch.zeros(param.numel() + 1))])


def test_sleep_wake_and_bad_prompts(engine):
    prompts = make_prompts(engine.adapter)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))
    engine.wake()
    assert len(engine.generate(prompts, SamplingParams(max_new_tokens=2, seed=0))) == 3
    no_pixels = PromptInput(prompts[0].input_ids, image_grid_thw=prompts[0].image_grid_thw)
    with pytest.raises(ValueError, match="prompt 1"):
        engine.generate([prompts[1], no_pixels], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(prompts, SamplingParams(top_p=0.0))


def test_sample_tokens_filters_and_reports_full_distribution():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    cases = [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.5), {0, 1}),  # 0.4 < 0.5 so token 1 is needed; 0.7 >= 0.5 stops there
        (SamplingParams(top_p=0.35), {0}),
        (SamplingParams(), {0, 1, 2, 3}),
    ]
    for params, allowed in cases:
        tokens, lps = sample_tokens(logits, params, [], g)
        assert set(tokens.tolist()) == allowed, params
        assert torch.allclose(lps, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))
    tokens, lps = sample_tokens(logits, SamplingParams(temperature=0.5), [0], g)
    assert 0 not in tokens.tolist()
    assert torch.allclose(lps, torch.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, None]).squeeze(-1))
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    want = torch.tensor([0.0, 9.0, 4.0, 1.0]) / 14.0  # p^2 renormalised without token 0
    assert torch.allclose(freq, want, atol=0.03)
