"""Benchmark prompts shipped with the package, addressed by file stem, or any JSONL file of the
same form (``{"turns": [...]}`` a line)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError

DATA_DIR = Path(__file__).parent


def iter_jsonl(path: Path, error=UsageError, complete_lines_only: bool = False):
    """(line number, parsed value) for each non-blank line of a JSONL file; a line that is not JSON
    raises ``error`` naming the file and line. ``complete_lines_only`` stops at a last line without
    its newline (a writer still running, or killed mid-line)."""
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if complete_lines_only and not line.endswith("\n"):
                break
            if not line.strip():
                continue
            try:
                yield no, json.loads(line)
            except ValueError:
                raise error(f"{path}:{no}: not valid JSON") from None


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.jsonl"))


def load_prompts(name_or_path: str, num_prompts: int | None = None) -> list[str]:
    """First user turns of a benchmark (by name) or of a JSONL file."""
    path = DATA_DIR / f"{name_or_path}.jsonl"
    if not path.is_file():
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise UsageError(f"unknown dataset {name_or_path!r}: use one of "
                             f"{', '.join(benchmark_names())} or a JSONL file path")
    prompts = []
    for i, row in iter_jsonl(path):
        try:
            turn = row["turns"][0]
        except (KeyError, IndexError, TypeError):
            raise UsageError(f"{path}:{i}: expected a JSON object with a non-empty \"turns\" list") from None
        if not isinstance(turn, str) or not turn.strip():
            raise UsageError(f"{path}:{i}: first turn is not a non-empty string")
        prompts.append(turn)
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts
