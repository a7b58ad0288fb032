"""Export to the engines' layouts and import back (dspark/interop/).

On a tiny random target: export -> import proposes bit for bit what the drafter proposes (tokens,
probabilities, confidences) in every layout, with a reduced draft vocabulary and with the full one;
a Markov table whose rows outside the draft vocabulary differ (a foreign writer's) is kept whole;
greedy fp32 output through an imported drafter equals plain decoding; bad checkpoints get one-line
errors naming the key; the layer-id convention (ours = DeepSpec's = output of layer L; the engines'
= L + 1) is checked against Hugging Face's hidden_states.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.drafters import load_drafter
from dspark.drafters.base import DraftContext
from dspark.drafters.dspark import DSparkDrafter
from dspark.engine import Engine
from dspark.errors import UsageError
from dspark.drafters import layouts as L
from dspark.interop.export import export_model
from dspark.drafters.foreign import load_foreign
from dspark.runtime.model import Decoder
from dspark.sampling import SamplingParams
from dspark.scheduling.policies import FixedPolicy

from _tiny import as_target, tiny_drafter_model, tiny_target

FORMATS = list(L.FORMATS)


def _model(target, kind="dspark", head="vanilla", vocab=(1, 2, 3, 4), qk_norm=True):
    model = tiny_drafter_model(target, kind, head, draft_vocab=None if vocab is None else torch.tensor(vocab),
                               scale=2.0, qk_norm=qk_norm, layers=2)
    with torch.no_grad():       # every transformed part away from its neutral value
        model.backbone.feature_scale.uniform_(0.5, 2.0)
        for layer in model.backbone.layers if qk_norm else ():
            layer.q_norm.weight.uniform_(0.5, 2.0)
            layer.k_norm.weight.uniform_(0.5, 2.0)
    if kind == "dspark":
        model.config.sts_temperatures, model.config.sts_shifts = [1.3, 0.7, 2.1], [0.1, -0.2, 0.0]
    return model


def _export(model, target, tmp_path, fmt, **kw):
    out = tmp_path / fmt
    rep = export_model(model, target.embed, target.lm_head, target.config.num_layers, out, fmt, **kw)
    return out, rep


def _proposals(drafter, target, rounds=3):
    """Blocks proposed over a few rounds of one request at temperature 1 (fixed seed)."""
    ids = [1, 3, 2, 4, 0, 2, 1, 3, 4, 2, 0, 3]
    kv = target.new_cache(1, 32)
    slot = kv.allocate()
    o = target(torch.tensor(ids), [(slot, len(ids))], kv, feature_layers=drafter.feature_layers, logits_rows=None)
    feats = torch.cat(o.features, -1)
    ctx = DraftContext(ids[:5], SamplingParams(temperature=1.0), torch.Generator().manual_seed(7), 3,
                       features=[feats[:4]])
    out = []
    for a in (4, 7, 10)[:rounds]:
        if a > 4:
            ctx.features.append(feats[len(ctx.tokens) - 1:a])
            ctx.tokens = ids[:a + 1]
        p = drafter.propose([ctx])[0]
        out.append((p.tokens.clone(), p.probs.clone(), p.confidences.clone()))
    return out


def _same(a, b):
    for (t1, p1, c1), (t2, p2, c2) in zip(a, b, strict=True):
        assert torch.equal(t1, t2) and torch.equal(p1, p2) and torch.equal(c1, c2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind,vocab", [("dspark", (1, 2, 3, 4)), ("dspark", None), ("dflash", (1, 2, 3, 4))])
def test_export_then_import_proposes_bit_for_bit(tmp_path, fmt, kind, vocab):
    target = tiny_target(scale=3.0)
    model = _model(target, kind, "vanilla" if kind == "dspark" else "none", vocab)
    out, rep = _export(model, target, tmp_path, fmt)
    assert not [m for m in rep.inexact if "q/k" in m or "fc" in m]
    imported = load_foreign(out, target.config, target.embed, target.lm_head)
    assert imported.config.kind == kind and not imported.config.markov_full_table
    _same(_proposals(DSparkDrafter(model, target), target), _proposals(DSparkDrafter(imported, target), target))


def test_export_tensors_follow_the_layout(tmp_path):
    target = tiny_target()
    model = _model(target)
    out, rep = _export(model, target, tmp_path, "deepspec")
    st, cfg = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["draft_vocab_size"] == 4
    assert cfg["target_layer_ids"] == [0, 2] and cfg["sample_from_anchor"] and cfg["markov_head_type"] == "vanilla"
    # the compact table expanded: every target token's row is its draft row, or the shared one
    w1 = model.head.w1.weight.detach()
    assert st[L.MARKOV_W1].shape == (5, 4) and torch.equal(st[L.MARKOV_W1][0], w1[4])
    assert torch.equal(st[L.MARKOV_W1][1:], w1[:4])
    assert st[L.D2T].tolist() == [1, 1, 1, 1]                 # target id = i + d2t[i]: 1, 2, 3, 4
    assert torch.equal(st[L.LM_HEAD], target.lm_head[1:])
    assert torch.equal(st[L.EMBED][0], model.mask_embedding.detach()) and torch.equal(st[L.EMBED][1:], target.embed[1:])
    fc = model.backbone.fc.weight.detach() * model.backbone.feature_scale[None]
    assert torch.equal(st[L.FC], fc)
    assert "layers.1.self_attn.q_norm.weight" in st and "confidence_head.proj.bias" in st
    assert "outside the draft vocabulary" in " ".join(rep.notes)


def test_layer_ids_convention(tmp_path):
    """Our id L (= DeepSpec's) is the output of decoder layer L: Hugging Face's hidden_states[L + 1],
    which is the id the engines use (speculators writes it, llama.cpp's converter adds the 1)."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=5, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)).eval()
    dec = Decoder.from_hf(hf)
    ids = torch.tensor([1, 3, 2, 4])
    kv = dec.new_cache(1, 8)
    ours = dec(ids, [(kv.allocate(), 4)], kv, feature_layers=(0, 1), logits_rows=None).features
    with torch.no_grad():       # (HF's last hidden state is after the final norm: layers 0 and 1 here)
        hs = hf(ids[None], output_hidden_states=True).hidden_states
    for L_id, f in zip((0, 1), ours):
        assert torch.allclose(f, hs[L_id + 1][0], atol=1e-5)
    target = tiny_target()
    model = _model(target)
    for fmt in FORMATS:
        out, rep = _export(model, target, tmp_path, fmt)
        cfg = json.loads((out / "config.json").read_text())
        assert rep.target_layer_ids == [0, 2] and rep.engine_layer_ids == [1, 3]
        if fmt == "speculators":
            assert cfg["aux_hidden_state_layer_ids"] == [1, 3] and "target_layer_ids" not in cfg
        else:
            ids_written = cfg["target_layer_ids"] if fmt == "deepspec" else cfg["dflash_config"]["target_layer_ids"]
            assert ids_written == [0, 2]
        assert load_foreign(out, target.config, target.embed, target.lm_head).config.target_layer_ids == [0, 2]


def _as_vllm_reads(cfg):
    """What vLLM 0.34.0 makes of an exported config.json, restated here from its source (read from the
    PyPI sdist vllm-0.34.0.tar.gz), so that the test fails where vLLM would take the checkpoint for
    something else:

    * vllm/transformers_utils/config.py (``HFConfigParser.parse``): without a top-level ``model_type``,
      a config.json with a ``speculators_config`` block is a speculators one; otherwise transformers'
      own parse runs, which needs ``model_type``.
    * vllm/transformers_utils/configs/speculators/base.py (``SpeculatorsConfig``): the run checks
      ``speculators_config.proposal_methods[0].speculative_tokens``,
      ``speculators_config.verifier.name_or_path``, ``speculators_model_type`` and a
      ``transformer_layer_config`` dict, which becomes the drafter's config (its ``model_type`` ignored).
    * vllm/transformers_utils/configs/speculators/algos.py (``update_dspark``): type "dspark" gives
      the class ``Qwen3DSparkModel`` (or a top-level ``Qwen3DSparkModel`` / ``Qwen3OmniDSparkModel``),
      aux layer ids = ``aux_hidden_state_layer_ids``, target_layer_ids = those - 1, and
      ``sample_from_anchor`` false when the key is absent; block_size, mask_token_id, markov_* and the
      confidence keys are copied from the top level.
    * vllm/config/speculative.py (``hf_config_override``): ``DSparkDraftModel`` with model_type "qwen3"
      becomes ``Qwen3DSparkModel``; any other model_type keeps it, which the registry
      (vllm/model_executor/models/registry.py) maps to DeepSeek-V4's DSpark.
    * vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (``get_eagle3_aux_layers_from_config``):
      aux ids = ``eagle_aux_hidden_state_layer_ids``, else ``dflash_config.target_layer_ids`` + 1, else
      top-level ``target_layer_ids`` + 1.
    * vllm/model_executor/models/qwen3_dflash.py / qwen3_dspark.py: mask_token_id from
      ``dflash_config`` before the top level; ``markov_rank`` and the confidence keys top level;
      ``max_position_embeddings`` read by every layer; full-attention ``layer_types`` = non-causal.
    * vllm/v1/worker/gpu/spec_decode/dspark/config.py and speculator.py: ``block_size`` is the number
      of speculative tokens, ``sample_from_anchor`` (default true there) the block layout.
    """
    if cfg.get("model_type") is None:
        assert cfg.get("speculators_config") is not None, "neither model_type nor speculators_config"
        spec, layer = cfg["speculators_config"], cfg["transformer_layer_config"]
        assert isinstance(layer, dict) and cfg["speculators_model_type"] == "dspark"
        assert isinstance(spec["verifier"]["name_or_path"], str)
        names = [a for a in cfg.get("architectures") or [] if a in ("Qwen3DSparkModel", "Qwen3OmniDSparkModel")]
        aux = list(cfg["aux_hidden_state_layer_ids"])
        return {"class": (names or ["Qwen3DSparkModel"])[0], "layers": layer["model_type"], "aux": aux,
                "mask": cfg["mask_token_id"], "tokens": spec["proposal_methods"][0]["speculative_tokens"],
                "block_size": cfg["block_size"], "sample_from_anchor": cfg.get("sample_from_anchor", False),
                "markov_rank": cfg.get("markov_rank"), "max_pos": layer.get("max_position_embeddings"),
                "causal": any(t == "sliding_attention" for t in layer.get("layer_types") or ())}
    arch = cfg["architectures"][0]
    if arch == "DSparkDraftModel":
        arch = "Qwen3DSparkModel" if cfg["model_type"] == "qwen3" else "DeepSeek-V4 DSpark"
    dflash = cfg.get("dflash_config") or {}
    aux = (cfg.get("eagle_aux_hidden_state_layer_ids") or [i + 1 for i in dflash.get("target_layer_ids") or []]
           or [i + 1 for i in cfg.get("target_layer_ids") or []])
    return {"class": arch, "layers": cfg["model_type"], "aux": aux,
            "mask": dflash.get("mask_token_id", cfg.get("mask_token_id")), "tokens": cfg["block_size"],
            "block_size": cfg["block_size"], "sample_from_anchor": cfg.get("sample_from_anchor", True),
            "markov_rank": cfg.get("markov_rank"), "max_pos": cfg.get("max_position_embeddings"),
            "causal": any(t == "sliding_attention" for t in cfg.get("layer_types") or ())}


@pytest.mark.parametrize("fmt", FORMATS)
def test_exported_config_is_what_vllm_reads(tmp_path, fmt):
    """Every layout, for a target whose own model_type is not qwen3 (the drafter's layers are a Qwen3
    stack whatever the target): vLLM takes it for its Qwen3 DSpark drafter with our layer ids + 1,
    our mask token, block size, block layout and Markov rank; and our import reads it back."""
    target = tiny_target()
    model = _model(target)
    c = model.config
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 8192,
            "_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    out, rep = _export(model, target, tmp_path, fmt, base_config=base)
    cfg = json.loads((out / "config.json").read_text())
    assert _as_vllm_reads(cfg) == {
        "class": "Qwen3DSparkModel", "layers": "qwen3", "aux": [1, 3], "mask": c.mask_token_id,
        "tokens": c.block_size, "block_size": c.block_size, "sample_from_anchor": True,
        "markov_rank": c.markov_rank, "max_pos": 8192, "causal": False}
    assert cfg["architectures"] == [L.ARCHITECTURE[fmt]]
    if fmt == "speculators":
        assert "model_type" not in cfg            # else vLLM never looks for speculators_config
        spec = cfg["speculators_config"]
        assert spec["algorithm"] == "dspark" and spec["verifier"] == {
            "name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"]}
        assert spec["default_proposal_method"] in [m["proposal_type"] for m in spec["proposal_methods"]]
        assert "architectures" not in cfg["transformer_layer_config"]   # llama.cpp merges it over the top level
        assert not [n for n in rep.notes if "verifier" in n]
    imported = load_foreign(out, target.config, target.embed, target.lm_head)
    assert (imported.config.target_layer_ids, imported.config.block_size, imported.config.sample_from_anchor,
            imported.config.mask_token_id, imported.config.kind) == ([0, 2], c.block_size, True, c.mask_token_id, "dspark")


def test_export_notes_what_vllm_cannot_take(tmp_path):
    """A verifier that is not a repository id (vLLM then takes the speculators folder only through
    --speculative-config), and a drafter without a Markov head."""
    target = tiny_target()
    out, rep = _export(_model(target), target, tmp_path, "speculators", verifier=str(tmp_path))
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path)
    assert any("not a Hugging Face repository id" in n for n in rep.notes)
    _, rep = _export(_model(target, "dflash", "none"), target, tmp_path / "d", "dflash")
    assert any("no Markov head" in n for n in rep.notes)


