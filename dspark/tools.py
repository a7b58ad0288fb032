"""Tool calling: OpenAI's ``tools`` rendered into the prompt, the calls constrained by a grammar,
and the output parsed back into ``tool_calls``, whole or as a stream.

One call syntax for every target, the one Qwen2.5 (and Hermes) were trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that knows tools (it reads ``tools`` and writes ``<tool_call>``) renders them itself
(``hermes``); for any other template (the bundled SmolLM2's) the tools and the syntax are described in
the system turn, and earlier calls and results are written in the same syntax (``generic``, as
llama.cpp's generic handler does).

The grammar (llguidance's Lark dialect; arguments by ``%json`` of each function's parameters) fixes
every byte outside the arguments, so the parser never guesses: ``required`` is one or more calls,
a named function one call of it, ``auto`` free text, optionally followed by calls. Under ``auto`` the
text cannot open a call tag it does not finish: text holds no ``<t`` unless it continues into
something other than ``<tool_call>`` (``<table>`` is text, ``<tool_call>`` starts a call, ``<tool_``
followed by anything else is refused). So a malformed call is never emitted. ``parallel_tool_calls``
false allows one call.

``ToolCallStream`` turns the text as it comes into content and call deltas whatever the text's
pieces (a step of speculative decoding can hold a whole call, or a tag split anywhere): content
before the first call, then per call its id and name once the name is complete, then the arguments'
text as it grows, holding back only what could be the start of the call's closing.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD = OPEN + '\n{"name": "'           # then the name, then MID
MID = '", "arguments": '
TAIL = "}\n" + CLOSE                   # after the arguments' JSON
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")    # OpenAI's rule for function names
FORMATS = ("auto", "hermes", "generic")

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_TOOLS = 64              # tools per request
MAX_TOOL_BYTES = 16_384     # one tool's definition, as JSON
MAX_TOOLS_BYTES = 131_072   # all of them


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict


def pick_format(tokenizer, wanted: str = "auto") -> str:
    """``hermes`` where the chat template renders tools and writes the call tag itself, else ``generic``."""
    if wanted != "auto":
        return wanted
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):          # named templates: the default one
        template = template.get("default", "")
    return "hermes" if "tools" in template and OPEN in template else "generic"


# ------------------------------------------------------------------------------------ the prompt
def _arguments(text: str):
    """A call's arguments as a template writes them: the JSON value (a template's ``tojson`` of the
    string would encode it twice), or the text as it is when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_text(name: str, arguments: str) -> str:
    return f"{HEAD}{name}{MID}{arguments}{TAIL}"


def describe(functions: list[Function]) -> str:
    """The system turn's description of the tools and of the call syntax (``generic``)."""
    tools = "\n".join(json.dumps({"name": f.name, "description": f.description, "parameters": f.parameters},
                                 ensure_ascii=False) for f in functions)
    return ("You can call functions (tools) to help answer. The functions, one JSON definition a line:\n"
            f"{tools}\n\nTo call a function, answer with this, one block per call:\n"
            f"{OPEN}\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n{CLOSE}\n"
            "A function's result comes back in a <tool_response> block.")


def render_messages(messages: list[dict], functions: list[Function], fmt: str) -> tuple[list[dict], list | None]:
    """(messages, tools) for ``apply_chat_template``: ``messages`` are OpenAI's (role, content,
    ``tool_calls``, ``tool_call_id``); ``hermes`` hands the template the tools and the calls as it
    reads them, ``generic`` writes both into the messages themselves."""
    out: list[dict] = []
    if fmt == "hermes":
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [{"type": "function", "id": c.get("id"),
                          "function": {"name": c["function"]["name"],
                                       "arguments": _arguments(c["function"]["arguments"])}}
                         for c in m["tool_calls"]]
                out.append({"role": "assistant", "content": m.get("content") or "", "tool_calls": calls})
            else:
                out.append({k: v for k, v in m.items() if k != "tool_calls"})
        tools = [{"type": "function", "function": {"name": f.name, "description": f.description,
                                                   "parameters": f.parameters}} for f in functions]
        return out, tools or None
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = "\n".join(_call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            content = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if functions:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + describe(functions)}
        else:
            out.insert(0, {"role": "system", "content": describe(functions)})
    return out, None


# ------------------------------------------------------------------------------------ the grammar
def _not_open() -> str:
    """A lexeme for a '<' that starts a prefix of OPEN and then leaves it (``<ta``, ``<tool_x``), so
    that text may hold those; OPEN itself, or a prefix of it that text ends on, it cannot."""
    body = OPEN[1:]
    alts = [re.escape(body[:i]) + "[^" + re.escape(body[i]) + "<]" for i in range(len(body))]
    return "/<(" + "|".join(alts) + ")/"


