"""The configuration of a trained drafter, saved as ``config.json`` in Hugging Face layout.

Keys follow DeepSpec / SpecForge (block_size, target_layer_ids, mask_token_id, markov_rank,
markov_head_type, num_hidden_layers) plus ``architectures`` naming the drafter class, so a folder
is recognised as a drafter (and not a draft LM) by its config alone.

Mask token: the block's input after the anchor is a mask embedding. It is a learned vector,
initialised from the embedding of ``mask_token_id``: a spare special token of the target when it
has one (for SmolLM2 ``<empty_output>``), otherwise its pad or end-of-text token. Because the
vector is trained, the choice only sets where it starts; a target without a spare token loses
nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import DsparkError

KINDS = ("dspark", "dflash", "eagle3")
HEAD_TYPES = ("vanilla", "gated", "rnn", "none")
ARCHITECTURES = {"dspark": "DSparkDrafter", "dflash": "DFlashDrafter", "eagle3": "Eagle3Drafter"}
_SPARE_NAMES = ("<mask>", "<|mask|>", "[MASK]", "<empty_output>", "<|reserved_special_token_0|>",
                "<unused0>", "<|fim_pad|>", "<pad>", "<|pad|>")


@dataclass
class DrafterConfig:
    kind: str = "dspark"                # dspark | dflash | eagle3
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 2
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    qk_norm: bool = False               # RMSNorm over each head's q and k (Qwen3 / DeepSpec layout)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    block_size: int = 7                 # gamma: drafted tokens per round
    target_layer_ids: list = field(default_factory=list)
    mask_token_id: int = 0
    markov_rank: int = 256
    markov_head_type: str = "vanilla"   # vanilla | gated | rnn | none (DFlash, EAGLE-3)
    # the Markov table W1 has a row per target token instead of one shared row for every token outside
    # the draft vocabulary: what an imported checkpoint in the engines' layout (``[vocab, rank]``) needs
    markov_full_table: bool = False
    # the block is [anchor, MASK * (gamma - 1)] and every slot drafts the token after it (DeepSpec's
    # DSpark, ours); false: [anchor, MASK * gamma], the anchor slot's output unused and slot k drafting
    # the token at its own position (z-lab DFlash, SpecForge's bonus anchor): imported checkpoints only
    sample_from_anchor: bool = True
    confidence_head: bool = True
    vocab_size: int = 49152             # the target's
    draft_vocab_size: int = 0           # 0 = the full target vocabulary
    target: str = ""                    # the target it was trained for (a name, for messages)
    target_hidden_size: int = 576
    final_logit_softcap: float | None = None
    embed_scale: float = 1.0
    sts_temperatures: list | None = None   # per position, fitted by `dspark calibrate`
    sts_shifts: list | None = None         # per position logit shift (`dspark calibrate --shift`)
    sts_greedy_temperatures: list | None = None   # the same, fitted on greedy rollouts: for greedy requests
    sts_greedy_shifts: list | None = None
    architectures: list = field(default_factory=list)
    model_type: str = "dspark_drafter"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DsparkError(f"drafter kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.markov_head_type not in HEAD_TYPES:
            raise DsparkError(f"markov_head_type must be one of {', '.join(HEAD_TYPES)}")
        if self.kind != "dspark":
            self.markov_head_type, self.confidence_head = "none", False
        if self.block_size < 1 or self.num_hidden_layers < 1 or not self.target_layer_ids:
            raise DsparkError("drafter config needs block_size >= 1, num_hidden_layers >= 1 and target_layer_ids")
        self.architectures = [ARCHITECTURES[self.kind]]

    @property
    def has_markov(self) -> bool:
        return self.markov_head_type != "none"

    def save(self, folder: Path) -> None:
        tmp = Path(folder) / "config.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(Path(folder) / "config.json")

    @classmethod
    def load(cls, folder: Path) -> DrafterConfig:
        path = Path(folder) / "config.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise DsparkError(f"cannot read drafter config {path}: {e}") from None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """``count`` target layers spread evenly from layer 1 to L-3 (DSpark / DFlash convention)."""
    lo, hi = 1, max(1, num_layers - 3)
    if count == 1:
        return [hi]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def pick_mask_token(tokenizer) -> int:
    vocab = tokenizer.get_vocab()
    for name in _SPARE_NAMES:
        if name in vocab:
            return vocab[name]
    for tid in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if tid is not None:
            return int(tid)
    return 0


def position_weights(block_size: int, decay: float = 4.0) -> list[float]:
    """w_k = exp(-(k-1)/decay), k = 1..block_size (DeepSpec's released configs use decay 4)."""
    return [math.exp(-k / decay) for k in range(block_size)]
