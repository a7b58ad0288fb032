"""How well could ANY confidence head rank position-1 acceptance, and how well does ours?

c_1 is computed before x_1 is sampled, so the best possible score of the event "x_1 is accepted" is
its probability given everything before x_1: q = 1 - TV(p_d, p_t) of the first block position.
Two settings:

* ``--cache``: the drafter's training forward on the last sequences of a training cache (teacher
  forcing, anchors every 4th supervised position); the events are drawn from q;
* ``--heldout``: what ``dspark calibrate`` scores (its evaluation half of the held-out prompts,
  temperature-1 rollouts, full blocks, the same seeds); the events are the target's real
  verdicts on x_1, and q is computed from the very distributions that verification compared.

Either way it reports the AUROC of q itself (the ceiling) and of the head's raw c_1 on the same events,
and that of statistics of the draft distribution itself (what a head could read without learning).

    .venv/bin/python scripts/auroc_ceiling.py --drafter dspark --cache ~/.cache/dspark/work/smollm2-135m-instruct/cache/train
    .venv/bin/python scripts/auroc_ceiling.py --drafter dspark --heldout ~/.cache/dspark/work/smollm2-135m-instruct/prompts/heldout.jsonl
"""

import argparse

import numpy as np
import torch

import dspark.engine
from dspark.drafters import load_drafter
from dspark.runtime.loading import load_target
from dspark.training.cache import CacheReader
from dspark.training.calibrate import auroc
from dspark.training.losses import target_probs


def draft_stats(pd: torch.Tensor) -> dict[str, np.ndarray]:
    """What a confidence could read off the first position's draft distribution pd [n, V] itself,
    besides the head: its largest probability and its negative entropy."""
    pd = pd.float()
    return {"max p_d": pd.amax(-1).numpy(), "-entropy of p_d": (pd * pd.clamp_min(1e-30).log()).sum(-1).numpy()}


def teacher_forced(a, target) -> tuple[np.ndarray, np.ndarray, list, dict]:
    """(q, c_1, events drawn from q, draft statistics) on cached training sequences."""
    model = load_drafter(a.drafter, target).model.float().eval()
    if getattr(model, "confidence", None) is None:
        raise SystemExit(f"drafter {a.drafter!r} has no confidence head")
    src = CacheReader(a.cache)
    qs, cs, stats = [], [], []
    with torch.no_grad():
        for i in range(max(0, len(src) - a.sequences), len(src)):
            seq = src[i]
            m = seq.loss_mask
            anchors = torch.nonzero(m[:-1] & m[1:]).squeeze(-1)[::4][:64]
            if anchors.numel() == 0:
                continue
            _, logits, conf = model.forward_train(seq.features.float(), seq.ids, anchors)
            pd = logits[:, 0].float().softmax(-1)
            pt, outside = target_probs(seq.hidden[anchors], model.target_lm_head, model.draft_vocab,
                                       model.config.final_logit_softcap)
            qs.append((1 - 0.5 * ((pd - pt).abs().sum(-1) + outside)).numpy())
            cs.append(torch.sigmoid(conf[:, 0].float()).numpy())
            stats.append(draft_stats(pd))
    q, c = np.concatenate(qs), np.concatenate(cs)
    rng = np.random.default_rng(0)
    return (q, c, [(rng.random(q.shape) < q).astype(np.float64) for _ in range(a.draws)],
            {k: np.concatenate([s[k] for s in stats]) for k in stats[0]})


def rollouts(a, target) -> tuple[np.ndarray, np.ndarray, list, dict]:
    """(q, c_1, the target's verdicts on x_1, draft statistics) on calibrate's held-out evaluation
    rollouts; the statistics include p_d(x_1), the drafter's probability of the token it drew (known
    once x_1 is drawn, before verification)."""
    from dspark.api import encode_prompt
    from dspark.training import calibrate as cal
    from dspark.training.prompts import read_prompts
    drafter = load_drafter(a.drafter, target)
    _, rows = cal.split_rows(read_prompts(a.heldout))
    prompts = [encode_prompt(target.tokenizer, r["prompt"], chat=True) for r in rows]
    qs, stats = [], []
    plain_stack = dspark.engine.stack_requests

    def stack(blocks):     # every request's block of the step, in the engine's order of requests
        for tokens, probs, target_rows, _, _ in blocks:
            if len(tokens):     # target rows at temperature 1: probabilities, as verification reads them
                qs.append(float(1 - 0.5 * (probs[0].float() - target_rows[0].float()).abs().sum()))
                stats.append({**draft_stats(probs[:1]), "p_d(x_1)": np.array([float(probs[0, int(tokens[0])])])})
        return plain_stack(blocks)
    dspark.engine.stack_requests = stack
    try:
        ro = cal.collect(target, drafter, prompts, [r["domain"] for r in rows], blocks=a.blocks)
    finally:
        dspark.engine.stack_requests = plain_stack
    if len(qs) != len(ro):     # one q per recorded block, in the same order, or the pairing is wrong
        raise SystemExit(f"recorded {len(qs)} first-position distributions for {len(ro)} blocks")
    q = np.array(qs)
    return (q, 1 / (1 + np.exp(-ro.z[:, 0])), [(ro.accepted > 0).astype(np.float64)],
            {k: np.concatenate([s[k] for s in stats]) for k in stats[0]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="dspark")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--cache", help="a training cache folder (teacher-forced contexts)")
    where.add_argument("--heldout", help="held-out prompts JSONL (calibrate's temperature-1 rollouts)")
    ap.add_argument("--blocks", type=int, default=5000, help="--heldout: verified blocks")
    ap.add_argument("--sequences", type=int, default=60, help="the last N sequences of the cache")
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    target = load_target(None, dtype="bf16")
    q, c, events, stats = teacher_forced(a, target) if a.cache else rollouts(a, target)
    ceiling = [auroc(q, y) for y in events]
    head = [auroc(c, y) for y in events]
    print(f"blocks {len(q)}, mean acceptance {q.mean():.3f} (sd {q.std():.3f}); AUROC at position 1: "
          f"ceiling {np.mean(ceiling):.3f}, head {np.mean(head):.3f}; corr(c_1, q) {np.corrcoef(c, q)[0, 1]:.3f}")
    print("AUROC of the draft distribution's own statistics: " + ", ".join(
        f"{k} {np.mean([auroc(v, y) for y in events]):.3f}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
