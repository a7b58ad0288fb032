"""The OpenAI API's request bodies (completions, chat completions) as pydantic models, and the text
side of a response: incremental detokenisation with stop strings.

Fields the engine cannot honour are refused with a clear 400 rather than ignored: any field the
API does not define. Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant
``tool_calls`` and ``tool`` messages) are rendered, constrained and parsed by tools.py. Types are strict (no ``true`` for a token id, no ``"yes"`` for a
boolean), strings must be valid Unicode (no lone surrogate, which a JSON body can spell
``"\\ud800"``), and a seed must fit the generator of every choice. Structured outputs (OpenAI's
``response_format`` json_object / json_schema, vLLM's ``structured_outputs`` json / regex / choice /
grammar) restrict the law to what the grammar allows (structured.py). vLLM's extensions ``top_k``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids`` and ``min_tokens`` are accepted; the logit
bias, penalties and ``min_tokens`` define the distribution the output follows (the target's
processed logits), which speculative decoding reproduces exactly. Log probabilities are the
target's own (log-softmax of its raw logits, before temperature and truncation: vLLM's default
``raw_logprobs``), whatever drafted the tokens; ``echo`` with ``logprobs`` also scores the prompt's
tokens (the first has none), as evaluation harnesses ask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .sampling import MAX_SEED
from .tools import MAX_TOOL_BYTES, MAX_TOOLS, MAX_TOOLS_BYTES

MAX_N = 16          # choices per request
MAX_STOPS = 16      # stop strings per request
MAX_LOGPROBS = 20   # most likely tokens returned per position (OpenAI's limit for chat)
TokenId = Annotated[int, Field(ge=0)]
# every model: unknown fields refused, strict types (a JSON true is no token id, "yes" no boolean)
_STRICT = ConfigDict(extra="forbid", strict=True)


def _lone_surrogate(value, path: str = "") -> str | None:
    """Where in a JSON value a string (or a key) holds a lone surrogate, which no UTF-8 encodes
    (a tokenizer, a grammar compiler, a log line all fail on it), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")       # fails on a surrogate alone
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and _lone_surrogate(k) is not None:
                return where.encode("utf-8", "backslashreplace").decode()   # the key itself, escaped
            found = _lone_surrogate(v, where)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def _schema_of_checks(strings: dict, arrays: dict | None = None):
    """A field's JSON schema (what /openapi.json tells a client, or a fuzzer) given the constraints a
    validator of the field checks: ``strings`` on every string in it, ``arrays`` on every array."""
    def add(schema: dict) -> None:
        for member in schema.get("anyOf", [schema]):
            if member.get("type") == "string":
                member.update(strings)
            elif member.get("type") == "array":
                member.update(arrays or {})
                add(member.get("items", {}))
    return add


class _Body(BaseModel):
    """A request body: strict types, unknown fields refused, valid Unicode everywhere."""
    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        where = _lone_surrogate(data)
        if where is not None:
            # ctx.field: the server's error handler names it as the error's param
            raise PydanticCustomError("lone_surrogate", "{field}: a string holds a lone surrogate (not valid "
                                      "Unicode)", {"field": where})
        return data


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class JsonSchema(BaseModel):
    """OpenAI's ``response_format.json_schema``."""
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""
    # one constraint: one key (the schema's approximation of _one)
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True,
                              json_schema_extra={"minProperties": 1, "maxProperties": 1})
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _one(self):
        if sum(v is not None for v in (self.json_, self.regex, self.choice, self.grammar)) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar")
        return self


