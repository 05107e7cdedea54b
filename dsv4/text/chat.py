"""DeepSeek-V4 chat encoding: messages -> prompt text, and completion text -> assistant message.

Reproduces the official `encoding/encoding_dsv4.py` (DSV4 has no Jinja template); DSV4_SPEC §5
"Encoding". Tokenizer loading and prompt ids live in `dsv4/tokenizer.py`.
"""
from __future__ import annotations

import copy
import json
import re
from typing import Any

from ..errors import InputError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")   # only "max" changes the prompt
ROLES = ("system", "developer", "user", "latest_reminder", "assistant", "tool")
# Roles kept whole when earlier reasoning is dropped (developer turns before the last user
# turn disappear entirely, as in the official code).
_DROP_KEEPS = ("user", "system", "tool", "latest_reminder", "direct_search_results")

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
RESPONSE_FORMAT_TEMPLATE = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {start}), you MUST output your complete reasoning \
inside {start}...{end} BEFORE any tool calls or final response.

Otherwise, output directly after {end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
_TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
_TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
_INVOKE_RE = re.compile(f'<{DSML}invoke name="(.*?)">\n(.*?)</{DSML}invoke>', re.DOTALL)
_PARAM_RE = re.compile(
    f'<{DSML}parameter name="(.*?)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL)


def _json(value: Any) -> str:
    # The official encoder dumps schemas and non-string arguments with ensure_ascii=False and
    # the default ", " / ": " separators; the prompt bytes depend on both.
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """The "## Tools" section for OpenAI-style tools ([{"type": "function", "function": {...}}])."""
    schemas = "\n".join(_json(t["function"] if "function" in t else t) for t in tools)
    return TOOLS_TEMPLATE.format(dsml=DSML, start=THINK_START, end=THINK_END, schemas=schemas)


def _render_arguments(arguments: Any) -> str:
    """DSML parameter lines: strings as is (string="true"), everything else as JSON."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else {"arguments": arguments}
    lines = []
    for key, value in arguments.items():
        is_str = isinstance(value, str)
        lines.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                     f'{value if is_str else _json(value)}</{DSML}parameter>')
    return "\n".join(lines)


def _render_tool_calls(tool_calls: list[dict]) -> str:
    invokes = []
    for call in tool_calls:
        fn = call.get("function", call)
        invokes.append(f'<{DSML}invoke name="{fn.get("name")}">\n'
                       f'{_render_arguments(fn.get("arguments", "{}"))}\n</{DSML}invoke>')
    return "\n\n" + _TOOL_CALLS_OPEN + "\n" + "\n".join(invokes) + "\n" + _TOOL_CALLS_CLOSE


def _render_user_blocks(blocks: list[dict]) -> str:
    parts = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append(block.get("text", ""))
        elif kind == "tool_result":
            body = block.get("content", "")
            if isinstance(body, list):
                body = "\n\n".join(b.get("text", "") if b.get("type") == "text"
                                   else f"[Unsupported {b.get('type')}]" for b in body)
            parts.append(f"<tool_result>{body}</tool_result>")
        else:
            parts.append(f"[Unsupported {kind}]")
    return "\n\n".join(parts)


def _last_user_index(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


def _render(i: int, msgs: list[dict], mode: str, drop_thinking: bool,
            reasoning_effort: str | None) -> str:
    """Text of message i, plus the hand-over to the assistant when a reply follows."""
    msg = msgs[i]
    role = msg.get("role")
    content = msg.get("content")
    last_user = _last_user_index(msgs)
    out = REASONING_EFFORT_MAX if (i == 0 and mode == "thinking" and reasoning_effort == "max") else ""

    if role in ("system", "developer"):
        if role == "developer" and not content:
            raise InputError(f"message {i} (developer) has no content; a developer turn needs text")
        body = (USER if role == "developer" else "") + (content or "")
        if msg.get("tools"):
            body += "\n\n" + render_tools(msg["tools"])
        if msg.get("response_format"):
            body += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=_json(msg["response_format"]))
        out += body
    elif role == "user":
        blocks = msg.get("content_blocks")
        out += USER + (_render_user_blocks(blocks) if blocks else (content or ""))
    elif role == "latest_reminder":
        out += LATEST_REMINDER + (content or "")
    elif role == "assistant":
        reasoning = ""
        prev_has_task = i > 0 and msgs[i - 1].get("task") is not None
        # A reply to a task token is a bare classification: never a thinking block.
        if mode == "thinking" and not prev_has_task and (not drop_thinking or i > last_user):
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = _render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
        out += reasoning + (content or "") + calls + ("" if msg.get("wo_eos") else EOS)
    elif role == "tool":
        raise AssertionError(f"message {i}: tool turns must be merged into user turns first")
    else:
        raise InputError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")

    # Only the turn right before an assistant/latest_reminder turn (or the final turn) hands over.
    if i + 1 < len(msgs) and msgs[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return out
    task = msg.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise InputError(f"message {i} has task {task!r}; expected one of {', '.join(TASK_TOKENS)}")
        if task == "action":
            out += ASSISTANT + (THINK_START if mode == "thinking" else THINK_END)
        out += TASK_TOKENS[task]
    elif role in ("user", "developer"):
        think = mode == "thinking" and (not drop_thinking or i >= last_user)
        out += ASSISTANT + (THINK_START if think else THINK_END)
    return out


def merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Fold role="tool" results (and following user text) into user turns with content_blocks."""
    merged: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        prev = merged[-1] if merged else {}
        open_user = prev.get("role") == "user" and "content_blocks" in prev
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""),
                     "content": msg.get("content", "")}
            if open_user:
                prev["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content", "")}
            if open_user and prev.get("task") is None:
                prev["content_blocks"].append(block)
            else:
                # `mask` (a training-loss flag) and `wo_eos` ride along; neither changes the text.
                new = {"role": "user", "content": msg.get("content", ""), "content_blocks": [block]}
                new.update({k: msg[k] for k in ("task", "wo_eos", "mask") if k in msg})
                merged.append(new)
        else:
            merged.append(msg)
    return merged


def sort_tool_results(messages: list[dict]) -> list[dict]:
    """Reorder tool_result blocks of each user turn to the order of the preceding tool calls (in place)."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {}
            for k, call in enumerate(msg["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    order[call_id] = k
        elif msg.get("role") == "user" and msg.get("content_blocks") and order:
            blocks = msg["content_blocks"]
            results = [b for b in blocks if b.get("type") == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [next(ranked) if b.get("type") == "tool_result" else b
                                         for b in blocks]
    return messages


def drop_thinking_messages(messages: list[dict]) -> list[dict]:
    """Strip reasoning_content of assistant turns before the last user turn; drop earlier developer turns."""
    last_user = _last_user_index(messages)
    out = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role in _DROP_KEEPS or i >= last_user:
            out.append(msg)
        elif role == "assistant":
            out.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return out


def encode_messages(messages: list[dict], thinking_mode: str = "chat", *,
                    tools: list[dict] | None = None, context: list[dict] | None = None,
                    drop_thinking: bool = True, add_default_bos_token: bool = True,
                    reasoning_effort: str | None = None) -> str:
    """Prompt text for a conversation, exactly as the official `encode_messages`.

    A final user/developer turn is followed by "<｜Assistant｜>" plus "<think>" (thinking mode)
    or "</think>" (chat mode): the generation prompt is implied, there is no flag for it.
    `tools` is a convenience (not in the official API): the tools are attached to a leading
    system/developer message, or to a new empty system message. `context` is an already-encoded
    prefix conversation: it is not rendered and suppresses the BOS. Inputs are not modified.
    """
    if thinking_mode not in THINKING_MODES:
        raise InputError(f"thinking_mode={thinking_mode!r}; expected 'chat' or 'thinking'")
    if reasoning_effort not in REASONING_EFFORTS:
        raise InputError(f"reasoning_effort={reasoning_effort!r}; expected None, 'high' or 'max'")
    messages = attach_tools(messages, tools)
    context = context or []
    messages = merge_tool_messages(messages)
    messages = sort_tool_results(context + messages)[len(context):]
    if context:
        context = sort_tool_results(merge_tool_messages(context))
    full = context + messages

    # Conversations with tools keep every reasoning block (tool-use chains need them).
    drop = drop_thinking and not any(m.get("tools") for m in full)
    if thinking_mode == "thinking" and drop:
        full = drop_thinking_messages(full)
        start = len(drop_thinking_messages(context))
    else:
        start = len(context)

    prompt = BOS if add_default_bos_token and not context else ""
    for i in range(start, len(full)):
        prompt += _render(i, full, thinking_mode, drop, reasoning_effort)
    return prompt


def attach_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages with `tools` on the leading system/developer turn (new empty system turn if none)."""
    if not tools:
        return messages
    messages = list(messages)
    if messages and messages[0].get("role") in ("system", "developer"):
        if messages[0].get("tools"):
            raise InputError("tools were given twice: as an argument and on the first message; "
                             "pass them one way only")
        messages[0] = {**messages[0], "tools": tools}
    else:
        messages.insert(0, {"role": "system", "content": "", "tools": tools})
    return messages


TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE, INVOKE_CLOSE = _TOOL_CALLS_OPEN, _TOOL_CALLS_CLOSE, f"</{DSML}invoke>"


def parse_tool_calls(text: str) -> list[dict]:
    """OpenAI-style tool calls [{type, function: {name, arguments}}] of every complete
    `<｜DSML｜invoke name=...>...</｜DSML｜invoke>` in text (string parameters as JSON strings,
    the others as written)."""
    calls = []
    for name, params in _INVOKE_RE.findall(text):
        args = [f"{_json(k)}: {_json(v) if is_str == 'true' else v}"
                for k, is_str, v in _PARAM_RE.findall(params)]
        calls.append({"type": "function",
                      "function": {"name": name, "arguments": "{" + ", ".join(args) + "}"}})
    return calls


def parse_completion(text: str, thinking_mode: str = "chat") -> dict:
    """Assistant message {role, content, reasoning_content, tool_calls} from generated text.

    `text` is what the model produced after the prompt (special tokens kept). In thinking mode
    it must contain "</think>". A missing final EOS is tolerated (a reply cut by max tokens).
    """
    if thinking_mode not in THINKING_MODES:
        raise InputError(f"thinking_mode={thinking_mode!r}; expected 'chat' or 'thinking'")
    reasoning = ""
    if thinking_mode == "thinking":
        reasoning, sep, text = text.partition(THINK_END)
        if not sep:
            raise ValueError("completion has no </think>: the reasoning block is not closed")
    body, _, _ = text.partition(EOS)
    content, sep, calls_text = body.partition("\n\n" + _TOOL_CALLS_OPEN)
    tool_calls = []
    if sep:
        if not calls_text.rstrip().endswith(_TOOL_CALLS_CLOSE):
            raise ValueError(f"tool-call block is not closed with {_TOOL_CALLS_CLOSE}")
        tool_calls = parse_tool_calls(calls_text)
    for token in (BOS, EOS, THINK_START, THINK_END, DSML):
        if token in content or token in reasoning:
            raise ValueError(f"unexpected special token {token!r} in the completion text")
    return {"role": "assistant", "content": content, "reasoning_content": reasoning,
            "tool_calls": tool_calls}
