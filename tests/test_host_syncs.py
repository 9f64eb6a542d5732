"""Host-device syncs in the training forward: a packed micro-batch's forward and backward read the device back
a fixed number of times, however many decoder layers and vision blocks the model has.

A read back (`.item()`, `.tolist()`, `int(t)`, `nonzero`, a boolean index, ...) makes the host wait until the
device has run everything queued before it; the device then idles while the host queues the next kernels.
`HostSyncs` counts, on CPU, the calls that would wait on CUDA: it follows which tensors would live on the device
(the model's, the micro-batch's, and whatever is computed from them or made on their device) and counts a read
of one, a boolean index or an index from the host into one, and a blocking copy from the host. The varlen
kernel's path (what runs on CUDA) is taken on CPU with a stand-in kernel (`cuda_path`), so the count is of
the code that runs there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from models import attention
from models.packing import pack
from models.parallel import full_value
from tests.test_packing import mixed_batch

_READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "argwhere", "masked_select",
          "unique", "unique_consecutive", "bincount", "cpu", "numpy"}
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}


class HostSyncs(TorchFunctionMode):
    """Counts the torch calls that would make the host wait for a CUDA device (`count`, and `calls`: where).

    A tensor is on the device when it is marked (`on_device`), computed from one that is, or made with the
    `device` of one that is (a device object read from a tensor is traced back to it; "cpu" is the host; any
    other device counts as the device). A tensor made from Python values without a device is on the host."""

    def __init__(self):
        super().__init__()
        self._device = WeakIdKeyDictionary()
        # id(a device object read from a tensor) → (the object, whether that tensor is on the device)
        self._devices: dict[int, tuple[torch.device, bool]] = {}
        self.calls: list[str] = []
        self._paused = False

    @property
    def count(self) -> int:
        return len(self.calls)

    def on_device(self, *tensors) -> None:
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                self._device[t] = True

    @contextlib.contextmanager
    def paused(self):
        """Calls in this block are not counted (a stand-in for one kernel launch)."""
        self._paused, was = True, self._paused
        try:
            yield
        finally:
            self._paused = was

    def _is_device(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x in self._device

    def _target_on_device(self, device) -> bool:
        known = self._devices.get(id(device))
        if known is not None and known[0] is device:
            return known[1]
        return not (isinstance(device, str) and device.startswith("cpu"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch.Tensor.device:  # a tensor's `.device`: remember whose
            self._devices[id(out)] = (out, self._is_device(args[0]))
            return out
        name = getattr(func, "__name__", "")
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        device_in = any(self._is_device(x) for x in inputs)
        target = kwargs.get("device")
        if name == "to" and target is None:
            target = next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
        device_out = device_in if target is None else self._target_on_device(target)
        if name == "cpu":
            device_out = False
        why = None if self._paused else self._why(name, args, kwargs, inputs, device_in, device_out, target)
        if why is not None:
            self.calls.append(f"{why} at {_caller()}")
        if device_out:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._device[t] = True
        return out

    def _why(self, name, args, kwargs, inputs, device_in, device_out, target) -> str | None:
        if name in _READS and device_in:
            return name
        if name == "repeat_interleave" and device_in and isinstance(kwargs.get("repeats", args[1] if len(args) > 1
                                                                                 else None), torch.Tensor):
            return name if kwargs.get("output_size") is None else None
        if name == "where" and len(args) == 1 and not kwargs and device_in:
            return "where(condition)"
        if name in _INDEXING and self._is_device(args[0]):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            for i in tree_flatten(index)[0]:
                if isinstance(i, torch.Tensor) and i.dtype == torch.bool and self._is_device(i):
                    return f"{name}[boolean mask]"
                if isinstance(i, torch.Tensor) and not self._is_device(i):
                    return f"{name}[index from the host]"
        if name == "to" and device_in and not device_out:
            return "copy to the host"
        if name == "to" and device_out and not device_in and not kwargs.get("non_blocking", False):
            return "blocking copy from the host"
        if name in ("tensor", "as_tensor") and target is not None and device_out and not device_in:
            return f"{name}(..., device=) from the host"
        return None


def _caller() -> str:
    """file:line of the innermost frame outside torch and this file."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("test_host_syncs.py"):
            return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}"
    return "?"