class _Sampling(_Body):
    """Fields shared by both endpoints."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="below 1e-5: greedy, as 0")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1, description="vLLM extension: 0 or -1 = off")
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, description="choice i of a request samples with seed + i, "
                                                     "at most 2**64 - 1")
    stop: str | list[str] | None = Field(None, validate_default=True, json_schema_extra=_schema_of_checks(
        {"minLength": 1}, {"maxItems": MAX_STOPS}))     # what _stops checks
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past end-of-text tokens")
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOPS,
                                      description="vLLM extension: token ids that end a choice too (kept)")
    min_tokens: int = Field(0, ge=0, description="vLLM extension: no stop token before this many tokens")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, ge=1e-6, le=1e6, allow_inf_nan=False,
                                      description="vLLM extension: 1 = off")
    logit_bias: dict[str, float] | None = Field(
        None, description="token id -> bias in [-100, 100], added to its logit",
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,18}$"},     # what _bias checks, in the schema
                           "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension")
    user: str | None = None

    def grammar_spec(self):
        """The structured.GrammarSpec the output must match, or None."""
        from .structured import GrammarSpec
        if self.response_format is not None and self.response_format.type != "text":
            if self.structured_outputs is not None:
                raise ValueError("give response_format or structured_outputs, not both")
            if self.response_format.type == "json_object":
                return GrammarSpec("json", {"type": "object"})
            return GrammarSpec("json", self.response_format.json_schema.schema_)
        so = self.structured_outputs
        if so is None:
            return None
        for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar)):
            if value is not None:
                return GrammarSpec(kind, value)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("seed")
    @classmethod
    def _seed(cls, v, info: ValidationInfo):
        n = info.data.get("n", 1)       # n comes first: choice i samples with seed + i
        if v is not None and v + n - 1 > MAX_SEED:
            raise ValueError(f"must be at most 2**64 - n = {MAX_SEED + 1 - n} (choice i samples with seed + i)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for k, b in (v or {}).items():
            # ASCII digits only: int() also takes "²", " 7", "1_0" and other digits; 18 digits at most
            if not (k.isascii() and k.isdigit() and len(k) <= 18):
                raise ValueError(f"keys must be token ids (decimal digits), got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"values must be in [-100, 100], got {b}")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self


class CompletionRequest(_Sampling):
    # what _prompt checks, in the schema: no blank text, no empty list
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        json_schema_extra=_schema_of_checks({"pattern": r"\S"}, {"minItems": 1}))
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="log probabilities of the sampled and this many most likely tokens")
    best_of: int | None = None
    suffix: str | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str):
            v = [v]
        elif v and isinstance(v[0], int):
            v = [v]
        if not v:
            raise ValueError("prompt is empty")
        for p in v:
            if (isinstance(p, str) and not p.strip()) or (isinstance(p, list) and not p):
                raise ValueError("prompt is empty")
            if isinstance(p, list) and any(t < 0 for t in p):
                raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _refused(self):
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCall(BaseModel):
    """An assistant message's call (``tool_calls``), as a response returned it."""
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None     # an assistant's calls
    tool_call_id: str | None = None              # a tool message: the call it answers

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _refused(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        names, total = set(), 0
        for t in v or []:
            size = len(t.model_dump_json())
            total += size
            if size > MAX_TOOL_BYTES:
                raise ValueError(f"tool {t.function.name!r} is {size} bytes as JSON; at most {MAX_TOOL_BYTES}")
            if t.function.name in names:
                raise ValueError(f"two tools are named {t.function.name!r}")
            names.add(t.function.name)
        if total > MAX_TOOLS_BYTES:
            raise ValueError(f"the tools are {total} bytes as JSON; at most {MAX_TOOLS_BYTES}")
        return v

    @property
    def tool_mode(self) -> str | None:
        """What the output may hold: None (no tools, or ``none``), ``auto``, ``required`` or the
        name of the function it must call."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else None)
        if choice is None or choice == "none" or not self.tools:
            return None
        return choice.function.name if isinstance(choice, NamedToolChoice) else choice

    @property
    def num_logprobs(self) -> int | None:
        """Most likely tokens to return per position, or None for no log probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> list[dict]:
        return chat_messages(self.messages)


def chat_messages(messages: list[Message]) -> list[dict]:
    """Messages as a chat template reads them ("developer" is the newer name of "system"); an
    assistant's calls and a tool message's call id kept as OpenAI writes them (tools.py renders them)."""
    out = []
    for m in messages:
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


class TokenizeRequest(_Body):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages through the chat template."""
    model_config = ConfigDict(json_schema_extra={"anyOf": [     # what _one checks, in the schema
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages")
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt, messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


class TextStream:
    """Token ids in, text out, as they come: each ``add`` returns the text that can be shown now.

    Decoding is incremental (each new chunk decoded together with the previous one, so that a
    tokenizer's word-boundary rules see the same neighbours as in a whole decode), and text that
    ends in an incomplete UTF-8 sequence waits for its next token. With stop strings, the text is
    cut before the first occurrence of any of them (the stop string itself is not returned, as in
    the OpenAI API), and a tail that could be the start of one is held back until it is not;
    ``kept`` says how many ids of the last ``add`` the output has (those up to the one that completed
    the stop string: the tokens that count, and whose log probabilities are returned)."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tok = tokenizer
        self.stops = list(stops)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self._prefix = 0
        self._read = 0
        self.kept = 0

    def _decode(self, final: bool) -> None:
        prev = self.tok.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(full) > len(prev) and (final or not full.endswith("\ufffd")):
            self.text += full[len(prev):]
            self._prefix, self._read = self._read, len(self.ids)

    def add(self, ids: list[int], final: bool = False) -> str:
        if self.stopped:
            self.kept = 0
            return ""
        self.ids.extend(ids)
        self.kept = len(ids)
        self._decode(final)
        end = len(self.text)
        if self.stops:
            start = max(0, self.sent - max(map(len, self.stops)) + 1)
            hits = [(i, i + len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stops) if i >= 0]
            if hits:
                end, stop_end = min(hits)
                self.stopped = True
                self.kept = self._tokens_to(stop_end, len(ids))
            elif not final:
                end -= self._held_back()
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def _tokens_to(self, chars: int, new: int) -> int:
        """How many of the ``new`` last ids it takes for the decoded text to reach ``chars``."""
        base = len(self.ids) - new
        for m in range(1, new):
            if len(self.tok.decode(self.ids[:base + m], skip_special_tokens=True)) >= chars:
                return m
        return new

    def finish(self) -> str:
        """The rest of the text once the request has ended."""
        return self.add([], final=True)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for k in range(min(len(self.text), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    @property
    def output(self) -> str:
        return self.text[:self.sent]
