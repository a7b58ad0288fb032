"""``dspark train``: train a DSpark / DFlash drafter on a target cache (or online), read top to bottom.

Per step: a global batch of sequences (a fixed permutation per epoch); per sequence, up to
``anchors`` anchor positions i where tokens i and i+1 are both supervised (0: every one), all
blocks in one forward (each block sees the context before its anchor and itself:
``block_attention``), so one target forward and one p_t per position serve every anchor of the
sequence; p_t recomputed from the last hidden state with the frozen LM head; the loss of
training/losses.py (``loss``: the paper's TV, forward KL, or both); AdamW, linear warmup then
cosine to 0 or warmup-stable-decay (``schedule="wsd"``: constant until the last ``decay`` of the
steps, so a run can be extended by raising its epochs while it is still in the stable phase),
gradient clipping.

Checkpoints: ``<out>/checkpoint`` (fp32 weights, optimizer moments, step) every ``save_every``
steps, every ``save_minutes`` and at the end, written to a temporary folder and renamed. Rerunning
the same command resumes from it and reproduces the uninterrupted run (the data order and the
anchors depend only on the seed and the step). ``init_weights`` starts a new run from a saved
drafter's weights with a fresh optimizer. The final drafter (bf16) is ``<out>/config.json +
model.safetensors``.

Held-out signal: every ``eval_every`` steps, on held-out sequences of each source, per block
position the mean 1 - TV(p_d, p_t) (the acceptance rate at temperature 1) and how often the
draft's argmax is the target's (greedy), teacher-forced, appended to ``<out>/heldout.jsonl`` with
the number of answer positions trained on so far.

Runs as is under ``torchrun --nproc_per_node N``: each rank takes its share of every batch and
gradients are summed across ranks (gloo: the drafter trains on the CPU).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..drafters.backbone import init_from_target
from ..drafters.config import DrafterConfig, position_weights
from ..drafters.dspark import DSparkModel
from ..errors import DsparkError, UsageError
from .grow import grow
from .losses import drafter_loss, eagle3_loss, target_probs


@dataclass
class TrainConfig:
    lr: float = 6e-4
    epochs: float = 1.0
    batch_size: int = 16          # sequences per optimizer step (global)
    anchors: int = 128            # anchors per sequence (DeepSpec: up to 512)
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 10
    log_every: int = 5
    loss_decay: float = 4.0       # position weights exp(-(k-1)/decay); 0: measured (measured_weights)
    max_steps: int | None = None  # stop early (the schedule still spans all epochs)
    init_layers: list | None = None  # start drafter layer i from target layer init_layers[i] (None: random)
    loss: str | None = None       # tv (paper) | kl | kl+tv | ce; None: ce for DFlash (the paper's), tv else
    schedule: str = "cosine"      # cosine | wsd (warmup-stable-decay)
    decay: float = 0.2            # wsd: the last fraction of the steps, lr falling linearly to 0
    warmup_steps: int = 50        # wsd: warmup in steps, not a fraction, so that a longer run starts alike
    save_minutes: float = 10.0    # also checkpoint whenever this long has passed since the last save
    eval_every: int = 0           # held-out signal every N steps (0: never)
    init_weights: str | None = None  # start from this saved drafter's weights (fresh optimizer)


LOSSES = {   # name -> (ce, l1, kl) weights; BCE of the confidence head 1.0 wherever p_t is used
    "tv": (0.1, 0.9, 0.0), "kl": (0.1, 0.0, 1.0), "kl+tv": (0.1, 0.9, 1.0), "ce": (1.0, 0.0, 0.0)}


WEIGHT_FLOOR = 0.05     # measured weights: the least a position gets, so that no position stops learning


def measured_weights(signal: dict, block_size: int) -> list[float]:
    """Position weights for the acceptance the drafter has: w_k = prod_{j<k} a_j, with a_j the
    held-out acceptance at position j (1 - TV, teacher-forced, the mean over sources). A drafted
    token at position k counts towards the accepted length only if positions 1..k-1 were accepted,
    so raising a_k is worth about that product; exp(-(k-1)/decay) is the same curve for a constant
    acceptance exp(-1/decay). Floored at WEIGHT_FLOOR."""
    accept = torch.tensor([v["accept"] for v in signal.values()]).mean(0) if signal else torch.zeros(block_size)
    w = torch.cat([torch.ones(1), accept[:block_size - 1].clamp(0, 1).cumprod(0)])
    return [round(float(x), 4) for x in w.clamp_min(WEIGHT_FLOOR)]


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    # wsd: warmup_steps, but at most a quarter of a short run (which would otherwise end still
    # warming up, never at the peak and never decayed)
    warm = max(1, min(cfg.warmup_steps, total // 4) if cfg.schedule == "wsd" else round(cfg.warmup * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.schedule == "wsd":
        start = max(warm, round((1 - cfg.decay) * total))
        return cfg.lr if step < start else cfg.lr * max(0.0, (total - step) / max(1, total - start))
    t = (step - warm) / max(1, total - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions i where tokens i and i+1 are both supervised."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).squeeze(-1)


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``n`` anchor candidates at random (n = 0: all of them), sorted."""
    cand = anchor_candidates(loss_mask)
    if 0 < n < cand.numel():
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:n]]
    return cand.sort().values