def _stand_in_kernel(counter: HostSyncs):
    """torch's varlen_attn as SDPA per segment (it is one kernel launch on CUDA: its own calls are not counted);
    checks the longest lengths it is given, which the real kernel trusts."""

    def kernel(q, k, v, cu_q, cu_k, longest_q, longest_k, scale=None, is_causal=False, enable_gqa=False):
        assert type(longest_q) is int and type(longest_k) is int
        with counter.paused():
            bq, bk = cu_q.tolist(), cu_k.tolist()
            assert longest_q == max(b - a for a, b in zip(bq, bq[1:]))
            assert longest_k == max(b - a for a, b in zip(bk, bk[1:]))
            out = []
            for s in range(len(bq) - 1):
                qs, ks, vs = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t, lo, hi in
                              ((q, bq[s], bq[s + 1]), (k, bk[s], bk[s + 1]), (v, bk[s], bk[s + 1])))
                lq, lk = qs.shape[2], ks.shape[2]
                mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if is_causal else None
                out.append(torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1))
            return torch.cat(out)

    return kernel


@contextlib.contextmanager
def cuda_path(monkeypatch, counter: HostSyncs, tensor_max_length: bool = False):
    """Attention takes the varlen kernel's path, as on CUDA, with `_stand_in_kernel`. `tensor_max_length`: the
    vision blocks get their longest window as a fresh device tensor in every block (what transformers before
    5.17 passes), not as an int."""
    from transformers import AttentionInterface

    monkeypatch.setattr(attention, "_kernel", lambda: (_stand_in_kernel(counter), {"is_causal", "enable_gqa"}))
    monkeypatch.setattr(attention, "kernel_runs", lambda device: True)
    if tensor_max_length:
        def vision(module, query, key, value, *args, cu_seq_lens_q=None, max_length_q=None, **kwargs):
            if cu_seq_lens_q is not None:
                max_length_q = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max()
            return attention.varlen_vision_attention(module, query, key, value, *args, cu_seq_lens_q=cu_seq_lens_q,
                                                     max_length_q=max_length_q, **kwargs)

        AttentionInterface.register(attention.VISION_NAME, vision)
    try:
        yield
    finally:
        attention.register()


def _tiny_policy(tmp_path_factory, layers: int, blocks: int, family: str = "qwen2_5_vl", **model):
    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tools.make_tiny_model import SIZES, make_tiny_model

    init_distributed()
    size = dataclasses.replace(SIZES["tiny"], text_layers=layers, vision_depth=blocks)
    path = make_tiny_model(tmp_path_factory.mktemp("models") / f"{family}_{layers}x{blocks}", family=family, size=size)
    torch.manual_seed(0)
    return build_policy(ModelConfig(path=str(path), activation_checkpointing=True, **model), build_parallel_dims())


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """The tiny Qwen2.5-VL at two depths (decoder layers x vision blocks, one block of full attention), varlen."""
    return {depth: _tiny_policy(tmp_path_factory, *depth, attn_implementation="varlen") for depth in ((2, 2), (5, 4))}


def moved(mb, device):
    """`mb.to(device)` as a move to a GPU makes it: every tensor a new one (on the CPU `to` hands back the same
    tensors), the host layout the packer's (its token ids the host's)."""
    out = mb.to(device)
    copies = {f.name: v.clone() for f in dataclasses.fields(out) if isinstance(v := getattr(out, f.name), torch.Tensor)}
    return dataclasses.replace(out, **copies)


def forward_backward_syncs(policy, mb, counter: HostSyncs) -> HostSyncs:
    """`counter` over `policy.logprobs(mb)` and its backward, `mb` on the device (as the update has it)."""
    policy.logprobs(mb)[0].sum().backward()  # once before: what is made once per run (the keep-alive's inputs)
    counter.on_device(*policy.model.parameters(), *policy.model.buffers(), policy._dummy_vision,
                      *(getattr(mb, f.name) for f in dataclasses.fields(mb)))
    with counter:
        lp, _ = policy.logprobs(mb)
        lp.sum().backward()
    policy.model.zero_grad(set_to_none=True)
    return counter


