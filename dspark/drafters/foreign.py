"""Import: a drafter checkpoint in an engine's layout (DeepSpec ``Qwen3DSparkModel``, SpecForge
``DSparkDraftModel`` with a nested ``dflash_config``, speculators ``DSparkDraftModel`` with
``speculators_model_type``, a nested ``transformer_layer_config`` and a ``speculators_config`` block,
which is not needed here) loaded into
our drafter class, so the engine serves it like one of ours (drafting, verification, scheduling).

The inverse of interop/export.py, for any writer: the Markov table ``[vocab, rank]`` is kept whole unless
the rows outside the draft vocabulary are all one row (then it is our compact table, as our exports
are); ``d2t`` offsets give the draft vocabulary; row ``mask_token_id`` of the shipped
``embed_tokens`` (or of the target's when none is shipped) is the mask vector; ``fc`` is taken as
it is (feature scale of ones). The embeddings and LM head come from the target, as in every engine
(the checkpoint's copies are frozen copies of the target's: a shipped ``lm_head`` that is not is
refused). Every inconsistency with the target is a one-line error naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..errors import UsageError
from . import layouts as L
from .config import DrafterConfig
from .dspark import DSparkModel


def is_foreign(data: dict[str, Any]) -> bool:
    """Whether a config.json is one of the engines' layouts (not ours, not a plain LM)."""
    archs = data.get("architectures") or []
    return (any(a in L.IMPORTABLE or a in L.KNOWN_UNSUPPORTED for a in archs)
            or "speculators_model_type" in data or "speculators_config" in data or "dflash_config" in data)


def _bad(folder: Path, msg: str) -> UsageError:
    return UsageError(f"drafter {folder}: {msg}")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise _bad(folder, "no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except (OSError, SafetensorError, ValueError) as e:
            raise _bad(folder, f"cannot read {f.name}: {e}") from None
        for k, v in part.items():       # SpecForge / speculators may prefix the names with "model."
            state[k[len("model."):] if k.startswith("model.") else k] = v
    return state


def _hparams(folder: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The config's keys in one flat dict (speculators nests the layer hyperparameters; DFlash
    nests the mask token and layer ids), in our layer-id convention."""
    archs = raw.get("architectures") or []
    unsupported = [a for a in archs if a in L.KNOWN_UNSUPPORTED]
    if unsupported:
        raise _bad(folder, f"architectures {unsupported[0]!r} is not supported (supported: {', '.join(L.IMPORTABLE)})")
    h = {**raw, **(raw.get("transformer_layer_config") or {})}
    dflash = raw.get("dflash_config") or {}
    if "aux_hidden_state_layer_ids" in raw and raw["aux_hidden_state_layer_ids"] is not None:
        h["target_layer_ids"] = L.deepspec_layer_ids(raw["aux_hidden_state_layer_ids"])
    for key in ("target_layer_ids", "mask_token_id", "block_size"):
        if key in dflash:
            h[key] = dflash[key]
    if "sample_from_anchor" not in raw and "sample_from_anchor" in dflash:
        h["sample_from_anchor"] = dflash["sample_from_anchor"]
    for key in ("target_layer_ids", "mask_token_id", "block_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        if h.get(key) is None:
            raise _bad(folder, f"config.json has no {key!r}")
    # the block: [anchor, MASK...] drafting from every slot (DeepSpec's DSpark, ours), or a bonus-anchor
    # block whose anchor slot drafts nothing (z-lab DFlash); block_size counts the anchor slot in both
    h["sample_from_anchor"] = bool(h.get("sample_from_anchor", not any(a in L.BONUS_ANCHOR_BY_DEFAULT for a in archs)))
    h["drafts"] = int(h["block_size"]) - (0 if h["sample_from_anchor"] else 1)
    if h["drafts"] < 1:
        raise _bad(folder, f"block_size {h['block_size']} leaves no draft slot")
    rope = h.get("rope_parameters") or h.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise _bad(folder, f"rope type {rope.get('rope_type', rope.get('type'))!r} is not supported (default RoPE only)")
    h["rope_theta"] = float(rope.get("rope_theta", h.get("rope_theta", 10000.0)))
    return h


def _draft_vocab(folder: Path, h: dict[str, Any], state: dict[str, torch.Tensor], V: int) -> torch.Tensor:
    vd = int(h.get("draft_vocab_size") or V)
    if L.D2T not in state:
        if vd != V:
            raise _bad(folder, f"draft_vocab_size {vd} < vocab_size {V} but no {L.D2T!r} tensor")
        return torch.arange(V)
    d2t = state[L.D2T].long().reshape(-1)
    if d2t.numel() != vd:
        raise _bad(folder, f"{L.D2T!r} has {d2t.numel()} entries, draft_vocab_size is {vd}")
    vocab = torch.arange(vd) + d2t
    if bool(((vocab < 0) | (vocab >= V)).any()) or vocab.unique().numel() != vd:
        raise _bad(folder, f"{L.D2T!r} maps to target ids outside [0, {V}) or maps two draft ids to one token")
    return vocab


def load_foreign(folder: Path, target_config, embed: torch.Tensor, lm_head: torch.Tensor) -> DSparkModel:
    """A DSparkModel (fp32) from a checkpoint in an engine's layout, checked against the target
    (its ``DecoderConfig``, embeddings [V, d] and LM head [V, d])."""
    folder = Path(folder)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise _bad(folder, f"cannot read config.json: {e}") from None
    h = _hparams(folder, raw)
    V, d, ids = _check_target(folder, h, target_config)
    if (folder / "mask_embedding.pt").is_file():     # z-lab MiMo's own mask vector: a pickle, never loaded
        raise _bad(folder, "mask_embedding.pt is not read (a pickle): convert the mask vector into row "
                           "mask_token_id of embed_tokens.weight")
    state = _read_tensors(folder)
    if L.FC not in state:
        raise _bad(folder, f"no {L.FC!r} tensor")
    fc = state[L.FC]
    if fc.dim() != 2 or fc.shape[0] != d or fc.shape[1] != len(ids) * target_config.hidden_size:
        raise _bad(folder, f"{L.FC!r} is {list(fc.shape)}, expected [{d}, {len(ids)} x "
                           f"{target_config.hidden_size}] for target_layer_ids {ids}")
    has_markov, rank, head_type, conf = _heads(folder, h, state)
    vocab = _draft_vocab(folder, h, state, V)
    ext = raw.get(L.EXTENSION_KEY) or {}
    sts = _calibration(folder, ext)
    w1, full_table = _markov_table(folder, state[L.MARKOV_W1], vocab, V, rank) if has_markov else (None, False)
    cfg = _config(folder, h, ext, target_config, ids, sts, markov=(rank, head_type, full_table) if has_markov else None,
                  conf=conf, qk_norm="layers.0.self_attn.q_norm.weight" in state)
    model = DSparkModel(cfg, vocab)
    ours = _our_tensors(folder, state, cfg, has_markov, conf)
    ours["backbone.fc.weight"] = fc
    ours["backbone.feature_scale"] = torch.ones(fc.shape[1])
    if w1 is not None:
        ours["head.w1.weight"] = w1
    # the mask slots' input: row mask_token_id of the shipped embeddings (the target's otherwise),
    # times the embedding scale the engines apply to every embedding
    emb = state.get(L.EMBED)
    if emb is not None and tuple(emb.shape) != (V, d):
        raise _bad(folder, f"{L.EMBED!r} is {list(emb.shape)}, expected [{V}, {d}]")
    row = (emb if emb is not None else embed)[cfg.mask_token_id].float()
    ours["mask_embedding"] = row * cfg.embed_scale if cfg.embed_scale != 1.0 else row
    ours["draft_vocab"] = vocab
    _check_lm_head(folder, state.get(L.LM_HEAD), lm_head, vocab)
    want = model.state_dict()
    for k, v in ours.items():
        if k in want and tuple(want[k].shape) != tuple(v.shape):
            raise _bad(folder, f"tensor for {k} is {list(v.shape)}, expected {list(want[k].shape)} from config.json")
    missing, unexpected = model.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in ours.items()}, strict=False)
    if missing or unexpected:
        raise _bad(folder, f"tensors do not match config.json (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.float()


def _check_target(folder: Path, h: dict[str, Any], tc) -> tuple[int, int, list[int]]:
    """The vocabulary, width and feature layers, checked against the target's config."""
    V, d = int(h["vocab_size"]), int(h["hidden_size"])
    if V != tc.vocab_size:
        raise _bad(folder, f"vocab_size {V} != the target's {tc.vocab_size}")
    if d != tc.hidden_size:
        raise _bad(folder, f"hidden_size {d} != the target's {tc.hidden_size} (the drafter embeds with the "
                           "target's embeddings)")
    ids = [int(i) for i in h["target_layer_ids"]]
    if not ids or min(ids) < 0 or max(ids) >= tc.num_layers:
        raise _bad(folder, f"target_layer_ids {ids} out of range: the target has {tc.num_layers} layers, ids "
                           f"0..{tc.num_layers - 1} (output of layer L; speculators' aux ids are L + 1)")
    return V, d, ids


def _heads(folder: Path, h: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[bool, int, str, bool]:
    """(has a Markov head, its rank, its type, has a confidence head), from the config and tensors."""
    rank = int(h.get("markov_rank") or 0)
    has_markov = rank > 0 or L.MARKOV_W1 in state
    head_type = str(h.get("markov_head_type", "vanilla")) if has_markov else "none"
    if has_markov and head_type != "vanilla":
        raise _bad(folder, f"unsupported markov_head_type {head_type!r} (only 'vanilla')")
    if has_markov and L.MARKOV_W1 not in state:
        raise _bad(folder, f"markov_rank {rank} but no {L.MARKOV_W1!r} tensor")
    if has_markov:
        rank = int(state[L.MARKOV_W1].shape[1])
    conf = bool(h.get("enable_confidence_head", False)) or "confidence_head.proj.weight" in state
    if conf and not (has_markov and h.get("confidence_head_with_markov", True)):
        raise _bad(folder, "a confidence head without the Markov embedding (confidence_head_with_markov false) "
                           "is not supported")
    return has_markov, rank, head_type, conf


def _markov_table(folder: Path, w1: torch.Tensor, vocab: torch.Tensor, V: int, rank: int
                  ) -> tuple[torch.Tensor, bool]:
    """The Markov table [V, rank] with the draft vocabulary's rows first -> (table, kept whole):
    compact (draft rows + one shared row) when the rows outside the draft vocabulary are all one
    row, as in our exports; whole otherwise."""
    if tuple(w1.shape) != (V, rank):
        raise _bad(folder, f"{L.MARKOV_W1!r} is {list(w1.shape)}, expected [{V}, {rank}] (vocab_size, markov_rank)")
    outside = torch.ones(V, dtype=torch.bool)
    outside[vocab] = False
    rest = w1[outside]
    if rest.shape[0] == 0:
        return torch.cat([w1[vocab], torch.zeros(1, rank, dtype=w1.dtype)]), False
    if bool((rest == rest[:1]).all()):
        return torch.cat([w1[vocab], rest[:1]]), False
    return torch.cat([w1[vocab], rest]), True


def _calibration(folder: Path, ext: dict[str, Any]) -> tuple[list[float] | None, list[float] | None]:
    """The confidence calibration (temperatures, shifts): ours in the extension key, else
    SGLang's STS file, else none."""
    temps, shifts = ext.get("sts_temperatures"), ext.get("sts_shifts")
    sts_file = folder / L.SGLANG_STS_FILE
    if temps is None and sts_file.is_file():
        try:
            temps = [float(t) for t in json.loads(sts_file.read_text())["temperatures"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise _bad(folder, f"cannot read {L.SGLANG_STS_FILE}: {e}") from None
    return temps, shifts


def _config(folder: Path, h: dict[str, Any], ext: dict[str, Any], tc, ids: list[int],
            sts: tuple[list[float] | None, list[float] | None], *, markov: tuple[int, str, bool] | None,
            conf: bool, qk_norm: bool) -> DrafterConfig:
    """Our DrafterConfig for the checkpoint. ``markov``: (rank, head type, whole table), None
    without a Markov head."""
    rank, head_type, full_table = markov if markov is not None else (0, "none", False)
    d, heads, V = int(h["hidden_size"]), int(h["num_attention_heads"]), int(h["vocab_size"])
    try:
        cfg = DrafterConfig(
            kind="dspark" if markov is not None else "dflash", hidden_size=d,
            intermediate_size=int(h["intermediate_size"]),
            num_hidden_layers=int(h["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(h["num_key_value_heads"]), head_dim=int(h.get("head_dim") or d // heads),
            qk_norm=qk_norm, rms_norm_eps=float(h.get("rms_norm_eps", 1e-6)),
            rope_theta=h["rope_theta"], block_size=h["drafts"], target_layer_ids=ids,
            sample_from_anchor=h["sample_from_anchor"],
            mask_token_id=int(h["mask_token_id"]), markov_rank=rank,
            markov_head_type=head_type, markov_full_table=full_table, confidence_head=conf, vocab_size=V,
            target=str(ext.get("target") or ""), target_hidden_size=tc.hidden_size,
            final_logit_softcap=h.get("final_logit_softcapping") or tc.final_logit_softcap,
            embed_scale=tc.embed_scale, sts_temperatures=sts[0], sts_shifts=sts[1])
    except (TypeError, ValueError) as e:
        raise _bad(folder, f"inconsistent config: {e}") from None
    if not 0 <= cfg.mask_token_id < V:
        raise _bad(folder, f"mask_token_id {cfg.mask_token_id} outside the vocabulary [0, {V})")
    return cfg


def _our_tensors(folder: Path, state: dict[str, torch.Tensor], cfg: DrafterConfig, has_markov: bool,
                 conf: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's layer and head tensors under our names."""
    ours: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        for mine, theirs in L.layer_names(i).items():
            if theirs.endswith(("q_norm.weight", "k_norm.weight")) and not cfg.qk_norm:
                continue
            if theirs not in state:
                raise _bad(folder, f"missing tensor {theirs!r}")
            ours[mine] = state[theirs]
    for mine, theirs in L.PLAIN.items():
        if mine.startswith("head.") and not has_markov or mine.startswith("confidence.") and not conf:
            continue
        if theirs not in state:
            raise _bad(folder, f"missing tensor {theirs!r}")
        ours[mine] = state[theirs]
    return ours


def _check_lm_head(folder: Path, shipped: torch.Tensor | None, lm_head: torch.Tensor, vocab: torch.Tensor) -> None:
    """The engines' drafters use a frozen copy of the target's head: a shipped one must be it (up to
    the rounding of the dtype it was written in)."""
    if shipped is None:
        return
    rows = lm_head.detach().cpu()
    if shipped.shape[0] == vocab.numel():
        rows = rows[vocab]
    elif shipped.shape[0] != rows.shape[0]:
        raise _bad(folder, f"{L.LM_HEAD!r} has {shipped.shape[0]} rows, expected the draft vocabulary's "
                           f"{vocab.numel()} or the target's {rows.shape[0]}")
    if shipped.shape[1] != rows.shape[1]:
        raise _bad(folder, f"{L.LM_HEAD!r} is {list(shipped.shape)}, the target's head has width {rows.shape[1]}")
    diff = (shipped.float() - rows.to(shipped.dtype).float()).abs().max()
    if float(diff) > 1e-2 * float(rows.float().abs().max()) + 1e-6:
        raise _bad(folder, f"{L.LM_HEAD!r} differs from the target's output head (max difference {float(diff):.3g}): "
                           "a drafter with its own head is not supported")
