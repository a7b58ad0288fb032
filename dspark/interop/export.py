"""``dspark export``: a DSpark or DFlash drafter of ours written in an engine's checkpoint layout.

What changes on the way, and why it is exact (our own import of the export proposes bit for bit
what the drafter proposes, tests/test_interop.py):

* fc: our fusion scales the concatenated target features per channel before ``fc``; the layouts
  have ``fc`` alone, so the scale is folded into its columns in fp32 and written in fp32. Our
  serving path already multiplies the same way (``DSparkDrafter._serving_weights``), so the
  imported ``fc`` (with a scale of ones) gives the same serving weight, bit for bit.
* Markov table: ours is compact, a row per draft-vocabulary token plus one shared row for every
  token outside it; the layouts index W1 by target token id, ``[vocab, rank]``, so each target
  token gets its draft row or the shared row: the same lookup for every previous token.
* draft vocabulary: written as DeepSpec's ``d2t`` offsets (target id = i + d2t[i]) when reduced.
* mask vector: DeepSpec feeds the embedding of ``mask_token_id`` to the block's mask slots, so the
  shipped ``embed_tokens`` is the target's with that row replaced by our learned vector (divided by
  the target's embedding scale, which the engines multiply back: exact when the scale is 1).
* q/k norms: every layout has them. A drafter trained without them (``qk_norm`` false) has no exact
  image (RMSNorm with weights of ones is not the identity), so it is refused unless
  ``allow_inexact``, which writes ones and says so in the report.
* STS calibration: written also as SGLang's JSON. Its confidence is sigmoid(z / T_k); ours is
  sigmoid(z / T_k + b_k) when calibrated with shifts, which the temperatures alone cannot carry
  unless every b_k is 0: the shifts are then listed as dropped in that file (our import reads them
  from our own config block, so nothing is lost here).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..drafters.config import DrafterConfig
from ..drafters.dspark import DSparkModel
from ..errors import UsageError
from ..drafters import layouts as L


@dataclass
class ExportReport:
    """What was written, and in what it is not the drafter we serve (``inexact``; empty = exact)."""

    folder: str
    format: str
    architecture: str
    tensors: int
    draft_vocab_size: int
    vocab_size: int
    mask_token_in_draft_vocab: bool
    target_layer_ids: list[int]             # ours = DeepSpec's (output of target layer L)
    engine_layer_ids: list[int]             # vLLM / llama.cpp / speculators (L + 1)
    inexact: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _check_exportable(model: DSparkModel, allow_inexact: bool, inexact: list[str]) -> None:
    if model.confidence is not None and model.head is None:
        raise UsageError("a confidence head without a Markov head has no layout in the engines")
    _check_config(model.config, allow_inexact, inexact)


def _check_config(c: DrafterConfig, allow_inexact: bool, inexact: list[str]) -> None:
    if c.kind == "eagle3":
        raise UsageError("an EAGLE-3 drafter has no DSpark / DFlash layout: export a dspark or dflash drafter")
    if c.markov_head_type not in ("vanilla", "none"):
        raise UsageError(f"markov_head_type {c.markov_head_type!r} has no layout in the engines (they load "
                         "'vanilla' only): export a drafter with a vanilla Markov head")
    if c.hidden_size != c.target_hidden_size:
        raise UsageError(f"hidden_size {c.hidden_size} != target_hidden_size {c.target_hidden_size}: the "
                         "layouts take the drafter's width from the target's")
    if not c.qk_norm:
        msg = ("the drafter has no q/k RMSNorm, which every layout has: written as norms with weights of "
               "ones, which normalise q and k where the drafter does not (a different drafter)")
        if not allow_inexact:
            raise UsageError("drafter has no q/k norms (qk_norm false) and the layouts require them; a "
                             "norm of ones is not the identity, so no exact export exists (--allow-inexact "
                             "writes ones anyway)")
        inexact.append(msg)


def _tensors(model: DSparkModel, embed: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype,
             inexact: list[str], notes: list[str]) -> dict[str, torch.Tensor]:
    c = model.config
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:     # own copies: safetensors refuses shared storage
        out[name] = (t.to(dtype) if t.is_floating_point() else t).clone().contiguous()

    for i in range(c.num_hidden_layers):
        for ours, theirs in L.layer_names(i).items():
            if ours in state:
                put(theirs, state[ours])
            elif ours.endswith(("q_norm.weight", "k_norm.weight")):     # refused above unless allowed
                put(theirs, torch.ones(c.head_dim))
    for ours, theirs in L.PLAIN.items():
        if ours in state:
            put(theirs, state[ours])
    # fold the feature scale into fc: the product our serving path computes (fp32, per column)
    fc = state["backbone.fc.weight"].float() * state["backbone.feature_scale"].float()[None]
    out[L.FC] = fc.to(dtype).contiguous()
    if dtype != torch.float32:
        inexact.append(f"fc (with the feature scale folded in) rounded to {dtype}; our serving path "
                       "rounds the fp32 product to the serving dtype, which matches only in that dtype")
    vocab = model.draft_vocab.cpu()
    vd, V = int(vocab.numel()), c.vocab_size
    if model.head is not None:
        # one row per target token: its draft row, or the shared row of tokens outside the draft vocabulary
        put(L.MARKOV_W1, state["head.w1.weight"][model.prev_rows.cpu()])
    # the mask slots' input: DeepSpec embeds mask_token_id, so that row carries our learned vector
    emb = embed.detach().cpu().float().clone()
    emb[c.mask_token_id] = state["mask_embedding"].float() / c.embed_scale
    if c.embed_scale != 1.0:
        inexact.append(f"mask vector divided by the embedding scale {c.embed_scale} (the engines multiply "
                       "it back): rounding in the last bit")
    put(L.EMBED, emb)
    head = lm_head.detach().cpu()
    put(L.LM_HEAD, head[:V] if vd == V else head[vocab])
    if vd < V:
        put(L.D2T, (vocab - torch.arange(vd)).long())
    mask_in = bool((vocab == c.mask_token_id).any())
    if vd == V:
        notes.append("full draft vocabulary: llama.cpp's converter drops lm_head and uses the shipped "
                     "embed_tokens as the output head, which is right only for a target with tied "
                     "embeddings, and there row mask_token_id (the mask vector) is also that token's "
                     "output row; DeepSpec, vLLM and SGLang read lm_head")
    elif mask_in:
        notes.append(f"mask_token_id {c.mask_token_id} is in the draft vocabulary: exact for every engine "
                     "that reads lm_head (the mask row of embed_tokens only feeds the mask slots)")
    else:
        notes.append(f"mask_token_id {c.mask_token_id} is outside the draft vocabulary: the patched "
                     "embed_tokens row is never an output row in any engine (exact)")
    return out


def _base_config(model: DSparkModel, base: dict[str, Any] | None) -> dict[str, Any]:
    """The target's config (DeepSpec writes the draft config as a modified copy of it) with every
    key that describes the drafter's own layers replaced."""
    c = model.config
    cfg = {k: v for k, v in (base or {}).items()
           if k not in ("auto_map", "quantization_config", "_name_or_path", "_model_name_or_path", "rope_scaling",
                        "sliding_window", "use_sliding_window", "max_window_layers", "text_config",
                        "transformers_version", "dtype", "torch_dtype")}
    cfg.update({"model_type": L.MODEL_TYPE, "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
                "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "rope_theta": c.rope_theta,
                "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
                "layer_types": ["full_attention"] * c.num_hidden_layers, "tie_word_embeddings": False,
                # vLLM's Qwen3 layers size their RoPE table from it (and raise it to the target's length)
                "max_position_embeddings": int(cfg.get("max_position_embeddings") or 32768),
                "torch_dtype": "float32"})
    return cfg


def _verifier(base: dict[str, Any] | None, name: str | None) -> dict[str, Any]:
    """speculators' ``verifier`` block: the target's repository (``name``, else the target config's
    ``_name_or_path``) and its architectures."""
    base = base or {}
    return {"name_or_path": name or base.get("_name_or_path") or None,
            "architectures": list(base.get("architectures") or [])}


def _is_repo_id(name: str | None) -> bool:
    """A Hugging Face repository id ("org/name"), not a local path: what vLLM accepts as the verifier
    of a speculators checkpoint served by itself."""
    return bool(name and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) and not Path(name).exists())


def _config(model: DSparkModel, fmt: str, num_target_layers: int, base: dict[str, Any] | None,
            shifts_dropped: bool, verifier: str | None = None) -> dict[str, Any]:
    c = model.config
    has_markov = model.head is not None
    dspark_keys: dict[str, Any] = {
        "block_size": c.block_size, "mask_token_id": c.mask_token_id, "num_target_layers": num_target_layers,
        "num_anchors": 512,                 # DeepSpec requires the key; training-only
        "markov_rank": c.markov_rank if has_markov else 0,
        "enable_confidence_head": model.confidence is not None,
        "confidence_head_with_markov": model.confidence is not None and has_markov,
        "sample_from_anchor": True,         # the block is [anchor, mask...] and every slot drafts
    }
    if has_markov:
        dspark_keys["markov_head_type"] = c.markov_head_type
    if c.draft_vocab_size < c.vocab_size:
        dspark_keys["draft_vocab_size"] = c.draft_vocab_size
    if c.final_logit_softcap:
        dspark_keys["final_logit_softcapping"] = c.final_logit_softcap
    ext = {"kind": c.kind, "target": c.target, "sts_temperatures": c.sts_temperatures,
           "sts_shifts": c.sts_shifts, "embed_scale": c.embed_scale, "qk_norm": c.qk_norm,
           "layer_ids": "target_layer_ids: output of target layer L (0-based), as DeepSpec; "
                        "vLLM / llama.cpp / speculators use L + 1",
           "feature_scale": "folded into fc.weight"}
    base_cfg = _base_config(model, base)
    layers = {k: v for k, v in base_cfg.items() if k != "architectures"}
    if fmt == "deepspec":
        cfg = {**base_cfg, **dspark_keys, "target_layer_ids": list(c.target_layer_ids)}
    elif fmt == "dflash":
        # model_type qwen3 (from base_cfg) is what makes vLLM read DSparkDraftModel as its Qwen3 DSpark
        cfg = {**base_cfg, **dspark_keys,
               "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                                 "block_size": c.block_size}}
    else:   # speculators: the layer hyperparameters nested, ids shifted by one, and no top-level
        # model_type: vLLM takes a config.json for a speculators one only by its speculators_config block
        cfg = {**dspark_keys, "speculators_model_type": "dspark", "transformer_layer_config": layers,
               "aux_hidden_state_layer_ids": L.engine_layer_ids(c.target_layer_ids),
               "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
               "vocab_size": c.vocab_size,
               "speculators_config": {
                   "algorithm": "dspark",
                   # every slot drafts (sample_from_anchor), so a round proposes block_size tokens
                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                   "default_proposal_method": "greedy",
                   "verifier": _verifier(base, verifier)}}
    cfg["architectures"] = [L.ARCHITECTURE[fmt]]
    if shifts_dropped:
        ext["sts_note"] = f"{L.SGLANG_STS_FILE} carries the temperatures only; the shifts are in this block"
    cfg[L.EXTENSION_KEY] = ext
    return cfg


def _sts_json(model: DSparkModel) -> tuple[dict[str, Any] | None, bool]:
    """SGLang's STS file from our calibration, and whether shifts had to be dropped."""
    c = model.config
    if not c.sts_temperatures:
        return None, False
    shifts = [float(b) for b in (c.sts_shifts or [])]
    dropped = any(b != 0.0 for b in shifts)
    doc: dict[str, Any] = {"temperatures": [float(t) for t in c.sts_temperatures],
                           "dataset": f"dspark calibrate held-out prompts ({c.target or 'the target'})",
                           # the calibration report is not kept with the checkpoint: rerun `dspark calibrate --json`
                           "num_samples": None, "ece_before": None, "ece_after": None}
    if dropped:
        doc["dropped_shifts"] = shifts
        doc["note"] = ("calibrated as sigmoid(z / T_k + b_k); the temperatures alone carry sigmoid(z / T_k), "
                       "so the per-position shifts b_k above are lost to an engine that reads this file")
    return doc, dropped


def export_model(model: DSparkModel, embed: torch.Tensor, lm_head: torch.Tensor, num_target_layers: int,
                 out: Path, fmt: str, *, base_config: dict[str, Any] | None = None, allow_inexact: bool = False,
                 dtype: torch.dtype = torch.float32, verifier: str | None = None) -> ExportReport:
    """Write ``model`` (a loaded drafter of ours, in fp32) into ``out`` in layout ``fmt``, with the
    target's embeddings [V, d] and LM head [V, d]. ``verifier``: the target's Hugging Face repository,
    named in the speculators layout (default: the target config's ``_name_or_path``)."""
    if fmt not in L.FORMATS:
        raise UsageError(f"unknown format {fmt!r}; choose one of {', '.join(L.FORMATS)}")
    c = model.config
    if max(c.target_layer_ids) >= num_target_layers:
        raise UsageError(f"target_layer_ids {c.target_layer_ids} out of range for a target of "
                         f"{num_target_layers} layers")
    inexact: list[str] = []
    notes: list[str] = []
    _check_exportable(model, allow_inexact, inexact)
    tensors = _tensors(model, embed, lm_head, dtype, inexact, notes)
    sts, dropped = _sts_json(model)
    if dropped:
        inexact.append(f"{L.SGLANG_STS_FILE}: the per-position confidence shifts cannot be folded into the "
                       "temperatures (nonzero shifts); listed there as dropped")
    if max(c.target_layer_ids) > num_target_layers - 3:
        notes.append(f"llama.cpp extracts layer inputs: it reaches ids <= {num_target_layers - 3} here "
                     f"(engine id {num_target_layers - 2}); {max(c.target_layer_ids)} is past that")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = _config(model, fmt, num_target_layers, base_config, dropped, verifier)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    notes.extend(_vllm_notes(model, fmt, cfg))
    if sts is not None:
        (out / L.SGLANG_STS_FILE).write_text(json.dumps(sts, indent=2) + "\n")
    report = ExportReport(folder=str(out), format=fmt, architecture=L.ARCHITECTURE[fmt], tensors=len(tensors),
                          draft_vocab_size=c.draft_vocab_size, vocab_size=c.vocab_size,
                          mask_token_in_draft_vocab=bool((model.draft_vocab == c.mask_token_id).any()),
                          target_layer_ids=list(c.target_layer_ids),
                          engine_layer_ids=L.engine_layer_ids(c.target_layer_ids), inexact=inexact, notes=notes)
    (out / "dspark_export.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def _vllm_notes(model: DSparkModel, fmt: str, cfg: dict[str, Any]) -> list[str]:
    """What vLLM does with the export, where that is not simply "serves it"."""
    notes = []
    if model.head is None:
        notes.append("no Markov head (a DFlash drafter of ours): vLLM would build its Qwen3 DSpark with a Markov "
                     "head of rank 0 (not tried there); its DFlash class, the one without a Markov head, refuses "
                     "blocks that draft from the anchor slot. llama.cpp and our import read it")
    if fmt == "speculators":
        name = cfg["speculators_config"]["verifier"]["name_or_path"]
        if not _is_repo_id(name):
            notes.append(f"verifier {name!r} is not a Hugging Face repository id: vLLM takes this folder as the "
                         "model of --speculative-config, but not as a model served by itself (`vllm serve "
                         "FOLDER` loads the verifier named there)")
    return notes


def hf_config_of(path: Path) -> dict[str, Any] | None:
    """The target's own config.json (Hugging Face folder, or the cached conversion of a GGUF file)."""
    from ..runtime.loading import _convert_gguf
    folder = _convert_gguf(path) if path.is_file() else path
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return {**data, **data.get("text_config", {})} if isinstance(data, dict) else None


def export_drafter(drafter: str, fmt: str, out: Path, *, target: str | None = None, allow_inexact: bool = False,
                   dtype: torch.dtype = torch.float32) -> ExportReport:
    """The CLI's entry: ``drafter`` is a trained drafter's folder or name (resolved for ``target``)."""
    from ..drafters import TRAINED_NAMES, trained_drafter_dirs
    from ..runtime.loading import load_target
    path = Path(drafter).expanduser()
    if not (path / "config.json").is_file():
        from ..runtime.loading import resolve_target
        name, _ = resolve_target(target)
        if drafter.lower() not in TRAINED_NAMES:
            raise UsageError(f"drafter {drafter!r} is neither a trained drafter's folder nor one of "
                             f"{', '.join(TRAINED_NAMES)}")
        found = [f for f in trained_drafter_dirs(name, drafter.lower()) if (f / "config.json").is_file()]
        if not found:
            raise UsageError(f"no trained {drafter!r} drafter for {name}")
        path = found[0]
    cfg = DrafterConfig.load(path)
    _check_config(cfg, allow_inexact, [])          # what is refused, before the target is loaded
    t = load_target(target or cfg.target or None, dtype="fp32")
    tc = t.model.config
    if cfg.vocab_size != tc.vocab_size or cfg.target_hidden_size != tc.hidden_size:
        raise UsageError(f"drafter {path} was trained for {cfg.target or 'another target'} (vocab {cfg.vocab_size}, "
                         f"hidden {cfg.target_hidden_size}), not {t.name} (vocab {tc.vocab_size}, hidden {tc.hidden_size})")
    model = DSparkModel.load(path)
    return export_model(model, t.model.embed, t.model.lm_head, tc.num_layers, out, fmt,
                        base_config=hf_config_of(t.path), allow_inexact=allow_inexact, dtype=dtype,
                        verifier=L.VERIFIER_REPOS.get(t.name))