def test_dflash_config_block_layout_is_read_when_the_top_level_has_none(tmp_path):
    """``sample_from_anchor`` nested in ``dflash_config`` (where vLLM's DFlash reads it) counts when the
    top level does not say."""
    target = tiny_target()
    out, _ = _export(_model(target), target, tmp_path, "dflash")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["sample_from_anchor"]
    cfg["dflash_config"].update(sample_from_anchor=False, block_size=cfg["block_size"] + 1)
    (out / "config.json").write_text(json.dumps(cfg))
    imported = load_foreign(out, target.config, target.embed, target.lm_head)
    assert not imported.config.sample_from_anchor and imported.config.block_size == cfg["block_size"]


def test_foreign_markov_table_is_kept_whole(tmp_path):
    """A writer whose W1 rows outside the draft vocabulary differ (DeepSpec trains them all)."""
    target = tiny_target()
    model = _model(target, vocab=(1, 2, 4))                    # tokens 0 and 3 outside
    out, _ = _export(model, target, tmp_path, "deepspec")
    st = load_file(str(out / "model.safetensors"))
    st[L.MARKOV_W1] = torch.randn(5, 4)
    save_file(st, str(out / "model.safetensors"))
    imported = load_foreign(out, target.config, target.embed, target.lm_head)
    assert imported.config.markov_full_table
    rows = imported.head.w1(imported.prev_rows)                 # the row each previous target token uses
    assert torch.equal(rows, st[L.MARKOV_W1])
    _proposals(DSparkDrafter(imported, target), target)         # and it serves


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_greedy_through_an_imported_drafter_equals_plain(tmp_path, fmt, kind):
    """Every layout and both drafter kinds, loaded by path and served through the engine."""
    target = tiny_target(seed=2)
    model = _model(target, kind, "vanilla" if kind == "dspark" else "none")
    out, _ = _export(model, target, tmp_path, fmt)
    drafter = load_drafter(str(out), as_target(target))        # by path, as --drafter PATH
    assert isinstance(drafter, DSparkDrafter) and drafter.config.qk_norm and drafter.config.kind == kind
    _assert_greedy_equals_plain(target, drafter, ([1, 2, 3], [4, 4, 1, 0, 2], [3]))


def _assert_greedy_equals_plain(target, drafter, prompts) -> None:
    """Greedy output with the drafter (whole block of 3) equals plain decoding, prompt by prompt."""
    greedy = SamplingParams(temperature=0)
    for prompt in prompts:
        outs = []
        for d, block in ((None, 0), (drafter, 3)):
            engine = Engine(target, d, FixedPolicy(block), max_requests=1, block_size=block, max_len=32)
            r = engine.add_request(prompt, greedy, 12)
            engine.run()
            outs.append(r.output_ids)
        assert outs[0] == outs[1], prompt


def _edit(out, **changes):
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("change,match", [
    ({"vocab_size": 7}, "vocab_size 7"),
    ({"hidden_size": 64}, "hidden_size 64"),
    ({"target_layer_ids": [0, 3]}, r"target_layer_ids \[0, 3\] out of range"),
    ({"markov_head_type": "gated"}, "unsupported markov_head_type 'gated'"),
    ({"mask_token_id": None}, "no 'mask_token_id'"),
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
    ({"block_size": 1, "sample_from_anchor": False}, "block_size 1 leaves no draft slot"),
])
def test_bad_checkpoints_are_one_line_errors(tmp_path, change, match):
    target = tiny_target()
    out, _ = _export(_model(target), target, tmp_path, "deepspec")
    _edit(out, **change)
    with pytest.raises(UsageError, match=match) as e:
        load_drafter(str(out), as_target(target))
    assert "\n" not in str(e.value)


