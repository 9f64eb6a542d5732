"""The family tool format (call markers, the tool-result message) and the multi-turn config keys."""

import json
import re

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


# --- Qwen3.5: XML calls ------------------------------------------------------------------------------

def _xml(name, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _parsed(text):
    """What the tool runner makes of each call Qwen3.5's format finds in `text`, with the real tools."""
    from rollout.tools import build_tools, parse_call

    tools = build_tools(["image_zoom_in_tool", "calculator"])
    fmt = FAMILIES["qwen3_5"].tool_format
    return [parse_call(raw, tools) for raw in fmt.calls(text, {n: t.parameters for n, t in tools.items()})]


def test_qwen3_5_xml_calls_convert_by_the_tools_schema():
    assert FAMILIES["qwen3_5"].tool_format is FAMILIES["qwen3_5_moe"].tool_format
    assert FAMILIES["qwen3_5"].tool_format.result_role == "tool"  # the template's tool role
    text = ("I look closer.\n" + _xml("image_zoom_in_tool", bbox_2d="[10, 20.5, 30, 40]", label="7") + "\n"
            + _xml("calculator", expression="2 *\n(3 + 4)"))
    assert _parsed(text) == [("image_zoom_in_tool", {"bbox_2d": [10, 20.5, 30, 40], "label": "7"}),
                             ("calculator", {"expression": "2 *\n(3 + 4)"})]  # a string stays a string
    assert _parsed("<answer>3</answer>") == []
    # Without schemas (or for a parameter the schema does not know) values stay text.
    raw = FAMILIES["qwen3_5"].tool_format.calls(_xml("image_zoom_in_tool", bbox_2d="[1, 2, 3, 4]"))
    assert json.loads(raw[0]) == {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": "[1, 2, 3, 4]"}}


def test_qwen3_5_schema_types_of_each_kind():
    from models.families.qwen3_5 import _schema_value

    assert _schema_value(" 12 ", {"type": "integer"}) == 12 and _schema_value("1.5", {"type": "integer"}) == "1.5"
    assert _schema_value("3", {"type": "number"}) == 3 and _schema_value("-2.5e1", {"type": "number"}) == -25.0
    assert _schema_value("True", {"type": "boolean"}) is True
    assert _schema_value('{"a": 1}', {"type": "object"}) == {"a": 1}
    assert _schema_value("[1, 2]", {"type": ["string", "array"]}) == "[1, 2]"  # the first type that takes it
    assert _schema_value("nan", {"type": "number"}) == "nan"  # no conversion: the text, for the schema check


@pytest.mark.parametrize("text, kind, message", [
    (_xml("image_zoom_in_tool", bbox_2d="[1, 2"), "bad_arguments",
     r"image_zoom_in_tool: argument 'bbox_2d' must be array"),
    (_xml("image_zoom_in_tool", bbox_2d='[1, 2, 3, "x"]'), "bad_arguments", r"argument 'bbox_2d\[3\]' must be number"),
    (_xml("calculator"), "bad_arguments", r"calculator: missing argument 'expression'"),
    (_xml("no_such_tool", x="1"), "unknown_tool", r"unknown tool 'no_such_tool'"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>', "malformed_json",
     r"not <function=NAME>"),
    ("<tool_call>\n<function=calculator>\n<parameter=expression>\n1+1\n</function>\n</tool_call>", "malformed_json",
     r"calculator: an unclosed <parameter"),
    ("<tool_call>\n<function=calculator>\nexpression: 1\n</function>\n</tool_call>", "malformed_json",
     r"text after the parameters"),
    (_xml("calculator", expression="1").replace("</function>", "<parameter=expression>\n2\n</parameter>\n</function>"),
     "malformed_json", r"parameter 'expression' is given twice"),
    ("<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n", "malformed_json",
     r"not <function=NAME>"),  # unclosed: the call runs to the end of the text
])
def test_qwen3_5_malformed_calls_are_tool_errors_in_one_line(text, kind, message):
    (outcome,) = _parsed(text)
    assert outcome.result is None and outcome.error_kind == kind
    assert "\n" not in outcome.error and re.search(message, outcome.error), outcome.error


def test_qwen3_5_schemas_come_first_in_the_system_turn():
    from rollout.tools import build_tools, tool_schema

    fmt = FAMILIES["qwen3_5"].tool_format
    schemas = [tool_schema(t) for t in build_tools(["calculator"]).values()]
    text = fmt.system_with_tools("  Be brief. ", schemas)
    assert text.startswith("# Tools\n\nYou have access to the following functions:\n\n<tools>\n{")
    assert text.endswith("</IMPORTANT>\n\nBe brief.") and json.dumps(schemas[0], ensure_ascii=False) in text
    assert fmt.system_with_tools("", schemas).endswith("</IMPORTANT>")  # no default system text