def build_draft_vocab(source, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The ``size`` most frequent answer tokens of the training data (ties by id), plus ``always``."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    rows = source.token_rows() if hasattr(source, "token_rows") else (
        (s.ids, s.loss_mask) for s in (source[i] for i in range(len(source))))
    for ids, mask in rows:
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    for t in always:
        counts[t] = counts.max() + 1
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))[:size]
    return torch.tensor(sorted(order))


def feature_scale(source, max_tokens: int = 50_000) -> torch.Tensor:
    """1 / mean |x| per feature channel over the first ``max_tokens`` supervised tokens (floored so
    that a dead channel does not blow up)."""
    total, count = None, 0
    for i in range(len(source)):
        if hasattr(source, "prefetch") and i % 16 == 0:     # online: the target over 16 sequences at once
            source.prefetch(range(i, min(i + 16, len(source))))
        s = source[i]
        f = s.features[s.loss_mask].float().abs()
        total = f.sum(0) if total is None else total + f.sum(0)
        count += f.shape[0]
        if count >= max_tokens:
            break
    if not count:
        raise UsageError("no supervised tokens to measure the feature scale on")
    assert total is not None            # set with the first counted row
    mean = total / count
    return 1.0 / mean.clamp_min(1e-3 * float(mean.median()) + 1e-12)


def model_class(kind: str):
    if kind == "eagle3":
        from ..drafters.eagle3 import Eagle3Model
        return Eagle3Model
    return DSparkModel


def sequence_loss(model: DSparkModel, seq, anchors: torch.Tensor, weights: torch.Tensor, kind: str,
                  loss: str = "tv"):
    """Loss of one sequence's packed blocks (teacher forcing)."""
    c = model.config
    g, L = c.block_size, seq.ids.shape[0]
    _, logits, conf = model.forward_train(seq.features, seq.ids, anchors)
    k = torch.arange(g)
    pos = anchors[:, None] + k[None]                     # p_t position for each block row
    tgt = pos + 1                                        # the token it predicts
    valid = tgt < L
    valid &= seq.loss_mask[tgt.clamp(max=L - 1)]
    # the supervised rows as indices: index_select's backward is a scatter, a boolean mask's an
    # accumulating index_put that costs 8x more over [rows, draft vocabulary]
    rows = valid.reshape(-1).nonzero().squeeze(-1)
    flat_logits = logits.reshape(-1, logits.shape[-1]).index_select(0, rows)
    ks = k.expand_as(pos).reshape(-1)[rows]
    gt = model.t2d[seq.ids[tgt.clamp(max=L - 1)].reshape(-1)[rows]]
    if not getattr(seq, "target_written", True):       # no CE on text the target did not write
        gt = torch.full_like(gt, logits.shape[-1])
    pt = pt_out = None
    if kind == "eagle3" or loss != "ce":
        need = pos.reshape(-1)[rows]
        uniq, inverse = torch.unique(need, return_inverse=True)
        assert model.target_lm_head is not None     # attach()ed, as forward_train above needs
        pu, ou = target_probs(seq.hidden[uniq], model.target_lm_head, model.draft_vocab, c.final_logit_softcap)
        pt, pt_out = pu[inverse], ou[inverse]
    cl = conf.reshape(-1).index_select(0, rows) if conf is not None else None
    if kind == "eagle3":
        assert pt is not None and pt_out is not None    # computed above for eagle3
        return eagle3_loss(flat_logits, ks, pt, pt_out)
    ce_w, l1_w, kl_w = LOSSES[loss]
    return drafter_loss(flat_logits, ks, weights, gt, pt, pt_out, cl, ce_weight=ce_w, l1_weight=l1_w, kl_weight=kl_w)


