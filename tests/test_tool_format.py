"""The family tool format (call markers, the tool-result message) and the multi-turn config keys."""

import pytest

from grpo.config import ConfigError, load_config
from models.family import FAMILIES, FamilyAdapter, require_tool_format


def test_qwen_families_have_a_tool_format_and_others_fail_naming_the_key():
    for name in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert FAMILIES[name].tool_format is not None
    assert FAMILIES["qwen2_5_vl"].tool_format.result_role == "user"  # DeepEyes: a user turn
    assert FAMILIES["qwen3_vl"].tool_format.result_role == "tool"  # its template's tool role
    with pytest.raises(ValueError, match=r"model family 'llava'.*'rollout.tools'"):
        require_tool_format(FamilyAdapter(name="llava", hf_architecture="x", image_token_id=1))


def test_calls_are_the_text_between_the_markers():
    fmt = FAMILIES["qwen2_5_vl"].tool_format
    text = 'think <tool_call>{"name": "a"}</tool_call> mid <tool_call> {"b": 1} </tool_call> end <tool_call>{"c"'
    assert fmt.calls(text) == ['{"name": "a"}', ' {"b": 1} ', '{"c"']
    assert fmt.calls("<answer>3</answer>") == []


def test_result_message_wraps_images_and_text():
    msg = FAMILIES["qwen2_5_vl"].tool_format.result_message("zoomed", 2)
    assert msg["role"] == "user"
    assert [p["type"] for p in msg["content"]] == ["text", "image", "image", "text"]
    assert msg["content"][0]["text"] == "<tool_response>" and msg["content"][-1]["text"] == "zoomed</tool_response>"
    msg3 = FAMILIES["qwen3_vl"].tool_format.result_message("", 1)
    assert msg3 == {"role": "tool", "content": [{"type": "image"}]}


@pytest.mark.parametrize("override, message", [
    ("rollout.max_turns=0", "rollout.max_turns"),
    ("rollout.tool_timeout_s=0", "rollout.tool_timeout_s"),
    ("rollout.tool_workers=0", "rollout.tool_workers"),
    ("rollout.max_tool_images=-1", "rollout.max_tool_images"),
    ("algorithm.tool_error_penalty=-0.5", "algorithm.tool_error_penalty"),
    ("rollout.max_context_tokens=10", "rollout.max_context_tokens"),
])
def test_tool_keys_are_range_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/demo.yaml", ["rollout.tools=[calculator]", override])


def test_more_turns_without_tools_is_refused():
    with pytest.raises(ConfigError, match="rollout.max_turns"):
        load_config("configs/demo.yaml", ["rollout.max_turns=3"])
    cfg = load_config("configs/demo.yaml", ["rollout.tools=[image_zoom_in_tool]", "rollout.max_turns=3"])
    assert cfg.rollout.tools == ["image_zoom_in_tool"] and cfg.rollout.max_turns == 3


def test_preflight_refuses_tools_for_a_family_without_a_tool_format(tmp_path):
    from grpo.preflight import _check_engine

    (tmp_path / "config.json").write_text('{"model_type": "llava"}')
    cfg = load_config(None, ["trainer.mode=grpo", f"model.path={tmp_path}", "rollout.engine=torch",
                             "rollout.tools=[calculator]"])
    with pytest.raises(ConfigError, match=r"rollout.tools=\['calculator'\]: model family 'llava' has no tool-call"):
        _check_engine(cfg)
    _check_engine(load_config(None, ["trainer.mode=grpo", f"model.path={tmp_path}", "rollout.engine=torch"]))


def test_tool_prompt_comes_from_the_config(tiny_model):
    from data.processing import load_processor
    from models.policy import load_model_config
    from rollout.rollouts import tool_prompt

    processor = load_processor(str(tiny_model))
    adapter = FAMILIES["qwen2_5_vl"].adapter(load_model_config(str(tiny_model)))
    base = [f"model.path={tiny_model}", "rollout.tools=[calculator,image_zoom_in_tool]", "rollout.max_turns=2"]
    tp = tool_prompt(load_config(None, base), adapter, processor)
    # in rollout.tools order; the tiny template does not take tools=, so the family's rule renders them
    assert [s["function"]["name"] for s in tp.schemas] == ["calculator", "image_zoom_in_tool"]
    assert not tp.template_takes_tools and tp.system_with_tools is not None
    assert tool_prompt(load_config(None, base + ["rollout.tool_schemas_in_prompt=false"]), adapter, processor) is None
    assert tool_prompt(load_config(None, [f"model.path={tiny_model}"]), adapter, processor) is None
    with pytest.raises(ValueError, match=r"model family 'llava'.*'rollout.tools'"):
        tool_prompt(load_config(None, base), FamilyAdapter(name="llava", hf_architecture="x", image_token_id=1),
                    processor)
