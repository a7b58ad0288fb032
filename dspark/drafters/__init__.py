"""Drafters by name or path: plain, ngram, cut[:N] (the target's first N layers), a draft LM."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError
from .base import DraftContext, Drafter, PlainDrafter, Proposal
from .draft_lm import DraftLMDrafter
from .ngram import NgramDrafter

__all__ = ["DraftContext", "Drafter", "PlainDrafter", "Proposal", "NgramDrafter", "DraftLMDrafter",
           "load_drafter", "DRAFTER_NAMES"]

DRAFTER_NAMES = ("plain", "ngram", "cut[:N]")


def _is_trained_drafter(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    archs = data.get("architectures") or []
    return any("Drafter" in a for a in archs) or "block_size" in data


def load_drafter(spec: str | Drafter | None, target, *, block_size: int | None = None,
                 dtype=None) -> Drafter:
    """``spec``: a Drafter, None / "plain", "ngram", "cut" / "cut:N", or a draft LM (bundled
    name, HF folder or GGUF file sharing the target's tokenizer)."""
    if isinstance(spec, Drafter):
        return spec
    name = "plain" if spec is None else str(spec).strip()
    low = name.lower()
    if low in ("plain", "none"):
        return PlainDrafter()
    if low == "ngram":
        return NgramDrafter(block_size=block_size or 10)
    if low == "cut" or low.startswith("cut:"):
        total = target.model.config.num_layers
        n = max(1, total // 4)
        if ":" in low:
            try:
                n = int(low.split(":", 1)[1])
            except ValueError:
                raise UsageError(f"drafter {name!r}: expected cut:N with N an integer") from None
        if not 1 <= n < total:
            raise UsageError(f"drafter {name!r}: N must be in [1, {total - 1}]")
        return DraftLMDrafter(target.model.truncated(n), block_size=block_size or 4, name=f"cut:{n}")
    from ..runtime.loading import BUNDLED, ALIASES, load_target
    path = Path(name).expanduser()
    if low not in BUNDLED and low not in ALIASES and not path.exists():
        raise UsageError(f"unknown drafter {name!r}: use one of {', '.join(DRAFTER_NAMES)}, "
                         "a trained drafter folder, or a draft LM (bundled name, folder or .gguf)")
    if path.is_dir() and _is_trained_drafter(path):
        raise UsageError(f"{name!r} is a trained drafter checkpoint; this version serves "
                         "plain, ngram and draft-LM drafters only")
    draft = load_target(name, dtype=dtype or target.model.dtype, device=str(target.model.device))
    _check_same_vocab(draft, target, name)
    return DraftLMDrafter(draft.model, block_size=block_size or 4, name=draft.name)


def _check_same_vocab(draft, target, name: str) -> None:
    dv, tv = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if dv != tv:
        raise UsageError(f"draft model {name!r} does not share the target's tokenizer "
                         f"({len(dv)} vs {len(tv)} tokens)")
    if draft.model.config.vocab_size != target.model.config.vocab_size:
        raise UsageError(f"draft model {name!r} has {draft.model.config.vocab_size} logits, "
                         f"the target {target.model.config.vocab_size}")
