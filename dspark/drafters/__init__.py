"""Drafters by name or path: plain, ngram, cut[:N] (the target's first N layers), a draft LM, a
trained drafter's folder (ours, or a checkpoint in an engine's layout: drafters/foreign.py),
ngram+NAME (n-gram lookup where the text repeats, drafter NAME elsewhere), and auto (ngram+dspark
where a trained DSpark drafter exists for the target, else ngram)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import UsageError
from .base import DraftContext, Drafter, PlainDrafter, Proposal
from .draft_lm import DraftLMDrafter
from .hybrid import HybridDrafter
from .ngram import NgramDrafter

__all__ = ["DraftContext", "Drafter", "PlainDrafter", "Proposal", "NgramDrafter", "DraftLMDrafter", "HybridDrafter",
           "load_drafter", "DRAFTER_NAMES"]

DRAFTER_NAMES = ("auto", "plain", "ngram", "cut[:N]", "dspark", "dflash", "dflash-5", "eagle3", "dspark-rnn",
                 "ngram+NAME")
TRAINED_NAMES = ("dspark", "dflash", "dflash-5", "eagle3", "dspark-rnn")
CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"


def trained_drafter_dirs(target_name: str, name: str) -> list[Path]:
    """Where a trained drafter called ``name`` for ``target_name`` may live: the checkpoints that
    ship in the package, then the user's cache (where `dspark train --name` puts rebuilt ones)."""
    from ..runtime.loading import cache_dir
    return [CHECKPOINTS / target_name / name, cache_dir() / "drafters" / target_name / name]


def load_trained(folder: Path, target, *, num_draft: int | None = None, name: str | None = None) -> Drafter:
    """A trained drafter's folder (ours or an engine's layout) loaded for ``target``; its one-request
    pass compiled when the target's forwards are (``Decoder.compile``), saying so on stderr."""
    drafter = _load_trained(folder, target, num_draft=num_draft, name=name)
    if target.model.compiled:
        print(f"dspark: {drafter.compile()}", file=sys.stderr)
    return drafter


def _load_trained(folder: Path, target, *, num_draft: int | None = None, name: str | None = None):
    from .config import DrafterConfig
    from .dspark import DSparkDrafter, DSparkModel
    if _is_foreign(Path(folder)):     # a checkpoint in an engine's layout (DeepSpec, DFlash, speculators)
        from .foreign import load_foreign
        m = target.model
        model = load_foreign(Path(folder), m.config, m.embed, m.lm_head)
        imported = DSparkDrafter(model, m, name=name, block_size=num_draft)
        imported.folder = Path(folder)
        return imported
    cfg = DrafterConfig.load(folder)
    tc = target.model.config
    if cfg.vocab_size != tc.vocab_size or cfg.target_hidden_size != tc.hidden_size or \
            max(cfg.target_layer_ids) >= tc.num_layers:
        raise UsageError(f"drafter {folder} was trained for {cfg.target or 'another target'} "
                         f"(vocab {cfg.vocab_size}, hidden {cfg.target_hidden_size}); the target is "
                         f"{target.name} (vocab {tc.vocab_size}, hidden {tc.hidden_size})")
    if cfg.kind == "eagle3":
        from .eagle3 import Eagle3Drafter, Eagle3Model
        drafter: DSparkDrafter = Eagle3Drafter(Eagle3Model.load(folder), target.model, name=name,
                                               block_size=num_draft)
    else:
        drafter = DSparkDrafter(DSparkModel.load(folder), target.model, name=name, block_size=num_draft)
    drafter.folder = Path(folder)
    return drafter


def _config_of(path: Path) -> dict | None:
    cfg = path / "config.json"
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_foreign(path: Path) -> bool:
    from .foreign import is_foreign
    data = _config_of(path)
    return data is not None and is_foreign(data)


def _is_trained_drafter(path: Path) -> bool:
    data = _config_of(path)
    if data is None:
        return False
    archs = data.get("architectures") or []
    return any("Drafter" in a for a in archs) or "block_size" in data or _is_foreign(path)


def load_drafter(spec: str | Drafter | None, target, *, num_draft: int | None = None,
                 dtype=None) -> Drafter:
    """``spec``: a Drafter, None / "plain", "ngram", "cut" / "cut:N", a trained drafter name (dspark, dflash,
    dflash-5, eagle3, dspark-rnn) or folder, or a draft LM (bundled name, HF folder or GGUF file
    sharing the target's tokenizer)."""
    if isinstance(spec, Drafter):
        return spec
    name = "plain" if spec is None else str(spec).strip()
    low = name.lower()
    if low in ("plain", "none"):
        return PlainDrafter()
    if low == "ngram":
        return NgramDrafter(block_size=num_draft or 10)
    if low == "auto":
        trained = any((f / "config.json").is_file() for f in trained_drafter_dirs(target.name, "dspark"))
        return load_drafter("ngram+dspark" if trained else "ngram", target, num_draft=num_draft, dtype=dtype)
    if "+" in low:
        first, _, second = name.partition("+")
        if first.strip().lower() != "ngram" or not second.strip() or "+" in second:
            raise UsageError(f"drafter {name!r}: a hybrid is ngram+NAME (n-gram lookup first, "
                             "then one other drafter: ngram+dspark)")
        model = load_drafter(second.strip(), target, dtype=dtype)
        if model.block_size == 0 or isinstance(model, NgramDrafter):
            raise UsageError(f"drafter {name!r}: the second part must be a drafter that drafts "
                             f"everywhere (a trained drafter or a draft LM), not {second.strip()!r}")
        return HybridDrafter(NgramDrafter(block_size=num_draft or 10), model)
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
        return DraftLMDrafter(target.model.truncated(n), block_size=num_draft or 4, name=f"cut:{n}")
    from ..runtime.loading import BUNDLED, ALIASES, load_target
    if low in TRAINED_NAMES:
        for folder in trained_drafter_dirs(target.name, low):
            if (folder / "config.json").is_file():
                return load_trained(folder, target, num_draft=num_draft, name=low)
        raise UsageError(f"no trained {low!r} drafter for {target.name}: train it with "
                         f"`dspark train --recipe {low}` (see README), or pass a drafter folder")
    path = Path(name).expanduser()
    if low not in BUNDLED and low not in ALIASES and not path.exists():
        raise UsageError(f"unknown drafter {name!r}: use one of {', '.join(DRAFTER_NAMES)}, "
                         "a trained drafter folder, or a draft LM (bundled name, folder or .gguf)")
    if path.is_dir() and _is_trained_drafter(path):
        return load_trained(path, target, num_draft=num_draft)
    draft = load_target(name, dtype=dtype or target.model.dtype, device=str(target.model.device))
    _check_same_vocab(draft, target, name)
    return DraftLMDrafter(draft.model, block_size=num_draft or 4, name=draft.name)


def _check_same_vocab(draft, target, name: str) -> None:
    dv, tv = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if dv != tv:
        raise UsageError(f"draft model {name!r} does not share the target's tokenizer "
                         f"({len(dv)} vs {len(tv)} tokens)")
    if draft.model.config.vocab_size != target.model.config.vocab_size:
        raise UsageError(f"draft model {name!r} has {draft.model.config.vocab_size} logits, "
                         f"the target {target.model.config.vocab_size}")
