"""The Python API: ``dspark.generate(prompt, target=..., drafter=..., sampling=...)`` for one prompt,
``dspark.generate_batch(prompts, ...)`` for many at once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast


from .drafters import Drafter, load_drafter
from .errors import UsageError
from .engine import RequestOptions, check_policy_name, serving_engine
from .generation import GenerationStats, generate_ids
from .runtime.loading import Target, load_target
from .sampling import SamplingParams
from .structured import GrammarSpec, grammar_state, grammar_states


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    drafter: str
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {"text": self.text, "drafter": self.drafter, "prompt_tokens": self.prompt_tokens,
                **self.stats.to_dict()}

    def __getattr__(self, name):  # result.num_tokens, result.accept_length, ...
        if name != "stats" and hasattr(self.stats, name):
            return getattr(self.stats, name)
        raise AttributeError(name)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not isinstance(prompt, str) or not prompt.strip():
        raise UsageError("prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("this target has no chat template; drop --chat")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def _spec(structured) -> GrammarSpec:
    if not isinstance(structured, GrammarSpec):
        raise UsageError(f"structured must be a dspark.GrammarSpec, got {type(structured).__name__}")
    return structured


def check_max_new_tokens(n) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise UsageError(f"max-new-tokens must be a positive integer, got {n!r}")
    return n


def _checked(sampling: SamplingParams | None, max_new_tokens, num_draft) -> SamplingParams:
    """The settings both entry points share, checked; the sampling settings (default: T = 1)."""
    check_max_new_tokens(max_new_tokens)
    if num_draft is not None and (not isinstance(num_draft, int) or num_draft < 0):
        raise UsageError(f"num-draft must be an integer >= 0, got {num_draft!r}")
    return sampling or SamplingParams()


def generate(prompt: str, *, target: str | Target | None = None, drafter: str | Drafter | None = "auto",
             sampling: SamplingParams | None = None, max_new_tokens: int = 128, chat: bool = False,
             num_draft: int | None = None, dtype: str = "auto", device: str = "cpu",
             stream=None, batch_invariant: bool = False, structured: GrammarSpec | None = None) -> GenerationResult:
    """Generate text from ``prompt`` with speculative decoding; the output is distributed exactly
    as the target's own sampling (``sampling``; greedy when temperature is 0), restricted to what
    ``structured`` allows (a GrammarSpec: JSON schema, regex, choice or Lark grammar). ``batch_invariant``:
    bf16 greedy output equal to bf16 plain decoding too (runtime/invariant.py; a loaded ``target``
    keeps its own setting)."""
    sampling = _checked(sampling, max_new_tokens, num_draft)
    if not isinstance(prompt, str) or not prompt.strip():
        raise UsageError("prompt is empty")
    tgt = target if isinstance(target, Target) else load_target(target, dtype=dtype, device=device,
                                                                     batch_invariant=batch_invariant)
    d = load_drafter(drafter, tgt, num_draft=num_draft)
    ids = encode_prompt(tgt.tokenizer, prompt, chat)
    grammar = None if structured is None else grammar_state(tgt, _spec(structured).compile())
    new, stats = generate_ids(tgt.model, ids, sampling, max_new_tokens, d, num_draft=num_draft,
                              eos_ids=tgt.eos_token_ids, stream=stream, grammar=grammar)
    text = cast(str, tgt.tokenizer.decode(new, skip_special_tokens=True))   # one sequence: one string
    return GenerationResult(text, new, len(ids), d.name, stats)


def generate_batch(prompts: list[str], *, target: str | Target | None = None, drafter: str | Drafter | None = "auto",
                   sampling: SamplingParams | None = None, max_new_tokens: int = 128, chat: bool = False,
                   num_draft: int | None = None, dtype: str = "auto", device: str = "cpu",
                   max_concurrency: int = 16, policy: str = "auto",
                   prefix_caching: bool = True, structured: GrammarSpec | None = None) -> list[GenerationResult]:
    """Generate from many prompts at once, the way vLLM's offline ``LLM.generate`` does: up to
    ``max_concurrency`` requests share every target forward (the engine's continuous batching; the
    rest wait their turn), each output distributed exactly as the target's own sampling. With a
    seed, prompt i samples with seed + i (as the server's choices do). ``policy``: how many drafted
    tokens each request verifies per step: "auto" (the load-aware prefix policy, on `dspark
    profile`'s cost table where one exists, else on step costs learned as it runs, as `dspark
    serve` does) or any policy name. ``prefix_caching``: a prompt reuses the cached entries of
    its start that an earlier or running prompt computed (as `dspark serve`; the output's law is the
    same). ``structured``: every output matches it (as for generate). Results come in the order
    of ``prompts``."""
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise UsageError("prompts must be a non-empty list of strings")
    if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
        raise UsageError(f"max_concurrency must be a positive integer, got {max_concurrency!r}")
    sampling = _checked(sampling, max_new_tokens, num_draft)
    check_policy_name(policy)
    tgt = target if isinstance(target, Target) else load_target(target, dtype=dtype, device=device)
    ids = [encode_prompt(tgt.tokenizer, p, chat) for p in prompts]
    d = load_drafter(drafter, tgt, num_draft=num_draft)
    engine = serving_engine(tgt, d, policy, min(max_concurrency, len(ids)),
                            max(map(len, ids)) + max_new_tokens + d.block_size + 1, prefix_caching,
                            isolate_failures=False)
    # one matcher per request (each advances with its output), copies of one built
    states = None if structured is None else grammar_states(tgt, _spec(structured).compile(), len(ids))
    reqs = []
    for i, p in enumerate(ids):
        params = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i)
        state = None if states is None else states[i]
        reqs.append(engine.add_request(p, RequestOptions(params, max_new_tokens, grammar=state)))
    engine.run()
    # decode of one sequence (a list of ints) is one string
    return [GenerationResult(cast(str, tgt.tokenizer.decode(r.output_ids, skip_special_tokens=True)), r.output_ids,
                             len(p), d.name, r.stats) for r, p in zip(reqs, ids)]
