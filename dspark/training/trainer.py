"""``dspark train``: train a DSpark / DFlash drafter on a target cache (or online), read top to bottom.

Per step: a global batch of sequences (a fixed permutation per epoch); per sequence, up to
``anchors`` anchor positions i where tokens i and i+1 are both supervised, all blocks packed into
one forward with the block attention mask; p_t recomputed from the cached last hidden state with
the frozen LM head, once per needed position; the loss of training/losses.py; AdamW, linear warmup
then cosine to 0, gradient clipping.

Checkpoints: ``<out>/checkpoint`` (fp32 weights, optimizer moments, step) every ``save_every``
steps and at the end, written to a temporary folder and renamed. Rerunning the same command
resumes from it and reproduces the uninterrupted run (the data order and the anchors depend only
on the seed and the step). The final drafter (bf16) is ``<out>/config.json + model.safetensors``.

Runs as is under ``torchrun --nproc_per_node N``: each rank takes its share of every batch and
gradients are summed across ranks (gloo on CPU, nccl on GPUs).
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

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..drafters.backbone import init_from_target
from ..drafters.config import DrafterConfig, position_weights
from ..drafters.dspark import DSparkModel
from ..errors import DsparkError, UsageError
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
    loss_decay: float = 4.0       # position weights exp(-(k-1)/decay)
    max_steps: int | None = None  # stop early (the schedule still spans all epochs)
    init_layers: list | None = None  # start drafter layer i from target layer init_layers[i] (None: random)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, round(cfg.warmup * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions i where tokens i and i+1 are both supervised."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).squeeze(-1)


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    cand = anchor_candidates(loss_mask)
    if cand.numel() > n:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:n]]
    return cand.sort().values


def build_draft_vocab(source, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The ``size`` most frequent answer tokens of the training data (ties by id), plus ``always``."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(len(source)):
        s = source[i]
        counts += torch.bincount(s.ids[s.loss_mask], minlength=vocab_size)[:vocab_size]
    for t in always:
        counts[t] = counts.max() + 1
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))[:size]
    return torch.tensor(sorted(order))


def feature_scale(source, max_tokens: int = 50_000) -> torch.Tensor:
    """1 / mean |x| per feature channel over the first ``max_tokens`` supervised tokens (floored so
    that a dead channel does not blow up)."""
    total, count = None, 0
    for i in range(len(source)):
        s = source[i]
        f = s.features[s.loss_mask].float().abs()
        total = f.sum(0) if total is None else total + f.sum(0)
        count += f.shape[0]
        if count >= max_tokens:
            break
    if not count:
        raise UsageError("no supervised tokens to measure the feature scale on")
    mean = total / count
    return 1.0 / mean.clamp_min(1e-3 * float(mean.median()) + 1e-12)


def model_class(kind: str):
    if kind == "eagle3":
        from ..drafters.eagle3 import Eagle3Model
        return Eagle3Model
    return DSparkModel


def sequence_loss(model: DSparkModel, seq, anchors: torch.Tensor, weights: torch.Tensor, kind: str):
    """Loss of one sequence's packed blocks (teacher forcing)."""
    c = model.config
    g, L = c.block_size, seq.ids.shape[0]
    h, logits, conf = model.forward_train(seq.features, seq.ids, anchors)
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
    pt = pt_out = None
    if kind in ("dspark", "eagle3"):
        need = pos.reshape(-1)[rows]
        uniq, inverse = torch.unique(need, return_inverse=True)
        pu, ou = target_probs(seq.hidden[uniq], model.target_lm_head, model.draft_vocab, c.final_logit_softcap)
        pt, pt_out = pu[inverse], ou[inverse]
    cl = conf.reshape(-1).index_select(0, rows) if conf is not None else None
    if kind == "eagle3":
        return eagle3_loss(flat_logits, ks, pt, pt_out)
    return drafter_loss(flat_logits, ks, weights, gt, pt, pt_out, cl)


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
def _save_checkpoint(folder: Path, model, opt, step: int, history: list, tcfg: TrainConfig) -> None:
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
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "history": history, "train": asdict(tcfg)}))
    old = folder.parent / (folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(folder: Path, model, opt) -> tuple[int, list]:
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
    return int(meta["step"]), list(meta.get("history", []))


# -------------------------------------------------------------------------------- the loop
def _dist():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if world > 1:
        return dist.get_rank(), world
    return 0, 1


def train(source, drafter_config: DrafterConfig, out_dir, target, tcfg: TrainConfig | None = None, *,
          draft_vocab: torch.Tensor | None = None, progress: bool = True, log=print) -> dict:
    tcfg = tcfg or TrainConfig()
    # autocast leaves RMSNorm in fp32 weights over bf16 inputs; torch warns once per shape
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    rank, world = _dist()
    out = Path(out_dir)
    ckpt = out / "checkpoint"
    n = len(source)
    if n == 0:
        raise UsageError("no training sequences")
    if tcfg.batch_size < world:
        raise UsageError(f"batch size {tcfg.batch_size} < number of processes {world}")
    if list(source.feature_layers) != list(drafter_config.target_layer_ids):
        raise UsageError(f"the cache holds layers {source.feature_layers}, the drafter wants "
                         f"{drafter_config.target_layer_ids}")
    torch.manual_seed(tcfg.seed)
    old = out / "checkpoint.old"
    if old.exists() and not ckpt.exists():     # killed between the two renames of a save
        old.rename(ckpt)
    if ckpt.exists():
        drafter_config = DrafterConfig.load(ckpt)
        draft_vocab = load_file(str(ckpt / "model.safetensors"))["draft_vocab"]
    model = model_class(drafter_config.kind)(drafter_config, draft_vocab)
    model.attach(target.model.embed, target.model.lm_head, init_mask=True)
    if not ckpt.exists():
        model.backbone.feature_scale.copy_(feature_scale(source))
        if tcfg.init_layers:
            _init_from_target(model, target, tcfg.init_layers)
            if rank == 0:
                log(f"drafter layers start from target layers {list(tcfg.init_layers)} (and its final norm)")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(n / tcfg.batch_size)
    total = max(1, round(tcfg.epochs * steps_per_epoch))
    stop = min(total, tcfg.max_steps or total)
    step, history = 0, []
    if ckpt.exists():
        step, history = _load_checkpoint(ckpt, model, opt)
        if rank == 0:
            log(f"resuming from {ckpt} at step {step}/{total}")
    weights = torch.tensor(position_weights(drafter_config.block_size, tcfg.loss_decay))
    kind = drafter_config.kind
    if rank == 0:
        nparam = sum(p.numel() for p in params)
        log(f"train {kind}: {n} sequences, {source.num_tokens} tokens, {total} steps of {tcfg.batch_size} "
            f"sequences, {nparam / 1e6:.2f}M trainable parameters, draft vocab {model.config.draft_vocab_size}, "
            f"{world} process(es)")
    from tqdm import tqdm
    bar = tqdm(total=stop, initial=step, unit="step", disable=not progress or rank != 0, dynamic_ncols=True)
    t0 = time.perf_counter()
    model.train()
    while step < stop:
        epoch, within = divmod(step, steps_per_epoch)
        order = list(range(n))
        random.Random(tcfg.seed * 7919 + epoch).shuffle(order)
        batch = order[within * tcfg.batch_size:(within + 1) * tcfg.batch_size]
        mine = batch[rank::world]
        lr = lr_at(step, total, tcfg)
        for grp in opt.param_groups:
            grp["lr"] = lr
        opt.zero_grad(set_to_none=True)
        sums: dict = {}
        for idx in mine:
            seq = source[idx]
            gen = torch.Generator().manual_seed(tcfg.seed * 1_000_003 + step * 10_007 + idx)
            anchors = sample_anchors(seq.loss_mask, tcfg.anchors, gen)
            if anchors.numel() == 0:
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not torch.cuda.is_available()):
                loss, terms = sequence_loss(model, seq, anchors, weights, kind)
            (loss / len(batch)).backward()
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        if world > 1:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
            t = torch.tensor([sums.get(k, 0.0) for k in ("loss", "ce", "l1", "bce", "accept")] + [len(mine)])
            dist.all_reduce(t)
            sums = dict(zip(("loss", "ce", "l1", "bce", "accept"), t[:5].tolist()))
            count = int(t[5])
        else:
            count = len(mine)
        gnorm = torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
        opt.step()
        step += 1
        rec = {"step": step, "lr": lr, "grad_norm": float(gnorm),
               **{k: v / max(1, count) for k, v in sums.items() if v}}
        history.append(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{rec.get('loss', 0):.3f}", acc=f"{rec.get('accept', 0):.3f}")
        if rank == 0 and (step % tcfg.log_every == 0 or step == stop):
            el = time.perf_counter() - t0
            msg = " ".join(f"{k} {v:.4f}" for k, v in rec.items() if k not in ("step",))
            bar.write(f"step {step}/{total} {msg} ({el:.0f}s)")
        if rank == 0 and (step % tcfg.save_every == 0 or step == stop):
            _save_checkpoint(ckpt, model, opt, step, history, tcfg)
    bar.close()
    if rank == 0 and step >= total:
        model.save(out)
        (out / "train_log.json").write_text(json.dumps({"train": asdict(tcfg), "history": history}))
        log(f"saved drafter to {out}")
    if world > 1:
        dist.barrier()
    return {"steps": step, "total_steps": total, "history": history[-1:] }
