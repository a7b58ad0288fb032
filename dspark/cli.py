"""``dspark`` command line. Exit codes: 0 ok, 1 failure at run time, 2 bad usage."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import DsparkError, UsageError


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None


def _float(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None


def _int_list(minimum: int):
    """argparse type: a comma list of integers, each >= minimum."""
    def parse(s: str) -> list[int]:
        try:
            vals = [int(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {s!r}") from None
        if not vals or any(v < minimum for v in vals):
            raise argparse.ArgumentTypeError(f"values must be integers >= {minimum}, got {s!r}")
        return vals
    return parse


def _positive_float(s: str) -> float:
    v = _float(s)
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {s!r}")
    return v


def _non_negative_int(s: str) -> int:
    v = _int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _add_closed_loop_flags(p: argparse.ArgumentParser, drafter: str, num_prompts: int) -> None:
    """The flags of the engine's closed-loop benches (concurrency, steps): what drafts, which
    prompts, how they are sampled, and the model flags (2 threads)."""
    p.add_argument("--drafter", default=drafter)
    p.add_argument("--datasets", default="humaneval,gsm8k,mt-bench")
    p.add_argument("--num-prompts", type=_positive_int, default=num_prompts)
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--temperature", type=_float, default=0.0)
    p.add_argument("--seed", type=_int, default=0)
    _add_model_flags(p)
    p.set_defaults(threads=2)


def _add_model_flags(p: argparse.ArgumentParser, compile_default: bool = False) -> None:
    p.add_argument("--target", default=None,
                   help="bundled model name, Hugging Face model folder or .gguf file "
                        "(default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto (default): bf16 on GPUs and on CPUs with bf16 instructions (AVX-512 BF16, AMX), "
                        "where it is the fast dtype, fp32 on other CPUs; fp32 is the exact one")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a token decoded alone and verified inside a block attend bit for bit alike, "
                        "so bf16 greedy speculative output equals bf16 plain decoding (fp32 does without "
                        "it); costs about 17 %% of a forward at one request, 3 %% for blocks of 8, on the README's CPU")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=compile_default,
                   help="run one request's decoding and verification forwards, and a trained drafter's "
                        "pass, as compiled graphs (bf16 on a CPU; building them takes about 2 minutes on 2 "
                        "cores and 40 s more for a trained drafter: at start, or for `serve` beside serving, "
                        "which answers eagerly until they are built; default: "
                        + ("on" if compile_default else "off") + ")")


def _add_sampling_flags(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    p.add_argument("--temperature", type=_float, default=temperature, help="0 = greedy")
    p.add_argument("--top-p", type=_float, default=1.0)
    p.add_argument("--top-k", type=_int, default=0, help="0 or -1 = off")
    p.add_argument("--seed", type=_int, default=None)
    p.add_argument("--presence-penalty", type=_float, default=0.0, help="in [-2, 2], on the output's tokens")
    p.add_argument("--frequency-penalty", type=_float, default=0.0, help="in [-2, 2], x each token's count in the output")
    p.add_argument("--repetition-penalty", type=_float, default=1.0,
                   help="> 0, on tokens of the prompt and the output (1 = off)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="speculative generation from one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    g.add_argument("--drafter", default="auto",
                   help="auto (default: ngram+dspark where a trained DSpark drafter exists for the target, "
                        "else ngram), plain, ngram, cut[:N] (the target's first N layers), a trained drafter "
                        "(dspark, dflash, dflash-5, eagle3, dspark-rnn, or a folder), a draft LM "
                        "(bundled name, folder or .gguf sharing the target's tokenizer), or ngram+NAME "
                        "(n-gram lookup where the text repeats, drafter NAME elsewhere)")
    g.add_argument("--num-draft", type=_int, default=None,
                   help="tokens drafted per round (default: the drafter's block size)")
    g.add_argument("--max-new-tokens", type=_int, default=128)
    _add_sampling_flags(g)
    _add_model_flags(g)
    so = g.add_mutually_exclusive_group()
    so.add_argument("--json-schema", default=None, metavar="SCHEMA|@FILE",
                    help="structured output: the text is JSON valid under this JSON schema ('{}' = any JSON)")
    so.add_argument("--regex", default=None, help="structured output: the text matches this regular expression")
    so.add_argument("--choice", action="append", default=None,
                    help="structured output: the text is one of these (repeat the flag for each)")
    so.add_argument("--grammar", default=None, metavar="FILE", help="structured output: a Lark grammar file")
    g.add_argument("--compare", action="store_true",
                   help="also run plain decoding on the same prompt and report the speed-up")
    g.add_argument("--json", action="store_true", help="last stdout line: one JSON object")

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_non_negative_int, default=8000)
    sv.add_argument("--drafter", default="auto", help="as for `dspark generate`")
    sv.add_argument("--num-draft", type=_non_negative_int, default=None,
                    help="tokens drafted per round (default: the drafter's block size)")
    sv.add_argument("--policy", default="auto",
                    help="verification policy: auto (prefix, on the cost table `dspark profile` measured where "
                         "there is one, else on step costs it learns from its first steps and keeps per "
                         "machine), plain, fixed, mtp1, threshold-X, ema, prefix, async")
    sv.add_argument("--max-requests", type=_positive_int, default=16,
                    help="requests decoded together (the rest wait in a queue)")
    sv.add_argument("--max-len", type=_positive_int, default=2048,
                    help="tokens per request, prompt and output together (the KV cache holds "
                         "max-requests x max-len tokens)")
    sv.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="a prompt that starts like what a cache slot holds (a shared system prompt, a "
                         "conversation's earlier turns, the n choices of one prompt) prefills only the rest "
                         "(default: on)")
    sv.add_argument("--served-model-name", default=None, help="the model name clients use (default: the target's)")
    sv.add_argument("--api-key", default=None,
                    help="require `Authorization: Bearer KEY` on every route but /health (default: $DSPARK_API_KEY, "
                         "else none)")
    sv.add_argument("--metrics-open", action="store_true",
                    help="with --api-key: /metrics needs no key (a Prometheus scraper without it)")
    # the defaults are server.door's DEFAULT_MAX_BODY_MB and DEFAULT_MAX_PROMPTS (not imported here:
    # it imports FastAPI, which every other command would then pay for)
    sv.add_argument("--max-body-mb", type=_positive_float, default=8.0,
                    help="largest request body in MiB; a larger one gets a 413 before it is parsed (default: 8)")
    sv.add_argument("--max-prompts", type=_positive_int, default=64,
                    help="most prompts in one /v1/completions request, a 400 past it (default: 64)")
    sv.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "generic"],
                    help="how tools are rendered and calls written: hermes (the chat template renders the tools, "
                         "calls in <tool_call> tags, as Qwen2.5), generic (the tools described in the system turn, "
                         "the same tags); auto: hermes where the template knows tools (default: auto)")
    sv.add_argument("--wait-for-graphs", action="store_true",
                    help="with --compile: build the compiled graphs before answering (about 3 minutes on 2 cores) "
                         "instead of answering at once with the eager forwards, slower while they build; "
                         "/health says which ({\"compiled\": true} once they are in use)")
    sv.add_argument("--step-log", default=None, metavar="FILE",
                    help="append every engine step as a JSON line (time, requests, what each drafted, verified "
                         "and accepted, prefill tokens, forward / drafter / policy seconds): what the policy "
                         "decided under the load the server had")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_model_flags(sv, compile_default=True)

    pr = sub.add_parser("profile", help="measure engine step costs on this machine (the cost table)")
    pr.add_argument("--drafter", default="ngram")
    pr.add_argument("--requests", type=_int_list(1), default="1,2,4,8,16,32",
                    help="numbers of concurrent requests")
    pr.add_argument("--verified", type=_int_list(0), default="0,1,2,3,5,7",
                    help="draft tokens verified per request")
    pr.add_argument("--contexts", type=_int_list(1), default="128,512", help="context lengths")
    pr.add_argument("--repeats", type=_positive_int, default=5)
    pr.add_argument("--temperature", type=_float, default=1.0,
                    help="sampling temperature of the profiled steps (0 = greedy, cheaper)")
    pr.add_argument("--output", default=None, help="where to write the table (default: the user cache, "
                                                   "where the engine looks for it)")
    pr.add_argument("--plot", default=None, help="write a PNG of the curves here")
    _add_model_flags(pr)
    pr.set_defaults(threads=2)
    pr.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    s = bsub.add_parser("speed", help="batch-1 tokens/s side by side: HF, ours, llama.cpp")
    s.add_argument("--datasets", default="humaneval,gsm8k,mt-bench")
    s.add_argument("--num-prompts", type=_positive_int, default=8)
    s.add_argument("--max-new-tokens", type=_positive_int, default=128)
    s.add_argument("--systems", default=None,
                   help="comma list (default: all available): hf-plain, hf-prompt-lookup, plain, ngram, "
                        "ngram-no-history, ngram-hf-rule, llama.cpp-plain, llama.cpp-prompt-lookup; also the "
                        "trained drafters dspark, dflash, dflash-5, eagle3, dspark-rnn, and ngram+NAME (the n-gram / "
                        "trained hybrid: ngram+dspark); ngram and the trained ones may name their "
                        "verification policy: dspark@prefix (default: the whole block)")
    s.add_argument("--num-draft", type=_int, default=None, help="drafted tokens per round (default: "
                                                                  "10 for ngram, the block size of trained drafters)")
    s.add_argument("--temperature", type=_float, default=0.0, help="0 = greedy (identity is reported)")
    s.add_argument("--seed", type=_int, default=0)
    _add_model_flags(s)
    s.set_defaults(threads=2)
    s.add_argument("--json", action="store_true")
    s.add_argument("--markdown", default=None, help="also write the table to this file")

    sb = bsub.add_parser("serving", help="closed-loop streaming clients against an OpenAI-compatible endpoint "
                                         "(ours in this process by default)")
    sb.add_argument("--endpoint", default=None, help="base URL of any OpenAI-compatible server, e.g. "
                                                     "http://host:8000/v1 (default: start `dspark serve` here)")
    sb.add_argument("--model", default=None, help="model name at the endpoint (default: its first)")
    sb.add_argument("--api-key", default=None)
    sb.add_argument("--concurrency", type=_int_list(1), default="1,4,16")
    sb.add_argument("--datasets", default="humaneval,gsm8k,mt-bench")
    sb.add_argument("--num-prompts", type=_positive_int, default=32)
    sb.add_argument("--max-new-tokens", type=_positive_int, default=64)
    sb.add_argument("--temperature", type=_float, default=0.0)
    sb.add_argument("--seed", type=_non_negative_int, default=0)
    sb.add_argument("--drafter", default="auto", help="our server's drafter (as for `dspark serve`)")
    sb.add_argument("--policy", default="auto", help="our server's policy (as for `dspark serve`)")
    sb.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="our server's (and engine's) prefix caching (as for `dspark serve`)")
    sb.add_argument("--repeats", type=_positive_int, default=1,
                    help="runs per concurrency (with --against-engine: engine runs, each between two server runs)")
    sb.add_argument("--against-engine", action="store_true",
                    help="also run the prompts through the engine directly (server, engine, server) and report "
                         "the server's total tokens/s over the engine's")
    _add_model_flags(sb)
    sb.set_defaults(threads=2)
    sb.add_argument("--json", action="store_true")

    t = bsub.add_parser("tools", help="tool-call answers through `dspark serve`: plain decoding against a drafter "
                                      "(tokens/s, calls that validate, identity to plain)")
    t.add_argument("--cases", default=None, help="a JSONL of {tools, messages, expect} cases (default: the 50 "
                                                 "shipped in dspark/data/tools/tool_calls.jsonl)")
    t.add_argument("--num-prompts", type=_positive_int, default=50, help="the first this many cases")
    t.add_argument("--modes", default="auto,required,named", help="tool_choice modes: auto, required, named")
    t.add_argument("--max-tokens", type=_positive_int, default=256)
    t.add_argument("--drafter", default="auto", help="the drafter set against plain decoding (as for `dspark serve`)")
    _add_model_flags(t)
    t.set_defaults(threads=2)
    t.add_argument("--json", action="store_true")

    c = bsub.add_parser("concurrency", help="closed-loop clients through the engine, per policy")
    c.add_argument("--repeats", type=_positive_int, default=1,
                   help="run the policies this many times per concurrency (each time all of them "
                        "in turn, one engine step each) and report the totals")
    c.add_argument("--concurrency", type=_int_list(1), default="1,2,4,8,16,32")
    c.add_argument("--policies", default="plain,mtp1,fixed",
                   help="comma list of plain, mtp1, fixed, threshold[-X], ema, prefix (Algorithm 1), "
                        "async, auto (what `dspark serve` runs: prefix, on the profile's cost table or on "
                        "step costs learned as it runs), auto-fresh (auto as on a new machine, beside it); "
                        "NAME-padded runs NAME on a padded layout")
    c.add_argument("--fresh-costs", action="store_true",
                   help="auto starts as on a new machine: no profile table, nothing learned before")
    c.add_argument("--num-draft", type=_non_negative_int, default=7,
                   help="tokens drafted per round (the fixed policy's whole block; the others' cap)")
    c.add_argument("--block", type=_non_negative_int, dest="num_draft", help=argparse.SUPPRESS)
    _add_closed_loop_flags(c, drafter="ngram", num_prompts=32)
    c.add_argument("--plot", default=None, help="write the Pareto PNG here")
    c.add_argument("--json", action="store_true")

    st = bsub.add_parser("steps", help="where an engine step's time goes, per policy, at one concurrency "
                                       "(the engine's step records)")
    st.add_argument("--policies", default="plain,prefix,auto", help="as for `dspark bench concurrency`")
    st.add_argument("--concurrency", type=_positive_int, default=16)
    st.add_argument("--num-draft", type=_non_negative_int, default=None,
                    help="tokens drafted per round (default: the drafter's block size)")
    _add_closed_loop_flags(st, drafter="ngram+dspark", num_prompts=64)
    st.add_argument("--json", action="store_true", help="print the summary and every step as JSON")

    from . import cli_training
    from .simulation import cli as simulation
    simulation.add_parser(sub, sys.modules[__name__])
    cli_training.add_parsers(sub, sys.modules[__name__])
    return parser


def _setup_torch(args) -> None:
    import torch
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def _structured(args):
    """The structured-output flags as a GrammarSpec (compiled here: a bad one fails before loading)."""
    from pathlib import Path

    from .structured import GrammarSpec

    def read(value, flag):
        if not value.startswith("@"):
            return value
        try:
            return Path(value[1:]).expanduser().read_text()
        except OSError as e:
            raise UsageError(f"{flag}: cannot read {value[1:]}: {e.strerror}") from None
    if args.json_schema is not None:
        spec = GrammarSpec("json", read(args.json_schema, "--json-schema"))
    elif args.regex is not None:
        spec = GrammarSpec("regex", args.regex)
    elif args.choice is not None:
        spec = GrammarSpec("choice", args.choice)
    elif args.grammar is not None:
        spec = GrammarSpec("grammar", read("@" + args.grammar, "--grammar"))
    else:
        return None
    spec.compile()
    return spec


def cmd_generate(args) -> int:
    from .api import check_max_new_tokens, generate
    from .drafters import load_drafter
    from .runtime.loading import target_from_args
    from .sampling import SamplingParams

    if not args.prompt.strip():
        raise UsageError("prompt is empty")
    check_max_new_tokens(args.max_new_tokens)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)
    if args.num_draft is not None and args.num_draft < 0:
        raise UsageError("num-draft must be >= 0")
    structured = _structured(args)
    _setup_torch(args)
    target = target_from_args(args)
    drafter = load_drafter(args.drafter, target, num_draft=args.num_draft)
    stream = text = None
    if not args.json:
        from .protocol import TextStream
        text = TextStream(target.tokenizer)

        def stream(tokens):      # print text as it comes
            sys.stdout.write(text.add(tokens))
            sys.stdout.flush()
    res = generate(args.prompt, target=target, drafter=drafter, sampling=params,
                   max_new_tokens=args.max_new_tokens, chat=args.chat, num_draft=args.num_draft,
                   stream=stream, structured=structured)
    out = res.to_dict()
    if args.compare:
        out.update(_against_plain(args, target, params, structured, res))
    if args.json:
        print(json.dumps(out))
    else:
        assert text is not None   # set above when not args.json
        sys.stdout.write(text.finish() + "\n")
        line = (f"[{res.drafter}] {res.num_tokens} tokens in {res.num_rounds} rounds, "
                f"accept length {res.accept_length:.2f}, {res.tokens_per_second:.1f} tokens/s")
        if args.compare:
            line += (f"; plain decoding {out['plain_tokens_per_second']:.1f} tokens/s, "
                     f"speed-up {out['speedup']:.2f}x")
            if args.temperature == 0 and out["identical_to_plain"]:
                line += ", greedy output identical to plain decoding"
            elif args.temperature == 0:
                line += (f"; greedy outputs first differ at token {out['first_divergence']}, where the "
                         f"target's top-2 logits are {out['top2_logit_gap_at_divergence']:.3g} apart "
                         f"(a near tie that {args.dtype} rounding of a one-token and a multi-token "
                         "forward can flip; --dtype fp32 is exact)")
        print(line, file=sys.stderr if not args.compare else sys.stdout)
    return 0


def _against_plain(args, target, params, structured, res) -> dict:
    """``generate --compare``: plain decoding of the same prompt, its speed, and whether the output
    is the same (where not: the first token that differs and the target's top-2 logit gap there)."""
    from .api import encode_prompt, generate
    base = generate(args.prompt, target=target, drafter="plain", sampling=params,
                    max_new_tokens=args.max_new_tokens, chat=args.chat, structured=structured)
    out = {"plain_tokens_per_second": base.tokens_per_second,
           "speedup": res.tokens_per_second / base.tokens_per_second if base.tokens_per_second else None,
           "identical_to_plain": base.token_ids == res.token_ids}
    if not out["identical_to_plain"]:
        from .evaluation.identity import first_divergence, top2_gap
        i = first_divergence(res.token_ids, base.token_ids)
        ids = encode_prompt(target.tokenizer, args.prompt, args.chat) + base.token_ids[:i]
        out["first_divergence"] = i
        out["top2_logit_gap_at_divergence"] = top2_gap(target.model, ids)
    return out


def cmd_serve(args) -> int:
    import os

    from .drafters import load_drafter
    from .runtime.loading import target_from_args
    from .engine import check_policy_name, serving_engine
    from .server import serve

    if args.port > 65535:
        raise UsageError(f"port must be at most 65535, got {args.port}")
    check_policy_name(args.policy)
    _setup_torch(args)
    # --compile: the graphs are built beside serving (compiling.py), the server answers at once
    compile_graphs, args.compile = args.compile, False
    target = target_from_args(args)
    drafter = load_drafter(args.drafter, target, num_draft=args.num_draft)
    engine = serving_engine(target, drafter, args.policy, args.max_requests, args.max_len, args.prefix_caching)
    if args.step_log:
        from .evaluation.steps import log_steps
        try:
            log_steps(engine, args.step_log)
        except OSError as e:
            raise UsageError(f"--step-log {args.step_log}: {e.strerror or e}") from None
    if compile_graphs:
        from .compiling import GraphBuilder
        builder = GraphBuilder(target.model, drafter,
                               say=lambda line: print(f"dspark: {line}", file=sys.stderr, flush=True)).start()
        if args.wait_for_graphs:      # answer nothing until they are built (as a benchmark wants)
            builder.thread.join()
    serve(target, engine, args.host, args.port, args.served_model_name,
          args.api_key or os.environ.get("DSPARK_API_KEY") or None, args.log_level,
          max_body_mb=args.max_body_mb, max_prompts=args.max_prompts, metrics_open=args.metrics_open,
          tool_format=args.tool_call_parser, banner=f"dspark: serving {target.name} with drafter {drafter.name}, policy {engine.policy.name}, "
                 f"{args.max_requests} requests x {args.max_len} tokens, "
                 f"prefix caching {'on' if args.prefix_caching else 'off'}")
    return 0


def cmd_profile(args) -> int:
    from .data import load_prompts
    from .drafters import load_drafter
    from .evaluation import profile as prof
    from .runtime.loading import target_from_args

    _setup_torch(args)
    target = target_from_args(args)
    drafter = load_drafter(args.drafter, target)
    tok = target.tokenizer
    prompts = [tok(p)["input_ids"] for d in ("humaneval", "gsm8k", "mt-bench") for p in load_prompts(d, 4)]

    def progress(ctx, r, v, sec):
        print(f"context {ctx:>5}  requests {r:>3}  verified {v}: {1e3 * sec:.1f} ms/step", file=sys.stderr)
    table = prof.profile(target, drafter, prompts, args.requests, sorted(set(args.verified)), args.contexts,
                         args.repeats, progress, temperature=args.temperature)
    path = table.save(args.output)
    print(f"cost table written to {path}", file=sys.stderr)
    if args.plot:
        prof.plot(table, args.plot)
    if args.json:
        print(json.dumps({"path": str(path), **table.to_json()}))
    return 0


def cmd_bench(args) -> int:
    _setup_torch(args)
    if args.bench == "speed":
        from .evaluation.speed import run_speed_bench
        return run_speed_bench(args)
    if args.bench == "concurrency":
        from .evaluation.concurrency import run_concurrency_bench
        return run_concurrency_bench(args)
    if args.bench == "serving":
        from .evaluation.serving import run_serving_bench
        return run_serving_bench(args)
    if args.bench == "steps":
        from .evaluation.steps import run_steps_bench
        return run_steps_bench(args)
    if args.bench == "tools":
        from .evaluation.tool_calls import run_tools_bench
        return run_tools_bench(args)
    raise UsageError(f"unknown benchmark {args.bench!r}")


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or bad usage (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        if getattr(args, "dtype", None) == "auto":     # named as resolved in every report
            from .runtime.loading import dtype_name, fast_dtype
            args.dtype = dtype_name(fast_dtype(args.device))
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "profile":
            return cmd_profile(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "simulate":
            _setup_torch(args)
            if args.validate:
                from .simulation.validate import run_validation
                return run_validation(args)
            from .simulation.run import run_simulate
            return run_simulate(args)
        from .cli_training import COMMANDS
        if args.command in COMMANDS:
            _setup_torch(args)
            return COMMANDS[args.command](args)
        parser.error(f"unknown command {args.command}")
    except UsageError as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2
    except DsparkError as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dspark: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failure at run time: one line, not a traceback
        print(f"dspark: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
