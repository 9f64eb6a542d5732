"""Packing: m-rope positions per sequence, packed logprobs equal padded per-sequence logprobs."""

import pytest
import torch

from data.batch import Batch, PackedGenericDataItem
from models.packing import bins_fit, grouped_bins, pack, plan_microbatches, unpack_per_sequence
from models.parallel import full_value


@pytest.fixture(scope="module")
def policy(tiny_model):
    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    return build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims())


@pytest.fixture(scope="module")
def reference(tiny_model):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(tiny_model), local_files_only=True,
                                                       attn_implementation="eager", dtype=torch.float32).eval()


def _sample(adapter, g, grids, n_text, n_resp, vocab=200):
    ids = []
    for t, h, w in grids:
        ids += torch.randint(10, vocab, (n_text,), generator=g).tolist()
        ids += [adapter.vision_start_token_id] + [adapter.image_token_id] * (t * h * w // 4) + [adapter.vision_end_token_id]
    ids += torch.randint(10, vocab, (n_text + n_resp,), generator=g).tolist()
    ids = torch.tensor(ids)
    mask = torch.zeros_like(ids)
    mask[-n_resp:] = 1
    width = 3 * adapter.temporal_patch_size * adapter.patch_size**2  # a patch row: 1176 for 14-pixel patches
    pix = torch.randn(sum(t * h * w for t, h, w in grids), width, generator=g) if grids else None
    return ids, mask, pix, (torch.tensor(grids) if grids else None)


def mixed_batch(adapter):
    """Different image sizes, a text-only row, and two images in one sample."""
    g = torch.Generator().manual_seed(0)
    rows = [_sample(adapter, g, [(1, 4, 4)], 5, 6), _sample(adapter, g, [], 7, 5),
            _sample(adapter, g, [(1, 4, 6), (1, 2, 4)], 4, 7), _sample(adapter, g, [(1, 6, 4)], 9, 3)]
    batch = Batch({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows],
                   "pixel_values": [r[2] for r in rows], "image_grid_thw": [r[3] for r in rows]})
    batch["position_ids"] = PackedGenericDataItem([adapter.position_ids(r[0], r[3]) for r in rows], dim=1)
    return batch


def padded_logprobs(model, batch, adapter):
    """Right-padded batch through the plain transformers forward; scored-token logprobs per row."""
    n = len(batch)
    L = max(t.numel() for t in batch["input_ids"].items)
    ids = torch.zeros(n, L, dtype=torch.long)
    att = torch.zeros(n, L, dtype=torch.long)
    pos = torch.zeros(3, n, L, dtype=torch.long)
    for i, (seq, p) in enumerate(zip(batch["input_ids"].items, batch["position_ids"].items)):
        ids[i, : seq.numel()] = seq
        att[i, : seq.numel()] = 1
        pos[:, i, : seq.numel()] = p[1:]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att, position_ids=pos,
                       pixel_values=batch["pixel_values"].as_tensor(),
                       image_grid_thw=batch["image_grid_thw"].as_tensor()).logits.float()
    lps = torch.log_softmax(logits, -1)
    out = []
    for i, (seq, mask) in enumerate(zip(batch["input_ids"].items, batch["loss_mask"].items)):
        t = torch.nonzero(mask[1:].bool()).flatten() + 1
        out.append(lps[i, t - 1, seq[t]])
    return out


def test_positions_match_transformers(policy):
    adapter = policy.adapter
    batch = mixed_batch(adapter)
    inner = policy.model.model
    import inspect

    if "mm_token_type_ids" not in inspect.signature(inner.get_rope_index).parameters:
        pytest.skip("this transformers version computes rope indices with another signature")
    for ids, grid, pos in zip(batch["input_ids"].items, batch["image_grid_thw"].items, batch["position_ids"].items):
        assert torch.equal(pos[0], torch.arange(ids.numel()))
        if grid is None:
            assert torch.equal(pos[1:], torch.arange(ids.numel()).expand(3, -1))
            continue
        mm = (ids == adapter.image_token_id).int()[None]
        ref, _ = inner.get_rope_index(ids[None], mm_token_type_ids=mm, image_grid_thw=grid)
        assert torch.equal(ref[:, 0], pos[1:])


def test_position_errors(policy):
    a = policy.adapter
    ids = torch.tensor([1, a.image_token_id, a.image_token_id, 2])
    with pytest.raises(ValueError, match="placeholder"):
        a.position_ids(ids, torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="images"):
        a.position_ids(ids, None)


def test_packed_equals_padded(policy, reference):
    batch = mixed_batch(policy.adapter)
    mb = pack(batch, list(range(len(batch))))
    assert mb.num_tokens == sum(t.numel() for t in batch["input_ids"].items)  # no padding
    with torch.no_grad():
        lp, ent = policy.logprobs(mb, with_entropy=True)
    packed = unpack_per_sequence(lp, mb)
    ref = padded_logprobs(reference, batch, policy.adapter)
    for p, r in zip(packed, ref):
        assert p.shape == r.shape
        assert torch.allclose(p, r, atol=1e-5, rtol=0), (p - r).abs().max()
    assert ent.shape == lp.shape and bool((ent > 0).all())
    # packing order does not change any sequence's logprobs
    mb2 = pack(batch, [3, 1, 0, 2])
    with torch.no_grad():
        lp2, _ = policy.logprobs(mb2)
    for i, chunk in zip(mb2.sample_indices, unpack_per_sequence(lp2, mb2)):
        assert torch.allclose(chunk, packed[i], atol=1e-5, rtol=0)


def test_temperature_scales_logits(policy, reference):
    batch = mixed_batch(policy.adapter)
    mb = pack(batch, [0])
    with torch.no_grad():
        lp_t, _ = policy.logprobs(mb, temperature=0.5)
        h = policy.hidden_states(mb.to(policy.device))
        logits = policy.model.lm_head(h[mb.target_positions]).float() / 0.5
    expect = torch.log_softmax(logits, -1).gather(-1, mb.target_ids[:, None]).squeeze(-1)
    assert torch.allclose(lp_t, expect, atol=1e-5)


def test_microbatch_planning():
    lengths = [100, 400, 300, 250, 50, 600]
    bins = plan_microbatches(lengths, 700)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert bins_fit(bins, lengths, 700) and len(bins) == 3
    fixed = plan_microbatches(lengths, 700, num_bins=4)
    assert len(fixed) == 4 and sorted(i for b in fixed for i in b) == list(range(6))
    loads = [sum(lengths[i] for i in b) for b in fixed]
    assert max(loads) - min(loads) <= 300
    assert plan_microbatches([900], 700) == [[0]]  # an over-long sample gets its own bin
    assert plan_microbatches([5, 5], 100, num_bins=3)[2] == []


def test_varlen_boundaries_come_from_the_packer_inside_packed_row():
    """Inside `packed_row` the kernel gets the packer's boundaries for a row of that length; outside,
    or for a row of another length, they are derived afresh from the positions (no stale cache)."""
    from models.attention import packed_row, row_boundaries

    pos_a = torch.cat([torch.arange(3), torch.arange(5)]).view(1, 8)
    pos_b = torch.cat([torch.arange(6), torch.arange(2)]).view(1, 8)
    assert row_boundaries(pos_a, 8)[0].tolist() == [0, 3, 8] and row_boundaries(pos_a, 8)[1] == 5
    assert row_boundaries(pos_b, 8)[0].tolist() == [0, 6, 8] and row_boundaries(pos_b, 8)[1] == 6
    given = torch.tensor([0, 4, 8], dtype=torch.int32)
    with packed_row(given, 8):
        cu, longest = row_boundaries(pos_a, 8)
        assert cu.tolist() == [0, 4, 8] and longest == 4
        assert row_boundaries(pos_b[:, :6], 6)[0].tolist() == [0, 6]  # another row: its own positions
    assert row_boundaries(pos_a, 8)[0].tolist() == [0, 3, 8]


def test_checkpoint_recompute_sees_the_forwards_packed_row():
    """Activation checkpointing recomputes in backward, after `packed_row` has closed: the
    recompute still gets the boundaries the forward used."""
    from torch.utils.checkpoint import checkpoint

    from models.attention import checkpoint_context, packed_row, row_boundaries

    pos = torch.arange(8).view(1, 8)
    seen = []

    def layer(x):
        seen.append(row_boundaries(pos, 8)[0].tolist())
        return (x * x).sin()  # saves tensors, so backward recomputes

    x = torch.ones(3, requires_grad=True)
    with packed_row(torch.tensor([0, 5, 8]), 8):
        y = checkpoint(layer, x, use_reentrant=False, context_fn=checkpoint_context)
    y.sum().backward()
    assert seen == [[0, 5, 8], [0, 5, 8]]  # forward, then the recompute


def test_grouped_bins_keep_an_images_responses_together():
    """8 prompts x 8 responses into 6 micro-batches: each image lands in at most 2 of them, where
    token-balanced bins spread every image over all 6 (6x the vision forwards)."""
    groups = [i // 8 for i in range(64)]
    lengths = [1318] * 64
    bins = grouped_bins(lengths, groups, 6, 16384)
    assert sorted(i for b in bins for i in b) == list(range(64)) and bins_fit(bins, lengths, 16384)
    spread = [len({k for k, b in enumerate(bins) if any(groups[i] == g for i in b)}) for g in range(8)]
    assert max(spread) <= 2 and sum(spread) <= 8 + 5, spread
    balanced = plan_microbatches(lengths, 16384, num_bins=6)
    assert sum(len({groups[i] for i in b}) for b in balanced) > 2 * sum(spread)
    # uneven lengths: still every sample once, in exactly the asked number of bins
    rng = torch.Generator().manual_seed(0)
    uneven = torch.randint(200, 2000, (40,), generator=rng).tolist()
    bins = grouped_bins(uneven, [i // 5 for i in range(40)], 5, 16384)
    assert len(bins) == 5 and sorted(i for b in bins for i in b) == list(range(40))


def test_backward_reaches_vision_and_text(policy):
    batch = mixed_batch(policy.adapter)
    mb = pack(batch, [1])  # text only: the vision tower still runs (zero-weighted)
    lp, _ = policy.logprobs(mb)
    lp.sum().backward()
    vision = [p for p in policy.adapter.vision_tower(policy.model).parameters()]
    assert all(p.grad is not None for p in vision)
    assert all(float(p.grad.abs().sum()) == 0.0 for p in vision)
    policy.model.zero_grad(set_to_none=True)
    lp, _ = policy.logprobs(pack(batch, [0, 2]))
    lp.sum().backward()
    assert any(float(p.grad.abs().sum()) > 0 for p in vision)
    policy.model.zero_grad(set_to_none=True)


def test_offload_reload_exact(policy):
    from torch.distributed.tensor import DTensor

    from grpo.update import build_optimizer
    from grpo.config import OptimConfig

    opt = build_optimizer(policy, OptimConfig(lr=1e-3))
    lp, _ = policy.logprobs(pack(mixed_batch(policy.adapter), [0]))
    lp.sum().backward()
    opt.step()
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    before = {n: local(p).detach().clone() for n, p in policy.model.named_parameters()}
    state = {(i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()
             if isinstance(v, torch.Tensor) and k != "step"}
    policy.offload(opt)
    assert all(local(p).device.type == "cpu" for p in policy.model.parameters())
    policy.reload(opt)
    for n, p in policy.model.named_parameters():
        assert torch.equal(local(p), before[n]), n
        assert local(p).device.type == policy.device.type
    after = {(i, k): v for i, s in enumerate(opt.state.values()) for k, v in s.items()
             if isinstance(v, torch.Tensor) and k != "step"}
    assert len(state) == len(after) > 0
    assert all(torch.equal(state[k], after[k]) for k in state)
    opt.zero_grad(set_to_none=True)


def test_vision_runs_once_per_prompt_group(policy):
    """G responses sharing one pixel tensor: one vision forward, same logprobs and gradients as copies."""
    base = mixed_batch(policy.adapter)
    G = 3
    rows = [0] * G + [2] * G  # two prompts (one with two images), G responses each
    g = torch.Generator().manual_seed(1)
    ids, masks, pos = [], [], []
    for i in rows:
        extra = torch.randint(10, 200, (4,), generator=g)
        seq = torch.cat([base["input_ids"][i], extra])
        ids.append(seq)
        masks.append(torch.cat([base["loss_mask"][i], torch.ones(4, dtype=torch.long)]))
        pos.append(policy.adapter.position_ids(seq, base["image_grid_thw"][i]))

    def build(share: bool) -> Batch:
        pix = [base["pixel_values"][i] if share else base["pixel_values"][i].clone() for i in rows]
        return Batch({"input_ids": ids, "loss_mask": masks, "pixel_values": pix,
                      "image_grid_thw": [base["image_grid_thw"][i] for i in rows],
                      "position_ids": PackedGenericDataItem(pos, dim=1)})

    calls = []
    hook = policy.adapter.vision_tower(policy.model).register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    results = {}
    try:
        for share in (True, False):
            calls.clear()
            mb = pack(build(share), list(range(len(rows))))
            lp, _ = policy.logprobs(mb)
            lp.sum().backward()
            grads = {n: getattr(p.grad, "full_tensor", lambda: p.grad)().detach().clone()
                     for n, p in policy.model.named_parameters() if p.grad is not None}
            policy.model.zero_grad(set_to_none=True)
            results[share] = (lp.detach(), grads, list(calls))
    finally:
        hook.remove()
    shared, copied = results[True], results[False]
    assert shared[2] == [16 + 24 + 8] and copied[2] == [G * (16 + 24 + 8)]  # patches through the tower
    assert torch.allclose(shared[0], copied[0], atol=1e-6)
    for name, grad in shared[1].items():
        assert torch.allclose(grad, copied[1][name], atol=1e-5, rtol=1e-4), name


def test_varlen_runs_each_sequence_on_its_own_off_gpu(tiny_model, monkeypatch):
    """attn_implementation=varlen (what auto builds on CPU) builds and, without the CUDA kernel, runs each sequence
    of a packed row through SDPA on its own, with no mask built for the row: sdpa's packed logprobs."""
    from grpo.config import ModelConfig
    from transformers import AttentionInterface
    from transformers import masking_utils

    from models import attention
    from models.attention import VISION_NAME, register, varlen_vision_attention
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    register()
    varlen = build_policy(ModelConfig(path=str(tiny_model), attn_implementation="varlen"), build_parallel_dims())
    sdpa = build_policy(ModelConfig(path=str(tiny_model), attn_implementation="sdpa"), build_parallel_dims())
    assert varlen.model.config._attn_implementation == "varlen"
    vision = varlen.adapter.vision_tower(varlen.model).config
    assert vision._attn_implementation == VISION_NAME
    calls = []

    def spy(module, query, *args, **kwargs):  # the vision tower hands over all its windows at once
        calls.append(int(kwargs["cu_seq_lens_q"].numel()) - 1)
        return varlen_vision_attention(module, query, *args, **kwargs)

    AttentionInterface.register(VISION_NAME, spy)
    batch = mixed_batch(sdpa.adapter)
    mb = pack(batch, list(range(len(batch))))
    rows, masks = [], []
    reference = attention.reference_attention
    monkeypatch.setattr(attention, "reference_attention",
                        lambda q, k, v, cu, *a, **kw: (rows.append(attention.host_bounds(cu)), reference(q, k, v, cu, *a,
                                                                                                         **kw))[1])
    sdpa_mask = masking_utils.sdpa_mask
    monkeypatch.setattr(masking_utils, "sdpa_mask", lambda *a, **kw: (masks.append(1), sdpa_mask(*a, **kw))[1])
    try:
        with torch.no_grad():
            a, _ = varlen.logprobs(mb)
            assert not masks  # no block-diagonal mask for the row
            b, _ = sdpa.logprobs(mb)
    finally:
        register()
    assert len(calls) == vision.depth and max(calls) > 1, calls
    layers = varlen.model.config.get_text_config().num_hidden_layers
    assert len(rows) == layers and all(len(r) == len(batch) + 1 for r in rows), rows  # each layer: every sequence
    assert rows[0][-1] == mb.num_tokens
    assert torch.allclose(a, b, atol=1e-6)


@pytest.fixture(scope="module")
def qwen3_5_folder(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_5", family="qwen3_5", size="tiny", seed=0)


@pytest.mark.parametrize("kernel_path", [False, True], ids=["cpu_fallback", "kernel_path"])
def test_qwen3_5_varlen_gives_sdpa_logprobs_and_gradients(qwen3_5_folder, monkeypatch, kernel_path):
    """Qwen3.5's full-attention layers (a gated output, m-rope over a quarter of each head) between Gated DeltaNet
    layers, packed: attn_implementation=varlen gives sdpa's logprobs and gradients. Off CUDA its call runs SDPA
    over each sequence on its own; `kernel_path` takes the CUDA path instead with a stand-in for the kernel (SDPA per segment,
    tests/test_host_syncs.py): no masks built for either layer kind, the row's boundaries from the packer."""
    from grpo.config import ModelConfig
    from models import attention
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tests.test_host_syncs import HostSyncs, cuda_path

    init_distributed()
    varlen, sdpa = (build_policy(ModelConfig(path=str(qwen3_5_folder), dtype="float32", attn_implementation=attn),
                                 build_parallel_dims()) for attn in ("varlen", "sdpa"))
    assert varlen.model.config._attn_implementation == "varlen"
    batch = mixed_batch(sdpa.adapter)
    mb = pack(batch, list(range(len(batch))))

    def logprobs_and_grads(policy):
        policy.model.zero_grad(set_to_none=True)
        lp, _ = policy.logprobs(mb)
        (lp * torch.linspace(-1.0, 1.0, lp.numel())).sum().backward()
        return lp.detach(), {n: full_value(p.grad) for n, p in policy.model.named_parameters() if p.grad is not None}

    want = logprobs_and_grads(sdpa)
    causal_calls = []
    if kernel_path:
        with cuda_path(monkeypatch, HostSyncs()):
            stand_in, params = attention._kernel()

            def kernel(*args, is_causal=False, **kwargs):
                causal_calls.append(is_causal)
                return stand_in(*args, is_causal=is_causal, **kwargs)

            monkeypatch.setattr(attention, "_kernel", lambda: (kernel, params))
            got = logprobs_and_grads(varlen)
    else:
        got = logprobs_and_grads(varlen)
    full = varlen.model.config.text_config.layer_types.count("full_attention")
    assert causal_calls.count(True) == (full if kernel_path else 0)  # the decoder's layers took the kernel's path
    assert torch.allclose(got[0], want[0], atol=1e-5)
    assert got[1].keys() == want[1].keys() and any("self_attn" in n for n in got[1])
    for name, grad in got[1].items():
        assert torch.allclose(grad, want[1][name], atol=1e-5, rtol=1e-4), name
