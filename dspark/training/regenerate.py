"""Regenerate: the target writes the answers to the training prompts with its own sampling.

The drafter must learn the target's distribution, not a data set's, so every answer is sampled
from the target, at the settings requests are served with (``regimes``: greedy, temperature 1, a
share of the prompts each, chosen by a hash of the prompt's id) or at fixed settings (DeepSpec's by
default: temperature 0.7, top-p 0.8, top-k 20). Two
back-ends: the local engine (continuous batching of many requests in one forward), or any
OpenAI-compatible endpoint (``--endpoint``) so a vLLM / SGLang fleet can do it at scale.

The output is JSONL, one row per finished prompt, appended as each one ends; a rerun skips the
ids already written, so an interrupted job resumes where it stopped (a half-written last line
is cut off first).
Rows: ``{"id", "domain", "prompt", "answer", "prompt_ids", "answer_ids", "finish_reason"}``
(token ids only from the local back-end; the cache step tokenizes text rows itself).
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..data import iter_jsonl
from ..errors import DsparkError, UsageError
from ..sampling import SamplingParams
from .prompts import parse_shares, read_prompts


def _done_ids(out: Path) -> set[str]:
    """Ids already written; drops a trailing partial line left by a killed run."""
    if not out.exists():
        return set()
    done = set()
    good = 0
    with open(out, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                done.add(json.loads(line)["id"])
            except (ValueError, KeyError):
                break
            good += len(line)
    if good != out.stat().st_size:
        with open(out, "r+b") as f:
            f.truncate(good)
    return done


REGIMES = {    # sampling settings answers can be written at: those requests are served with, and DeepSpec's
    "greedy": {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
    "t1": {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
    "deepspec": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
}


def parse_regimes(text: str) -> dict[str, float]:
    """``greedy=0.5,t1=0.5``: each regime's share of the prompts."""
    return parse_shares(text, REGIMES, "--regimes")


def regime_of(row_id: str, regimes: dict[str, float]) -> str:
    """The regime a prompt is answered at: a hash of its id placed on the shares (stable across
    resumes and across prompt files that share ids)."""
    total = sum(regimes.values())
    u = (zlib.crc32(b"regime:" + row_id.encode()) % 1_000_003) / 1_000_003 * total
    for name, share in regimes.items():
        if share > 0 and u < share:
            return name
        u -= share
    return next(n for n, s in reversed(regimes.items()) if s > 0)


def request_seed(seed: int, row_id: str) -> int:
    """Each prompt's own seed, so a resumed run samples what an uninterrupted one would."""
    return (seed * 1_000_003 + zlib.crc32(row_id.encode())) % (2 ** 62)


def regenerate(prompts_path, out_path, *, target=None, dtype="auto", device="cpu", endpoint=None,
               model_name=None, api_key=None, max_new_tokens=384, max_prompt_tokens=512,
               concurrency=32, temperature=0.7, top_p=0.8, top_k=20, seed=0, limit=None,
               regimes: dict[str, float] | None = None, deadline: float | None = None,
               progress=True, log=print) -> dict:
    """``regimes`` (name -> share of the prompts, names of REGIMES): each prompt is answered at
    its regime's settings (``regime_of``) instead of temperature / top_p / top_k, and the row
    records which. ``deadline`` (time.monotonic()): no prompt is started after it (those in flight
    finish); a rerun goes on with the rest."""
    if max_new_tokens <= 0 or concurrency <= 0 or max_prompt_tokens <= 0:
        raise UsageError("max-new-tokens, max-prompt-tokens and concurrency must be > 0")
    SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)   # validates
    rows = read_prompts(prompts_path)
    if limit is not None:
        rows = rows[:limit]
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done_ids(out)
    todo = [r for r in rows if r["id"] not in done]
    log(f"regenerate: {len(rows)} prompts, {len(done & {r['id'] for r in rows})} already done, "
        f"{len(todo)} to go -> {out}")
    if not todo:
        return {"written": 0, "done": len(rows), "tokens": 0}
    custom = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    names = {r["id"]: regime_of(r["id"], regimes) if regimes else "custom" for r in todo}
    settings = {i: (name, REGIMES.get(name, custom)) for i, name in names.items()}
    kw = dict(max_new_tokens=max_new_tokens, settings=settings, seed=seed, progress=progress, deadline=deadline)
    with open(out, "a", encoding="utf-8") as f:
        def write(row):
            f.write(json.dumps(row) + "\n")
            f.flush()
        if endpoint:
            stats = _remote(todo, write, endpoint, model_name, api_key, concurrency, **kw)
        else:
            stats = _local(todo, write, target, dtype, device, concurrency, max_prompt_tokens, log, **kw)
        os.fsync(f.fileno())
    stats["done"] = len(done) + stats["written"]
    return stats


