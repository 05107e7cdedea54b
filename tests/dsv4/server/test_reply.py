"""The streaming reply parser (dsv4/server/reply.py): for replies in every shape (reasoning,
content, tool calls, stop strings, cut by max tokens), split into pieces at every position (and token by
token), the deltas add up to what dsv4.text.chat.parse_completion gives for the whole text, and no
markup ever reaches content or reasoning."""
import itertools

import pytest

from dsv4.text.chat import DSML, THINK_END, parse_completion
from dsv4.server.reply import ReplyParser

CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
REPLIES = [
    ("chat", "Hello there.\n\nBye < > | </thin"),
    ("chat", "Let me check." + CALL),
    ("chat", CALL),
    ("thinking", "I should call the tool.\n" + THINK_END + "Sure." + CALL),
    ("thinking", "Plain thought " + THINK_END + "answer with \n\n newlines\n\n"),
    ("thinking", "no end to this thinking <"),
]


def _run(parser, pieces):
    out = []
    for p in pieces:
        out += parser.push(p)
    out += parser.finish()
    reasoning = "".join(d.text for d in out if d.kind == "reasoning")
    content = "".join(d.text for d in out if d.kind == "content")
    calls = [d.call for d in out if d.kind == "tool_call"]
    return reasoning, content, calls, out


def _splits(text):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)                                     # one character at a time


@pytest.mark.parametrize("mode,text", REPLIES)
def test_every_split_gives_the_whole_parse(mode, text):
    if THINK_END in text or mode == "chat":
        want = parse_completion(text, mode)
    else:                                                # cut inside the reasoning block
        want = {"reasoning_content": text, "content": "", "tool_calls": []}
    for pieces in _splits(text):
        reasoning, content, calls, deltas = _run(ReplyParser(thinking=mode == "thinking"), pieces)
        assert (reasoning, content, calls) == (want["reasoning_content"], want["content"],
                                               want["tool_calls"]), pieces
        for d in deltas:
            assert DSML not in d.text and THINK_END not in d.text


def test_tool_calls_come_whole_as_each_invoke_closes():
    p = ReplyParser()
    assert [d.kind for d in p.push("ok" + CALL[:CALL.index("</｜DSML｜invoke>")])] == ["content"]
    d = p.push(CALL[CALL.index("</｜DSML｜invoke>"):CALL.index('name="now"')])
    assert [x.call["function"]["name"] for x in d] == ["get_weather"]
    assert d[0].call["function"]["arguments"] == '{"city": "Paris", "days": 3}'
    assert [x.call["function"]["name"] for x in p.push(CALL[CALL.index('name="now"'):])] == ["now"]
    assert p.push("trailing text after the block") == [] and p.finish() == []


@pytest.mark.parametrize("cut", [len("Hi.") + k for k in (1, 2, 3, 8, 30, 90)])
def test_a_reply_cut_inside_the_tool_block_leaks_no_markup(cut):
    text = "Hi." + CALL
    reasoning, content, calls, deltas = _run(ReplyParser(), [text[:cut]])
    assert content in ("Hi.", "Hi.\n", "Hi.\n\n", "Hi.\n\n<") and DSML not in content
    assert all(c["function"]["name"] == "get_weather" for c in calls)


def test_stop_strings_end_the_content_at_their_first_occurrence():
    text = "one two STOP three END four"
    for pieces in itertools.islice(_splits(text), 0, None):
        p = ReplyParser(stop=("END", "STOP", ""))
        reasoning, content, calls, _ = _run(p, pieces)
        assert content == "one two " and p.stopped and p.done
    p = ReplyParser(thinking=True, stop=("x",))           # reasoning is not matched
    _, content, _, _ = _run(p, ["a x b" + THINK_END + "c x d"])
    assert content == "c "
    p = ReplyParser(stop=("abc",))
    assert _run(p, ["xab"])[1] == "xab" and not p.stopped   # a held prefix comes out at the end


def test_plain_text_mode_keeps_markup_as_text():
    reasoning, content, calls, _ = _run(ReplyParser(tools=False), ["a" + CALL])
    assert content == "a" + CALL and not calls and not reasoning
