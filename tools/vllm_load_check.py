"""Build vLLM's own model of a checkpoint on CPU, refit it as the engine does, and compare vision features.

For one model folder it constructs vLLM 0.26's model class the way the engine's worker does
(float32 here), then checks:

  refit     the policy's tensors (transformers' in-memory names, as `Policy.full_state_dict` sends
            them) go through the engine's own refit code (`vllm_engine.refit_stream` into the
            model's `load_weights`, then `check_loaded`): vLLM must load exactly the parameters the
            name table predicts; then every tensor read back (`vllm_engine._read_params`, as
            `VLLMEngine.read_weights`) must equal what was sent, bit for bit. The same for the
            checkpoint file's names. Every parameter is set to NaN before each refit, so a tensor
            that reads back equal was written by that refit, and a parameter (or part of one) that
            no refit tensor reaches is reported (`unwritten`): in the engine it would stay stale.
  features  a trainer prompt's images (1 and 2 images of different shapes) through vLLM's processor
            and its model's `embed_multimodal`, against the policy's image features
            (`FamilyAdapter.image_features`) on the trainer's pixels: the vision tower, the
            projector and, for Gemma3, the soft-embedding norm, as each side implements them.

What it cannot check is the language model's forward: vLLM's attention runs only through its
compiled kernels. One JSON line per check on stdout; the exit status is 1 if any check failed.

    python tools/vllm_load_check.py --model /tmp/vcpu/gemma3

Runs where `tools/vllm_prompt_check.py` runs (vLLM's Python code and its pure-Python
dependencies, no compiled extension, no GPU). In this process only, `_patch_cpu_model` makes
vLLM's CPU platform the current one and gives the compiled activation and norm ops it looks up
while building layers a placeholder that raises if called (the checks never call them),
turns off pinned host memory, which needs a GPU driver, and answers the free-memory query Gemma4's
image encoder makes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.vllm_prompt_check import MAX_PIXELS, MIN_PIXELS, _images, _patch_vllm, build_vllm_processor  # noqa: E402

# Compiled ops vLLM's layers look up when built (activations, norms, rotary embedding caches).
_PLACEHOLDER_OPS = ("_and_mul", "gelu", "silu", "norm", "rotary", "quick")


def _patch_cpu_model() -> list[str]:
    import torch._ops as ops

    lookup = ops._OpNamespace.__getattr__

    def placeholder_lookup(namespace, name):
        try:
            return lookup(namespace, name)
        except AttributeError:
            # Quantization ops stay missing: vLLM probes for them with hasattr and must see False.
            if name.startswith("__") or "quant" in name or not any(k in name for k in _PLACEHOLDER_OPS):
                raise

            def missing(*args, **kwargs):
                raise RuntimeError(f"the compiled op {name} is not available without vLLM's extensions")

            return missing

    ops._OpNamespace.__getattr__ = placeholder_lookup
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    patched = ["vLLM CPU platform", "placeholders for compiled activation/norm ops"]
    import torch

    if not torch.accelerator.is_available():
        # Gemma4's image encoder sizes its batches from the accelerator's free memory
        # (gemma4_mm.py `_process_image_input`); without one, report 16 GiB of 32 free.
        torch.accelerator.get_memory_info = lambda *args, **kwargs: (16 * 1024**3, 32 * 1024**3)
        patched.append("torch.accelerator.get_memory_info without an accelerator")
    return patched


def build_vllm_model(config):
    """vLLM's model for a `ModelConfig`, on CPU, in a world of one (gloo)."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config = VllmConfig(model_config=config, device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            port = os.environ.get("VLLM_LOAD_CHECK_PORT", "29517")
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
            initialize_model_parallel(1, 1)
        with set_default_torch_dtype(config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
    # Pinned host memory needs a GPU driver; the flag was read when vLLM was imported.
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "PIN_MEMORY", False) is True:
            module.PIN_MEMORY = False
    return vllm_config, model.eval()


def check_refit(model, family: str, model_config: dict, named: dict, label: str) -> dict:
    """The engine's refit of `named` into vLLM's model, then its read-back, compared bitwise."""
    import torch

    from rollout.vllm_engine import _read_params, check_loaded, head_is_embedding, load_into, refit_stream
    from rollout.weight_names import VLLMSkips, vllm_param_for

    skips = VLLMSkips.for_config(family, model_config)
    out = {"check": f"refit_{label}", "tensors": len(named)}
    try:
        tied = head_is_embedding(model, family)
        expected, skipped = set(), {}
        with torch.no_grad():
            _poison(model)
            loaded = load_into(model, refit_stream(family, skips, tied, named.items(), expected, skipped))
        unwritten = _poisoned(model)
        check_loaded(loaded, expected)
        targets = [(name, *vllm_param_for(family, name)) for name in named if skips.reason(family, name) is None]
        back = _read_params(model, targets)
    except Exception as err:  # noqa: BLE001 - reported as this check's failure
        return {**out, "ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    wrong = [n for n, _, _ in targets if back[n].shape != named[n].shape or not torch.equal(back[n], named[n])]
    out.update(tied_head=tied, loaded=len(loaded), skipped=len(skipped), read_back=len(back),
               read_back_wrong=wrong[:5], unwritten=unwritten[:5], ok=not wrong and not unwritten)
    return out


def _poison(model) -> None:
    """Fill every floating-point parameter of vLLM's model with NaN before a refit, so that a tensor
    reading back equal was written by this refit (not left from the last one, or from a loader that
    skipped it), and any part of a parameter the refit did not write stays NaN."""
    for param in model.parameters():
        if param.is_floating_point():
            param.data.fill_(float("nan"))


def _poisoned(model) -> list[str]:
    """The parameters still holding a NaN of `_poison` after the refit: in the engine they would keep
    their start-up values while the policy trains."""
    import torch

    return [name for name, param in model.named_parameters()
            if param.is_floating_point() and torch.isnan(param.data).any()]


def check_features(processor, vllm_config, model, policy, trainer_processor, adapter, vocab, count: int,
                   task: str) -> dict:
    """vLLM's image embeddings for a trainer prompt's images vs the policy's image features."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.multimodal.processing import ProcessorInputs
    from vllm.multimodal.processing.context import TimingContext

    from data.datasets import Sample
    from data.processing import encode_prompt

    sample = Sample(0, _images(count), " and ".join(["<image>"] * count) + " How many objects?", "3")
    encoded = encode_prompt(trainer_processor, sample, task, vllm_config.model_config.max_model_len)
    out = {"check": f"features_{count}_images"}
    try:
        collapsed, _ = adapter.vllm_collapse(encoded.input_ids.tolist(), vocab)
        items = processor.info.parse_mm_data({"image": list(encoded.images)})
        result = processor.apply(ProcessorInputs(prompt=collapsed, mm_data_items=items),
                                 timing_ctx=TimingContext(enabled=False))
        with torch.no_grad(), set_current_vllm_config(vllm_config):
            theirs = torch.cat([e.float() for e in model.embed_multimodal(**result["mm_kwargs"].get_data())])
            streams = adapter.image_features(policy, encoded.pixel_values, encoded.image_grid_thw)
    except Exception as err:  # noqa: BLE001 - reported as this check's failure
        import traceback

        traceback.print_exc()
        return {**out, "ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    ours = torch.cat([s.reshape(-1, s.shape[-1]).float() for s in streams], dim=-1)
    out.update(shape_policy=list(ours.shape), shape_vllm=list(theirs.shape))
    if ours.shape != theirs.shape:
        return {**out, "ok": False}
    diff = (ours - theirs).abs().max().item()
    scale = ours.abs().max().item()
    # float32 on both sides: only summation order differs (e.g. fused q/k/v, sdpa vs eager attention).
    out.update(max_abs_diff=diff, max_abs=scale, ok=diff <= 1e-4 * max(scale, 1.0))
    return out


def run_checks(model: str, max_images: int = 2, task: str = "clevr") -> list[dict]:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    from data.processing import load_processor
    from models.family import build_adapter
    from rollout.vllm_engine import read_config

    model_config = read_config(model)
    family = model_config["model_type"]
    adapter = build_adapter(AutoConfig.from_pretrained(model, local_files_only=True))
    kwargs = adapter.vllm_processor_kwargs(MIN_PIXELS, MAX_PIXELS)
    setup = {"check": "setup", "family": family, "model": model, "patched": _patch_vllm(family) + _patch_cpu_model()}
    results = [setup]
    try:
        config, processor = build_vllm_processor(model, kwargs, max_images,
                                                 hf_overrides=adapter.vllm_engine_kwargs().get("hf_overrides"))
        vllm_config, vllm_model = build_vllm_model(config)
    except Exception as err:  # noqa: BLE001 - vLLM's config validation and model construction raise here
        setup.update(ok=False, error=f"{type(err).__name__}: {err}"[:2000])
        return results
    setup.update(vllm_model=type(vllm_model).__name__, ok=True)
    policy = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32, local_files_only=True).eval()
    in_memory = {name: t.detach().clone() for name, t in policy.state_dict().items()}
    results.append(check_refit(vllm_model, family, model_config, in_memory, "module_names"))
    results.append(check_refit(vllm_model, family, model_config, load_file(str(Path(model) / "model.safetensors")),
                               "file_names"))
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    # What vLLM's loader does once weights are in (on CPU it picks the linear layers' kernels).
    process_weights_after_loading(vllm_model, config, torch.device("cpu"))
    trainer_processor = load_processor(model)
    vocab = trainer_processor.tokenizer.get_vocab()
    for count in range(1, max_images + 1):
        results.append(check_features(processor, vllm_config, vllm_model, policy, trainer_processor, adapter,
                                      vocab, count, task))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder (e.g. from tools/make_tiny_model.py)")
    parser.add_argument("--max-images", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout holds the JSON lines only
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = run_checks(args.model, args.max_images)
    for r in results:
        print(json.dumps(r, default=str), flush=True)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
