"""Benchmark prompts shipped with the package, addressed by file stem, or any JSONL file of the
same form (``{"turns": [...]}`` a line)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError

DATA_DIR = Path(__file__).parent


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
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                turn = row["turns"][0]
            except (ValueError, KeyError, IndexError, TypeError):
                raise UsageError(f"{path}:{i}: expected a JSON object with a non-empty \"turns\" list") from None
            if not isinstance(turn, str) or not turn.strip():
                raise UsageError(f"{path}:{i}: first turn is not a non-empty string")
            prompts.append(turn)
            if num_prompts is not None and len(prompts) >= num_prompts:
                break
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts
