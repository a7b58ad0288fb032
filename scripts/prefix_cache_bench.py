"""Prefix caching on and off, side by side in one process: the engine `dspark serve` runs (the
default drafter, policy auto), closed-loop clients, greedy, runs alternating on, off, on, off, ...

Two workloads:
- ``mt-bench``: each conversation sends its first turn, then its second with the first turn's
  answer in the history (the benchmark's two turns), as a chat client does;
- ``system``: every request carries the same long system prompt (about 330 tokens of instructions)
  before its own question (humaneval, gsm8k and mt-bench first turns in turn).

Reported per workload and concurrency: total tokens/s, the median time to first token, and the
share of prompt tokens the target had to run (the rest came from the cache).

    .venv/bin/python scripts/prefix_cache_bench.py --concurrency 1,4 --num-conversations 12
"""

import argparse
import json
import statistics
import time

import torch

from dspark.data import DATA_DIR, iter_jsonl, load_prompts
from dspark.drafters import load_drafter
from dspark.engine import serving_engine
from dspark.runtime.loading import load_target
from dspark.sampling import SamplingParams

SYSTEM = (
    "You are the assistant of a small software company's support desk. Follow these rules in every "
    "answer. First, read the customer's message completely before you reply, and answer the question "
    "that was asked rather than a related one. Second, keep answers short: a few sentences of plain "
    "prose, or a short code block when code is the clearest answer, never both at length. Third, when "
    "you write code, use Python unless the customer names another language, include the imports the "
    "code needs, and prefer the standard library over third-party packages. Fourth, when a question is "
    "ambiguous, state the reading you chose in one sentence and answer that reading; do not ask the "
    "customer to clarify unless no reasonable reading exists. Fifth, never invent product features, "
    "prices, release dates or policies: if the answer depends on something you do not know, say so "
    "plainly and suggest where the customer can find it. Sixth, for arithmetic or word problems, show "
    "the steps of the calculation on separate lines and give the final number on a line of its own. "
    "Seventh, be polite but not effusive: no greetings, no apologies for things that are not our "
    "fault, and no closing offers of further help. Eighth, if the customer reports a bug, restate the "
    "symptom in one line, list the most likely causes in order of likelihood, and give the first check "
    "they should run. Ninth, never ask for passwords, keys or personal data, and tell the customer to "
    "remove any such data they have pasted. Tenth, answer in the language the customer wrote in.")


def chat_ids(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def conversations(workload: str, n: int) -> list[list[list[dict]]]:
    """Each conversation: its user turns, as message lists to send one after another (an answer
    is put in the history before the next turn)."""
    if workload == "mt-bench":
        rows = [row for _, row in iter_jsonl(DATA_DIR / "mt-bench.jsonl")][:n]
        return [[[{"role": "user", "content": t}] for t in row["turns"][:2]] for row in rows]
    sets = [load_prompts(d) for d in ("humaneval", "gsm8k", "mt-bench")]
    qs = [sets[i % 3][i // 3] for i in range(n)]
    return [[[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]] for q in qs]


def run(target, drafter, convs, concurrency: int, max_new: int, caching: bool) -> dict:
    tok = target.tokenizer
    max_len = 2048
    engine = serving_engine(target, drafter, "auto", concurrency, max_len, prefix_caching=caching)
    drafter.reset()
    greedy = SamplingParams(temperature=0)
    todo = list(range(len(convs)))
    live = {}          # request id -> (conversation, turn, history, request)
    done, outputs = [], {}

    def send(c, turn, history):
        msgs = history + convs[c][turn]
        req = engine.add_request(chat_ids(tok, msgs), greedy, max_new)
        live[req.id] = (c, turn, msgs, req)

    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            send(todo.pop(0), 0, [])
        for r in engine.step():
            c, turn, msgs, req = live.pop(r.id)
            done.append(req)
            answer = tok.decode(req.output_ids, skip_special_tokens=True)
            outputs[(c, turn)] = req.output_ids
            if turn + 1 < len(convs[c]):
                send(c, turn + 1, msgs + [{"role": "assistant", "content": answer}])
    wall = time.perf_counter() - t0
    prompt = sum(len(r.prompt_ids) for r in done)
    return {"caching": caching, "concurrency": concurrency, "requests": len(done), "wall_seconds": wall,
            "tokens_per_second": sum(len(r.output_ids) for r in done) / wall,
            "ttft_p50_ms": 1e3 * statistics.median(r.stats.prefill_seconds for r in done),
            "prompt_tokens": prompt, "prompt_tokens_run": prompt - sum(r.stats.num_cached_tokens for r in done),
            "outputs": outputs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="mt-bench,system")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--num-conversations", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating")
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                    help="fp32: the outputs with and without the cache are identical (bf16 rounds a prefix "
                         "computed alone and one computed with the rest of its prompt differently)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m-instruct", dtype=args.dtype)
    drafter = load_drafter(args.drafter, target)
    warm = conversations("mt-bench", 2)
    run(target, drafter, warm, 2, 8, True)           # untimed: first-call costs fall on neither
    results = []
    for w in args.workloads.split(","):
        convs = conversations(w, args.num_conversations)
        for c in map(int, args.concurrency.split(",")):
            got = {True: [], False: []}
            for _ in range(args.repeats):
                for caching in (True, False):
                    got[caching].append(run(target, drafter, convs, c, args.max_new_tokens, caching))
            row = {"workload": w, "concurrency": c}
            for caching, runs in got.items():
                key = "on" if caching else "off"
                wall = sum(r["wall_seconds"] for r in runs)
                row[f"{key}_tokens_per_second"] = sum(r["tokens_per_second"] * r["wall_seconds"] for r in runs) / wall
                row[f"{key}_ttft_p50_ms"] = statistics.mean(r["ttft_p50_ms"] for r in runs)
                row[f"{key}_prompt_run_share"] = runs[0]["prompt_tokens_run"] / runs[0]["prompt_tokens"]
            on, off = got[True][0]["outputs"], got[False][0]["outputs"]
            row["identical_outputs"] = sum(on[k] == off[k] for k in on) / len(on)
            row["speedup"] = row["on_tokens_per_second"] / row["off_tokens_per_second"]
            row["ttft_ratio"] = row["off_ttft_p50_ms"] / row["on_ttft_p50_ms"]
            results.append(row)
            print(f"{w:>9} c={c:<2} tok/s on {row['on_tokens_per_second']:6.1f} off {row['off_tokens_per_second']:6.1f} "
                  f"({row['speedup']:.3f}x)  TTFT p50 on {row['on_ttft_p50_ms']:6.1f} ms off "
                  f"{row['off_ttft_p50_ms']:6.1f} ms ({row['ttft_ratio']:.2f}x)  prompt run on "
                  f"{row['on_prompt_run_share']:.0%}  identical {row['identical_outputs']:.0%}", flush=True)
    if args.json:
        print(json.dumps({"drafter": drafter.name, "results": results}))


if __name__ == "__main__":
    main()
