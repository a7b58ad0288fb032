"""What the export and the import share: formats, architecture names, tensor names, layer ids.

Tensor names are DeepSpec's ``Qwen3DSparkModel`` ones, without a ``model.`` prefix; the DFlash /
SpecForge and speculators variants of DSpark use the same names and differ in config.json only
(llama.cpp's converter reads all three through one class). Sources: docs/interop.md.

Target-layer convention. Our ``target_layer_ids`` and DeepSpec's are the same: id L is the output of
target decoder layer L (0-based), so the last layer's output is n_layers - 1. vLLM, llama.cpp and
speculators count hidden states with the embeddings first, so their id for the same tensor is
L + 1 (speculators writes it shifted in ``aux_hidden_state_layer_ids``; llama.cpp's converter adds
the 1 itself when it reads DeepSpec's ``target_layer_ids``).
"""

from __future__ import annotations

FORMATS = ("deepspec", "dflash", "speculators")

# the ``architectures`` each format writes. vLLM (0.34.0) picks its class from these names:
# ``Qwen3DSparkModel`` is its Qwen3 DSpark drafter whatever the model_type; ``DSparkDraftModel`` is
# DeepSeek-V4's DSpark (weights inside the target) unless model_type is "qwen3", which it rewrites to
# ``Qwen3DSparkModel`` (vllm/config/speculative.py, ``hf_config_override``); a speculators checkpoint
# (``speculators_model_type: dspark``) becomes ``Qwen3DSparkModel`` too
# (vllm/transformers_utils/configs/speculators/algos.py). DFlash: SpecForge's DSpark name with
# DFlash's nested ``dflash_config``; z-lab's ``DFlashDraftModel`` means a block whose slot j predicts
# the token at slot j (the anchor slot's output unused), while our blocks predict the next token from
# every slot, anchor included (``sample_from_anchor``), which the DSpark names mean (vLLM's DFlash
# runtime refuses ``sample_from_anchor``). speculators: what the package writes (its
# ``save_pretrained`` names the model class; ``DSparkSpeculator``, its config's default, is read too);
# its loaders, and vLLM's, dispatch on ``speculators_model_type``
ARCHITECTURE = {"deepspec": "Qwen3DSparkModel", "dflash": "DSparkDraftModel", "speculators": "DSparkDraftModel"}
# the drafter's layers are a Qwen3 stack (q/k RMSNorm, no biases) whatever the target is: every
# layout says so, and vLLM reads ``DSparkDraftModel`` as the Qwen3 DSpark only under this model_type
MODEL_TYPE = "qwen3"
# what the import accepts (llama.cpp's converter registers the same names)
IMPORTABLE = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator", "DFlashDraftModel")
# z-lab's DFlash: a bonus-anchor block unless the config says otherwise (llama.cpp reads it so)
BONUS_ANCHOR_BY_DEFAULT = ("DFlashDraftModel",)
# foreign architectures recognised, so that they get a precise error instead of "not a drafter"
KNOWN_UNSUPPORTED = ("DFlash2DraftModel", "Lfm2DSparkDraftModel", "LingDSparkModel")

# the Hugging Face repositories of the bundled targets: a speculators checkpoint names its verifier
# there (``speculators_config.verifier.name_or_path``), and vLLM serves the checkpoint by itself
# (``vllm serve DRAFTER``) only when that is a repository id, not a local path
VERIFIER_REPOS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
                  "qwen2.5-coder-0.5b-instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
                  "qwen2.5-coder-1.5b-instruct": "Qwen/Qwen2.5-Coder-1.5B-Instruct"}

SGLANG_STS_FILE = "sts_calibration.json"    # SGLang's STS calibration (temperatures per position)
EXTENSION_KEY = "dspark"                    # our own block in config.json: what the layouts cannot carry


def engine_layer_ids(ids: list[int]) -> list[int]:
    """Our / DeepSpec ids -> the ids of vLLM, llama.cpp and speculators (embeddings = 0)."""
    return [int(i) + 1 for i in ids]


def deepspec_layer_ids(ids: list[int]) -> list[int]:
    """vLLM / llama.cpp / speculators ids -> ours (= DeepSpec's)."""
    return [int(i) - 1 for i in ids]


def layer_names(i: int) -> dict[str, str]:
    """Our state-dict key -> the layout's tensor name, for drafter layer i."""
    ours, theirs = f"backbone.layers.{i}.", f"layers.{i}."
    names = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
             "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
             "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
    return {f"{ours}{a}.weight": f"{theirs}{b}.weight" for a, b in names.items()}


# tensors copied one to one outside the layers (the rest is transformed: fc, the Markov table, the
# mask vector, the draft vocabulary)
PLAIN = {"backbone.fc_norm.weight": "hidden_norm.weight", "backbone.norm.weight": "norm.weight",
         "head.w2.weight": "markov_head.markov_w2.weight",
         "confidence.linear.weight": "confidence_head.proj.weight",
         "confidence.linear.bias": "confidence_head.proj.bias"}
FC = "fc.weight"
MARKOV_W1 = "markov_head.markov_w1.weight"
EMBED = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"
D2T = "d2t"
