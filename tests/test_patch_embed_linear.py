"""The vision patch embedding's Conv3d (stride = kernel) runs as one matmul over each flattened window, as vLLM's
Conv3dLayer computes it: the same values and gradients as the convolution, other inputs still convolved."""

import pytest
import torch
from torch import nn

from models.policy import conv3d_windows_as_linear


@pytest.mark.parametrize("bias", [False, True])
def test_a_window_per_item_is_one_matmul_with_the_convolutions_values_and_gradients(bias):
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 16, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=bias).double()
    reference = nn.Conv3d(3, 16, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=bias).double()
    reference.load_state_dict(conv.state_dict())
    model = nn.Sequential(conv)
    assert conv3d_windows_as_linear(model) == 1
    x = torch.randn(37, 3, 2, 14, 14, dtype=torch.float64)
    calls = []
    conv.register_forward_hook(lambda *a: calls.append(1))
    out, ref = conv(x), reference(x)
    assert out.shape == ref.shape == (37, 16, 1, 1, 1) and calls
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(conv.weight.grad, reference.weight.grad, rtol=1e-10, atol=1e-12)
    # larger inputs (several windows an item) keep the convolution
    big = torch.randn(2, 3, 4, 28, 28, dtype=torch.float64)
    torch.testing.assert_close(conv(big), reference(big), rtol=1e-12, atol=1e-12)


def test_only_non_overlapping_plain_convolutions_are_routed():
    model = nn.ModuleList([nn.Conv3d(3, 8, 2, stride=1), nn.Conv3d(3, 8, 2, stride=2, padding=1),
                           nn.Conv3d(4, 8, 2, stride=2, groups=2), nn.Conv3d(3, 8, 2, stride=2)])
    assert conv3d_windows_as_linear(model) == 1


def test_the_policy_routes_the_qwen_vl_patch_embedding(tiny_model):
    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    policy = build_policy(ModelConfig(path=str(tiny_model), dtype="float32"), build_parallel_dims())
    convs = [m for m in policy.model.modules() if isinstance(m, nn.Conv3d)]
    assert convs and all(m.forward.__name__ == "forward" and "_windows_as_linear" in m.forward.__qualname__
                         for m in convs)
