"""Entry point of the multi-process training test: a tiny target, a cache, ``train`` (run alone or
under ``torchrun``; the output folder is the first argument)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _tiny import as_target, tiny_config, tiny_target  # noqa: E402

from dspark.training.cache import CacheReader, build_cache  # noqa: E402
from dspark.training.trainer import TrainConfig, train  # noqa: E402


def main(out: str) -> None:
    torch.set_num_threads(1)
    target = as_target(tiny_target())
    g = torch.Generator().manual_seed(0)
    rows = [{"id": f"r{i}", "prompt_ids": torch.randint(0, 5, (4 + i,), generator=g).tolist(),
             "answer_ids": torch.randint(0, 5, (8 + i,), generator=g).tolist()} for i in range(8)]
    cache = Path(out) / "cache"
    import os
    if os.environ.get("RANK", "0") == "0" and not (cache / "index.json").exists():
        build_cache(rows, target, cache, [0, 2], progress=False, log=lambda m: None)
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()                      # the cache is written before any rank reads it
    cfg = TrainConfig(lr=3e-3, epochs=2, batch_size=4, anchors=0, log_every=100, save_every=100)
    train(CacheReader(cache), tiny_config(), Path(out) / "drafter", target, cfg,
          draft_vocab=torch.tensor([0, 1, 2, 4]), progress=False, log=lambda m: None)


if __name__ == "__main__":
    main(sys.argv[1])
