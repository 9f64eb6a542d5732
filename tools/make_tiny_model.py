"""Build tiny offline VLM checkpoints laid out like hub checkpoints.

    python tools/make_tiny_model.py --family qwen2_5_vl --size tiny --out /tmp/tiny-qwen2_5_vl
    python tools/make_tiny_model.py --family qwen2_vl --size demo --out ckpt/demo --seed 3
    python tools/make_tiny_model.py --family gemma3 --size tiny --out /tmp/tiny-gemma3
    python tools/make_tiny_model.py --family gemma4 --size tiny --out /tmp/tiny-gemma4

Families: every registered family (`models.family.FAMILIES`); each family's module says what its
tiny checkpoint is made of (`models.families.tiny.TinySpec`: classes, tokens, chat-template image
part, config and image processor from a size). Every family's
chat template lays turns out as ChatML does (`<|im_start|>` + role, a newline, the message),
but ends each turn with the family's own end-of-turn token (`<|im_end|>` for Qwen, `</s>` for
LLaVA, `<end_of_utterance>` for SmolVLM, `<end_of_turn>` for Gemma3), so stopping and SFT
targets follow the family as they do with real checkpoints; the tokenizer's eos and
generation_config.json stay Qwen's (`<|im_end|>`, `<|endoftext|>`) for every family. The image
part of the template and its special tokens are the family's own
(`<|vision_start|><|image_pad|><|vision_end|>`, `<image>`, `<start_of_image>`), expanded by
`data.processing` exactly as the family's processor does.
The Qwen-specific details below (hub weight names, mrope, window attention) apply to the
Qwen families; LLaVA and Gemma3 save in their pre-4.52 hub layout (`language_model.*`,
`vision_tower.*`, `multi_modal_projector.*`), Idefics3 in its only one (`model.text_model.*`,
`model.vision_model.*`, `model.connector.*`). Fixed-size families take square images of
twice the size's minimum side (56 pixels tiny, 112 demo); Idefics3 tiles images up to two
tiles a side plus a global tile; the tiny Gemma3 pools each image to 4 soft tokens and
keeps lm_head untied; the tiny Gemma4 has four decoder layers whatever the size (the last two
reuse the first two's keys and values), 8-pixel patches pooled 2x2 under a 70-soft-token budget
(a 56x56 image is brought to 128x128, 64 soft tokens) and an untied lm_head.

or, from Python, `make_tiny_model(out, family="qwen2_5_vl", size="tiny", seed=0)`.

The folder holds what a hub checkpoint of the family holds, written by transformers'
own classes; nothing is downloaded:

- `config.json`: the family's config class (model_type qwen2_vl / qwen2_5_vl), token
  ids taken from the tokenizer below;
- `generation_config.json`: token ids only (eos = <|im_end|>, <|endoftext|>; pad), no
  sampling defaults, so an engine that reads it does not change temperature or penalties;
- `model.safetensors`: random weights from `save_pretrained`, which in transformers 5
  names them as the hub checkpoints do (`model.embed_tokens.*`, `model.layers.*`,
  `model.norm.*`, `visual.*`, `lm_head.*`); loaded, they become `model.language_model.*`,
  `model.visual.*`, `lm_head.*`, and `--weight-names current` writes those names instead;
- `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`: the tokenizer below
  and a chat template that behaves like the Qwen2-VL one;
- `preprocessor_config.json` (flat, as on the hub) and `processor_config.json` (nested,
  as transformers 5 writes it): the family's image processor and processor class.

The tokenizer is a byte-level BPE trained here with `tokenizers` on the corpus of
`tools/corpus.py`, with the Qwen2 pre-tokenizer (the one the family's tokenizer class
rebuilds at load time) and the family's special tokens added right after the BPE vocab.
BPE vocab: 1500 (tiny) / 3000 (demo) entries, 256 of them the byte alphabet; the
model's `vocab_size` is the tokenizer length rounded up to a multiple of 64, so, as in
the real checkpoints, the embedding has a few rows no token maps to. The corpus, and so
the tokenizer, does not depend on `seed`: checkpoints built with different seeds share
token ids and differ only in their weights. Every string round-trips exactly once
NFC-normalized: like the family's own tokenizer, this one applies NFC first.

Sizes (weights in float32, untied embeddings):

| size | text (hidden/layers/heads/kv/mlp, mrope) | vision (hidden/depth/heads) | pixels per image (min..max) |
| --- | --- | --- | --- |
| tiny | 64 / 2 / 4 / 2 / 128, [2, 3, 3] | 32 / 2 / 2 | 28*28*1 .. 28*28*16 (1..16 image tokens) |
| demo | 256 / 4 / 4 / 2 / 768, [8, 12, 12] | 128 / 4 / 4 | 28*28*4 .. 28*28*64 (4..64 image tokens) |
| tiny_hd128 | 256 / 2 / 2 / 1 / 256, [16, 24, 24] | 32 / 2 / 2 | as tiny |

tiny_hd128 is tiny with the released checkpoints' 128-wide attention heads: on an H200, FlashAttention
tiles the keys of a decode step and of a prefill alike only for heads wider than 64, which the exact
on-policy checks need past 128 tokens of context (docs/fidelity.md, "Exact mode").
The `tiny_hd128_*` sizes add one feature of the 3b size each (vit3b: 80-wide vision heads, the 3420-wide
vision MLP, 112-pixel windows; gqa8: 8 query heads per key/value head; mlp: the 11008-wide MLP; vocab: the
151,936-row vocabulary; deep: 36 decoder layers and 32 vision blocks), to find which one breaks the exact
mode's bitwise match (`EXACT_VARIANTS` in tools/gpu_session.sh's exact stage).

Qwen2.5-VL's vision tower alternates window and full attention: tiny uses a 56-pixel
window (2x2 merged tokens) with block 1 full, demo the family's 112-pixel window with
blocks 1 and 3 full, so images at the size's max pixels span several windows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (python tools/make_tiny_model.py): make the repo importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from models.families.tiny import (  # noqa: E402,F401  (re-exported: the tests and tools build from here)
    MERGE_SIZE, PATCH_SIZE, SPECIAL_TOKENS, SizeSpec, TinySpec, fixed_image_side,
)
from models.family import FAMILIES as _REGISTRY, build_adapter  # noqa: E402
from tools.corpus import generate_corpus  # noqa: E402

WEIGHT_NAMES = ("hub", "current")
# The tiny-model spec of every registered family, by model_type.
FAMILIES: dict[str, TinySpec] = {name: spec.tiny for name, spec in _REGISTRY.items()}


def chat_template(family: TinySpec) -> str:
    """The ChatML-laid-out template with the family's image part and end-of-turn token."""
    return family.chat_template()


def processor_fields(family_name: str, size: SizeSpec) -> dict:
    """What the family's processor class reads from processor_config.json besides the image processor."""
    return FAMILIES[family_name].processor_fields(size)

SIZES = {
    "tiny": SizeSpec(
        bpe_vocab=1500, text_hidden=64, text_layers=2, text_heads=4, text_kv_heads=2,
        text_intermediate=128, mrope_section=(2, 3, 3), max_positions=8192,
        vision_hidden=32, vision_depth=2, vision_heads=2, vision_mlp_ratio=4,
        vision_intermediate=64, window_size=56, fullatt_blocks=(1,),
        min_pixels=28 * 28 * 1, max_pixels=28 * 28 * 16,
    ),
    "demo": SizeSpec(
        bpe_vocab=3000, text_hidden=256, text_layers=4, text_heads=4, text_kv_heads=2,
        text_intermediate=768, mrope_section=(8, 12, 12), max_positions=8192,
        vision_hidden=128, vision_depth=4, vision_heads=4, vision_mlp_ratio=4,
        vision_intermediate=384, window_size=112, fullatt_blocks=(1, 3),
        min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64,
    ),
    # The shapes of Qwen2.5-VL-3B-Instruct (3.75B parameters, 151936-row embedding) with a
    # small local tokenizer: for GPU benchmarks and fidelity checks, not for CPU tests.
    "3b": SizeSpec(
        bpe_vocab=3000, text_hidden=2048, text_layers=36, text_heads=16, text_kv_heads=2,
        text_intermediate=11008, mrope_section=(16, 24, 24), max_positions=128000,
        vision_hidden=1280, vision_depth=32, vision_heads=16, vision_mlp_ratio=4,
        vision_intermediate=3420, window_size=112, fullatt_blocks=(7, 15, 23, 31),
        min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1280, vocab_size=151936,
    ),
    # The shapes of Qwen3.5-4B (hidden 2560, 32 layers in the 3:1 Gated DeltaNet pattern, 16/4 heads of
    # 256 with a quarter rotated, Gated DeltaNet 16 key / 32 value heads of 128, MLP 9216, a 24-block
    # 1024-wide vision tower, 248320-row tied embedding) with a small local tokenizer: GPU benchmarks.
    "qwen3_5_4b": SizeSpec(
        bpe_vocab=3000, text_hidden=2560, text_layers=32, text_heads=16, text_kv_heads=4,
        text_intermediate=9216, mrope_section=(11, 11, 10), max_positions=262144,
        vision_hidden=1024, vision_depth=24, vision_heads=16, vision_mlp_ratio=4,
        vision_intermediate=4096, window_size=112, fullatt_blocks=(),
        min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 1280, vocab_size=248320, head_dim=256,
        families=("qwen3_5",),
    ),
}