@pytest.mark.parametrize("path", ["kernel", "kernel, longest window as a tensor", "no kernel"])
def test_forward_backward_syncs_do_not_grow_with_depth(policies, monkeypatch, path):
    """The same syncs for 2 decoder layers x 2 vision blocks as for 5 x 4: none per layer or block. With images
    (several windows each) and a text-only sequence, packed plainly and as a row with shared prompts
    (query and key segments), and an image-less micro-batch (the vision keep-alive)."""
    counts = {}
    for depth, policy in policies.items():
        batch = mixed_batch(policy.adapter)
        for kind, rows, share in (("images", range(len(batch)), False), ("shared", range(len(batch)), True),
                                  ("text", [1], False)):
            mb = moved(pack(batch, list(rows), share_prompts=share), policy.device)
            counter = HostSyncs()
            context = cuda_path(monkeypatch, counter, path.endswith("tensor")) if path != "no kernel" else \
                contextlib.nullcontext()
            with context:
                counts[depth, kind] = forward_backward_syncs(policy, mb, counter).calls
    for kind in ("images", "shared", "text"):
        assert counts[(2, 2), kind] == counts[(5, 4), kind], (kind, counts[(2, 2), kind], counts[(5, 4), kind])
    if path == "kernel":  # no read at all: the boundaries, grids and placeholder counts come from the host
        assert counts[(5, 4), "images"] == counts[(5, 4), "shared"] == counts[(5, 4), "text"] == [], counts


def test_an_optimizer_step_reads_the_device_back_once(policies, monkeypatch):
    """optimizer_step over several micro-batches with images, one data-parallel rank, on the kernel's path: the
    loss, the gradient norm and the metric sums (device scalars and host floats) in one read back, after the
    clip's kernels are queued; nothing per micro-batch, no trip through the device for the one-rank sums."""
    from grpo.config import OptimConfig
    from grpo.update import PackedStep, build_optimizer, optimizer_step

    policy = policies[(2, 2)]
    batch = mixed_batch(policy.adapter)
    step = PackedStep(batch, max_tokens=40, device=policy.device)
    assert len(step.microbatches) >= 3
    step.microbatches = [moved(mb, policy.device) for mb in step.microbatches]
    optimizer = build_optimizer(policy, OptimConfig(lr=1e-3))

    def loss_fn(lp, mb, den):
        return -lp.sum() / den["tokens"], {"loss/lp_sum": lp.detach().sum(), "loss/rows": 1.0}

    counter = HostSyncs()
    counter.on_device(*policy.model.parameters(), *policy.model.buffers(), policy._dummy_vision,
                      *(getattr(mb, f.name) for mb in step.microbatches for f in dataclasses.fields(mb)))
    with cuda_path(monkeypatch, counter), counter:
        out = optimizer_step(policy, optimizer, step, loss_fn, max_tokens=40, grad_clip=1.0,
                             denominators={"tokens": 16.0})
    assert [c.split(" at ")[0] for c in counter.calls] == ["tolist"], counter.calls
    assert "update.py" in counter.calls[0]
    assert out["loss/rows"] == float(len(step.microbatches)) and out["loss/grad_norm"] > 0
    assert out["loss/total"] == pytest.approx(-out["loss/lp_sum"] / 16.0, rel=1e-5)


def test_read_floats_reads_a_device_once_in_order():
    """grpo.update.read_floats: host numbers as they are, the device's scalars in one read, in the given order,
    float64 values kept exactly."""
    from grpo.update import read_floats

    values = [1.5, torch.tensor(2.25), 3, torch.tensor(1e10 + 1, dtype=torch.float64), torch.tensor([4.0])]
    counter = HostSyncs()
    counter.on_device(values[1], values[3], values[4])
    with counter:
        got = read_floats(values)
    assert got == [1.5, 2.25, 3.0, 1e10 + 1, 4.0] and counter.count == 1, counter.calls
    assert read_floats([]) == [] and read_floats([2]) == [2.0]


def test_vision_blocks_read_their_windows_back_once(monkeypatch):
    """transformers before 5.17 hands every vision block its longest window as a fresh device tensor; the
    attention does not read it, but the windows' boundaries (the same tensor in every block), once."""
    counter = HostSyncs()
    seen = []

    def kernel(q, k, v, cu_q, cu_k, longest_q, longest_k, **kwargs):
        seen.append(longest_q)
        return q

    monkeypatch.setattr(attention, "_kernel", lambda: (kernel, {"is_causal"}))
    monkeypatch.setattr(attention, "kernel_runs", lambda device: True)
    q = torch.randn(1, 2, 11, 4)
    cu = torch.tensor([0, 4, 8, 11], dtype=torch.int32)
    counter.on_device(q, cu)
    with counter:
        for _ in range(6):
            attention.varlen_vision_attention(None, q, q, q, cu_seq_lens_q=cu, max_length_q=(cu[1:] - cu[:-1]).max())
    assert seen == [4] * 6 and counter.count == 1, counter.calls
    attention.remember_bounds(cu, [0, 4, 8, 11])  # what the family hands over when it made them on the host
    fresh = HostSyncs()
    fresh.on_device(q, cu)
    with fresh:
        attention.varlen_vision_attention(None, q, q, q, cu_seq_lens_q=cu, max_length_q=None)
    assert fresh.count == 0 and seen[-1] == 4


