"""The held-out signal of a saved drafter: what ``dspark train --corpus --eval-every N`` logs during
training, measured on any DSpark / DFlash drafter folder (a committed one, a run's checkpoint), so a
run can be read against the drafter it should beat.

Per corpus source and block position: mean 1 - TV(p_d, p_t) (acceptance at temperature 1) and
argmax agreement (the greedy proxy), teacher-forced on each source's held-out rows of the corpus
that ``dspark train --corpus`` builds with the same ``--mix``, ``--positions``, ``--max-len`` and
``--seed`` (the held-out rows are set apart by a hash of the row id, so they do not depend on the
mix's shares).

    python scripts/heldout_signal.py DRAFTER_DIR [--mix chat=0.6,code=0.4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter", type=Path, help="a drafter folder (config.json + model.safetensors)")
    ap.add_argument("--mix", default="chat=0.6,code=0.4")
    ap.add_argument("--positions", type=int, default=4_000_000)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the signal here")
    args = ap.parse_args()
    from dspark.drafters.config import default_layer_ids
    from dspark.drafters.dspark import DSparkModel
    from dspark.runtime.loading import load_target
    from dspark.training import corpus
    from dspark.training.cache import OnlineSource
    from dspark.training.trainer import heldout_signal
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(dtype=args.dtype)
    _, held, _ = corpus.build(target.tokenizer, corpus.parse_mix(args.mix), args.positions, max_len=args.max_len,
                              seed=args.seed, log=lambda m: None)
    source = OnlineSource(held, target, default_layer_ids(target.model.config.num_layers), max_len=args.max_len)
    model = DSparkModel.load(args.drafter)
    model.attach(target.model.embed, target.model.lm_head)
    signal = heldout_signal(model, [source[i] for i in range(len(source))])
    print("| source | position-1 accept (T = 1) | position-1 argmax (greedy) | accept at positions 1-7 |")
    print("|---|---|---|---|")
    for name, s in signal.items():
        per = " / ".join(f"{a:.3f}" for a in s["accept"])
        print(f"| {name} | {s['accept'][0]:.3f} | {s['argmax'][0]:.3f} | {per} |")
    if args.json:
        args.json.write_text(json.dumps(signal, indent=1))


if __name__ == "__main__":
    main()