# tiny with the released checkpoints' 128-wide attention heads (the exact-mode checks on an H200)
SIZES["tiny_hd128"] = dataclasses.replace(SIZES["tiny"], text_hidden=256, text_heads=2, text_kv_heads=1,
                                          text_intermediate=256, mrope_section=(16, 24, 24))

# tiny_hd128 with one feature of the 3b size each, for bisecting an exact-mode mismatch seen at 3b but not on
# tiny_hd128 (tests/gpu/test_exact.py with EXACT_SIZE; tools/gpu_session.sh exact with EXACT_VARIANTS).
# The windows, the ~300-token prompts and several 1024-patch images per encoder call come from 448x448 images.
_HD128, _3B = SIZES["tiny_hd128"], SIZES["3b"]
SIZES.update({
    # the 3b vision block: 80-wide heads, the 3420-wide MLP (a GEMM K that is not a multiple of 8), 112-pixel
    # windows (16 per 448x448 image) and full-attention blocks between them
    "tiny_hd128_vit3b": dataclasses.replace(_HD128, vision_hidden=2 * _3B.vision_hidden // _3B.vision_heads,
                                            vision_heads=2, vision_intermediate=_3B.vision_intermediate,
                                            vision_depth=4, window_size=_3B.window_size, fullatt_blocks=(1, 3)),
    # 8 query heads per key/value head, as the 3b's 16/2
    "tiny_hd128_gqa8": dataclasses.replace(_HD128, text_hidden=1024, text_heads=_3B.text_heads // _3B.text_kv_heads,
                                           text_kv_heads=1, text_intermediate=1024),
    # the 3b's MLP width: down_proj's GEMM sums over K = 11008
    "tiny_hd128_mlp": dataclasses.replace(_HD128, text_intermediate=_3B.text_intermediate),
    # the 3b's 151,936-row embedding and lm_head (the sampler's log-softmax over 149 blocks of 1024)
    "tiny_hd128_vocab": dataclasses.replace(_HD128, vocab_size=_3B.vocab_size),
    # the 3b's depths: 36 decoder layers, 32 vision blocks with its window and full-attention blocks
    "tiny_hd128_deep": dataclasses.replace(_HD128, text_layers=_3B.text_layers, vision_depth=_3B.vision_depth,
                                           window_size=_3B.window_size, fullatt_blocks=_3B.fullatt_blocks),
})
# tiny at the 3b's depths: so narrow that a CPU's time for a pass is mostly the host's work per module and op
# (tools/host_cost.py --train-size tiny_deep)
SIZES["tiny_deep"] = dataclasses.replace(SIZES["tiny"], text_layers=_3B.text_layers, vision_depth=_3B.vision_depth,
                                         fullatt_blocks=_3B.fullatt_blocks)