def test_paged_layout_reads_no_lengths_back():
    """vllm_paged attention (exact mode) lays each layer's K/V out in blocks: the table's shape comes from the
    row's boundaries on the host, not from the device's lengths in every layer."""
    k = torch.randn(11, 2, 4)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    attention.remember_bounds(cu, [0, 5, 11])
    counter = HostSyncs()
    counter.on_device(k, cu)
    with counter:
        k_cache, _, table, lengths = attention.paged_kv(k, k, cu, block=4)
    assert counter.calls == []
    assert k_cache.shape == (4, 4, 2, 4) and table.tolist() == [[0, 1], [2, 3]] and lengths.tolist() == [5, 6]


def test_the_stand_in_kernel_path_gives_sdpas_logprobs(policies, monkeypatch):
    """The counted path computes what the CPU path does: the tower's inputs from the host's grid, the packer's
    boundaries and the prebuilt (absent) masks change no result."""
    policy = policies[(2, 2)]
    batch = mixed_batch(policy.adapter)
    mb = pack(batch, list(range(len(batch)))).to(policy.device)
    with torch.no_grad():
        plain, _ = policy.logprobs(mb)
        with cuda_path(monkeypatch, HostSyncs()):
            kernel, _ = policy.logprobs(mb)
    torch.testing.assert_close(kernel, plain, atol=1e-5, rtol=0)


def test_the_tower_takes_its_grid_inputs_from_the_host(policies):
    """Qwen2.5-VL's tower gets its rotary positions, windows and their longest spans computed from the host's
    grid, bitwise the features it computes from the device's grid itself."""
    from models.attention import image_grid

    policy = policies[(5, 4)]
    a, tower = policy.adapter, policy.adapter.vision_tower(policy.model)
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 4, 6], [1, 6, 4], [1, 2, 2]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=g)
    with torch.no_grad(), image_grid(grid.tolist()):
        layout = a._vision_layout(tower, grid)
        given = a.image_features(policy.model, pixels, grid)[0]
    with torch.no_grad():
        own = a.image_features(policy.model, pixels, grid)[0]
    assert {"position_ids", "cu_seqlens", "max_seqlen", "window_index", "cu_window_seqlens",
            "max_window_seqlen"} <= layout.keys()
    assert layout["max_seqlen"] == 24 and torch.equal(given, own)


# The syncs of a forward+backward on the kernel's path, with images and without, for the families beyond Qwen2.5-VL:
# the decoder's look for packed sequences in the positions where it builds its masks whatever it is given
# (Qwen3-VL's, GLM-4.1V's; Qwen3.5's take them prebuilt, as Qwen2.5-VL's).
FAMILY_SYNCS = {"qwen3_vl": (1, 1), "qwen3_5": (0, 0), "qwen3_5_moe": (0, 0), "glm4v": (1, 1)}


@pytest.fixture(scope="module", params=sorted(FAMILY_SYNCS))
def family_policies(request, tmp_path_factory):
    """(family, its tiny model at two depths, varlen): Qwen3-VL (DeepStack levels at a quarter, half and three
    quarters of the tower), Qwen3.5 dense and MoE (Gated DeltaNet layers), GLM-4.1V."""
    family = request.param
    return family, {depth: _tiny_policy(tmp_path_factory, *depth, family, attn_implementation="varlen")
                    for depth in ((2, 2), (5, 4))}