def test_missing_tensor_is_named(tmp_path):
    target = tiny_target()
    out, _ = _export(_model(target), target, tmp_path, "dflash")
    st = load_file(str(out / "model.safetensors"))
    del st["layers.1.mlp.up_proj.weight"]
    save_file(st, str(out / "model.safetensors"))
    with pytest.raises(UsageError, match="missing tensor 'layers.1.mlp.up_proj.weight'"):
        load_foreign(out, target.config, target.embed, target.lm_head)


def test_export_refuses_what_has_no_exact_image(tmp_path):
    target = tiny_target()
    with pytest.raises(UsageError, match="q/k norms"):
        _export(_model(target, qk_norm=False), target, tmp_path, "deepspec")
    _, rep = _export(_model(target, qk_norm=False), target, tmp_path, "deepspec", allow_inexact=True)
    assert any("q/k RMSNorm" in m for m in rep.inexact)
    with pytest.raises(UsageError, match="markov_head_type 'rnn'"):
        _export(tiny_drafter_model(target, "dspark", "rnn", qk_norm=True), target, tmp_path, "deepspec")


def test_sts_calibration_as_sglang_json(tmp_path):
    target = tiny_target()
    model = _model(target)
    out, rep = _export(model, target, tmp_path, "deepspec")
    sts = json.loads((out / L.SGLANG_STS_FILE).read_text())
    assert {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"} <= set(sts)
    assert sts["temperatures"] == [1.3, 0.7, 2.1] and sts["dropped_shifts"] == [0.1, -0.2, 0.0]
    assert any("shifts" in m for m in rep.inexact)
    # without our config block an importer reads the temperatures from SGLang's file (shifts lost)
    cfg = json.loads((out / "config.json").read_text())
    del cfg[L.EXTENSION_KEY]
    (out / "config.json").write_text(json.dumps(cfg))
    imported = load_foreign(out, target.config, target.embed, target.lm_head)
    assert imported.config.sts_temperatures == [1.3, 0.7, 2.1] and imported.config.sts_shifts is None
    model.config.sts_shifts = None
    out, rep = _export(model, target, tmp_path / "noshift", "deepspec")
    assert "dropped_shifts" not in json.loads((out / L.SGLANG_STS_FILE).read_text()) and not rep.inexact


def test_zlab_dflash_bonus_anchor_block(tmp_path):
    """z-lab's DFlashDraftModel: the block is [anchor, MASK * gamma], slot k >= 1 drafts the token at
    its own position and block_size counts the anchor slot. Imported, it drafts what a forward over
    gamma + 1 slots gives at slots 1..gamma, and greedy output equals plain decoding."""
    target = tiny_target(scale=3.0)
    model = _model(target, "dflash", "none", None)
    out, _ = _export(model, target, tmp_path, "dflash")
    cfg = json.loads((out / "config.json").read_text())
    for key in ("sample_from_anchor", L.EXTENSION_KEY, "markov_rank", "enable_confidence_head"):
        cfg.pop(key, None)
    cfg.update(architectures=["DFlashDraftModel"], block_size=4)        # 3 drafts + the anchor slot
    cfg["dflash_config"]["block_size"] = 4
    (out / "config.json").write_text(json.dumps(cfg))
    imported = load_foreign(out, target.config, target.embed, target.lm_head)
    assert not imported.config.sample_from_anchor and imported.config.block_size == 3
    ids = [1, 3, 2, 4, 0, 2, 1, 3]
    kv = target.new_cache(1, 32)
    slot = kv.allocate()
    feats = torch.cat(target(torch.tensor(ids), [(slot, len(ids))], kv, feature_layers=(0, 2),
                             logits_rows=None).features, -1)
    a = 5
    ctx = DraftContext(ids[:a + 1], SamplingParams(temperature=1.0), torch.Generator().manual_seed(1), 3,
                       features=[feats[:a]])
    prop = DSparkDrafter(imported, target).propose([ctx])[0]
    imported.config.block_size = 4                  # the training forward over all 4 slots
    with torch.no_grad():
        _, logits, _ = imported.forward_train(feats[:a], torch.tensor(ids), torch.tensor([a]))
    for k in range(3):
        assert torch.allclose(prop.probs[k], logits[0, k + 1].softmax(-1), atol=1e-5), k
    imported.config.block_size = 3
    drafter = load_drafter(str(out), as_target(target))
    _assert_greedy_equals_plain(target, drafter, ([1, 2, 3], [4, 4, 1, 0, 2]))


def test_export_cli_errors_are_one_line(tmp_path, capsys):
    from dspark.cli import main
    assert main(["export", str(tmp_path / "nothing"), "--format", "deepspec", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "neither a trained drafter's folder" in err and "\n" not in err
    assert main(["export", "dspark", "--format", "onnx", "--out", str(tmp_path / "o")]) == 2


def test_committed_dspark_drafter_export(tmp_path, capsys):
    """Without q/k norms the committed drafter's export is refused, naming why; with them it is
    written, exact but for the STS shifts, which the export names as dropped."""
    from dspark.cli import main
    from dspark.drafters import CHECKPOINTS
    from dspark.drafters.config import DrafterConfig
    folder = CHECKPOINTS / "smollm2-135m-instruct" / "dspark"
    rc = main(["export", str(folder), "--format", "deepspec", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    cfg = DrafterConfig.load(folder)
    if cfg.qk_norm:
        assert rc == 0
        if any(cfg.sts_shifts or ()):   # our STS shifts have no place in DeepSpec's layout: said, not dropped silently
            assert "shifts cannot be folded" in err
        else:
            assert "exact:" in err
    else:
        assert rc == 2 and "qk_norm false" in err and not (tmp_path / "o").exists()


SPECULATORS = __import__("pathlib").Path(__file__).parent / "data" / "speculators-dspark"


def test_a_checkpoint_the_speculators_package_wrote_is_read_as_it_computes():
    """Written by speculators 0.9.0 itself (scripts/speculators_writes_dspark.py, in its own
    environment): a reduced draft vocabulary (t2d / d2t), a full-table vanilla Markov head and a
    confidence head that reads it, for a tiny Llama target it saved beside. Imported, the Markov
    bias and the confidence logit equal what speculators' heads computed; the embeddings and LM
    head come from the target; greedy output through it equals plain decoding."""
    from safetensors.torch import load_file as load
    ref = load(str(SPECULATORS / "reference.safetensors"))
    target = Decoder.from_hf(LlamaForCausalLM.from_pretrained(SPECULATORS / "verifier").eval())
    drafter = load_drafter(str(SPECULATORS / "drafter"), as_target(target))
    m = drafter.model
    assert isinstance(drafter, DSparkDrafter) and m.config.markov_full_table and m.config.confidence_head
    assert m.draft_vocab.tolist() == list(range(0, 32, 2)) and m.config.target_layer_ids == [0, 2]
    with torch.no_grad():
        bias, e = m.head.teacher_forced(ref["hidden"], m.prev_rows[ref["prev_tokens"]])
        conf = m.confidence(ref["hidden"], e)
    torch.testing.assert_close(bias, ref["markov_bias"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conf, ref["confidence_logits"], rtol=1e-5, atol=1e-6)
    _assert_greedy_equals_plain(target, drafter, ([1, 5, 9], [4, 20, 1, 0, 2, 17], [3]))