def _lookup(table: dict, key: str, what: str):
    """table[key], or a ValueError naming the bad key and the valid ones."""
    if key not in table:
        raise ValueError(f"make_tiny_model: unknown {what} {key!r}; expected one of {sorted(table)}")
    return table[key]


def _check_size(size: SizeSpec, family: str = "") -> None:
    """Fail early on shapes the family's model code would reject or mis-handle."""
    if size.families and family not in size.families:
        raise ValueError(f"make_tiny_model: this size has {', '.join(size.families)}'s shapes; --family {family} "
                         f"cannot take it")
    head_dim, rem = divmod(size.text_hidden, size.text_heads)
    if size.head_dim:  # a released model's own head size, rotated over part of it (the family checks)
        head_dim, rem = size.head_dim, 0
    if rem or size.text_heads % size.text_kv_heads:
        raise ValueError(f"make_tiny_model: text heads {size.text_heads}/{size.text_kv_heads} do not divide hidden {size.text_hidden}")
    if not size.head_dim and sum(size.mrope_section) * 2 != head_dim:
        raise ValueError(f"make_tiny_model: mrope_section {size.mrope_section} must sum to head_dim/2 = {head_dim // 2}")
    if size.window_size % (PATCH_SIZE * MERGE_SIZE):
        raise ValueError(f"make_tiny_model: window_size {size.window_size} must be a multiple of {PATCH_SIZE * MERGE_SIZE}")
    if any(not 0 <= i < size.vision_depth for i in size.fullatt_blocks):
        raise ValueError(f"make_tiny_model: fullatt_blocks {size.fullatt_blocks} must lie in [0, {size.vision_depth})")


def train_bpe(lines: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with the Qwen2 tokenizer's normalizer and pre-tokenizer.

    The pipeline is taken from a fresh `Qwen2Tokenizer`, because that class rebuilds
    exactly this pipeline around the saved vocab and merges when the checkpoint is
    loaded: training with anything else would give merges the loader never applies.
    """
    reference = transformers.Qwen2Tokenizer().backend_tokenizer
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = reference.normalizer
    tokenizer.pre_tokenizer = reference.pre_tokenizer
    tokenizer.decoder = reference.decoder
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"train_bpe: the corpus yielded {tokenizer.get_vocab_size()} tokens, not {vocab_size}; "
            "grow tools/corpus.py or lower the size's bpe_vocab"
        )
    return tokenizer


def build_tokenizer(family: TinySpec, size: SizeSpec):
    """The family's tokenizer class over a locally trained BPE and the family's added tokens."""
    backend = train_bpe(generate_corpus(), size.bpe_vocab)
    added = [(token, True) for token in SPECIAL_TOKENS] + list(family.extra_tokens)
    # One at a time so ids follow the listed order whatever the special flag.
    for content, special in added:
        backend.add_tokens([AddedToken(content, special=special, normalized=False)])
    tokenizer = transformers.Qwen2Tokenizer(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=size.max_positions,
        **({"extra_special_tokens": dict(family.named_tokens)} if family.named_tokens else {}),
    )
    tokenizer.chat_template = family.chat_template()
    ids = [tokenizer.convert_tokens_to_ids(content) for content, _ in added]
    if ids != list(range(size.bpe_vocab, size.bpe_vocab + len(added))):
        raise RuntimeError(f"build_tokenizer: added tokens got ids {ids}, expected them right after the BPE vocab")
    return tokenizer


def build_image_processor(size: SizeSpec, family_name: str = "qwen2_5_vl"):
    """The family's image processor with the size's pixel limits (the PIL flavour where it exists:
    it needs no torchvision, and saves under the family's canonical name)."""
    return _lookup(FAMILIES, family_name, "family").image_processor(size)


def build_config(family_name: str, size: SizeSpec, tokenizer):
    """The family's config class with the size's shapes and the tokenizer's token ids."""
    return _lookup(FAMILIES, family_name, "family").config(size, tokenizer)


def _draw_zero_matrices(model, std: float = 0.02) -> None:
    """Draw every weight matrix transformers initializes to zeros (Gemma3's image projection).

    A zero projection makes every image feature zero: the decoder would never see the image,
    and no test comparing two implementations of the vision path could fail.
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, std)


def build_model(family_name: str, config, tokenizer, seed: int, device: str = "cpu",
                dtype: torch.dtype = torch.float32):
    """A randomly initialized model of the family; the same seed gives the same weights
    (on the same device: CUDA draws other numbers than the CPU)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, FAMILIES[family_name].model_class)(config)
        _draw_zero_matrices(model)
        model = model.to(dtype)
    eot, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot
    )
    return model.eval()