def cpu_bf16(model):
    """bf16 autocast where the drafter's weights are on the CPU (training's matrix products at the
    fast dtype, the weights and optimizer in fp32); a no-op elsewhere. Keyed on the weights, not on
    whether the machine has a GPU: a CPU run beside an idle GPU is still a CPU run."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=next(model.parameters()).device.type == "cpu")


@torch.no_grad()
def heldout_signal(model: DSparkModel, seqs: list, max_anchors: int = 48) -> dict:
    """Per source and block position: mean 1 - TV(p_d, p_t) and argmax agreement, teacher-forced,
    over up to ``max_anchors`` evenly spaced anchors of each held-out sequence."""
    g = model.config.block_size
    was = model.training
    model.eval()
    sums: dict = {}
    for seq in seqs:
        cand = anchor_candidates(seq.loss_mask)
        if cand.numel() == 0:
            continue
        anchors = cand[torch.linspace(0, cand.numel() - 1, min(max_anchors, cand.numel())).round().long().unique()]
        L = seq.ids.shape[0]
        with cpu_bf16(model):
            _, logits, _ = model.forward_train(seq.features, seq.ids, anchors)
        pos = anchors[:, None] + torch.arange(g)[None]
        ok = (pos + 1 < L) & seq.loss_mask[(pos + 1).clamp(max=L - 1)]
        need = pos.clamp(max=L - 1)
        assert model.target_lm_head is not None     # attach()ed, as forward_train above needs
        pt, pt_out = target_probs(seq.hidden[need.reshape(-1)], model.target_lm_head, model.draft_vocab,
                                  model.config.final_logit_softcap)
        pd = logits.float().softmax(-1).reshape(-1, logits.shape[-1])
        accept = (1 - 0.5 * ((pd - pt).abs().sum(-1) + pt_out)).clamp(0, 1).view(-1, g)
        top_t = (seq.hidden[need.reshape(-1)].to(model.target_lm_head.dtype) @ model.target_lm_head.T).argmax(-1)
        agree = (model.draft_vocab[pd.argmax(-1)] == top_t).float().view(-1, g)
        s = sums.setdefault(getattr(seq, "source", "regen"), [torch.zeros(g), torch.zeros(g), torch.zeros(g)])
        s[0] += (accept * ok).sum(0)
        s[1] += (agree * ok).sum(0)
        s[2] += ok.sum(0)
    model.train(was)
    return {src: {"accept": (a / n.clamp_min(1)).tolist(), "argmax": (m / n.clamp_min(1)).tolist(),
                  "rows": int(n[0])} for src, (a, m, n) in sums.items()}


def _init_from_target(model, target, layer_ids: list) -> None:
    if model.config.kind == "eagle3":
        raise UsageError("the EAGLE-3-style layer reads [embedding; feature] (2d inputs): it cannot start from a target layer")
    n = len(target.model.layers)
    if any(not 0 <= i < n for i in layer_ids):
        raise UsageError(f"target layer ids must be in [0, {n - 1}], got {layer_ids}")
    try:
        init_from_target(model.backbone, [target.model.layers[i] for i in layer_ids], target.model.final_norm)
    except ValueError as e:
        raise UsageError(f"cannot start the drafter from target layers {layer_ids}: {e}") from None


# -------------------------------------------------------------------------------- checkpoints
def _save_checkpoint(folder: Path, model, opt, step: int, history: list, tcfg: TrainConfig,
                     weights: list | None = None) -> None:
    tmp = folder.parent / (folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
    model.config.save(tmp)
    params = list(model.parameters())
    ost = {}
    for i, p in enumerate(params):
        st = opt.state.get(p)
        if st:
            for name, v in st.items():
                ost[f"{i}.{name}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().contiguous()
    save_file(ost, str(tmp / "optimizer.safetensors"))
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "history": history, "train": asdict(tcfg),
                                                       "position_weights": weights}))
    old = folder.parent / (folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(folder: Path, model, opt) -> tuple[int, list, list | None]:
    try:
        state = load_file(str(folder / "model.safetensors"))
        ost = load_file(str(folder / "optimizer.safetensors"))
        meta = json.loads((folder / "trainer_state.json").read_text())
    except Exception as e:  # noqa: BLE001 - any damage means the same thing to the user
        raise DsparkError(f"checkpoint {folder} is damaged ({e}); delete it to start over") from None
    model.load_state_dict(state, strict=False)
    params = list(model.parameters())
    for key, v in ost.items():
        i, name = key.split(".", 1)
        opt.state[params[int(i)]][name] = v
    return int(meta["step"]), list(meta.get("history", [])), meta.get("position_weights")


# -------------------------------------------------------------------------------- the loop
def _dist():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")     # the drafter trains on the CPU, a GPU or none beside it
    if world > 1:
        return dist.get_rank(), world
    return 0, 1


HEAD_PREFIXES = ("head.", "confidence.")    # DSpark's sequential and confidence heads


def _load_weights(model, folder) -> list[str]:
    """A saved drafter's (or checkpoint's) weights into ``model``, which must have its shapes or
    grow from them (training/grow.py: more layers, another Markov rank); returns what grew."""
    try:
        state = load_file(str(Path(folder) / "model.safetensors"))
    except Exception as e:  # noqa: BLE001 - any damage means the same thing to the user
        raise UsageError(f"--init-weights {folder}: cannot read model.safetensors ({e})") from None
    mine = model.state_dict()
    # a DSpark drafter starts a drafter without its heads (DFlash: the same backbone) from its backbone,
    # so both recipes can share one training history; the sequential and confidence heads are left out
    state = {k: v for k, v in state.items() if k in mine or not k.startswith(HEAD_PREFIXES)}
    state, done = grow(state, mine, model.config.markov_head_type, model.config.hidden_size, f"--init-weights {folder}")
    bad = [k for k, v in state.items() if k not in mine or mine[k].shape != v.shape]
    # a drafter saved without q/k norms grows them: they start at one (RMSNorm's init), the rest loads
    grown = [k for k in mine if k not in state and k.endswith((".q_norm.weight", ".k_norm.weight"))]
    missing = [k for k in mine if k not in state and k not in grown]
    if bad or missing:
        raise UsageError(f"--init-weights {folder}: weights do not fit this drafter "
                         f"(mismatched {bad[:3]}, missing {missing[:3]})")
    model.load_state_dict({k: v.to(mine[k].dtype) for k, v in state.items()}
                          | {k: torch.ones_like(mine[k]) for k in grown})
    return done + (["q/k norms at one"] if grown else [])


def _check(source, drafter_config: DrafterConfig, tcfg: TrainConfig, heldout, world: int) -> str:
    """The run's settings checked against each other; returns the loss's name."""
    loss_name = tcfg.loss or ("ce" if drafter_config.kind == "dflash" else "tv")
    if loss_name not in LOSSES:
        raise UsageError(f"loss must be one of {', '.join(LOSSES)}, got {loss_name!r}")
    if tcfg.schedule not in ("cosine", "wsd") or not 0 < tcfg.decay <= 1:
        raise UsageError("schedule must be cosine or wsd, with decay in (0, 1]")
    if tcfg.loss_decay == 0 and not (heldout is not None and tcfg.eval_every):
        raise UsageError("measured position weights (loss decay 0) need held-out sequences and eval_every")
    if len(source) == 0:
        raise UsageError("no training sequences")
    if tcfg.batch_size < world:
        raise UsageError(f"batch size {tcfg.batch_size} < number of processes {world}")
    if list(source.feature_layers) != list(drafter_config.target_layer_ids):
        raise UsageError(f"the cache holds layers {source.feature_layers}, the drafter wants "
                         f"{drafter_config.target_layer_ids}")
    return loss_name


def _drafter_model(source, drafter_config: DrafterConfig, target, tcfg: TrainConfig, ckpt: Path,
                   draft_vocab: torch.Tensor | None, rank: int, log):
    """The drafter to train: the checkpoint's shape (its weights are loaded with the optimiser's
    state later), or ``init_weights``'s weights, or new (its feature scale from the data, its
    layers from the target's with ``init_layers``)."""
    if ckpt.exists() or tcfg.init_weights:
        src = ckpt if ckpt.exists() else Path(cast(str, tcfg.init_weights))   # set: the condition above
        saved = DrafterConfig.load(src)
        # a DSpark drafter's backbone starts a DFlash one (_load_weights leaves its heads out)
        kind_fits = saved.kind == drafter_config.kind or (saved.kind, drafter_config.kind) == ("dspark", "dflash")
        if not ckpt.exists() and (not kind_fits or saved.target_layer_ids != drafter_config.target_layer_ids):
            raise UsageError(f"--init-weights {src}: a {saved.kind} drafter on layers {saved.target_layer_ids}, "
                             f"not a {drafter_config.kind} on {drafter_config.target_layer_ids}")
        drafter_config = saved if ckpt.exists() else drafter_config
        try:
            draft_vocab = load_file(str(src / "model.safetensors"))["draft_vocab"]
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"{src}: cannot read the draft vocabulary ({e})") from None
    model = model_class(drafter_config.kind)(drafter_config, draft_vocab)
    model.attach(target.model.embed, target.model.lm_head, init_mask=True)
    if not ckpt.exists() and tcfg.init_weights:
        grew = _load_weights(model, tcfg.init_weights)
        if rank == 0:
            log(f"weights from {tcfg.init_weights} (fresh optimizer)" + (f"; grown: {'; '.join(grew)}" if grew else ""))
    elif not ckpt.exists():
        model.backbone.feature_scale.copy_(feature_scale(source))
        if tcfg.init_layers:
            _init_from_target(model, target, tcfg.init_layers)
            if rank == 0:
                log(f"drafter layers start from target layers {list(tcfg.init_layers)} (and its final norm)")
    return model


