"""model.liger_kernel: auto/true/false in the config, what auto settles to for a device, a family and an installed
package (the kernels themselves are Triton: CUDA only), what the policy asks of liger's apply function (against a
stand-in module: rotary only where liger has a kernel for the family), and the settled value the run's config.yaml
records."""

import importlib.machinery
import logging
import sys
import types

import pytest
import torch
import yaml

from grpo.config import ConfigError, load_config, save_config
from models import policy as policy_module
from models.policy import LIGER_MEASURED_FAMILIES, apply_liger_kernels, liger_patch, uses_liger
from tools.loop_summary import read_settings


# --- config ---------------------------------------------------------------------------------------------------------
def test_auto_is_the_default_and_booleans_read_as_true_and_false(tmp_path):
    assert load_config(None, []).model.liger_kernel == "auto"
    assert load_config(None, ["model.liger_kernel=true"]).model.liger_kernel == "true"
    assert load_config(None, ["model.liger_kernel=false"]).model.liger_kernel == "false"
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  liger_kernel: true\n")
    assert load_config(str(path)).model.liger_kernel == "true"
    with pytest.raises(ConfigError, match=r"model.liger_kernel.*one of 'auto', 'true', 'false'"):
        load_config(None, ["model.liger_kernel=sometimes"])


@pytest.mark.parametrize("overrides", [["rollout.exact=true"], ["model.compile=true"]])
def test_auto_settles_off_under_exact_and_compile(overrides):
    assert load_config(None, overrides).model.liger_kernel == "false"
    assert load_config(None, [*overrides, "model.liger_kernel=false"]).model.liger_kernel == "false"


def test_true_with_compile_names_both_keys():
    with pytest.raises(ConfigError, match=r"'model.liger_kernel' and 'model.compile' are both true.*dynamo.*"
                                          r"LigerRMSNormFunction.*set one of them to false"):
        load_config(None, ["model.liger_kernel=true", "model.compile=true"])
    assert load_config(None, ["model.liger_kernel=false", "model.compile=true"]).model.compile


def test_true_with_exact_is_refused():
    with pytest.raises(ConfigError, match=r"'model.liger_kernel' is true; it needs auto or false .* rollout.exact"):
        load_config(None, ["rollout.exact=true", "model.liger_kernel=true"])


def test_settled_value_round_trips_and_reads_as_a_boolean_in_the_summary(tmp_path):
    for word, meaning in (("true", True), ("false", False)):
        cfg = load_config(None, [f"model.liger_kernel={word}"])
        save_config(cfg, tmp_path / "config.yaml")
        assert load_config(str(tmp_path / "config.yaml")) == cfg
        assert read_settings(tmp_path / "config.yaml")["liger_kernel"] is meaning
    (tmp_path / "old.yaml").write_text("model:\n  liger_kernel: true\n")  # a run from before auto: a boolean
    assert read_settings(tmp_path / "old.yaml")["liger_kernel"] is True


# --- what auto settles to -------------------------------------------------------------------------------------------
def test_auto_takes_liger_only_on_cuda_for_a_measured_family_with_the_package():
    assert LIGER_MEASURED_FAMILIES == {"qwen2_5_vl"}
    assert uses_liger("auto", "qwen2_5_vl", "cuda", importable=True)
    assert not uses_liger("auto", "qwen2_5_vl", "cpu", importable=True)
    assert not uses_liger("auto", "qwen2_vl", "cuda", importable=True)  # liger has kernels for it, not measured
    assert not uses_liger("auto", "qwen3_vl", "cuda", importable=True)
    assert not uses_liger("auto", "qwen2_5_vl", "cuda", importable=False)


@pytest.mark.parametrize("setting, expected", [("true", True), (True, True), ("false", False), (False, False)])
def test_true_and_false_decide_alone(setting, expected):
    for device, family, importable in (("cpu", "llava", False), ("cuda", "qwen2_5_vl", True)):
        assert uses_liger(setting, family, device, importable) is expected


