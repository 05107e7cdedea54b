"""DSV4 chat encoding: the official reference prompts (../shared) and the template rules."""
from __future__ import annotations

import copy
import json

import pytest

from dsv4.text.chat import (ASSISTANT, BOS, EOS, REASONING_EFFORT_MAX, THINK_END, THINK_START, USER,
                       encode_messages, parse_completion)
from dsv4.errors import InputError

CASE_MODES = {1: "thinking", 2: "thinking", 3: "thinking", 4: "chat"}


def load_case(shared_dir, n):
    folder = shared_dir / "data" / "dsv4-encoding"
    if not (folder / f"test_input_{n}.json").is_file():
        pytest.skip(f"encoding case {n} not found in {folder}")
    data = json.loads((folder / f"test_input_{n}.json").read_text(encoding="utf-8"))
    expected = (folder / f"test_output_{n}.txt").read_text(encoding="utf-8")
    if isinstance(data, dict):   # case 1: {"messages": [...], "tools": [...]}
        data["messages"][0]["tools"] = data["tools"]
        data = data["messages"]
    return data, expected


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_official_case_byte_exact(shared_dir, n):
    messages, expected = load_case(shared_dir, n)
    before = copy.deepcopy(messages)
    got = encode_messages(messages, CASE_MODES[n])
    assert got.encode("utf-8") == expected.encode("utf-8")
    assert messages == before, "encode_messages must not modify its input"


def test_tools_argument_matches_case_1(shared_dir):
    folder = shared_dir / "data" / "dsv4-encoding"
    if not (folder / "test_input_1.json").is_file():
        pytest.skip("encoding case 1 not found")
    data = json.loads((folder / "test_input_1.json").read_text(encoding="utf-8"))
    expected = (folder / "test_output_1.txt").read_text(encoding="utf-8")
    assert encode_messages(data["messages"], "thinking", tools=data["tools"]) == expected


def test_chat_and_thinking_suffix():
    msgs = [{"role": "user", "content": "Hi"}]
    assert encode_messages(msgs, "chat") == f"{BOS}{USER}Hi{ASSISTANT}{THINK_END}"
    assert encode_messages(msgs, "thinking") == f"{BOS}{USER}Hi{ASSISTANT}{THINK_START}"
    assert encode_messages(msgs) == encode_messages(msgs, "chat")


def test_system_prompt_has_no_role_token():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert encode_messages(msgs, "chat") == f"{BOS}Be brief.{USER}Hi{ASSISTANT}{THINK_END}"


def test_thinking_drops_reasoning_before_last_user_only():
    msgs = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "A", "reasoning_content": "old-thought"},
            {"role": "user", "content": "b"}]
    out = encode_messages(msgs, "thinking")
    assert out == f"{BOS}{USER}a{ASSISTANT}{THINK_END}A{EOS}{USER}b{ASSISTANT}{THINK_START}"
    kept = encode_messages(msgs, "thinking", drop_thinking=False)
    assert f"{USER}a{ASSISTANT}{THINK_START}old-thought{THINK_END}A{EOS}" in kept
    # tools anywhere keep every reasoning block
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert "old-thought" in encode_messages(msgs, "thinking", tools=tools)


def test_chat_mode_never_writes_reasoning():
    msgs = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "A", "reasoning_content": "thought"}]
    assert encode_messages(msgs, "chat") == f"{BOS}{USER}a{ASSISTANT}{THINK_END}A{EOS}"


def test_reasoning_effort_max_only_in_thinking_mode():
    msgs = [{"role": "user", "content": "x"}]
    assert encode_messages(msgs, "thinking", reasoning_effort="max").startswith(
        BOS + REASONING_EFFORT_MAX + USER)
    assert encode_messages(msgs, "chat", reasoning_effort="max") == encode_messages(msgs, "chat")
    assert encode_messages(msgs, "thinking", reasoning_effort="high") == encode_messages(msgs, "thinking")


def test_task_tokens():
    msgs = [{"role": "user", "content": "q", "task": "query"}]
    assert encode_messages(msgs, "chat") == f"{BOS}{USER}q<｜query｜>"
    msgs = [{"role": "user", "content": "q", "task": "action"}]
    assert encode_messages(msgs, "thinking") == f"{BOS}{USER}q{ASSISTANT}{THINK_START}<｜action｜>"
    with pytest.raises(InputError, match="task 'bogus'"):
        encode_messages([{"role": "user", "content": "q", "task": "bogus"}])


def test_tool_results_merge_and_follow_call_order():
    calls = [{"id": f"c{k}", "type": "function",
              "function": {"name": "f", "arguments": json.dumps({"n": k, "s": "x"})}}
             for k in (1, 2)]
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c2", "content": "two"},
            {"role": "tool", "tool_call_id": "c1", "content": "one"}]
    out = encode_messages(msgs, "chat")
    assert out.endswith(f"{EOS}{USER}<tool_result>one</tool_result>\n\n"
                        f"<tool_result>two</tool_result>{ASSISTANT}{THINK_END}")
    assert '<｜DSML｜parameter name="n" string="false">1</｜DSML｜parameter>' in out
    assert '<｜DSML｜parameter name="s" string="true">x</｜DSML｜parameter>' in out


def test_developer_turn_dropped_before_last_user_in_thinking_mode():
    msgs = [{"role": "developer", "content": "dev-1"},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "b"}]
    assert "dev-1" not in encode_messages(msgs, "thinking")
    assert "dev-1" in encode_messages(msgs, "chat")


def test_bad_arguments_name_the_problem():
    with pytest.raises(InputError, match="thinking_mode='think'"):
        encode_messages([{"role": "user", "content": "x"}], "think")
    with pytest.raises(InputError, match="reasoning_effort='low'"):
        encode_messages([{"role": "user", "content": "x"}], "thinking", reasoning_effort="low")
    with pytest.raises(InputError, match="role 'bot'"):
        encode_messages([{"role": "bot", "content": "x"}])


def test_parse_completion_round_trip():
    call = {"type": "function",
            "function": {"name": "get_weather", "arguments": '{"location": "Beijing", "days": 3}'}}
    turn = {"role": "assistant", "content": "Let me check.", "reasoning_content": "need weather",
            "tool_calls": [call]}
    prompt = encode_messages([{"role": "user", "content": "w?"}], "thinking")
    full = encode_messages([{"role": "user", "content": "w?"}, turn], "thinking")
    parsed = parse_completion(full[len(prompt):], "thinking")
    assert parsed == {"role": "assistant", "content": "Let me check.",
                      "reasoning_content": "need weather", "tool_calls": [call]}
    assert parse_completion("Hello" + EOS) == {"role": "assistant", "content": "Hello",
                                                "reasoning_content": "", "tool_calls": []}
    with pytest.raises(ValueError, match="</think>"):
        parse_completion("no end", "thinking")