def _checkpoint(out: Path) -> Path:
    """Where the run saves (and resumes from); a save killed between its two renames is completed."""
    ckpt, old = out / "checkpoint", out / "checkpoint.old"
    if old.exists() and not ckpt.exists():
        old.rename(ckpt)
    return ckpt


def _held_out(heldout) -> list:
    """Every held-out sequence, read once (the held-out signal reads them at every evaluation)."""
    if hasattr(heldout, "prefetch"):
        heldout.prefetch(range(len(heldout)))
    return [heldout[i] for i in range(len(heldout))]


def _signal(model, held_seqs: list, out: Path, step: int, anchors_seen: int, g: int | None, log):
    """The held-out signal now, appended to ``heldout.jsonl`` and logged; with ``g``, the position
    weights measured from it (they follow the acceptance the drafter has now)."""
    rec: dict[str, Any] = {"step": step, "anchors_seen": anchors_seen, "sources": heldout_signal(model, held_seqs)}
    weights = None
    if g is not None:
        weights = torch.tensor(measured_weights(rec["sources"], g))
        rec["position_weights"] = weights.tolist()
    with open(out / "heldout.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    first = " ".join(f"{k} {v['accept'][0]:.3f}/{v['argmax'][0]:.3f}" for k, v in rec["sources"].items())
    log(f"held-out at step {step} ({anchors_seen} anchors): position-1 accept/argmax {first}")
    return weights


def _batch(step: int, n: int, steps_per_epoch: int, tcfg: TrainConfig) -> list[int]:
    """The sequences of this step: its epoch's seeded shuffle, cut at the step's place in it (the
    same batch whenever a resumed run comes to this step)."""
    epoch, within = divmod(step, steps_per_epoch)
    order = list(range(n))
    random.Random(tcfg.seed * 7919 + epoch).shuffle(order)
    return order[within * tcfg.batch_size:(within + 1) * tcfg.batch_size]


def _show(bar, rec: dict, total: int, write: bool, t0: float) -> None:
    """A step on the progress bar; with ``write``, its record in a line of the log."""
    bar.update(1)
    bar.set_postfix(loss=f"{rec.get('loss', 0):.3f}", acc=f"{rec.get('accept', 0):.3f}")
    if write:
        msg = " ".join(f"{k} {v:.4f}" for k, v in rec.items() if k not in ("step", "anchors_seen"))
        bar.write(f"step {rec['step']}/{total} {msg} ({time.perf_counter() - t0:.0f}s)")


def _gradients(model, source, batch: list[int], mine: list[int], step: int, weights: torch.Tensor, kind: str,
               loss_name: str, tcfg: TrainConfig, params: list, world: int) -> tuple[dict, int, int]:
    """One step's gradients over this process's share (``mine``) of the batch, all-reduced across
    processes: (the loss terms summed, the sequences they sum over, the anchors trained)."""
    sums: dict = {}
    step_anchors = 0
    if hasattr(source, "prefetch"):
        source.prefetch(mine)
    for idx in mine:
        seq = source[idx]
        gen = torch.Generator().manual_seed(tcfg.seed * 1_000_003 + step * 10_007 + idx)
        anchors = sample_anchors(seq.loss_mask, tcfg.anchors, gen)
        if anchors.numel() == 0:
            continue
        step_anchors += anchors.numel()
        with cpu_bf16(model):
            loss, terms = sequence_loss(model, seq, anchors, weights, kind, loss_name)
        (loss / len(batch)).backward()
        for k, v in terms.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    names = ("loss", "ce", "l1", "kl", "bce", "accept")
    if world > 1:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        t = torch.tensor([sums.get(k, 0.0) for k in names] + [len(mine), step_anchors], dtype=torch.float64)
        dist.all_reduce(t)
        sums = dict(zip(names, t[:len(names)].tolist()))
        count, step_anchors = int(t[-2]), int(t[-1])
    else:
        count = len(mine)
    return sums, count, step_anchors


def _step(model, opt, params: list, source, step: int, total: int, weights: torch.Tensor, loss_name: str,
          tcfg: TrainConfig, rank: int, world: int) -> tuple[dict, int]:
    """One optimiser step at ``step`` of ``total``: its batch, learning rate, gradients and update.
    Returns its record (mean loss terms over the batch) and the anchors it trained."""
    n = len(source)
    batch = _batch(step, n, math.ceil(n / tcfg.batch_size), tcfg)
    lr = lr_at(step, total, tcfg)
    for grp in opt.param_groups:
        grp["lr"] = lr
    opt.zero_grad(set_to_none=True)
    sums, count, step_anchors = _gradients(model, source, batch, batch[rank::world], step, weights,
                                           model.config.kind, loss_name, tcfg, params, world)
    gnorm = float(torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip))
    opt.step()
    rec = {"step": step + 1, "lr": lr, "grad_norm": gnorm, **{k: v / max(1, count) for k, v in sums.items() if v}}
    return rec, step_anchors