def test_other_families_syncs_do_not_grow_with_depth(family_policies, monkeypatch):
    """Qwen3-VL, Qwen3.5 and GLM-4.1V read the device back as often at 5 decoder layers x 4 vision blocks as at
    2 x 2, and no more than `FAMILY_SYNCS` says: the towers' grid inputs (positions, boundaries, the position
    table's interpolation) come from the host's grid, their windows run in one call, Qwen3-VL's DeepStack levels
    add at indices rather than under a mask, Qwen3.5's Gated DeltaNet layers take the row's boundaries from the
    host. With images (and, where the family shares prompts, a row with shared prompts) and text only."""
    family, policies = family_policies
    counts = {}
    for depth, policy in policies.items():
        batch = mixed_batch(policy.adapter)
        kinds = [("images", range(len(batch)), False), ("text", [1], False)]
        if policy.adapter.shares_prompts:
            kinds.append(("shared", range(len(batch)), True))
        for kind, rows, share in kinds:
            mb = moved(pack(batch, list(rows), share_prompts=share), policy.device)
            counter = HostSyncs()
            with cuda_path(monkeypatch, counter):
                counts[depth, kind] = forward_backward_syncs(policy, mb, counter).calls
    for depth, kind in counts:
        assert counts[depth, kind] == counts[(5, 4), kind], (kind, counts[depth, kind], counts[(5, 4), kind])
    images, text = FAMILY_SYNCS[family]
    assert len(counts[(5, 4), "images"]) == images and len(counts[(5, 4), "text"]) == text, counts
    if ((5, 4), "shared") in counts:
        assert len(counts[(5, 4), "shared"]) == images, counts


