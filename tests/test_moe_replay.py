"""MoE routing replay (models/moe.py, algorithm.routing_replay) on the tiny Qwen3.5-MoE: the built-in engine
records the experts it routed every token to, episodes and packed micro-batches carry them, and the policy's
routers take them in place of their own top-k (gate weights from the policy's own logits), also where the
policy's router would choose otherwise and through activation checkpointing's recompute."""

import numpy as np
import pytest
import torch

from grpo.config import ModelConfig
from models.moe import RouteRecorder, replay_topk
from models.packing import pack, unpack_per_sequence
from models.parallel import build_parallel_dims, full_value, init_distributed
from models.policy import build_policy
from rollout.base import SamplingParams
from tests.test_families import _prompts
from tests.test_full_state_dict import set_full_value
from tests.test_torch_engine import generation_batch


@pytest.fixture(scope="module")
def moe_folder(tiny_moe_model):
    return tiny_moe_model


@pytest.fixture(scope="module")
def rollout(moe_folder):
    """The engine's prompts and generations, each with its routing, and the engine's model."""
    from rollout.torch_engine import TorchEngine

    engine = TorchEngine(str(moe_folder), adapter=None, record_routing=True)
    prompts = _prompts(moe_folder)
    gens = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=0))
    return prompts, gens, engine


def _policy(folder, activation_checkpointing=False):
    init_distributed()
    return build_policy(ModelConfig(path=str(folder), dtype="float32", attn_implementation="sdpa",
                                    activation_checkpointing=activation_checkpointing), build_parallel_dims())


def _micro_batch(policy, prompts, gens, replay=True):
    batch = generation_batch(policy.adapter, prompts, gens)
    if replay:
        batch["routed_experts"] = [g.routed_experts for g in gens]
    return pack(batch, list(range(len(gens))))


def test_replay_topk_takes_the_forced_experts_with_the_routers_own_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]])
    weights, chosen = replay_topk(logits, torch.tensor([[3, 2], [-1, -1]]), 2)
    probs = logits.softmax(-1)
    assert chosen.tolist() == [[3, 2], [1, 3]]  # a row of -1 (not run by the engine): its own top-k
    assert torch.allclose(weights[0], probs[0, [3, 2]] / probs[0, [3, 2]].sum())
    assert torch.allclose(weights[1], probs[1, [1, 3]] / probs[1, [1, 3]].sum())


def test_the_engine_reports_the_routing_of_every_token_it_ran(rollout):
    prompts, gens, engine = rollout
    layers = len(engine.adapter.routers(engine.model))
    for g in gens:
        p = len(prompts[g.prompt_index].input_ids)
        r = g.routed_experts
        assert r.shape == (p + len(g.token_ids), layers, engine.adapter.experts_per_token) and r.dtype == torch.int16
        assert (r[:-1] >= 0).all() and (r[-1] == -1).all()  # the last sampled token was never run
    # a prompt's n samples share its prefill's routing, then go their own ways
    a, b = gens[0].routed_experts, gens[1].routed_experts
    assert torch.equal(a[:len(prompts[0].input_ids)], b[:len(prompts[0].input_ids)])


def _perturbed(policy, layer: int, expert: int, scale: float) -> torch.Tensor:
    """Push one expert's row of a router (before any forward, while it is sharded) so that the policy's own
    top-k differs from the engine's for many tokens; returns the router's new full weight."""
    weight = policy.adapter.routers(policy.model)[layer].weight
    with torch.no_grad():
        full = full_value(weight).clone()
        full[expert] += scale * full.std()
    set_full_value(weight, full)
    return full


def test_replayed_logprobs_follow_the_engines_routing(moe_folder, rollout):
    prompts, gens, _ = rollout
    policy = _policy(moe_folder)
    engine_lp = torch.cat([torch.tensor(g.logprobs) for g in gens])
    with torch.no_grad():
        replayed, _ = policy.logprobs(_micro_batch(policy, prompts, gens))
        own, _ = policy.logprobs(_micro_batch(policy, prompts, gens, replay=False))
    assert (replayed - engine_lp).abs().max() < 1e-5 and (own - engine_lp).abs().max() < 1e-5
    # The policy's first router pushed so that its own top-k differs from the engine's for many tokens.
    policy = _policy(moe_folder)
    weight = _perturbed(policy, 0, 0, 3.0)
    router = policy.adapter.routers(policy.model)[0]
    seen = RouteRecorder([router])
    mb = _micro_batch(policy, prompts, gens)
    routes = mb.routed_experts[:, 0].long()
    with torch.no_grad():
        own, _ = policy.logprobs(_micro_batch(policy, prompts, gens, replay=False))
        own_choice = seen.take()[:, 0].long().sort(-1).values
        replayed, _ = policy.logprobs(mb)
        replay_choice = seen.take()[:, 0].long()
    ran = (routes >= 0).all(-1)
    assert (own_choice[ran] != routes[ran].sort(-1).values).any(-1).float().mean() > 0.2  # the router moved
    assert torch.equal(replay_choice[ran], routes[ran])  # yet the replay routes as the engine did
    assert (replayed - own).abs().max() > 1e-3
    # The gate weights are the perturbed router's own softmax over the engine's experts.
    hidden, out = _first_router_call(policy, mb)
    want, _ = replay_topk(torch.nn.functional.linear(hidden, weight), routes, 2)
    assert torch.allclose(out[1], want, atol=1e-6)