def _finish(model, out: Path, tcfg: TrainConfig, history: list, log) -> None:
    """The whole schedule ran: the drafter, and how it was trained."""
    model.save(out)
    (out / "train_log.json").write_text(json.dumps({"train": asdict(tcfg), "history": history}))
    log(f"saved drafter to {out}")


def train(source, drafter_config: DrafterConfig, out_dir, target, tcfg: TrainConfig | None = None, *,
          draft_vocab: torch.Tensor | None = None, heldout=None, progress: bool = True, log=print) -> dict:
    """``heldout``: a source of held-out sequences for the held-out signal (with ``eval_every``)."""
    tcfg = tcfg or TrainConfig()
    rank, world = _dist()
    loss_name = _check(source, drafter_config, tcfg, heldout, world)
    measured = tcfg.loss_decay == 0
    # autocast leaves RMSNorm in fp32 weights over bf16 inputs; torch warns once per shape
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    out = Path(out_dir)
    ckpt = _checkpoint(out)
    torch.manual_seed(tcfg.seed)
    model = _drafter_model(source, drafter_config, target, tcfg, ckpt, draft_vocab, rank, log)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.95))
    total = max(1, round(tcfg.epochs * math.ceil(len(source) / tcfg.batch_size)))
    stop = min(total, tcfg.max_steps or total)
    step, history, saved_weights = _load_checkpoint(ckpt, model, opt) if ckpt.exists() else (0, [], None)
    g = model.config.block_size
    weights = torch.tensor(saved_weights or (position_weights(g, tcfg.loss_decay) if not measured else [1.0] * g))
    held_seqs = None
    if rank == 0:
        if ckpt.exists():
            log(f"resuming from {ckpt} at step {step}/{total}")
        log(f"train {model.config.kind}: {len(source)} sequences, {source.num_tokens} tokens, {total} steps of "
            f"{tcfg.batch_size} sequences, {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters, "
            f"draft vocab {model.config.draft_vocab_size}, loss {loss_name}, {tcfg.schedule} schedule, "
            f"{world} process(es)")
        out.mkdir(parents=True, exist_ok=True)
        held_seqs = _held_out(heldout) if heldout is not None and tcfg.eval_every else None
    anchors_seen = int(history[-1].get("anchors_seen", 0)) if history else 0

    def signal():
        nonlocal weights
        got = _signal(model, held_seqs, out, step, anchors_seen, g if measured else None, log)
        weights = got if got is not None else weights

    from tqdm import tqdm
    bar = tqdm(total=stop, initial=step, unit="step", disable=not progress or rank != 0, dynamic_ncols=True)
    t0 = last_save = time.perf_counter()
    model.train()
    if held_seqs is not None and step == 0:
        signal()
    while step < stop:
        rec, step_anchors = _step(model, opt, params, source, step, total, weights, loss_name, tcfg, rank, world)
        step, anchors_seen = step + 1, anchors_seen + step_anchors
        history.append({**rec, "anchors_seen": anchors_seen})
        _show(bar, history[-1], total, rank == 0 and (step % tcfg.log_every == 0 or step == stop), t0)
        if held_seqs is not None and (step % tcfg.eval_every == 0 or step == stop):
            signal()
        due = time.perf_counter() - last_save >= 60 * tcfg.save_minutes
        if rank == 0 and (step % tcfg.save_every == 0 or step == stop or due):
            _save_checkpoint(ckpt, model, opt, step, history, tcfg, weights.tolist())
            last_save = time.perf_counter()
    bar.close()
    if rank == 0 and step >= total:
        _finish(model, out, tcfg, history, log)
    if world > 1:
        dist.barrier()
    return {"steps": step, "total_steps": total, "history": history[-1:]}