def _bar(total, progress, unit="prompt"):
    from tqdm import tqdm
    return tqdm(total=total, unit=unit, disable=not progress, dynamic_ncols=True, smoothing=0.05)


def _local(todo, write, target, dtype, device, concurrency, max_prompt_tokens, log, *,
           max_new_tokens, settings, seed, progress, deadline) -> dict:
    import time
    from ..engine import Engine, RequestOptions
    from .prompts import encode_row
    from ..runtime.loading import load_target
    from ..scheduling.policies import PlainPolicy

    tgt = load_target(target, dtype=dtype, device=device)
    engine = Engine(tgt.model, None, PlainPolicy(), max_requests=concurrency, block_size=0,
                    max_len=max_prompt_tokens + max_new_tokens + 2, eos_ids=tgt.eos_token_ids)
    pending = list(reversed(todo))
    meta = {}
    written = tokens = skipped = 0
    bar = _bar(len(todo), progress)
    while pending or engine.has_work():
        if deadline is not None and time.monotonic() > deadline and pending:
            log(f"regenerate: the stage's time is up; {len(pending)} prompts left for a rerun")
            pending.clear()
        while pending and len(engine.waiting) < concurrency:
            row = pending.pop()
            ids = encode_row(tgt.tokenizer, row)
            if len(ids) > max_prompt_tokens:
                skipped += 1
                bar.update(1)
                continue
            regime, sp = settings[row["id"]]
            params = SamplingParams(**sp, seed=request_seed(seed, row["id"]))
            req = engine.add_request(ids, RequestOptions(params, max_new_tokens))
            meta[req.id] = (row, ids, regime)
        for req in engine.step():
            row, ids, regime = meta.pop(req.id)
            write({"id": row["id"], "domain": row.get("domain", "unknown"), "prompt": row["prompt"],
                   **({"history": row["history"]} if row.get("history") else {}),
                   "answer": tgt.tokenizer.decode(req.output_ids, skip_special_tokens=True),
                   "prompt_ids": ids, "answer_ids": req.output_ids, "finish_reason": req.finish_reason,
                   "regime": regime})
            written += 1
            tokens += len(req.output_ids)
            bar.update(1)
            bar.set_postfix(tokens=tokens)
    bar.close()
    if skipped:
        log(f"skipped {skipped} prompts longer than {max_prompt_tokens} tokens")
    return {"written": written, "tokens": tokens, "skipped": skipped}


def _remote(todo, write, endpoint, model_name, api_key, concurrency, *, max_new_tokens,
            settings, seed, progress, deadline) -> dict:
    import time
    from .prompts import row_messages
    try:
        import openai
    except ImportError:
        raise DsparkError("--endpoint needs the openai client: pip install openai") from None
    client = openai.OpenAI(base_url=endpoint, api_key=api_key or os.environ.get("OPENAI_API_KEY", "none"),
                           max_retries=5, timeout=600)
    if model_name is None:
        try:
            model_name = client.models.list().data[0].id
        except Exception as e:  # noqa: BLE001 - any transport error is reported the same way
            raise DsparkError(f"cannot list models at {endpoint}: {e}") from None

    def one(row):
        regime, sp = settings[row["id"]]
        if deadline is not None and time.monotonic() > deadline:
            return row, None, regime, None
        r = client.chat.completions.create(
            model=model_name, messages=row_messages(row),
            max_tokens=max_new_tokens, temperature=sp["temperature"], top_p=sp["top_p"],
            seed=request_seed(seed, row["id"]) % (2 ** 31), extra_body={"top_k": sp["top_k"] or -1})
        choice = r.choices[0]
        return row, choice.message.content or "", regime, choice.finish_reason

    written = 0
    bar = _bar(len(todo), progress)
    with ThreadPoolExecutor(concurrency) as pool:
        try:
            for row, text, regime, reason in pool.map(one, todo):
                if text is None:       # past the deadline
                    continue
                write({"id": row["id"], "domain": row.get("domain", "unknown"), "prompt": row["prompt"],
                       **({"history": row["history"]} if row.get("history") else {}), "answer": text, "finish_reason": reason, "regime": regime})
                written += 1
                bar.update(1)
        except openai.OpenAIError as e:
            raise DsparkError(f"endpoint {endpoint} failed after {written} answers (rerun to resume): {e}") from None
    bar.close()
    return {"written": written, "tokens": None}


def read_regenerated(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path} not found (run `dspark regenerate` first)")
    return [row for _, row in iter_jsonl(path, DsparkError, complete_lines_only=True)]
