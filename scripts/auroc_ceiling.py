"""How well could ANY confidence head rank position-1 acceptance, and how well does ours?

c_1 is computed before x_1 is sampled, so the best possible score of the event "x_1 is accepted" is
its probability given everything before x_1: q = 1 - TV(p_d, p_t) of the first block position.
This script runs the drafter's training forward on the last sequences of a training cache
(teacher forcing, anchors every 4th supervised position), draws the events from q, and reports
the AUROC of q itself (the ceiling) and of the head's c_1 on the same draws.

    .venv/bin/python scripts/auroc_ceiling.py --drafter dspark --cache ~/.cache/dspark/work/smollm2-135m-instruct/cache/train
"""

import argparse

import numpy as np
import torch

from dspark.drafters import load_drafter
from dspark.runtime.loading import load_target
from dspark.training.cache import CacheReader
from dspark.training.calibrate import auroc
from dspark.training.losses import target_probs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--cache", required=True)
    ap.add_argument("--sequences", type=int, default=60, help="the last N sequences of the cache")
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    target = load_target(None, dtype="bf16")
    model = load_drafter(a.drafter, target).model.float().eval()
    if getattr(model, "confidence", None) is None:
        raise SystemExit(f"drafter {a.drafter!r} has no confidence head")
    src = CacheReader(a.cache)
    qs, cs = [], []
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
    q, c = np.concatenate(qs), np.concatenate(cs)
    rng = np.random.default_rng(0)
    ceiling, head = [], []
    for _ in range(a.draws):
        y = (rng.random(q.shape) < q).astype(np.float64)
        ceiling.append(auroc(q, y))
        head.append(auroc(c, y))
    print(f"anchors {len(q)}, mean acceptance {q.mean():.3f} (sd {q.std():.3f}); AUROC at position 1: "
          f"ceiling {np.mean(ceiling):.3f}, head {np.mean(head):.3f}; corr(c_1, q) {np.corrcoef(c, q)[0, 1]:.3f}")


if __name__ == "__main__":
    main()