def _logprobs_and_grads(policy, mb) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's logprobs and the gradients of a weighted sum of them."""
    policy.model.zero_grad(set_to_none=True)
    lp, _ = policy.logprobs(mb)
    (lp * torch.linspace(-1.0, 1.0, lp.numel())).sum().backward()
    grads = {n: full_value(p.grad).clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    policy.model.zero_grad(set_to_none=True)
    return lp.detach(), grads


def test_other_families_compute_bitwise_what_transformers_computes(family_policies, monkeypatch):
    """What the policy hands Qwen3-VL, Qwen3.5 and GLM-4.1V (the towers' inputs from the host's grid, the windows
    in one call, DeepStack at indices, the row's boundaries from the host) changes no logprob and no gradient, bit
    for bit, from what transformers computes from the device's tensors itself."""
    from models.families import qwen_vl
    from models.packing import PackedMicrobatch

    _, policies = family_policies
    policy = policies[(5, 4)]
    batch = mixed_batch(policy.adapter)
    mb = pack(batch, list(range(len(batch))))
    tower = policy.adapter.vision_tower(policy.model)
    assert tower.config._attn_implementation == attention.VISION_NAME
    given = _logprobs_and_grads(policy, mb)
    monkeypatch.setattr(PackedMicrobatch, "host_layout", lambda self: None)  # no grid or boundaries from the host
    monkeypatch.setattr(qwen_vl, "apply_indexed_deepstack", lambda decoder: False)  # DeepStack under the mask
    monkeypatch.setattr(tower.config, "_attn_implementation", "sdpa")  # transformers' own loop over the images
    own = _logprobs_and_grads(policy, mb)
    assert torch.equal(given[0], own[0])
    assert given[1].keys() == own[1].keys() and any(".visual." in n for n in given[1])
    assert all(torch.equal(given[1][n], own[1][n]) for n in given[1]), [n for n in given[1]
                                                                         if not torch.equal(given[1][n], own[1][n])]


def main(argv: list[str]) -> None:
    """Print the syncs of one forward+backward per path, depth (LAYERSxBLOCKS arguments) and micro-batch kind:
    python -m tests.test_host_syncs 2x2 5x4 [--family=qwen3_vl] [-v: where each is]."""
    import collections
    import tempfile
    from pathlib import Path

    class Folders:  # tmp_path_factory's one call
        @staticmethod
        def mktemp(name):
            return Path(tempfile.mkdtemp(prefix=name))

    patch = pytest.MonkeyPatch()
    family = next((a.split("=", 1)[1] for a in argv if a.startswith("--family=")), "qwen2_5_vl")
    for depth in [tuple(int(x) for x in a.split("x")) for a in argv if not a.startswith("-")]:
        policy = _tiny_policy(Folders, *depth, family, attn_implementation="varlen")
        batch = mixed_batch(policy.adapter)
        for path in ("kernel", "kernel, longest window as a tensor", "no kernel"):
            for kind, rows in (("4 sequences, 4 images", list(range(len(batch)))), ("text only", [1])):
                counter = HostSyncs()
                context = cuda_path(patch, counter, path.endswith("tensor")) if path != "no kernel" else \
                    contextlib.nullcontext()
                with context:
                    forward_backward_syncs(policy, moved(pack(batch, rows), policy.device), counter)
                patch.undo()
                print(f"{depth[0]} layers x {depth[1]} blocks | {path:36s} | {kind:21s} | {counter.count}", flush=True)
                if "-v" in argv:
                    for where, n in collections.Counter(counter.calls).most_common():
                        print(f"    {n} {where}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])


@pytest.mark.parametrize("overrides", [[], ["algorithm.policy_loss=gspo"], ["algorithm.policy_loss=cispo"],
                                       ["algorithm.policy_loss=sapo"], ["algorithm.loss_agg=seq-mean-token-sum"],
                                       ["algorithm.loss_agg=seq-mean-token-mean"],
                                       ["algorithm.rollout_correction=icepop"], ["algorithm.rollout_correction=mis"],
                                       ["algorithm.rollout_correction=seq_mask_tis"]],
                         ids=lambda o: o[0].split("=")[1] if o else "recipe")
def test_the_recipes_update_reads_the_device_back_once(tiny_model, clevr_parquet, tmp_path, monkeypatch, overrides):
    """The recipe's path from the reference pass through the update (one epoch, the old logprobs from the update's
    own forward, no mismatch mask, a reference model's KL in the loss): the advantages and the token counts are
    made on the host and queued, and the loss's sums stay on the device, so the device is read back once, in the
    optimizer step; nothing makes the update's first forward wait for the reference pass. The same
    for the other policy losses, loss aggregations and rollout corrections."""
    from grpo.config import load_config
    from grpo.trainer import Trainer
    from grpo.update import PackedStep, packed_logprobs
    from models.parallel import init_distributed

    init_distributed()
    trainer = Trainer(load_config("configs/clevr_qwen2_5_vl_3b.yaml", [  # its algorithm, the tiny model, on the CPU
        f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", "data.eval_path=", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "data.min_pixels=3136", "data.max_pixels=3136",
        f"trainer.run_dir={tmp_path / 'run'}", "logging.tensorboard=false", "checkpoint.resume=never",
        "optim.max_tokens_per_microbatch=96", "model.vision_once=on", "model.attn_implementation=varlen",
        *overrides]))
    assert trainer._old_logprobs_from_update() and trainer.ref is not None  # algorithm.kl_coef's reference
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 500, (n,), generator=g) for n in (5, 9, 7, 3)]
    batch = trainer._sequence_batch(trainer.feeder.next(2), responses, [0, 0, 1, 1])
    counter = HostSyncs()
    anchor = torch.zeros(1)
    counter.on_device(anchor)
    with counter:
        device = anchor.device  # a device object the counter takes for the GPU's
    step = PackedStep(batch, 96, device)
    assert len(step.microbatches) > 1
    step.microbatches = [moved(mb, device) for mb in step.microbatches]
    step.set_per_token("engine_logprobs", [-torch.rand(r.numel(), generator=g) * 8 for r in responses])
    for policy in (trainer.policy, trainer.ref):
        counter.on_device(*policy.model.parameters(), *policy.model.buffers())
    counter.on_device(*(getattr(mb, f.name) for mb in step.microbatches for f in dataclasses.fields(mb)),
                      *(v for _, f in step for v in f.values()))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    with cuda_path(monkeypatch, counter), counter:  # the reference pass, the advantages, the update
        packed_logprobs(trainer.ref, step, "ref_logprobs", 1.0)
        step.set_per_sequence("advantages", advantages)
        out = trainer._ppo_update(step, old_from_update=True)
    assert [c.split(" at ")[0] for c in counter.calls] == ["tolist"], counter.calls
    assert "update.py" in counter.calls[0]  # optimizer_step's one read of the loss, norm and sums
    assert out["loss/kl"] == 0.0  # the reference is the policy before this update
    # something was learned (seq_mask_tis may mask every sequence against these made-up engine logprobs)
    assert out["loss/grad_norm"] > 0 or overrides == ["algorithm.rollout_correction=seq_mask_tis"]
    assert all(torch.isfinite(v).all() and v.numel() for v in step.per_sample("ref_logprobs"))
    # the per-token advantages are the per-sample ones broadcast over each sample's scored tokens
    for i, values in enumerate(step.per_sample("advantages")):
        assert values.numel() == int(batch["loss_mask"].items[i][1:].sum()) > 0
        assert torch.equal(values, torch.full_like(values, float(advantages[i])))
    assert step.scored_counts() == (float(sum(r.numel() for r in responses)), 4.0)