def tag_tokens(tokenizer) -> tuple[int | None, int | None]:
    """The ids of OPEN and CLOSE where the tokenizer has each as one added token (Qwen2.5's
    ``<tool_call>``): llguidance reads added tokens as special, so the grammar names them by id (the
    model writes them as that token, not as the bytes of their text). None where a tag is text."""
    added = {t.content: i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    return added.get(OPEN), added.get(CLOSE)


def grammar(functions: list[Function], choice: str | None, parallel: bool = True,
            tags: tuple[int | None, int | None] = (None, None)) -> str:
    """The Lark grammar of the output: ``choice`` auto, required, or a function's name; ``tags``:
    ``tag_tokens`` of the tokenizer."""
    def piece(text: str, tag: str, token: int | None) -> str:
        """``text``, its ``tag`` as the token that is it where there is one."""
        if token is None:
            return json.dumps(text)
        before, after = text.split(tag, 1)
        return " ".join(p for p in (json.dumps(before) if before else "", f"<[{token}]>",
                                    json.dumps(after) if after else "") if p)

    def call(f: Function) -> str:
        # arguments as the call syntax writes them: one line, ", " and ": " (the text the templates
        # and their models write; flexible whitespace would let a model spend tokens on indentation)
        schema = {**(f.parameters or {"type": "object"}), "x-guidance": JSON_STYLE}
        return " ".join([piece(HEAD + f.name + MID, OPEN, tags[0]), "%json", json.dumps(schema),
                         piece(TAIL, CLOSE, tags[1])])
    named = [f for f in functions if f.name == choice]
    pool = named or functions
    rules = [f"call_{i}: {call(f)}" for i, f in enumerate(pool)]
    one = " | ".join(f"call_{i}" for i in range(len(pool)))
    lines = [f"call: {one}", *rules]
    # a newline may close the calls (a model trained on the syntax writes one before its end of turn)
    calls = 'call ("\\n" call)* "\\n"?' if parallel and not named else 'call "\\n"?'
    if choice == "auto":
        lines = ["start: text | text? calls", "text: (CHUNK | NOT_OPEN | \"<\")+", f"calls: {calls}",
                 "CHUNK: /[^<]+/", f"NOT_OPEN: {_not_open()}", *lines]
    else:
        lines = [f"start: {calls}", *lines]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ the output
@dataclass
class Call:
    index: int
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallStream:
    """Text in (``add``, then ``finish``), OpenAI deltas out: each call returns the content and the
    call deltas that can be shown now. ``calls`` holds every call begun, with its arguments so far."""

    content: str = ""
    calls: list[Call] = field(default_factory=list)
    _buf: str = ""
    _state: str = "text"            # text | head | args | between

    def add(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, list[dict]]:
        content, deltas = "", []
        while True:
            b = self._buf
            if self._state == "text":
                i = b.find(OPEN)
                if i < 0:
                    keep = 0 if final else _held(b, OPEN)
                    content += b[:len(b) - keep]
                    self._buf = b[len(b) - keep:]
                    break
                content += b[:i]
                self._buf, self._state = b[i:], "head"
            elif self._state == "head":
                n = min(len(b), len(HEAD))
                if b[:n] != HEAD[:n]:       # not the syntax (no grammar made it so): text
                    content += b[:len(OPEN)]
                    self._buf, self._state = b[len(OPEN):], "text"
                    continue
                j = b.find(MID, len(HEAD)) if len(b) >= len(HEAD) else -1
                if j < 0:                   # the name is still coming (or was cut off: then text)
                    if final:
                        content += b
                        self._buf, self._state = "", "text"
                    break
                call = Call(len(self.calls), "call_" + secrets.token_hex(12), b[len(HEAD):j])
                self.calls.append(call)
                deltas.append({"index": call.index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                self._buf, self._state = b[j + len(MID):], "args"
            elif self._state == "args":
                i = b.find(TAIL)
                if i >= 0:
                    piece, rest = b[:i], b[i + len(TAIL):]
                else:
                    cut = min(len(b), _cut(self.calls[-1].arguments + b, final))
                    piece, rest = b[:len(b) - cut], None
                if piece:
                    self.calls[-1].arguments += piece
                    deltas.append({"index": self.calls[-1].index, "function": {"arguments": piece}})
                if rest is None:
                    self._buf = b[len(piece):]
                    break
                self._buf, self._state = rest, "between"
            else:                           # between calls: a newline, then the next or the end
                nxt = "\n" + OPEN
                if b.startswith(nxt) or b.startswith(OPEN):
                    self._buf, self._state = b[1:] if b.startswith(nxt) else b, "head"
                    continue
                if not final and nxt.startswith(b):
                    break
                if final and not b.strip():     # the newline that may close the calls
                    self._buf = ""
                    break
                self._state = "text"        # anything else (no grammar allows it) is text
        self.content += content
        return content, merge_deltas(deltas)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _cut(args: str, final: bool) -> int:
    """How much of the end of a call's arguments so far to hold back: what could be the start of its
    closing; at the end of an output cut off inside a call, what is the closing's start (it has begun
    with its newline, or only the text before it is whole JSON)."""
    held = _held(args, TAIL)
    if not final or not held:
        return held
    if args[-held:].startswith("}\n") or (_is_json(args[:-held]) and not _is_json(args)):
        return held
    return 0


def _held(text: str, tag: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """Argument pieces of one call that follow each other in one batch, as one delta (a call's
    first delta, its id and name, stays apart, as OpenAI sends it)."""
    out: list[dict] = []
    for d in deltas:
        if out and "id" not in d and "id" not in out[-1] and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append(d)
    return out


def parse(text: str) -> tuple[str, list[Call]]:
    """A whole output's content and calls (what the stream of the same text reassembles to)."""
    s = ToolCallStream()
    s.add(text)
    s.finish()
    return s.content, s.calls
