#!/usr/bin/env python3
"""Render golden conversations with the released GLM-5.3-Flash chat template.

Writes tests/golden/chat_template/renders.json: for every case the messages, tools and template
options glmtune receives, and the exact text the released `chat_template.jinja` renders for them.
tests/unit/test_chat_template.cpp compares glmtune's renderer against every case byte for byte.

Rendering goes through transformers' own `render_jinja_template` when transformers is importable,
so the environment (trim_blocks, lstrip_blocks, loopcontrols, the `tojson` override that calls
`json.dumps(ensure_ascii=False)`) is exactly the one `apply_chat_template` uses. Without
transformers the same environment is rebuilt from jinja2 alone; both give identical text.

glmtune accepts two input forms the released template cannot render, and normalises them first:
tool-call `arguments` given as a JSON string (OpenAI wire format) are parsed into an object, and
the role `observation` is read as `tool`. Cases using them render the normalised messages with
jinja and record the original messages, so the test also covers the normalisation.

The template, tools/golden/glm53_chat_template.jinja, is the released `chat_template.jinja` of
zai-org/GLM-5.3-Flash (10,950 bytes, git blob oid 06bd89e94b96652fd5d76d9f9e11cfa15e09f49d,
sha256 0c4099f3382d6c92700dfb99725025360966fd73032f0ecf32377c0d9e6309c5), byte for byte; the
sha256 is recorded in renders.json and checked by the C++ test.

Usage: python tools/golden/chat_template_goldens.py [--template PATH] [--out PATH]
"""

import argparse
import copy
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO / "tests" / "golden" / "chat_template"


def make_renderer(template_text):
    """Returns (render(messages, tools, **kwargs) -> str, description of the engine used)."""
    try:
        import transformers
        from transformers.utils.chat_template_utils import render_jinja_template

        def render(messages, tools, **kwargs):
            out, _ = render_jinja_template(
                conversations=[messages], tools=tools, chat_template=template_text, **kwargs
            )
            return out[0]

        return render, f"transformers {transformers.__version__} render_jinja_template"
    except ImportError:
        pass

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Mirrors transformers' _compile_jinja_template: the `generation` tag is irrelevant for this
    # template (it has none), everything else that changes output is reproduced here.
    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template_text)

    def render(messages, tools, **kwargs):
        return compiled.render(messages=messages, tools=tools, documents=None, **kwargs)

    return render, f"jinja2 {jinja2.__version__} (transformers environment rebuilt)"


