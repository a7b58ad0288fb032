"""Structured outputs: the target's law restricted to the tokens a grammar allows next.

A request may carry a JSON schema, "any JSON object", a regular expression, a list of choices or a
Lark grammar (OpenAI's ``response_format``, vLLM's ``structured_outputs``). The grammar is compiled
and matched by llguidance, vLLM's ``guidance`` backend: at each position it says which tokens may
come next, and the output is sampled from the target's logits with every other token at -inf (the
end-of-text tokens are allowed exactly where the grammar is complete).

With speculative decoding, verification row k follows the output plus the first k drafts, so its
mask is the grammar's state after those drafts: the matcher consumes the drafts to build the rows'
masks and rolls back. A draft the grammar forbids has probability 0 under the law and is rejected
with certainty (the rows after it are never used). So the output follows the constrained law
exactly, whatever drafted it. A drafter may still use the grammar to draft better: the DSpark
drafter samples each drafted position from what the grammar allows after its drafts so far
(``push`` / ``pop``), and the engine cuts point-mass proposals before their first forbidden token.
Where the grammar forces the next tokens (jump-forward decoding), the engine proposes those
instead of the drafter's block unless the block starts with them: a proposal chosen from the
grammar's state alone, verified as any other.

Every matcher runs under llguidance's parser limits (``grammar.parser_limits``: its default fuel
and size budgets, short error messages); a server compiles and checks a request's grammar against
them before admitting it, in a process of its own (``grammar_sandbox.py``), so that a grammar too
complex for them is refused at the door rather than failing its request at some token, and one that
crashes llguidance crashes only that process.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import UsageError
from .grammar import GrammarSpec, check_on, one_line, parser_limits

__all__ = ["GrammarSpec", "GrammarState", "check", "grammar_state", "grammar_tokenizer"]


def check(target, grammar: str, kind: str = "grammar") -> None:
    """Refuse (UsageError) a compiled grammar that llguidance rejects or that exceeds the parser
    limits on this target's tokenizer (grammar.check_on). In this process: a server runs the same
    check in its grammar sandbox instead (grammar_sandbox.py), where a grammar that crashes
    llguidance takes down only the sandbox."""
    check_on(grammar_tokenizer(target), grammar, kind, target.model.config.vocab_size, target.eos_token_ids)


def grammar_tokenizer(target):
    """llguidance's view of the target's tokenizer (built once per target, about 0.3 s): token
    bytes over the model's vocabulary, the target's end-of-text tokens as its end."""
    tok = getattr(target, "_grammar_tokenizer", None)
    if tok is None:
        import llguidance.hf
        try:
            tok = llguidance.hf.from_tokenizer(target.tokenizer, n_vocab=target.model.config.vocab_size,
                                               eos_token=list(target.eos_token_ids))
        except ValueError as e:
            raise UsageError(f"structured outputs need a fast (Rust) Hugging Face tokenizer: {e}") from None
        target._grammar_tokenizer = tok
    return tok


class GrammarState:
    """One request's matcher: the masks of a verification block's rows, and the output so far."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int, end_ids):
        from llguidance import LLMatcher
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if self.matcher.is_error():
            raise UsageError(f"invalid grammar: {one_line(self.matcher.get_error())}")
        self.vocab_size = vocab_size
        self.end = torch.zeros(vocab_size, dtype=torch.bool)
        self.end[list(end_ids)] = True

    def copy(self) -> GrammarState:
        """A matcher in this one's state, for another choice or request. llguidance's deep copy
        shares what compiling the grammar built; a fresh matcher builds it again (megabytes for a
        large enum: a request's n choices times its prompts would each hold that much)."""
        twin = object.__new__(GrammarState)
        twin.matcher = self.matcher.deep_copy()
        twin.vocab_size, twin.end = self.vocab_size, self.end   # end: read, never written
        return twin

    def allowed_now(self) -> torch.Tensor:
        """[V] bool: the tokens allowed after the output and what has been pushed."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool))
        if mask.shape[0] < self.vocab_size:          # a tokenizer shorter than the model's vocabulary
            mask = torch.cat([mask, torch.zeros(self.vocab_size - mask.shape[0], dtype=torch.bool)])
        # nothing allowed (the grammar has ended): only the end, so that the request can stop
        return mask if mask.any() else self.end

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of these tokens the grammar allows in a row after the output."""
        return 0 if self.matcher.is_stopped() else self.matcher.validate_tokens(tokens)

    def push(self, token: int, allowed: torch.Tensor | None = None) -> bool:
        """Advance over a drafted token (False, and nothing changed, if the grammar forbids it or has
        ended); ``allowed``: allowed_now() if the caller has it already. ``pop`` undoes pushes."""
        if self.matcher.is_stopped():
            return False
        if not (self.allowed_now() if allowed is None else allowed)[token]:
            return False
        return self.matcher.consume_token(token)

    def pop(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, V] bool: the tokens allowed at row k, after the output and drafts[:k].
        Rows after a forbidden draft repeat the last real one (verification stops before them)."""
        rows, taken = [], 0
        for k in range(len(drafts) + 1):
            rows.append(self.allowed_now())
            if k == len(drafts) or not self.push(drafts[k], rows[-1]):
                break
            taken += 1
        self.pop(taken)
        rows.extend([rows[-1]] * (len(drafts) + 1 - len(rows)))
        return torch.stack(rows)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (llguidance's fast-forward tokens: a
        key's name, the punctuation around it), proposed as drafts: the masked law puts all or
        nearly all its mass on them, so they are accepted almost surely, whoever else drafts."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens()[:limit])

    def advance(self, tokens: list[int]) -> None:
        """The output grew by these tokens (drawn from the masked law, so the grammar allows them; once
        the grammar has ended, only end tokens, which the matcher no longer takes)."""
        for t in tokens:
            if self.matcher.is_stopped() and self.end[t]:
                continue
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"the grammar refused emitted token {t}: {self.matcher.get_error()}")


def grammar_state(target, grammar: str) -> GrammarState:
    """A fresh matcher for one request over a compiled grammar (GrammarSpec.compile; each choice of
    a request has its own matcher: ``grammar_states``)."""
    return GrammarState(grammar_tokenizer(target), grammar, target.model.config.vocab_size, target.eos_token_ids)


def grammar_states(target, grammar: str, n: int) -> list[GrammarState]:
    """n matchers at the start of one grammar, for the choices of a request: one built, the others
    copies of it (GrammarState.copy), so that a request's memory does not grow n-fold."""
    first = grammar_state(target, grammar)
    return [first] + [first.copy() for _ in range(n - 1)]
