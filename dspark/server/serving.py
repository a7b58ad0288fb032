"""A request's way through the server: checked and tokenised into choices (a job each), submitted
to the engine's thread, and its events read back as text, tokens and finish reasons."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field

from .. import tools as tool_calls
from ..engine import Engine, RequestOptions
from ..errors import DsparkError
from ..grammar_sandbox import SERVER_STACK, GrammarSandbox, GrammarTimeout, SandboxBusy
from ..protocol import ChatCompletionRequest, CompletionRequest, TextStream
from ..runtime.allocator import release_memory
from ..sampling import SamplingParams
from ..structured import grammar_states
from .door import DEFAULT_MAX_PROMPTS, ApiError
from .metrics import Metrics
from .worker import EngineWorker, Failed, Job, Tokens

log = logging.getLogger("dspark.server")


@dataclass
class Choice:
    index: int
    prompt_tokens: int
    text: TextStream
    job: Job
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)   # (token, log probability, top) of the output so far
    logprob_chars: int = 0                          # text_offset of the next token (completions)
    tools: tool_calls.ToolCallStream | None = None  # the output's calls, parsed as it comes (tools.py)


class Server:
    """The app's state: target, engine worker, metrics, and the request handling shared by both
    endpoints."""

    def __init__(self, target, engine: Engine, model_name: str, api_key: str | None = None,
                 max_prompts: int = DEFAULT_MAX_PROMPTS, tool_format: str = "auto"):
        self.target = target
        self.tokenizer = target.tokenizer
        self.tool_format = tool_calls.pick_format(target.tokenizer, tool_format)
        self.tool_tags = tool_calls.tag_tokens(target.tokenizer)
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key      # what the door asks for (Door), kept here for the app's users
        self.max_prompts = max_prompts
        self.metrics = Metrics()
        self.worker = EngineWorker(engine, self.metrics)
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}
        # requests' grammars are compiled and checked in a child process (grammar_sandbox.py); the
        # threads started from here on get the stack that sandbox's margin is measured against
        self.grammars = GrammarSandbox(self.tokenizer, target.model.config.vocab_size, target.eos_token_ids)
        if threading.stack_size() < SERVER_STACK:
            threading.stack_size(SERVER_STACK)
        release_memory()      # what loading the target and the drafter left behind

    # ------------------------------------------------------------------ requests -> jobs
    def check(self, body) -> None:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"`{self.model_name}`.", "invalid_request_error", "model", "model_not_found")

    def limit(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """max_tokens checked against the per-request cache (or, when absent, all that fits)."""
        room = self.engine.room(len(prompt_ids))
        if max_tokens is None:
            if room < 1:
                raise ApiError(400, f"This model's maximum context length is {self.engine.cache.max_len} tokens; "
                                    f"the prompt has {len(prompt_ids)}.", param="messages",
                               code="context_length_exceeded")
            return room
        if max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {self.engine.cache.max_len} tokens "
                                f"(less {self.engine.block_size + 1} for drafting); the prompt has {len(prompt_ids)} "
                                f"and max_tokens is {max_tokens}.", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 add_special_tokens: bool = False, tools: list | None = None) -> list[int]:
        """``messages`` through the chat template; with tools, as tools.render_messages wrote them."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        if tools is None:
            messages, tools = tool_calls.render_messages(messages, [], self.tool_format)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, tools=tools)
        except Exception as e:     # a template that refuses these messages (e.g. roles out of order)
            raise ApiError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        vocab = self.target.model.config.vocab_size
        if any(t >= vocab for t in prompt):
            raise ApiError(400, f"token ids must be below the vocabulary size {vocab}", param="prompt")
        return list(prompt)

    def grammar(self, body) -> str | None:
        """The request's structured-output constraint compiled (once for all its choices) and
        checked against the parser limits on this target's tokenizer, in the grammar sandbox, or
        None. Blocks for up to the sandbox's timeout on a pathological grammar: handlers run it in
        a thread."""
        param = "structured_outputs" if body.structured_outputs is not None else "response_format"
        try:
            spec = body.grammar_spec()
            if spec is None:
                return None
            return self.grammars.compile(spec.kind, spec.value)
        except SandboxBusy as e:
            raise ApiError(503, str(e), type_="server_error", code="grammar_queue_full") from None
        except (ValueError, DsparkError) as e:
            raise ApiError(400, f"{param}: {e}", param=param) from None

    def completion_choices(self, body: CompletionRequest) -> tuple[list[Choice], list[str]]:
        """A completion request's choices, and each prompt's echo ("" without ``echo``): the
        tokenising and checking of ``choices``, which handlers run in a worker thread."""
        self.check(body)
        if len(body.prompt) > self.max_prompts:
            raise ApiError(400, f"prompt: {len(body.prompt)} prompts in one request, more than this server's "
                                f"limit of {self.max_prompts} (--max-prompts)", param="prompt", code="too_many_prompts")
        prompts = [self.prompt_ids(p) for p in body.prompt]
        echo = [self.tokenizer.decode(p, skip_special_tokens=True) if body.echo else "" for p in prompts]
        return self.choices(prompts, body, body.max_tokens, self.grammar(body)), echo

    def chat_choices(self, body: ChatCompletionRequest) -> list[Choice]:
        """A chat request's choices (in a worker thread, as completion_choices); with tools, the
        prompt renders them, a grammar constrains the calls and each choice parses its own."""
        self.check(body)
        mode = body.tool_mode
        if body.tool_choice not in (None, "none") and not body.tools:
            raise ApiError(400, "tool_choice: needs tools", param="tool_choice")
        functions = [tool_calls.Function(t.function.name, t.function.description or "",
                                         t.function.parameters or {"type": "object", "properties": {}})
                     for t in body.tools or []]
        if mode not in (None, "auto", "required") and mode not in {f.name for f in functions}:
            raise ApiError(400, f"tool_choice: names the function {mode!r}, which is not among tools",
                           param="tool_choice")
        if mode is not None and (body.structured_outputs is not None or (
                body.response_format is not None and body.response_format.type != "text")):
            raise ApiError(400, "tools: a tool call's grammar cannot be combined with response_format or "
                                "structured_outputs (give tool_choice none, or drop one)", param="tools")
        messages, template_tools = tool_calls.render_messages(body.chat(), functions, self.tool_format)
        ids = self.chat_ids(messages, tools=template_tools or [])
        grammar = self.tool_grammar(functions, mode, body.parallel_tool_calls) if mode else self.grammar(body)
        choices = self.choices([ids], body, body.token_limit, grammar)
        if mode:
            for ch in choices:
                ch.tools = tool_calls.ToolCallStream()
        return choices

    def tool_grammar(self, functions: list[tool_calls.Function], mode: str, parallel: bool) -> str:
        """The calls' grammar, compiled and checked in the grammar sandbox; a schema it refuses is
        named (``tools.N.function.parameters``)."""
        try:
            return self.grammars.compile("grammar", tool_calls.grammar(functions, mode, parallel, self.tool_tags))
        except SandboxBusy as e:
            raise ApiError(503, str(e), type_="server_error", code="grammar_queue_full") from None
        except GrammarTimeout as e:     # not each tool in turn: each might take the timeout again
            raise ApiError(400, f"tools: {e}", param="tools") from None
        except DsparkError as e:
            for i, f in enumerate(functions):
                try:
                    self.grammars.compile("json", f.parameters)
                except (GrammarTimeout, SandboxBusy):
                    break       # no more of the sandbox's time on naming the culprit
                except DsparkError as bad:
                    where = f"tools.{i}.function.parameters"
                    raise ApiError(400, f"{where}: {bad}", param=where) from None
            raise ApiError(400, f"tools: {e}", param="tools") from None

    def choices(self, prompts: list[list[int]], body, max_tokens: int | None,
                grammar: str | None = None) -> list[Choice]:
        """n choices per prompt, checked, their jobs not yet submitted (``start``). ``grammar``: the
        request's, from ``grammar``."""
        if not all(prompts):    # text a tokenizer drops whole (characters outside its vocabulary)
            raise ApiError(400, "the prompt has no tokens for this model", param="prompt" if hasattr(body, "prompt")
                           else "messages")
        limits = [self.limit(p, max_tokens) for p in prompts]      # all checked before any is submitted
        vocab = self.target.model.config.vocab_size
        if any(t >= vocab for t in body.stop_token_ids):
            raise ApiError(400, f"stop_token_ids must be below the vocabulary size {vocab}", param="stop_token_ids")
        stop_ids = (frozenset() if body.ignore_eos else self.engine.eos_ids) | frozenset(body.stop_token_ids)
        bias = tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))
        if any(t >= vocab for t, _ in bias):
            raise ApiError(400, f"logit_bias token ids must be below the vocabulary size {vocab}", param="logit_bias")
        # one matcher built per request, copied for each choice (grammar_states)
        states = grammar_states(self.target, grammar, len(prompts) * body.n) if grammar is not None else None
        choices = []
        for pi, (ids, limit) in enumerate(zip(prompts, limits)):
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + j
                try:
                    params = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=seed,
                                            presence_penalty=body.presence_penalty,
                                            frequency_penalty=body.frequency_penalty,
                                            repetition_penalty=body.repetition_penalty, logit_bias=bias)
                except DsparkError as e:
                    raise ApiError(400, str(e), param="seed" if "seed" in str(e) else None) from None
                scored = body.num_logprobs if getattr(body, "echo", False) else None    # the prompt's too
                options = RequestOptions(params, limit, stop_ids, body.num_logprobs, scored, body.min_tokens,
                                         None if states is None else states[pi * body.n + j])
                job = Job(ids, options, _no_sink)
                choices.append(Choice(pi * body.n + j, len(ids), TextStream(self.tokenizer, body.stop), job))
        return choices

    def start(self, choices: list[Choice]) -> asyncio.Queue:
        """Submit the choices' jobs (on the event loop); their events arrive on the returned queue as
        (index, event)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for ch in choices:
            def sink(ev, i=ch.index):
                loop.call_soon_threadsafe(queue.put_nowait, (i, ev))
            ch.job.sink = sink
            self.worker.submit(ch.job)
        return queue

    async def events(self, choices: list[Choice], queue: asyncio.Queue):
        """(choice, new text, the new tokens' (token, log probability, top) if asked) as tokens come,
        until every choice has ended; a choice's last item carries its finish_reason. Cancels what
        is still running when closed before that (the client went away: see _respond)."""
        live = len(choices)
        try:
            while live:
                i, ev = await queue.get()
                ch = choices[i]
                if ch.finish_reason is not None:
                    continue
                if isinstance(ev, Failed):
                    raise ApiError(500, ev.message, "internal_error")
                if isinstance(ev, Tokens):
                    text = _decoded(ch.text.add, ev.ids)
                    kept = ch.text.kept            # the tokens after a stop string do not count
                    ch.tokens += kept
                    new = [(t, *lp) for t, lp in zip(ev.ids[:kept], ev.logprobs)] if ev.logprobs is not None else []
                    ch.logprobs.extend(new)
                    if ch.text.stopped:
                        self.worker.cancel(ch.job)
                        ch.finish_reason = "stop"
                        live -= 1
                        self.metrics.finished.labels(finished_reason="stop").inc()
                    if text or new or ch.text.stopped:
                        yield ch, text, new
                else:
                    ch.finish_reason = "length" if ev.reason == "length" else "stop"
                    live -= 1
                    self.metrics.finished.labels(finished_reason=ch.finish_reason).inc()
                    yield ch, _decoded(ch.text.finish), []
        finally:
            for ch in choices:
                if ch.finish_reason is None:
                    self.worker.cancel(ch.job)
                    ch.finish_reason = "abort"
                    self.metrics.finished.labels(finished_reason="abort").inc()

    def token_text(self, token: int) -> str:
        """A token's text as the log probabilities name it (its own decode, as vLLM does)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    @staticmethod
    def usage(choices: list[Choice]) -> dict:
        prompts: dict[int, int] = {}     # a prompt once, whatever n
        cached: dict[int, int] = {}
        for ch in choices:
            key = id(ch.job.prompt_ids)
            prompts[key] = ch.prompt_tokens
            got = ch.job.request.stats.num_cached_tokens if ch.job.request is not None else 0
            cached[key] = max(cached.get(key, 0), got)
        p, c = sum(prompts.values()), sum(ch.tokens for ch in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def _decoded(fn, *args) -> str:
    """The text ``fn`` (a TextStream's add or finish) decodes; a failure there (this request's
    tokens, the tokenizer) ends this request alone, with a 500 or an error event."""
    try:
        return fn(*args)
    except Exception as e:
        log.error("detokenising failed: %s", traceback.format_exc())
        raise ApiError(500, f"request failed: detokenising its output: {type(e).__name__}: {e}",
                       "internal_error") from None


def _no_sink(ev) -> None:
    raise AssertionError("a job's sink is set when it is submitted (Server.start)")