def normalise_for_jinja(messages):
    """The two normalisations glmtune applies before rendering (see the module docstring)."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("role") == "observation":
            m["role"] = "tool"
        for tc in m.get("tool_calls") or []:
            fn = tc["function"] if tc.get("function") else tc
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
    return out


def u(text):
    return {"role": "user", "content": text}


def a(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def sys_(text):
    return {"role": "system", "content": text}


def call(name, arguments, call_id=None, wrap=True):
    fn = {"name": name, "arguments": arguments}
    if not wrap:
        return fn if call_id is None else {"id": call_id, **fn}
    tc = {"type": "function", "function": fn}
    if call_id is not None:
        tc = {"id": call_id, **tc}
    return tc


def tool(content, call_id=None, key="tool_call_id"):
    m = {"role": "tool", "content": content}
    if call_id is not None:
        m[key] = call_id
    return m


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
        "strict": True,
    },
}
CALC_TOOL = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression; returns a number.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}, "precision": {"type": "integer"}},
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Suche in der Dokumentation — 文档搜索",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        "defer_loading": True,
    },
}
TRANSLATE_TOOL = {
    "type": "function",
    "function": {
        "name": "translate",
        "description": "Translate text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        "defer_loading": False,
        "strict": False,
    },
}


def cases():
    """(name, messages, tools, options). Options are template variables besides messages/tools."""
    yield "plain_single_turn", [u("What is 2 + 3?"), a("5")], None, {}
    yield "system_user_assistant", [
        sys_("You are a concise assistant."),
        u("Reverse the word 'glass'."),
        a("ssalg"),
    ], None, {}
    yield "multi_turn_reasoning_kept", [
        u("What is 7 * 6?"),
        a("42", reasoning_content="7 * 6 = 42."),
        u("And 42 / 7?"),
        a("6", reasoning_content="42 / 7 = 6."),
    ], None, {}
    yield "multi_turn_clear_thinking", [
        u("What is 7 * 6?"),
        a("42", reasoning_content="7 * 6 = 42."),
        u("And 42 / 7?"),
        a("6", reasoning_content="42 / 7 = 6."),
    ], None, {"clear_thinking": True}
    yield "clear_thinking_after_last_user_with_tools", [
        u("Weather in Oslo?"),
        a("", reasoning_content="Need the tool.", tool_calls=[call("get_weather", {"city": "Oslo"}, "c1")]),
        tool("{\"temp\": -3}", "c1"),
        a("It is -3 degrees in Oslo.", reasoning_content="The tool said -3."),
    ], [WEATHER_TOOL], {"clear_thinking": True}
    yield "reasoning_inside_content", [
        u("Capital of France?"),
        a("<think>France's capital is Paris.</think>\n\nParis."),
    ], None, {}
    yield "reasoning_inside_content_nested_markers", [
        u("x"),
        a("pre<think>one<think>two</think>mid</think>  tail  "),
    ], None, {}
    yield "reasoning_field_wins_over_content_markers", [
        u("x"),
        a("<think>in content</think>answer", reasoning_content="from field"),
    ], None, {}
    yield "content_stripping_unicode_spaces", [
        u("  keep user spaces  "),
        a("\u3000\u00a0 answer with spaces \u2028\n\t"),
        u("next"),
        a("   \n  "),
    ], None, {}
    yield "empty_reasoning_string", [u("hi"), a("hello", reasoning_content="")], None, {}
    yield "tool_call_dict_arguments_types", [
        u("Compute things"),
        a("Calling the calculator.", tool_calls=[
            call("calculator", {
                "expression": "3.5 * 2",
                "precision": 2,
                "ratio": 0.1,
                "big": 1e16,
                "small": 1e-05,
                "whole": 100.0,
                "neg": -0.0,
                "flag": True,
                "none": None,
                "list": [1, 2.5, "x", [], {}],
                "nested": {"é": "ü\n\"q\"\\", "ctl": "\u0001\u001f\u007f"},
                "ключ": "значение",
            }),
        ]),
    ], [CALC_TOOL], {}
    yield "tool_call_string_arguments", [
        u("Weather in Berlin in fahrenheit"),
        a("", tool_calls=[call("get_weather", "{\"city\": \"Berlin\", \"unit\": \"fahrenheit\"}", "c9")]),
    ], [WEATHER_TOOL], {}
    yield "tool_call_unwrapped_and_multiple", [
        u("Two lookups"),
        a("Looking up both.", tool_calls=[
            call("get_weather", {"city": "Rome"}, "a", wrap=False),
            call("calculator", {"expression": "1+1"}, "b", wrap=False),
        ]),
    ], [WEATHER_TOOL, CALC_TOOL], {}
    yield "tool_results_reordered_by_id", [
        u("Weather in Rome and Lima"),
        a("", tool_calls=[call("get_weather", {"city": "Rome"}, "r1"), call("get_weather", {"city": "Lima"}, "r2")]),
        tool("Lima: 18C", "r2"),
        tool("Rome: 25C", "r1"),
        a("Rome 25C, Lima 18C."),
    ], [WEATHER_TOOL], {}
    yield "tool_results_id_key_and_missing_result", [
        u("Three cities"),
        a("", tool_calls=[
            call("get_weather", {"city": "A"}, "x1"),
            call("get_weather", {"city": "B"}, "x2"),
            call("get_weather", {"city": "C"}, "x3"),
        ]),
        tool("C is cold", "x3", key="id"),
        tool("A is warm", "x1"),
        a("Done."),
    ], [WEATHER_TOOL], {}
    yield "tool_results_missing_id_keep_order", [
        u("Two"),
        a("", tool_calls=[call("get_weather", {"city": "A"}, "k1"), call("get_weather", {"city": "B"}, "k2")]),
        tool("second", "k2"),
        tool("first"),
        a("ok"),
    ], [WEATHER_TOOL], {}
    yield "tool_results_duplicate_id_keep_order", [
        u("Two"),
        a("", tool_calls=[call("get_weather", {"city": "A"}, "d1"), call("get_weather", {"city": "B"}, "d2")]),
        tool("second", "d2"),
        tool("again", "d2"),
        a("ok"),
    ], [WEATHER_TOOL], {}
    yield "tool_results_unknown_id_keep_order", [
        u("Two"),
        a("", tool_calls=[call("get_weather", {"city": "A"}, "e1")]),
        tool("zzz", "e9"),
        tool("aaa", "e1"),
        a("ok"),
    ], [WEATHER_TOOL], {}
    yield "tool_call_ids_duplicate_keep_order", [
        u("Two"),
        a("", tool_calls=[call("get_weather", {"city": "A"}, "same"), call("get_weather", {"city": "B"}, "same")]),
        tool("B result", "same"),
        a("ok"),
    ], [WEATHER_TOOL], {}
    yield "tool_results_list_of_outputs", [
        u("Batch"),
        a("", tool_calls=[call("calculator", {"expression": "2*2"}, "o1"), call("calculator", {"expression": "3*3"}, "o2")]),
        {"role": "tool", "content": [
            {"type": "function_call_output", "call_id": "ignored", "tool_call_id": "o2", "output": "9"},
            {"type": "function_call_output", "id": "o1", "output": [{"type": "text", "text": "4"}]},
        ]},
        a("4 and 9"),
    ], [CALC_TOOL], {}
    yield "tool_reference_results", [
        u("Which tools can translate?"),
        a("", tool_calls=[call("search_docs", {"query": "translate"}, "s1")]),
        tool([{"type": "tool_reference", "name": "translate"}, {"type": "tool_reference", "name": "search_docs"}], "s1"),
        a("The translate tool."),
    ], [WEATHER_TOOL, SEARCH_TOOL, TRANSLATE_TOOL], {}
    yield "tool_reference_inside_outputs", [
        u("Find"),
        a("", tool_calls=[call("search_docs", {"query": "weather"}, "t1")]),
        {"role": "tool", "content": [
            {"tool_call_id": "t1", "output": [{"type": "tool_reference", "name": "get_weather"}]},
        ]},
        a("get_weather"),
    ], [WEATHER_TOOL, SEARCH_TOOL], {}
    yield "tool_content_text_list_and_null", [
        u("Go"),
        a("", tool_calls=[call("calculator", {"expression": "1"}, "n1"), call("calculator", {"expression": "2"}, "n2")]),
        tool([{"type": "text", "text": "part one, "}, "part two"], "n1"),
        tool(None, "n2"),
        a("fine"),
    ], [CALC_TOOL], {}
    yield "tool_first_and_observation_role", [
        {"role": "observation", "content": "stray result"},
        u("Now a question"),
        a("An answer."),
        {"role": "observation", "content": "late result"},
    ], None, {}
    yield "tools_block_variants_and_effort_low", [
        u("Hello"),
    ], [WEATHER_TOOL, CALC_TOOL, SEARCH_TOOL, TRANSLATE_TOOL], {"reasoning_effort": "low", "add_generation_prompt": True}
    yield "effort_high_generation_prompt", [sys_("Be brief."), u("Hi")], None, {
        "reasoning_effort": "high", "add_generation_prompt": True}
    yield "effort_unknown_values_render_max", [u("Hi"), a("Hello")], None, {"reasoning_effort": "medium"}
    yield "effort_uppercase_is_not_honoured", [u("Hi")], None, {
        "reasoning_effort": "LOW", "add_generation_prompt": True}
    yield "empty_tools_list", [u("Hi"), a("Hello")], [], {}
    yield "media_in_user_content", [
        u([
            {"type": "text", "text": "Compare "},
            {"type": "image", "image": "a.png"},
            {"type": "text", "text": " with "},
            {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg"}},
            " and this clip: ",
            {"type": "video", "video": "c.mp4"},
            {"type": "video_url", "video_url": {"url": "d.mp4"}},
        ]),
        a("The first image is brighter."),
    ], None, {}
    yield "media_in_tool_result", [
        u("Take a screenshot"),
        a("", tool_calls=[call("screenshot", {}, "p1")]),
        tool([{"type": "text", "text": "captured: "}, {"type": "image", "image": "s.png"}], "p1"),
        a("Here it is."),
    ], [{"name": "screenshot", "parameters": {"type": "object", "properties": {}}}], {}
    yield "null_and_missing_content", [
        sys_(None),
        {"role": "user"},
        a(None),
        u([]),
        a([{"type": "text", "text": "list content"}]),
    ], None, {}
    yield "consecutive_assistants_and_mid_system", [
        u("Count to two"),
        a("one"),
        a("two"),
        sys_("Switch to German."),
        u("Und drei?"),
        a("drei"),
    ], None, {}
    yield "multilingual_and_emoji", [
        sys_("Du bist ein hilfreicher Assistent."),
        u("Wie groß ist der Monitor? 🦅"),
        a("27 Zoll.", reasoning_content="Größe nachsehen…"),
        u("你好，世界。工具调用"),
        a("你好！"),
        u("¿Cuál es la capital de Perú?"),
        a("Lima."),
    ], None, {}
    yield "final_assistant_tool_calls", [
        u("Weather in Paris"),
        a("Let me check.", reasoning_content="Use the tool.", tool_calls=[
            call("get_weather", {"city": "Paris", "unit": "celsius"}, "w1")]),
    ], [WEATHER_TOOL], {}
    yield "empty_tool_calls_list", [u("Hi"), a("Hello", tool_calls=[])], None, {}
    yield "generation_prompt_after_tool", [
        u("Weather in Nairobi"),
        a("", tool_calls=[call("get_weather", {"city": "Nairobi"}, "g1")]),
        tool("Sunny, 24C", "g1"),
    ], [WEATHER_TOOL], {"add_generation_prompt": True}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--template", type=Path, default=REPO / "tools" / "golden" / "glm53_chat_template.jinja")
    parser.add_argument("--out", type=Path, default=GOLDEN_DIR / "renders.json")
    args = parser.parse_args()

    template_bytes = args.template.read_bytes()
    render, engine = make_renderer(template_bytes.decode("utf-8"))
    out_cases = []
    for name, messages, tools, options in cases():
        expected = render(normalise_for_jinja(messages), tools, **options)
        case = {"name": name, "messages": messages, "options": options, "expected": expected}
        if tools is not None:
            case["tools"] = tools
        out_cases.append(case)
    doc = {
        "template_sha256": hashlib.sha256(template_bytes).hexdigest(),
        "engine": engine,
        "cases": out_cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(out_cases)} cases to {args.out} with {engine}", file=sys.stderr)


if __name__ == "__main__":
    main()
