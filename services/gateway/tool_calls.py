"""An answer's tool calls, read out of its text: whole for a JSON reply, and as the text streams for
SSE, in the OpenAI API's streaming shape (a call's index, id and function name first, then its
arguments in fragments).

The format is the chat templates': `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`.
Text before the first call is the message's content. A call's `arguments` are its raw JSON text,
the same whole or streamed. A call cut off by max_tokens stays text in a whole answer; streamed, its
fragments were already sent.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.DOTALL)
TAIL = re.compile(r"\}\s*$")  # the call object's own closing brace, after the arguments


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole answer: the calls that parse, and the text before the first,
    trailing whitespace dropped (None when nothing is left); with no call that parses, all of the
    text is content. Text after the first call is not content (the template puts none there)."""
    calls = []
    for match in CALL.finditer(text):
        parsed = _call(match.group(1))
        if parsed is not None:
            calls.append(tool_call(*parsed))
    if not calls:
        return text, []
    content = text[: text.index(OPEN)].rstrip()
    return content or None, calls


def _call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one call's body, or None when it is not a call."""
    head = HEAD.match(body)
    tail = TAIL.search(body)
    if head is None or tail is None or tail.start() < head.end():
        return None
    arguments = body[head.end() : tail.start()].strip()
    try:
        name = json.loads(f'"{head.group(1)}"')
        if not isinstance(json.loads(arguments), dict):
            return None
    except ValueError:
        return None
    return name, arguments


@dataclass
class CallStream:
    """Text in, deltas out: `feed` the answer's text as it comes and get `{"content": ...}` and
    `{"tool_calls": [...]}` deltas, then `flush` at its end. Their concatenation is what `parse`
    makes of the whole text: text that may yet be the start of a call tag, or whitespace before one,
    is held back until it is known not to be."""

    buffer: str = ""
    calls: int = 0  # calls ended
    in_call: bool = False
    named: bool = False  # the current call's head (id, name) was sent
    args_from: int = 0  # where the current call's arguments start in the buffer
    sent_args: int = 0  # characters of the current call's arguments sent
    began: bool = False  # a call began: text outside calls is no longer content

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        deltas: list[dict] = []
        while (step := self._call_step() if self.in_call else self._text_step()) is not None:
            deltas += step
        return deltas

    def flush(self) -> list[dict]:
        """The answer ended: text still held is content, unless a call began (an unfinished call's
        fragments were sent; `parse` keeps such text as content, having no call at all)."""
        rest, self.buffer = self.buffer, ""
        return [{"content": rest}] if rest and not self.began else []

    def _text_step(self) -> list[dict] | None:
        at = self.buffer.find(OPEN)
        if at >= 0:
            text, self.buffer = self.buffer[:at].rstrip(), self.buffer[at + len(OPEN) :]
            self.in_call, self.named, self.sent_args = True, False, 0
            out = [{"content": text}] if text and not self.began else []
            self.began = True
            return out
        head = self.buffer[: len(self.buffer) - _partial_suffix(self.buffer, OPEN)].rstrip()
        if not head:
            return None
        self.buffer = self.buffer[len(head) :]
        return [] if self.began else [{"content": head}]

    def _call_step(self) -> list[dict] | None:
        end = self.buffer.find(CLOSE)
        body = self.buffer if end < 0 else self.buffer[:end]
        out: list[dict] = []
        if not self.named:
            head = HEAD.match(body)
            if head is None or head.end() == len(body):  # the arguments' first character not yet in
                if end >= 0:  # not a call after all: dropped, as `parse` drops it
                    self.buffer, self.in_call = self.buffer[end + len(CLOSE) :], False
                    return []
                return None
            function = {"name": json.loads(f'"{head.group(1)}"'), "arguments": ""}
            out.append(self._delta({"id": call_id(), "type": "function", "function": function}))
            self.named, self.args_from = True, head.end()
        arguments = body[self.args_from :]
        if end >= 0:
            tail = TAIL.search(arguments)
            ready = arguments[: tail.start()].rstrip() if tail else arguments
        else:  # hold back what may yet be the call's closing brace and the whitespace before it
            ready = arguments[: len(arguments) - _closing_suffix(arguments)]
        if len(ready) > self.sent_args:
            out.append(self._delta({"function": {"arguments": ready[self.sent_args :]}}))
            self.sent_args = len(ready)
        if end >= 0:
            self.buffer, self.in_call = self.buffer[end + len(CLOSE) :], False
            self.calls += 1
            return out
        return out or None

    def _delta(self, call: dict) -> dict:
        return {"tool_calls": [{"index": self.calls, **call}]}


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _closing_suffix(arguments: str) -> int:
    """How many characters at the end of a call's arguments so far may be the call's own `}` and the
    whitespace and tag around it: from the last `}` when only whitespace or `<` follows it."""
    last = arguments.rfind("}")
    if last < 0:
        return len(arguments) - len(arguments.rstrip())
    after = arguments[last + 1 :]
    if after.strip() in ("", *(CLOSE[:n] for n in range(1, len(CLOSE)))):
        return len(arguments) - last
    return len(arguments) - len(arguments.rstrip())
