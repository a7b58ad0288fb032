"""Tiny random targets and drafters shared by the trained-drafter and training tests."""

import os
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.drafters.config import DrafterConfig
from dspark.drafters.dspark import DSparkModel
from dspark.drafters.eagle3 import Eagle3Model
from dspark.runtime.model import Decoder

VOCAB = 5
# where the tiny targets live: `DSPARK_TEST_DEVICE=cuda` runs the tests built on them on a GPU
# (scripts/cuda_check.sh); the drafters follow their target's device
DEVICE = os.environ.get("DSPARK_TEST_DEVICE", "cpu")


def tiny_target(seed: int = 0, scale: float = 8.0, vocab: int = VOCAB, dtype=torch.float32,
                device: str = DEVICE) -> Decoder:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)     # sharper, context-dependent distributions
    return Decoder.from_hf(m, dtype=dtype, device=device)


def tiny_config(kind="dspark", head="vanilla", layers=1, block=3, vocab=VOCAB, qk_norm=False) -> DrafterConfig:
    return DrafterConfig(kind=kind, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=block,
                         target_layer_ids=[0, 2], mask_token_id=0, markov_rank=4, markov_head_type=head,
                         vocab_size=vocab, target_hidden_size=32, rope_theta=10000.0, qk_norm=qk_norm)


def tiny_drafter_model(target: Decoder, kind="dspark", head="vanilla", draft_vocab=None, seed=1,
                       scale=3.0, layers=1, block=3, qk_norm=False, vocab=VOCAB):
    torch.manual_seed(seed)
    cls = Eagle3Model if kind == "eagle3" else DSparkModel
    model = cls(tiny_config(kind, head, layers, block, vocab=vocab, qk_norm=qk_norm), draft_vocab)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:                      # norm weights, biases, the mask vector
                p.fill_(1.0) if "norm" in name else p.normal_(0, 0.3)
            else:                                 # peaked, prefix-dependent draft distributions
                p.normal_(0, scale / max(1, p.shape[-1]) ** 0.5)
    return model.attach(target.embed, target.lm_head)


def as_target(decoder: Decoder, name="tiny"):
    """What the pipeline functions expect of a loaded target."""
    return SimpleNamespace(name=name, model=decoder, tokenizer=None, eos_token_ids=())