def test_missing_package_on_a_measured_gpu_says_how_to_install_it_once(caplog):
    with caplog.at_level(logging.INFO, logger="vlrl"):
        uses_liger("auto", "qwen2_5_vl", "cuda", importable=False, hint=True)
        uses_liger("auto", "qwen2_5_vl", "cuda", importable=False)  # the reference's build: no second line
        uses_liger("auto", "qwen2_5_vl", "cpu", importable=False, hint=True)  # not measured off CUDA: nothing
        uses_liger("auto", "qwen2_vl", "cuda", importable=False, hint=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pip install -e .[liger]" in lines[0] and "2.87 -> 2.65 s" in lines[0]


# --- what the policy asks of liger ----------------------------------------------------------------------------------
class FakeLiger(types.ModuleType):
    """A stand-in for liger_kernel.transformers.monkey_patch (the package is not installed for the CPU tests): apply
    functions with liger 0.8.5's signatures that record what they are given. Qwen3.5's (and Qwen3.5-MoE's) refuses
    rope=True as liger's does; `swap`, where set, is called with (rms_norm, swiglu) as liger's class swaps."""

    def __init__(self):
        super().__init__("liger_kernel.transformers.monkey_patch")
        self.calls: list[tuple[str, dict]] = []
        self.swap = None
        self.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen2_5_vl": self.qwen2_5_vl, "qwen3_5": self.qwen3_5,
                                             "qwen3_5_moe": self.qwen3_5, "llava": self.llava,
                                             "gemma3": self.gemma3}

    def qwen2_5_vl(self, rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                   model=None):
        self.calls.append(("qwen2_5_vl", {"rope": rope, "cross_entropy": cross_entropy, "rms_norm": rms_norm,
                                          "fused_linear_cross_entropy": fused_linear_cross_entropy, "swiglu": swiglu}))

    def qwen3_5(self, rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                model=None):
        assert not (cross_entropy and fused_linear_cross_entropy)
        if rope:
            raise NotImplementedError("liger_rotary_pos_emb is not available for Qwen3_5 models.")
        self.calls.append(("qwen3_5", {"rope": rope, "cross_entropy": cross_entropy, "rms_norm": rms_norm,
                                       "fused_linear_cross_entropy": fused_linear_cross_entropy, "swiglu": swiglu}))
        if self.swap is not None:
            self.swap(rms_norm, swiglu)

    def gemma3(self, rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True,
               model=None):
        self.calls.append(("gemma3", {"rope": rope, "cross_entropy": cross_entropy, "rms_norm": rms_norm,
                                      "fused_linear_cross_entropy": fused_linear_cross_entropy, "geglu": geglu}))

    def llava(self, cross_entropy=False, fused_linear_cross_entropy=True, model=None, **kwargs):
        self.calls.append(("llava", {"cross_entropy": cross_entropy,
                                     "fused_linear_cross_entropy": fused_linear_cross_entropy, **kwargs}))