def _write_json(path: Path, data: dict) -> None:
    """JSON as transformers writes its configs: indented, sorted keys, trailing newline."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_processor_files(out: Path, tokenizer, image_processor, processor_class: str,
                         template: str = FAMILIES["qwen2_vl"].chat_template(),
                         processor_fields: dict | None = None) -> None:
    """Write the tokenizer, chat template, image processor and processor config.

    This writes what `ProcessorMixin.save_pretrained` writes in transformers 5, without
    constructing the processor: its constructor needs torchvision (for the video
    processor) even when no video is ever processed. The nested `processor_config.json`
    leaves the video processor out, so loaders fall back to `preprocessor_config.json`
    for it, as they do for hub checkpoints.
    """
    tokenizer._set_processor_class(processor_class)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    flat = json.loads((out / "preprocessor_config.json").read_text(encoding="utf-8"))
    flat["processor_class"] = processor_class
    _write_json(out / "preprocessor_config.json", flat)
    _write_json(out / "processor_config.json", {"image_processor": image_processor.to_dict(),
                                                 "processor_class": processor_class, **(processor_fields or {})})
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")



@contextlib.contextmanager
def _quiet_progress_bars():
    """Hide transformers' progress bars for the block, restoring the caller's setting after."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _save_weights(model, out: Path, weight_names: str) -> None:
    """Write config.json, generation_config.json and model.safetensors with save_pretrained.

    "hub" keeps save_pretrained's default, which writes the names the family's hub
    checkpoints use (`model.layers.*`, `model.embed_tokens.*`, `visual.*`, `lm_head.*`);
    "current" writes the names of the loaded model's modules (`model.language_model.*`,
    `model.visual.*`, `lm_head.*`). transformers loads both.
    """
    kwargs = {} if weight_names == "hub" else {"save_original_format": False}
    with _quiet_progress_bars():
        model.save_pretrained(out, safe_serialization=True, **kwargs)


def _summary(out: Path, family_name: str, size_name: str, model, tokenizer, seconds: float) -> str:
    """One line describing what was built."""
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in build_adapter(model.config).vision_tower(model).parameters())
    size = SIZES[size_name] if isinstance(size_name, str) else size_name
    size_name = size_name if isinstance(size_name, str) else "custom"
    return (
        f"make_tiny_model: {family_name}/{size_name} -> {out} | params {total / 1e6:.2f}M "
        f"(vision {vision / 1e6:.2f}M) | tokenizer {len(tokenizer)} tokens, model vocab "
        f"{model.config.text_config.vocab_size} | text {size.text_hidden}x{size.text_layers}, "
        f"vision {size.vision_hidden}x{size.vision_depth} | pixels {size.min_pixels}..{size.max_pixels} "
        f"| {seconds:.1f}s"
    )


