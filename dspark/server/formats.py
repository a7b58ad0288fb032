"""Each endpoint's answers in the OpenAI API's shapes: one formatter per endpoint, which writes a
choice's opening chunk, the delta of each piece of its text, the whole choice, and the log
probabilities of its tokens (``responses.respond`` lays them out as a stream or one object)."""

from __future__ import annotations

from .. import tools as tool_calls
from ..protocol import ChatCompletionRequest, CompletionRequest
from .serving import Choice, Server


def finish_reason(ch: Choice) -> str | None:
    """A choice's finish_reason: ``tool_calls`` where it ended on its own after calling a tool."""
    if ch.finish_reason == "stop" and ch.tools is not None and ch.tools.calls:
        return "tool_calls"
    return ch.finish_reason


class Format:
    """What one endpoint writes (``id`` prefix, object names, and per choice the pieces below)."""

    prefix = ""         # of the response's id
    obj = ""            # the whole response's ``object``
    chunk_obj = ""      # a streamed chunk's ``object``

    def __init__(self, srv: Server):
        self.srv = srv

    def opening(self, ch: Choice) -> list[dict]:
        """The fields of the chunks a streamed choice starts with (none by default)."""
        return []

    def delta(self, ch: Choice, text: str) -> dict:
        """A streamed chunk's fields for the next piece of the choice's text."""
        raise NotImplementedError

    def whole(self, ch: Choice) -> dict:
        """The fields of the choice in a whole (not streamed) response."""
        raise NotImplementedError

    def logprobs(self, ch: Choice, entries: list, whole: bool = False) -> dict:
        """The log probabilities of ``entries`` ((token, log probability, top) of the choice's next
        tokens); ``whole``: of the whole output (with the prompt's, where they were asked for)."""
        raise NotImplementedError


class CompletionFormat(Format):
    """``/v1/completions``: text, and the legacy API's log probabilities."""

    prefix, obj, chunk_obj = "cmpl", "text_completion", "text_completion"

    def __init__(self, srv: Server, body: CompletionRequest, echo: list[str]):
        super().__init__(srv)
        self.body, self.echo = body, echo      # echo: each prompt's text ("" without ``echo``)

    def _echo(self, ch: Choice) -> str:
        return self.echo[ch.index // self.body.n]

    def opening(self, ch: Choice) -> list[dict]:
        return [{"text": self._echo(ch)}] if self.body.echo else []

    def delta(self, ch: Choice, text: str) -> dict:
        return {"text": text}

    def whole(self, ch: Choice) -> dict:
        return {"text": self._echo(ch) + ch.text.output}

    def logprobs(self, ch: Choice, entries: list, whole: bool = False) -> dict:
        """tokens, token_logprobs, a dict per token of the most likely ones and the sampled one, and
        each token's character offset in the text. ``whole`` with ``echo``: the prompt's tokens
        first (the first one with none), as an evaluation harness scores a text."""
        if whole and ch.job.options.prompt_logprobs is not None:
            assert ch.job.request is not None   # its tokens came: the engine took it
            ids = ch.job.prompt_ids
            entries = ([(ids[0], None, None)] + [(t, lp, top) for t, (lp, top) in
                                                 zip(ids[1:], ch.job.request.prompt_logprobs_out)] + entries)
        token_text = self.srv.token_text
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp, top in entries:
            text = token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            if top is None:
                out["top_logprobs"].append(None)
            else:
                best = {token_text(t): v for t, v in top}
                best.setdefault(text, lp)
                out["top_logprobs"].append(best)
            out["text_offset"].append(ch.logprob_chars)
            ch.logprob_chars += len(text)
        return out


class ChatFormat(Format):
    """``/v1/chat/completions``: the assistant's message (its content and, with tools, its calls)."""

    prefix, obj, chunk_obj = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, srv: Server, body: ChatCompletionRequest):
        super().__init__(srv)
        self.body = body

    def opening(self, ch: Choice) -> list[dict]:
        return [{"delta": {"role": "assistant", "content": ""}}]

    def delta(self, ch: Choice, text: str) -> dict:
        """The text, or with tools the content and the call deltas it holds (the rest of the parse
        once the choice has ended)."""
        if ch.tools is None:
            return {"delta": {"content": text} if text else {}}
        content, calls = ch.tools.add(text)
        if ch.finish_reason is not None:
            more, last = ch.tools.finish()
            content, calls = content + more, tool_calls.merge_deltas(calls + last)
        d: dict = {}
        if content:
            d["content"] = content
        if calls:
            d["tool_calls"] = calls
        return {"delta": d}

    def whole(self, ch: Choice) -> dict:
        if ch.tools is None:
            return {"message": {"role": "assistant", "content": ch.text.output}}
        ch.tools.add(ch.text.output)
        ch.tools.finish()
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in ch.tools.calls]
        msg: dict = {"role": "assistant", "content": ch.tools.content or None}
        if calls:
            msg["tool_calls"] = calls
        return {"message": msg}

    def logprobs(self, ch: Choice, entries: list, whole: bool = False) -> dict:
        """token, logprob, UTF-8 bytes and the most likely alternatives per token."""
        token_text = self.srv.token_text

        def one(token, lp):
            text = token_text(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]}
                            for token, lp, top in entries], "refusal": None}