@pytest.fixture
def fake_liger(monkeypatch) -> FakeLiger:
    fake = FakeLiger()
    for name in ("liger_kernel", "liger_kernel.transformers"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # what importlib.util.find_spec reads
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    return fake


FUSED = {"rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}


def test_rotary_is_fused_where_liger_has_a_kernel_for_it(fake_liger, caplog):
    with caplog.at_level(logging.INFO, logger="vlrl"):
        apply, kwargs = liger_patch("qwen2_5_vl", hint=True)
    assert kwargs == {**FUSED, "rope": True} and caplog.records == []
    apply(**kwargs)
    assert fake_liger.calls == [("qwen2_5_vl", kwargs)]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_gets_rms_norm_and_swiglu_and_one_line_saying_rotary_stays_unfused(fake_liger, caplog, family):
    apply, _ = liger_patch(family)
    with pytest.raises(NotImplementedError):  # what the call with rope=True met
        apply(rope=True, **FUSED)
    with caplog.at_level(logging.INFO, logger="vlrl"):
        apply, kwargs = liger_patch(family, hint=True)
        liger_patch(family)  # the reference model's build: no second line
    assert kwargs == {**FUSED, "rope": False}
    apply(**kwargs)
    assert fake_liger.calls == [("qwen3_5", kwargs)]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"model type '{family}'" in lines[0] and "rotary embedding stays unfused" in lines[0]


def test_an_apply_function_without_rope_is_not_given_it(fake_liger):
    apply, kwargs = liger_patch("llava")
    assert kwargs == FUSED
    apply(**kwargs)
    assert fake_liger.calls == [("llava", FUSED)]


def test_liger_mlp_false_asks_for_no_gated_mlp_under_either_name(fake_liger, monkeypatch):
    """model.liger_mlp=false: liger is asked for its RMSNorm and rotary but not its SwiGLU (GeGLU for Gemma)."""
    monkeypatch.setattr(policy_module, "route_rotary_to_liger", lambda model_type: None)  # liger's rope module
    apply_liger_kernels("qwen2_5_vl", "cuda", gated_mlp=False)
    apply_liger_kernels("gemma3", "cuda", gated_mlp=False)
    (_, qwen), (_, gemma) = fake_liger.calls
    assert qwen["swiglu"] is False and qwen["rms_norm"] and qwen["rope"]
    assert gemma["geglu"] is False and "swiglu" not in gemma and gemma["rms_norm"]


def test_gemma_gets_its_gelu_gated_mlp_fused_under_geglu(fake_liger):
    apply, kwargs = liger_patch("gemma3")
    assert kwargs == {"rms_norm": True, "geglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False,
                      "rope": True}
    apply(**kwargs)  # liger's Gemma function takes no swiglu: a TypeError if it were passed
    assert fake_liger.calls == [("gemma3", kwargs)]


def test_a_missing_family_or_package_is_named(fake_liger, monkeypatch):
    with pytest.raises(RuntimeError, match="liger-kernel has no kernels for model type 'smolvlm'"):
        liger_patch("smolvlm")
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # an import of it fails
    with pytest.raises(RuntimeError, match=r"needs the liger-kernel package: pip install -e \.\[liger\]"):
        liger_patch("qwen2_5_vl")


def test_true_on_cpu_still_raises(fake_liger):
    for family in ("qwen2_5_vl", "qwen3_5"):
        with pytest.raises(RuntimeError, match="model.liger_kernel=true needs CUDA"):
            apply_liger_kernels(family, "cpu")
    assert fake_liger.calls == []  # refused before liger is asked


@pytest.mark.parametrize("mlp", [True, False])
def test_qwen3_5_policy_is_built_from_the_swapped_classes(fake_liger, monkeypatch, tmp_path_factory, mlp):
    """liger swaps the classes in transformers' modeling module; the policy's model is built after the swap, so
    every decoder RMSNorm (the layers', q/k norms, the final one) and MLP is liger's, and nothing else is. With
    model.liger_mlp=false liger is not asked for its SwiGLU and the MLPs stay the family's own."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tools.make_tiny_model import make_tiny_model

    class FusedNorm(modeling.Qwen3_5RMSNorm):
        pass

    class FusedMLP(modeling.Qwen3_5MLP):
        pass

    def swap(rms_norm, swiglu):  # liger's swaps, undone after the test
        if rms_norm:
            monkeypatch.setattr(modeling, "Qwen3_5RMSNorm", FusedNorm)
        if swiglu:
            monkeypatch.setattr(modeling, "Qwen3_5MLP", FusedMLP)

    real = policy_module.apply_liger_kernels

    def without_the_cuda_check(model_type, device_type, **kwargs):
        real(model_type, "cuda", **kwargs)

    fake_liger.swap = swap
    monkeypatch.setattr(policy_module, "apply_liger_kernels", without_the_cuda_check)
    folder = make_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_5", family="qwen3_5", size="tiny", seed=0)
    init_distributed()
    policy = build_policy(ModelConfig(path=str(folder), dtype="float32", attn_implementation="sdpa",
                                      liger_kernel="true", liger_mlp=mlp), build_parallel_dims())
    assert policy.liger_kernel and fake_liger.calls == [("qwen3_5", {**FUSED, "rope": False, "swiglu": mlp})]
    decoder = policy.adapter.language_model(policy.model)
    layers = list(decoder.layers)
    assert {layer.block_type for layer in layers} == {"linear_attention", "full_attention"}
    norms = [decoder.norm] + [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms += [m for layer in layers if hasattr(layer, "self_attn")
              for m in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
    assert all(type(m) is FusedNorm for m in norms)
    assert all((type(layer.mlp) is FusedMLP) == mlp for layer in layers)
    swapped = [n for n, m in policy.model.named_modules() if isinstance(m, (FusedNorm, FusedMLP))]
    # the vision tower and the Gated DeltaNet's gated norm keep theirs
    assert len(swapped) == len(norms) + mlp * len(layers)


def test_torch_rms_norm_leaves_liger_the_rest(fake_liger, monkeypatch):
    """model.torch_rms_norm with liger: liger is asked for its SwiGLU and rotary but not its RMSNorm."""
    from models.policy import apply_liger_kernels

    monkeypatch.setattr(policy_module, "route_rotary_to_liger", lambda model_type: None)  # liger's rope module
    apply_liger_kernels("qwen2_5_vl", "cuda", rms_norm=False)
    apply_liger_kernels("qwen2_5_vl", "cuda")
    assert [c[1]["rms_norm"] for c in fake_liger.calls] == [False, True]
    assert all(c[1]["swiglu"] for c in fake_liger.calls)



def test_torch_rms_norm_routes_liger_s_llama_norm():
    """A process that built a policy with liger's RMSNorm builds later models with it (liger replaces the class in
    transformers' module): model.torch_rms_norm routes those too where they compute the same function (no offset,
    llama casting), and leaves Gemma's (offset 1) alone; the routed norm gives the module's output."""
    from models.policy import route_rms_norms_to_torch

    class LigerRMSNorm(torch.nn.Module):  # liger's attributes, the llama-cast forward
        def __init__(self, width, offset=0.0, casting_mode="llama"):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)
            self.variance_epsilon, self.offset, self.casting_mode = 1e-6, offset, casting_mode

        def forward(self, x):
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.offset + self.weight) * normed.to(x.dtype)

    llama, gemma, cast = LigerRMSNorm(16), LigerRMSNorm(16, offset=1.0, casting_mode="gemma"), LigerRMSNorm(16)
    cast.casting_mode = "none"
    block = torch.nn.ModuleList([llama, gemma, cast])
    x = torch.randn(3, 16)
    expected = llama(x)
    calls = []
    handle = torch.nn.functional.rms_norm
    torch.nn.functional.rms_norm = lambda *a, **k: calls.append(1) or handle(*a, **k)
    try:
        assert route_rms_norms_to_torch(block) == 1
        assert "forward" in llama.__dict__ and "forward" not in gemma.__dict__ and "forward" not in cast.__dict__
        torch.testing.assert_close(llama(x), expected, atol=1e-6, rtol=1e-6)
        gemma(x)
    finally:
        torch.nn.functional.rms_norm = handle
    assert calls == [1]


# --- the trainer ----------------------------------------------------------------------------------------------------
def _trainer_cfg(tiny_model, clevr_parquet, run_dir, overrides=()):
    return load_config(None, [
        "trainer.mode=grpo", f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "data.min_pixels=3136", "data.max_pixels=3136",
        f"trainer.run_dir={run_dir}", "logging.tensorboard=false", "checkpoint.resume=never", *overrides,
    ])


ON_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's settling (on CUDA auto may take liger)")


@ON_CPU
def test_auto_on_cpu_builds_without_liger_and_records_false(tiny_model, clevr_parquet, tmp_path, capsys):
    from grpo.trainer import Trainer
    from models.parallel import init_distributed

    init_distributed()
    trainer = Trainer(_trainer_cfg(tiny_model, clevr_parquet, tmp_path / "run"))
    try:
        assert trainer.policy.liger_kernel is False and trainer.cfg.model.liger_kernel == "false"
        saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
        assert saved["model"]["liger_kernel"] == "false"  # what ran, not auto
        # model.torch_rms_norm and model.flash_direct: auto is on CUDA only
        assert saved["model"]["torch_rms_norm"] == "false" and saved["model"]["flash_direct"] == "false"
        assert trainer.policy.torch_rms_norms == 0 and trainer.policy.flash_direct is False
        settings = read_settings(tmp_path / "run" / "config.yaml")
        assert settings["liger_kernel"] is False and settings["torch_rms_norm"] is False
        assert settings["flash_direct"] is False
        out = capsys.readouterr().out
        assert "liger kernels: off (model.liger_kernel=auto)" in out
    finally:
        trainer.rollouts.close()


@ON_CPU
def test_true_on_cpu_fails_building_the_policy(tiny_model, clevr_parquet, tmp_path):
    from grpo.trainer import Trainer
    from models.parallel import init_distributed

    init_distributed()
    with pytest.raises(RuntimeError, match=r"model.liger_kernel=true needs CUDA .* set it to auto or false"):
        Trainer(_trainer_cfg(tiny_model, clevr_parquet, tmp_path / "run", ["model.liger_kernel=true"]))


def test_qwen2_5_vl_s_rotary_calls_reach_liger_s_kernels(fake_liger, monkeypatch, tiny_model):
    """liger's Qwen2.5-VL function replaces `apply_multimodal_rotary_pos_emb`, which transformers 5.x's attention no
    longer calls; the policy routes the decoder's `apply_rotary_pos_emb` and the tower's `apply_rotary_pos_emb_vision`
    to liger's kernels itself (stand-ins here that count their calls and compute transformers' own formula)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as modeling

    from grpo.config import ModelConfig
    from models.packing import pack
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import LIGER_ROTARY, build_policy
    from tests.test_packing import mixed_batch

    assert "qwen2_5_vl" in LIGER_ROTARY
    for name in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_vision", "apply_multimodal_rotary_pos_emb"):
        if hasattr(modeling, name):
            monkeypatch.setattr(modeling, name, getattr(modeling, name))  # put back after the test
    plain, vision = modeling.apply_rotary_pos_emb, modeling.apply_rotary_pos_emb_vision
    calls = {"decoder": 0, "vision": 0}

    def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        calls["decoder"] += 1
        return plain(q, k, cos, sin, unsqueeze_dim)

    def rope_vision(q, k, cos, sin):
        calls["vision"] += 1
        return vision(q, k, cos, sin)

    rope_module = types.ModuleType("liger_kernel.transformers.rope")
    rope_module.liger_rotary_pos_emb, rope_module.liger_rotary_pos_emb_vision = rope, rope_vision
    monkeypatch.setitem(sys.modules, rope_module.__name__, rope_module)
    init_distributed()
    dims = build_parallel_dims()
    reference = build_policy(ModelConfig(path=str(tiny_model), dtype="float32", attn_implementation="sdpa"), dims)
    batch = mixed_batch(reference.adapter)
    packed = pack(batch, list(range(len(batch))))
    with torch.no_grad():
        want = reference.logprobs(packed)[0]  # transformers' own rotary functions
    on_cuda = policy_module.apply_liger_kernels  # the whole function, as on a GPU
    monkeypatch.setattr(policy_module, "apply_liger_kernels",
                        lambda model_type, device_type, **kwargs: on_cuda(model_type, "cuda", **kwargs))
    fused = build_policy(ModelConfig(path=str(tiny_model), dtype="float32", attn_implementation="sdpa",
                                     liger_kernel="true"), dims)
    assert modeling.apply_rotary_pos_emb is rope and modeling.apply_rotary_pos_emb_vision is rope_vision
    assert calls == {"decoder": 0, "vision": 0}
    with torch.no_grad():
        got = fused.logprobs(packed)[0]
    layers = len(list(fused.adapter.language_model(fused.model).layers))
    assert calls["decoder"] == layers and calls["vision"] > 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
