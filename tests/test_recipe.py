"""`dspark recipe` end to end on a tiny random target (a Hugging Face folder with a byte-level
tokenizer): prompts -> regenerate -> DSpark and DFlash on the same steps -> calibration in both
regimes -> evaluation -> DeepSpec export, a drafter `--drafter DIR` serves, and a rerun after an
interruption that redoes nothing finished."""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import dspark.training.recipe as recipe_mod
from dspark.cli import main
from dspark.drafters import load_drafter
from dspark.errors import UsageError
from dspark.generation import generate_ids
from dspark.runtime.loading import load_target
from dspark.sampling import SamplingParams


def _tiny_target_folder(path):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["</s>"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=vocab["</s>"],
                      pad_token_id=vocab["<pad>"])
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(4.0)
    m.save_pretrained(path)
    tok.save_pretrained(path)
    return path


ARGS = ["--budget-hours", "0.004", "--init", "scratch", "--answer-tokens", "24", "--max-len", "80",
        "--eval-prompts", "1", "--eval-tokens", "12", "--calib-blocks", "12", "--concurrency", "8",
        "--batch-size", "4", "--draft-vocab", "0", "--layers", "1", "--markov-rank", "16", "--dtype", "fp32",
        "--mix", "code=0.2,regen=0.8"]


def test_recipe_runs_end_to_end_and_resumes(tmp_path, monkeypatch, capsys):
    folder = _tiny_target_folder(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Say {i} things about {w}."}) + "\n"
                               for i, w in enumerate(["rain", "code", "cats", "maps", "tea", "sand"] * 5)))
    cmd = ["recipe", "--target", str(folder), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
           "--prompts", str(prompts), *ARGS]

    def interrupted(self):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:           # killed at calibration: training is done and kept
        m.setattr(recipe_mod.Recipe, "stage_calibrate", interrupted)
        assert main(cmd) != 0
    state = json.loads((tmp_path / "work" / "recipe.json").read_text())
    assert {"prompts", "regenerate", "train-dspark", "train-dflash"} <= set(state["done"])
    steps = state["steps"]
    assert state["done"]["train-dspark"]["steps"] == state["done"]["train-dflash"]["steps"] == steps
    trained = (tmp_path / "out" / "dspark" / "model.safetensors").stat().st_mtime_ns

    def no_more_training(self, *a, **k):
        raise AssertionError("a finished stage ran again")
    monkeypatch.setattr(recipe_mod.Recipe, "_train", no_more_training)
    capsys.readouterr()
    assert main([*cmd, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (tmp_path / "out" / "dspark" / "model.safetensors").stat().st_mtime_ns == trained
    ev = rep["evaluation"]
    for key in ("t0", "t1"):
        assert set(ev[key]) == {"dspark", "dflash", "ratios"} and ev[key]["dspark"]["tau"] >= 1.0
    assert ev["speed"]["speedup"] > 0 and set(rep["calibration"]) == {"sampled", "greedy"}
    cfg = json.loads((tmp_path / "out" / "dspark" / "config.json").read_text())
    assert len(cfg["sts_temperatures"]) == len(cfg["sts_greedy_temperatures"]) == 7
    assert (tmp_path / "out" / "deepspec" / "config.json").is_file()
    assert "tau" in (tmp_path / "out" / "report.md").read_text()
    regen = [json.loads(line) for line in (tmp_path / "work" / "regen" / "train.jsonl").read_text().splitlines()]
    assert {r["regime"] for r in regen} == {"greedy", "t1"}

    # the drafter serves: greedy fp32 output equals plain decoding
    target = load_target(str(folder), dtype="fp32")
    d = load_drafter(str(tmp_path / "out" / "dspark"), target)
    ids = target.tokenizer("Say 3 things about rain.")["input_ids"]
    greedy = SamplingParams(temperature=0)
    assert generate_ids(target.model, ids, greedy, 20, d)[0] == generate_ids(target.model, ids, greedy, 20)[0]


def test_a_rerun_with_other_settings_is_refused(tmp_path):
    folder = _tiny_target_folder(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    (tmp_path / "work").mkdir()
    base = ["recipe", "--target", str(folder), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
            "--prompts", str(prompts)]
    from dspark.training.recipe import Plan, Recipe
    Recipe(Plan(target=str(folder), prompts=str(prompts)), tmp_path / "work", tmp_path / "out")._save()
    with pytest.raises(UsageError, match="max_len"):
        Recipe(Plan(target=str(folder), prompts=str(prompts), max_len=2048), tmp_path / "work", tmp_path / "out")
    again = Recipe(Plan(target=str(folder), prompts=str(prompts), budget_hours=2.0), tmp_path / "work", tmp_path / "out")
    assert again.budget == 2.0 * 3600        # a rerun may give the recipe more time
    assert main([*base, "--budget-hours", "0"]) == 2


def test_the_budget_split_counts_what_an_interrupted_stage_spent(tmp_path):
    from dspark.training.recipe import SHARES, Plan, Recipe
    r = Recipe(Plan(target="x", budget_hours=1.0), tmp_path / "work", tmp_path / "out", log=lambda m: None)
    assert r.left("regenerate") == pytest.approx(3600 * SHARES["regenerate"])
    r.state.spent["regenerate"] = 600.0                       # killed 10 minutes in
    assert r.left("regenerate") == pytest.approx(3600 * SHARES["regenerate"] - 600)
    r.state.done = {"prompts": {}, "regenerate": {}}            # it ended: the rest share what it left
    r.state.spent["prompts"] = 0.0
    todo = 1 - SHARES["prompts"] - SHARES["regenerate"]
    assert r.left("train-dspark") == pytest.approx((3600 - 600) * SHARES["train-dspark"] / todo)


def test_a_scaling_worse_than_none_on_the_held_out_split_is_not_kept():
    """The recipe keeps the fitted STS only where the held-out split's ECE (all positions, weighted
    by their blocks) is no worse than the head's raw confidences'."""
    from dspark.training.recipe import kept_scaling
    better = [{"blocks": 100, "ece_before": 0.14, "ece_after": 0.05}, {"blocks": 40, "ece_before": 0.10, "ece_after": 0.12}]
    assert kept_scaling(better, [0.8, 1.2], [0.1, -0.2]) == ([0.8, 1.2], [0.1, -0.2], True)
    worse = [{"blocks": 100, "ece_before": 0.141, "ece_after": 0.152}, {"blocks": 40, "ece_before": 0.10, "ece_after": 0.09}]
    assert kept_scaling(worse, [0.8, 1.2], [0.1, -0.2]) == ([1.0, 1.0], [0.0, 0.0], False)
