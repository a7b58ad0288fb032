"""Write a DSpark checkpoint with the `speculators` package (vLLM's drafter library), for
tests/test_interop.py to import: a writer nobody here wrote.

speculators pins transformers <= 5.19, so this runs in its own environment, never in the project's:

    python3 -m venv /tmp/specenv && /tmp/specenv/bin/pip install torch==2.13.0 speculators==0.9.0
    /tmp/specenv/bin/python scripts/speculators_writes_dspark.py --out tests/data/speculators-dspark

It writes, under --out: ``verifier/`` (a tiny random Llama target, saved by transformers),
``drafter/`` (speculators' ``DSparkDraftModel`` for it, saved by ``save_pretrained``: 2 layers, a
reduced draft vocabulary with ``t2d`` / ``d2t``, a vanilla Markov head and a confidence head that
reads it) and ``reference.safetensors``: what speculators' own Markov and confidence heads compute
for a few previous tokens and hidden states, so the test checks our reading of them against the
writer's arithmetic, not only that the files load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, DRAFT_VOCAB, HIDDEN, RANK = 32, 16, 32, 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from speculators.models.dspark.core import DSparkDraftModel   # only in the separate environment

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                      max_position_embeddings=256)
    verifier = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in verifier.parameters():
            p.mul_(8.0)                 # sharp, context-dependent distributions
    vdir = args.out / "verifier"
    verifier.save_pretrained(vdir)

    # the draft layers' config, as speculators' training CLI builds it: the verifier's, 2 layers deep
    layer_cfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 2})
    draft_ids = torch.arange(0, VOCAB, 2)                                  # every other token
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    d2t = draft_ids - torch.arange(DRAFT_VOCAB)                            # offsets, EAGLE-3 style
    model = DSparkDraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=str(vdir), draft_vocab_size=DRAFT_VOCAB,
        target_layer_ids=[1, 3], block_size=4, mask_token_id=VOCAB - 1, markov_rank=RANK,
        markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True,
        draft_attn_impl="eager")
    torch.manual_seed(1)
    with torch.no_grad():               # away from the near-zero initialisation, so that a misread shows
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_")) or name == "lm_head.weight":
                continue
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() > 1 else 0.2) + (1.0 if "norm" in name else 0.0))
    ddir = args.out / "drafter"
    model.save_pretrained(ddir)
    (ddir / "config.py").unlink(missing_ok=True)     # speculators' own source for auto_map: not checkpoint data

    # the writer's own arithmetic for the DSpark parts: Markov bias and confidence logit
    prev = torch.tensor([[3, 8, 0, 30], [17, 2, 2, 9]])
    hidden = torch.randn(2, 4, HIDDEN)
    with torch.no_grad():
        emb = model.markov_head.prev_embeddings(prev)
        bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)
        conf = model.confidence_head(torch.cat([hidden, emb], -1))
    save_file({"prev_tokens": prev, "hidden": hidden, "markov_bias": bias.contiguous(),
               "confidence_logits": conf.contiguous()}, str(args.out / "reference.safetensors"))
    from importlib.metadata import version
    (args.out / "WRITER.json").write_text(json.dumps(
        {"speculators": version("speculators"), "torch": torch.__version__,
         "command": "python scripts/speculators_writes_dspark.py --out " + str(args.out)}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