def make_tiny_model(
    out: str | os.PathLike,
    family: str = "qwen2_5_vl",
    size: str | SizeSpec = "tiny",
    seed: int = 0,
    overwrite: bool = False,
    verbose: bool = False,
    weight_names: str = "hub",
    device: str = "cpu",
    dtype: str = "float32",
    weights: bool = True,
) -> Path:
    """Build a random-weight checkpoint of `family` at `size` into the folder `out`.

    `seed` draws the weights (the tokenizer does not depend on it); `weight_names`
    picks the tensor names in model.safetensors (see `_save_weights`). The folder is
    written under a temporary name and renamed when complete, so it never exists
    half-written. An existing `out` is an error unless `overwrite`. With `verbose`,
    prints a one-line summary. `size` is a name in SIZES or a SizeSpec; `device` and
    `dtype` ("float32" or "bfloat16") are where the weights are drawn and how they are
    saved (the 3b size is best drawn on a GPU and saved in bfloat16). `weights=False` writes the
    config, tokenizer and processor files only (no model is built): enough for vLLM's multimodal
    processor on the CPU at any size (`tools/bench_turns.py --add-only`). Returns the folder.
    """
    family_spec = _lookup(FAMILIES, family, "family")
    size_spec = size if isinstance(size, SizeSpec) else _lookup(SIZES, size, "size")
    torch_dtype = _lookup({"float32": torch.float32, "bfloat16": torch.bfloat16}, dtype, "dtype")
    if weight_names not in WEIGHT_NAMES:
        raise ValueError(f"make_tiny_model: weight_names must be one of {WEIGHT_NAMES}, got {weight_names!r}")
    _check_size(size_spec, family)
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"make_tiny_model: {out} already exists; remove it or pass overwrite=True (--overwrite)")
    start = time.perf_counter()
    tokenizer = build_tokenizer(family_spec, size_spec)
    config = build_config(family, size_spec, tokenizer)
    model = build_model(family, config, tokenizer, seed, device=device, dtype=torch_dtype) if weights else None
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if model is None:
            config.save_pretrained(staging)
        else:
            _save_weights(model, staging, weight_names)
        save_processor_files(staging, tokenizer, build_image_processor(size_spec, family), family_spec.processor_class,
                             family_spec.chat_template(), family_spec.processor_fields(size_spec))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if verbose and model is None:
        print(f"make_tiny_model: {family}/{size if isinstance(size, str) else 'custom'} -> {out} | config, tokenizer "
              f"and processor only (no weights) | {time.perf_counter() - start:.1f}s")
    elif verbose:
        print(_summary(out, family, size, model, tokenizer, time.perf_counter() - start))
    return out


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description="Build a tiny offline VLM checkpoint of a registered family.")
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", required=True, help="folder to create")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    parser.add_argument("--weight-names", choices=WEIGHT_NAMES, default="hub",
                        help="tensor names in model.safetensors: the hub checkpoints' (default) or the modules' own")
    parser.add_argument("--device", default="cpu", help="where to draw the weights (cuda is much faster for --size 3b)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the saved weights")
    parser.add_argument("--no-weights", action="store_true",
                        help="config, tokenizer and processor files only: for vLLM's processor on the CPU")
    args = parser.parse_args(argv)
    try:
        make_tiny_model(args.out, family=args.family, size=args.size, seed=args.seed,
                        overwrite=args.overwrite, verbose=True, weight_names=args.weight_names,
                        device=args.device, dtype=args.dtype, weights=not args.no_weights)
    except (ValueError, FileExistsError) as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
