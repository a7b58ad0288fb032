"""Grammars as text: compiling a structured-output request into llguidance's grammar, and checking
it against llguidance's parser limits on a tokenizer before any request decodes under it.

This module needs llguidance and numpy, not torch, so that the grammar sandbox
(``grammar_sandbox.py``) can run it in a small process of its own: llguidance is native code whose
grammar processing recurses once per nesting level (a rule chain, a ``$ref`` chain), so a deep
enough grammar overflows the stack of whatever process compiles it. The matchers that decode live
in ``structured.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from .errors import UsageError

KINDS = ("json", "regex", "choice", "grammar")
CHECK_STEPS = 8      # mask computations the door check runs (the first token and what follows it)


def parser_limits():
    """llguidance's limits every matcher runs under: its default fuel and size budgets (lexer fuel
    for the initial regexes and per mask, Earley items per mask, lexer states, grammar size), and
    one-line errors (the verbose ones carry a dump of the parser's state and the grammar)."""
    from llguidance import LLParserLimits
    return LLParserLimits(verbose_errors=False)


def one_line(message: str) -> str:
    return " ".join(message.replace("<non-verbose/>", "").split())


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: ``kind`` json (``value`` a JSON schema, a dict or its text),
    regex (a pattern the whole output matches), choice (a list of strings, the output is one of
    them) or grammar (a Lark grammar, llguidance's dialect)."""

    kind: str
    value: object

    def compile(self) -> str:
        """llguidance's grammar text; a UsageError naming the problem when it does not compile."""
        from llguidance import LLMatcher
        try:
            if self.kind == "json":
                schema = json.loads(self.value) if isinstance(self.value, str) else self.value
                if not isinstance(schema, dict):
                    raise UsageError("a JSON schema must be a JSON object")
                text = LLMatcher.grammar_from_json_schema(schema)
            elif self.kind == "regex":
                if not isinstance(self.value, str) or not self.value:
                    raise UsageError("regex must be a non-empty string")
                text = LLMatcher.grammar_from_regex(self.value)
            elif self.kind == "choice":
                if (not isinstance(self.value, (list, tuple)) or not self.value
                        or not all(isinstance(c, str) and c for c in self.value)):
                    raise UsageError("choice must be a non-empty list of non-empty strings")
                text = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
            elif self.kind == "grammar":
                if not isinstance(self.value, str) or not self.value.strip():
                    raise UsageError("grammar must be a non-empty Lark grammar")
                text = LLMatcher.grammar_from_lark(self.value)
            else:
                raise UsageError(f"unknown structured output kind {self.kind!r}: use one of {', '.join(KINDS)}")
        except RecursionError:      # json.loads of a deeply nested schema text
            raise UsageError(f"invalid {self.kind}: nested too deeply") from None
        except (ValueError, TypeError) as e:    # json.JSONDecodeError is a ValueError
            raise UsageError(f"invalid {self.kind}: {one_line(str(e))}") from None
        bad, messages = LLMatcher.validate_grammar_with_warnings(text)
        if bad:
            raise UsageError(f"invalid {self.kind}: {one_line('; '.join(messages))}")
        return text


def check_on(tokenizer, grammar: str, kind: str, vocab_size: int, end_ids) -> None:
    """Refuse (UsageError) a compiled grammar that llguidance rejects or that exceeds the parser
    limits on this tokenizer (an ``llguidance.LLTokenizer``): validated with the tokenizer and the
    limits, then a matcher takes up to CHECK_STEPS steps the way decoding would (the first mask,
    then the tokens the grammar forces or else the first allowed one that does not end the
    output), which builds the lexer states the first tokens need (a regex such as
    ``(a{1000}){1000}`` compiles, then fails there)."""
    from llguidance import LLMatcher
    bad, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=parser_limits())
    if bad:
        raise UsageError(f"invalid {kind}: {one_line('; '.join(messages))}")
    m = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    end = np.zeros(vocab_size, dtype=bool)
    end[[t for t in end_ids if t < vocab_size]] = True
    for _ in range(CHECK_STEPS):
        if m.is_error() or m.is_stopped():
            break
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)
        if m.is_error():
            break
        step = list(m.compute_ff_tokens()[:16])
        if not step:
            free = np.flatnonzero(allowed[:len(end)] & ~end[:len(allowed)])
            step = [int(free[0])] if len(free) else []
        if not step or not m.consume_tokens(step):
            break
    if m.is_error():
        raise UsageError(f"{kind} fails in the grammar engine on its first tokens: {one_line(m.get_error())}")
