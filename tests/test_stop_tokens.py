"""Stop tokens and SFT targets follow the family: what the chat template writes after an assistant
message stops generation and ends every SFT target, whatever the family; generation_config.json's
eos ids and the tokenizer's eos stop it too."""

import json
import shutil

import pytest
from transformers import AutoConfig, AutoTokenizer

from data.processing import encode_response, sft_target, stop_token_ids, token_id
from models.family import build_adapter

# The end-of-turn token of each family's released checkpoints, which the tiny ones copy.
END_OF_TURN = {
    "qwen2_vl": "<|im_end|>",
    "qwen2_5_vl": "<|im_end|>",
    "qwen3_vl": "<|im_end|>",
    "llava": "</s>",
    "idefics3": "<end_of_utterance>",
    "gemma3": "<end_of_turn>",
}
LOCAL = {"local_files_only": True}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("stop")
    return {f: make_tiny_model(root / f, family=f, size="tiny", seed=0) for f in END_OF_TURN}


def _load(folder):
    return AutoTokenizer.from_pretrained(folder, **LOCAL), build_adapter(AutoConfig.from_pretrained(folder, **LOCAL))


def _turns(target: str) -> tuple[list[dict], list[dict]]:
    user = {"role": "user", "content": [{"type": "text", "text": "How many?"}]}
    return [user], [user, {"role": "assistant", "content": [{"type": "text", "text": target}]}]


@pytest.mark.parametrize("family", END_OF_TURN)
def test_stop_ids_hold_the_token_the_template_writes_after_an_answer(folders, family):
    tokenizer, adapter = _load(folders[family])
    _, conversation = _turns("MARK")
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    after = text[text.index("MARK") + len("MARK"):]
    emitted = tokenizer.encode(after, add_special_tokens=False)[0]
    assert tokenizer.convert_ids_to_tokens(emitted) == END_OF_TURN[family] == adapter.end_of_turn
    stops = stop_token_ids(str(folders[family]), tokenizer, adapter.end_of_turn)
    assert stops[0] == emitted
    assert len(set(stops)) == len(stops)


@pytest.mark.parametrize("family", END_OF_TURN)
def test_sft_target_is_the_assistant_turn_the_template_writes(folders, family):
    tokenizer, adapter = _load(folders[family])
    target = sft_target("clevr", "3")
    prompt, conversation = _turns(target)
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert full_text.startswith(prompt_text)
    turn = tokenizer.encode(full_text[len(prompt_text):], add_special_tokens=False)
    response = encode_response(tokenizer, target, adapter.end_of_turn).tolist()
    assert turn[:len(response)] == response
    assert response[-1] == token_id(tokenizer, END_OF_TURN[family])
    assert response[-1] in stop_token_ids(str(folders[family]), tokenizer, adapter.end_of_turn)


def _copy_with_generation_config(src, dst, eos):
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    if eos is None:
        path.unlink()
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": eos}))
    return dst


def test_generation_config_eos_ids_are_added_and_unknown_ones_skipped(folders, tmp_path):
    tokenizer, adapter = _load(folders["gemma3"])
    eot = token_id(tokenizer, "<end_of_turn>")
    extra = tokenizer.convert_tokens_to_ids(["<|box_end|>", "<end_of_image>"])
    listed = _copy_with_generation_config(folders["gemma3"], tmp_path / "listed", [*extra, eot, 10**9, -1, "x"])
    stops = stop_token_ids(str(listed), tokenizer, adapter.end_of_turn)
    assert stops == [eot, *extra, tokenizer.eos_token_id]
    single = _copy_with_generation_config(folders["gemma3"], tmp_path / "single", extra[0])
    assert stop_token_ids(str(single), tokenizer, adapter.end_of_turn) == [eot, extra[0], tokenizer.eos_token_id]


def test_missing_pieces_are_skipped_and_no_stop_token_is_an_error(folders, tmp_path):
    tokenizer, _ = _load(folders["llava"])
    bare = _copy_with_generation_config(folders["llava"], tmp_path / "bare", None)
    assert stop_token_ids(str(bare), tokenizer, "<no_such_token>") == [tokenizer.eos_token_id]
    corrupt = _copy_with_generation_config(folders["llava"], tmp_path / "corrupt", 0)
    (corrupt / "generation_config.json").write_text("{not json")
    assert stop_token_ids(str(corrupt), tokenizer, "</s>") == [token_id(tokenizer, "</s>"), tokenizer.eos_token_id]
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="bare.*no stop token"):
        stop_token_ids(str(bare), tokenizer, "<no_such_token>")


def test_encode_response_needs_an_end_of_turn_the_tokenizer_has(folders):
    tokenizer, _ = _load(folders["idefics3"])
    with pytest.raises(ValueError, match="<no_such_token>"):
        encode_response(tokenizer, "<answer>3</answer>", "<no_such_token>")
    open_turn = encode_response(tokenizer, "<answer>3</answer>", "").tolist()
    assert open_turn == tokenizer.encode("<answer>3</answer>", add_special_tokens=False)