def _first_router_call(policy, mb):
    router, got = policy.adapter.routers(policy.model)[0], []
    handle = router.register_forward_hook(lambda m, args, out: got.append((args[0].reshape(-1, m.hidden_dim), out)))
    try:
        with torch.no_grad():
            policy.logprobs(mb)
    finally:
        handle.remove()
    return got[0]


def test_replay_survives_activation_checkpointing(moe_folder, rollout):
    """Backward recomputes each layer after the forward's block closed: it must replay the same routes."""
    prompts, gens, _ = rollout
    grads = []
    for recompute in (False, True):
        policy = _policy(moe_folder, activation_checkpointing=recompute)
        _perturbed(policy, 1, 1, -3.0)  # the policy's own top-k would differ from the engine's
        lp, _ = policy.logprobs(_micro_batch(policy, prompts, gens))
        lp.sum().backward()
        grads.append({n: full_value(p.grad).clone() for n, p in policy.model.named_parameters()
                      if p.grad is not None})
    assert any(".mlp.gate." in n for n in grads[0]) and grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6), name


def test_grpo_step_with_routing_replay(moe_folder, clevr_parquet, tmp_path):
    """Through the trainer: episodes carry the built-in engine's routing into the packed micro-batches, and
    engine and policy logprobs agree."""
    from grpo.config import load_config
    from grpo.trainer import Trainer

    init_distributed()
    cfg = load_config(None, [
        "trainer.mode=grpo", f"model.path={moe_folder}", f"data.train_path={clevr_parquet}", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "rollout.max_new_tokens=6", "data.min_pixels=3136",
        "data.max_pixels=3136", f"trainer.run_dir={tmp_path / 'run'}", "logging.tensorboard=false",
        "checkpoint.resume=never", "optim.max_tokens_per_microbatch=256", "algorithm.routing_replay=true",
    ])
    trainer = Trainer(cfg)
    packed = []
    policy_logprobs = trainer.policy.logprobs
    trainer.policy.logprobs = lambda mb, **kw: packed.append(mb.routed_experts) or policy_logprobs(mb, **kw)
    m = trainer.grpo_step(1)
    assert packed and all(r is not None and r.shape[0] > 0 for r in packed)
    assert 1.0 <= m["fidelity/token_mult_prob_error"] <= 1.0001, m["fidelity/token_mult_prob_error"]


def test_routing_replay_needs_an_moe_family(tiny_model):
    from grpo.config import load_config
    from rollout.factory import build_engine

    cfg = load_config(None, [f"model.path={tiny_model}", "rollout.engine=torch", "algorithm.routing_replay=true"])
    policy = _policy(tiny_model)
    with pytest.raises(ValueError, match=r"'algorithm.routing_replay' is true, but model family 'qwen2_5_vl'"):
        build_engine(cfg, policy)


def test_vllm_routing_arrays_become_one_row_per_token():
    from rollout.vllm_engine import engine_routes

    prompt = np.arange(5 * 3 * 2, dtype=np.int16).reshape(5, 3, 2)
    response = np.ones((3, 3, 2), dtype=np.int16)  # 4 sampled tokens, the last never run
    out = engine_routes(prompt, response, 5, 4)
    assert out.shape == (9, 3, 2) and torch.equal(out[:5], torch.from_numpy(prompt))
    assert (out[5:8] == 1).all() and (out[8] == -1).all()
    whole = engine_routes(None, np.zeros((8, 3, 2)), 5, 4)  # one array for the whole sequence
    assert whole.shape == (9, 3, 2) and (whole[8] == -1).all()
    with pytest.raises(RuntimeError, match="no routed_experts"):
        engine_routes(prompt, None, 5, 4)
    with pytest.raises(RuntimeError, match=r"shape \(10, 3, 2\)"):
        engine_routes(prompt, np.ones((5, 3, 2)), 5, 4)


def test_routing_replay_is_refused_with_exact_mode():
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"'algorithm.routing_replay' is true; it needs false .*rollout.exact=true"):
        load_config(None, ["rollout.engine=vllm", "rollout.exact=true", "algorithm.routing_replay=true"])
