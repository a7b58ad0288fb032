"""Regenerate: the target writes the answers to the training prompts with its own sampling.

The drafter must learn the target's distribution, not a data set's, so every answer is sampled
from the target (DeepSpec's settings by default: temperature 0.7, top-p 0.8, top-k 20). Two
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
from .prompts import read_prompts


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


def request_seed(seed: int, row_id: str) -> int:
    """Each prompt's own seed, so a resumed run samples what an uninterrupted one would."""
    return (seed * 1_000_003 + zlib.crc32(row_id.encode())) % (2 ** 62)


def regenerate(prompts_path, out_path, *, target=None, dtype="auto", device="cpu", endpoint=None,
               model_name=None, api_key=None, max_new_tokens=384, max_prompt_tokens=512,
               concurrency=32, temperature=0.7, top_p=0.8, top_k=20, seed=0, limit=None,
               progress=True, log=print) -> dict:
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
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
              seed=seed, progress=progress)
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
           max_new_tokens, temperature, top_p, top_k, seed, progress) -> dict:
    from ..api import encode_prompt
    from ..engine import Engine, RequestOptions
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
        while pending and len(engine.waiting) < concurrency:
            row = pending.pop()
            ids = encode_prompt(tgt.tokenizer, row["prompt"], chat=bool(tgt.tokenizer.chat_template))
            if len(ids) > max_prompt_tokens:
                skipped += 1
                bar.update(1)
                continue
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=request_seed(seed, row["id"]))
            req = engine.add_request(ids, RequestOptions(params, max_new_tokens))
            meta[req.id] = (row, ids)
        for req in engine.step():
            row, ids = meta.pop(req.id)
            write({"id": row["id"], "domain": row.get("domain", "unknown"), "prompt": row["prompt"],
                   "answer": tgt.tokenizer.decode(req.output_ids, skip_special_tokens=True),
                   "prompt_ids": ids, "answer_ids": req.output_ids, "finish_reason": req.finish_reason})
            written += 1
            tokens += len(req.output_ids)
            bar.update(1)
            bar.set_postfix(tokens=tokens)
    bar.close()
    if skipped:
        log(f"skipped {skipped} prompts longer than {max_prompt_tokens} tokens")
    return {"written": written, "tokens": tokens, "skipped": skipped}


def _remote(todo, write, endpoint, model_name, api_key, concurrency, *, max_new_tokens,
            temperature, top_p, top_k, seed, progress) -> dict:
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
        r = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": row["prompt"]}],
            max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            seed=request_seed(seed, row["id"]) % (2 ** 31), extra_body={"top_k": top_k})
        choice = r.choices[0]
        return row, choice.message.content or "", choice.finish_reason

    written = 0
    bar = _bar(len(todo), progress)
    with ThreadPoolExecutor(concurrency) as pool:
        try:
            for row, text, reason in pool.map(one, todo):
                write({"id": row["id"], "domain": row.get("domain", "unknown"), "prompt": row["prompt"],
                       "answer": text, "finish_reason": reason})
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
