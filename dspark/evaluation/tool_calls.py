"""``dspark bench tools``: tool-call answers through `dspark serve`, plain decoding against a drafter.

The cases (``dspark/data/tools/tool_calls.jsonl``, 50 written for this benchmark: 1 to 5 tools each,
JSON Schema parameters of every kind, single calls, two calls, multi-turn conversations holding
earlier calls and results, and requests no tool serves) are sent one at a time, greedy, with the
`openai` client, to a server started in this process as `dspark serve` runs it, once per system
(``plain`` and ``--drafter``, each on a fresh server). Per ``tool_choice`` mode:

* ``auto``: every case; ``required``: the cases that expect a call; ``named``: the same, naming
  the first function they expect.

Reported per system and mode: completion tokens/s (tokens over the requests' wall time), the share
of whole calls (all but the last of an answer cut by ``--max-tokens``) that name a tool and whose
arguments parse and validate against its schema (jsonschema), the share of answers calling the
expected functions, and the answers cut; the drafter's tokens/s
over plain's, and how many answers (content and calls) are identical to plain decoding's, which in
fp32 must be all of them.
"""

from __future__ import annotations

import json
import sys
import time
from importlib.resources import files

from ..errors import UsageError

MODES = ("auto", "required", "named")


def load_cases(path: str | None = None) -> list[dict]:
    from pathlib import Path
    from ..data import iter_jsonl
    src = Path(path).expanduser() if path else Path(str(files("dspark") / "data" / "tools" / "tool_calls.jsonl"))
    if not src.is_file():
        raise UsageError(f"--cases {src}: no such file")
    return [row for _, row in iter_jsonl(src)]


def _validates(schema: dict, value) -> bool:
    try:
        import jsonschema
    except ImportError:
        raise UsageError("the tool benchmark validates arguments with jsonschema: pip install jsonschema "
                         "(the bench extra)") from None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def _requests(cases: list[dict], modes: list[str]) -> list[tuple[str, str, dict]]:
    """(case id, mode, request fields) of every request the modes make of the cases."""
    out = []
    for mode in modes:
        for c in cases:
            if mode != "auto" and not c["expect"]:
                continue
            choice = ({"type": "function", "function": {"name": c["expect"][0]}} if mode == "named"
                      else mode)
            out.append((c["id"], mode, {"messages": c["messages"], "tools": c["tools"], "tool_choice": choice}))
    return out


def _ask(base_url: str, model: str, requests, max_tokens: int) -> list[dict]:
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    out = []
    for case, mode, fields in requests:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens, **fields)
        seconds = time.perf_counter() - t0
        ch = r.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        out.append({"case": case, "mode": mode, "content": ch.message.content or "", "calls": calls,
                    "finish_reason": ch.finish_reason, "tokens": r.usage.completion_tokens, "seconds": seconds})
    return out


def _score(answers: list[dict], cases: dict) -> dict:
    """Per mode: tokens/s; of the calls made whole (all but the last of an answer cut by max_tokens),
    the share that name a tool and whose arguments parse and validate; the share of answers calling
    the expected functions; and the answers cut."""
    by: dict = {}
    for a in answers:
        by.setdefault(a["mode"], []).append(a)
    out = {}
    for mode, rows in by.items():
        whole = valid = expected = cut = 0
        for a in rows:
            tools = {t["function"]["name"]: t["function"].get("parameters") or {} for t in cases[a["case"]]["tools"]}
            cut += a["finish_reason"] == "length"
            done = a["calls"][:-1] if a["finish_reason"] == "length" else a["calls"]
            for name, args in done:
                whole += 1
                try:
                    valid += name in tools and _validates(tools[name], json.loads(args))
                except ValueError:
                    pass
            expected += [n for n, _ in a["calls"]] == cases[a["case"]]["expect"]
        tokens, seconds = sum(a["tokens"] for a in rows), sum(a["seconds"] for a in rows)
        out[mode] = {"requests": len(rows), "whole_calls": whole, "tokens": tokens, "seconds": round(seconds, 2),
                     "tokens_per_second": round(tokens / seconds, 2),
                     "valid_calls": round(valid / whole, 4) if whole else None,
                     "expected_calls": round(expected / len(rows), 4), "cut_by_max_tokens": cut}
    return out


def run_tools_bench(args) -> int:
    from ..drafters import load_drafter
    from ..engine import serving_policy
    from ..runtime.loading import target_from_args
    from .serving import local_run
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise UsageError(f"--modes: a comma list of {', '.join(MODES)}")
    cases = load_cases(args.cases)[:args.num_prompts]
    target = target_from_args(args)
    requests = _requests(cases, modes)
    by_id = {c["id"]: c for c in cases}
    results, answers = {}, {}
    for name in ("plain", args.drafter):
        drafter = load_drafter(name, target)
        policy = serving_policy(target, drafter, "auto")[0].name if name != "plain" else "plain"
        max_len = 4096
        # untimed: a process's first requests pay one-time costs (new shapes, first touches)
        local_run(target, drafter, policy, 1, max_len, lambda url: _ask(url, target.name, requests[:2], 16))
        got = local_run(target, drafter, policy, 1, max_len,
                        lambda url: _ask(url, target.name, requests, args.max_tokens))
        answers[drafter.name] = got
        results[drafter.name] = _score(got, by_id)
        for mode, r in results[drafter.name].items():
            valid = "-" if r["valid_calls"] is None else f"{r['valid_calls']:.1%}"
            print(f"{drafter.name:>14} {mode:>8}: {r['tokens_per_second']:.1f} tok/s over {r['requests']} answers, "
                  f"{r['whole_calls']} whole calls, valid {valid}, expected calls {r['expected_calls']:.1%}, "
                  f"cut {r['cut_by_max_tokens']}", file=sys.stderr)
    plain, spec = list(answers)
    same = sum((a["content"], a["calls"]) == (b["content"], b["calls"]) for a, b in zip(answers[plain], answers[spec]))
    summary = {"target": target.name, "dtype": str(target.model.dtype).replace("torch.", ""), "cases": len(cases),
               "max_tokens": args.max_tokens, "results": results, "identical_to_plain": same,
               "answers": len(requests),
               "speedup": {m: round(results[spec][m]["tokens_per_second"] / results[plain][m]["tokens_per_second"], 3)
                           for m in results[spec]}}
    print(f"{spec} / plain: " + ", ".join(f"{m} {v:.2f}x" for m, v in summary["speedup"].items())
          + f"; identical to plain: {same} of {len(requests)}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
    return 0
