"""The command line: JSON output, clear errors with exit code 2 (usage) or 1 (run time), and
nothing half-written when a model file is missing or corrupt."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.cli import main


def _run(args, env=None):
    e = dict(os.environ, **(env or {}))
    p = subprocess.run([sys.executable, "-m", "dspark.cli", *args], capture_output=True, text=True,
                       env=e, timeout=600)
    return p.returncode, p.stdout, p.stderr


def test_generate_json(target_fp32):
    code, out, err = _run(["generate", "--prompt", "List three primary colors.", "--chat",
                           "--drafter", "ngram", "--max-new-tokens", "24", "--json", "--dtype", "fp32",
                           "--compare"])
    assert code == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    for key in ("text", "num_tokens", "num_rounds", "accept_length", "tokens_per_second", "speedup"):
        assert key in res
    assert 1 <= res["num_tokens"] <= 24 and res["num_rounds"] >= 1 and res["text"]
    assert res["identical_to_plain"] is True


@pytest.mark.parametrize("args,needle", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "   "], "prompt is empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    (["--prompt", "hi", "--max-new-tokens", "-3"], "max-new-tokens"),
    (["--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["--prompt", "hi", "--top-p", "0"], "top-p"),
    (["--prompt", "hi", "--top-p", "1.5"], "top-p"),
    (["--prompt", "hi", "--top-k", "-2"], "top-k"),
    (["--prompt", "hi", "--drafter", "no-such-drafter"], "unknown drafter"),
    (["--prompt", "hi", "--target", "/nonexistent/model.gguf"], "neither"),
    (["--prompt", "hi", "--temperature", "abc"], "expected a number"),
    (["--prompt", "hi", "--frequency-penalty", "3"], "frequency penalty"),
    (["--prompt", "hi", "--repetition-penalty", "0"], "repetition penalty"),
    (["--prompt", "hi", "--regex", "(a"], "invalid regex"),
    (["--prompt", "hi", "--json-schema", '{"type": "bogus"}'], "invalid json"),
    (["--prompt", "hi", "--json-schema", "@/nonexistent/schema.json"], "cannot read"),
    (["--prompt", "hi", "--grammar", "/nonexistent/g.lark"], "cannot read"),
    (["--prompt", "hi", "--regex", "a", "--choice", "b"], "not allowed with"),
])
def test_bad_usage_exits_2_with_one_line(args, needle, capsys):
    code = main(["generate", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_bad_flag_type_exits_2():
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "x"]) == 2
    assert main(["generate"]) == 2
    assert main(["no-such-command"]) == 2


def test_corrupt_gguf_exits_1_and_writes_nothing(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_CACHE", str(cache))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    code = main(["generate", "--prompt", "hi", "--target", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert "cannot read GGUF" in err and len(err.splitlines()) == 1
    models = cache / "models"
    assert not models.exists() or not any(models.iterdir()), "a half-written cache copy was left"


def test_corrupt_model_folder_exits_1(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10,
                                                    "hidden_size": 8, "num_hidden_layers": 1,
                                                    "num_attention_heads": 2, "intermediate_size": 16}))
    (folder / "model.safetensors").write_bytes(b"\x00" * 100)
    code = main(["generate", "--prompt", "hi", "--target", str(folder)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "cannot load model" in err


def test_folder_without_config_is_usage_error(tmp_path, capsys):
    assert main(["generate", "--prompt", "hi", "--target", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_damaged_cache_copy_is_rebuilt(tmp_path, monkeypatch):
    """Our own cached safetensors copy of a GGUF gets corrupted: it is rebuilt, not fatal."""
    import shutil

    from dspark.runtime import loading
    gguf = loading.bundled_gguf(loading.DEFAULT_TARGET)
    good = loading._convert_gguf(gguf)           # the session's copy (made once, reused)
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    folder = loading._gguf_cache_folder(gguf)
    assert folder != good
    shutil.copytree(good, folder)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    model, tok = loading.load_hf(gguf)
    assert model.config.num_hidden_layers == 30
    shutil.rmtree(tmp_path)


def test_eval_json_has_tau_and_per_position_acceptance(target_fp32, tmp_path):
    code, out, err = _run(["eval", "--drafters", "ngram,cut:8", "--dataset", "gsm8k", "humaneval",
                           "--num-prompts", "2", "--max-new-tokens", "24", "--temperature", "0",
                           "--num-draft", "3", "--dtype", "fp32", "--json"])
    assert code == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    rows = res["results"]
    assert {(r["drafter"], r["benchmark"]) for r in rows} == {
        (d, b) for d in ("ngram", "cut:8") for b in ("gsm8k", "humaneval")}
    for r in rows:
        assert r["tau"] >= 1.0
        assert len(r["acceptance_conditional"]) == len(r["acceptance_unconditional"]) == 3
        u = r["acceptance_unconditional"]
        assert all(0 <= x <= 1 for x in u) and u == sorted(u, reverse=True)   # prefix survival decays
    assert res["greedy_identity_vs_ngram"]["cut:8"] == 1.0    # greedy: every drafter, the same text
    assert {c["drafter"] for c in res["ratios"]} == {"ngram", "cut:8"}
    _check_merge(res, tmp_path)


def _check_merge(res, tmp_path):
    """Drafters evaluated in separate runs compare afterwards as if side by side."""
    paths = []
    for name in ("ngram", "cut:8"):
        part = {"settings": res["settings"], "results": [r for r in res["results"] if r["drafter"] == name]}
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text("log line\n" + json.dumps(part) + "\n")
    code, out, err = _run(["eval", "--merge", *map(str, paths), "--json"])
    assert code == 0, err
    merged = json.loads(out.strip().splitlines()[-1])
    assert merged["macro_tau"] == pytest.approx(res["macro_tau"])
    assert len(merged["ratios"]) == len(res["ratios"])
    for m, c in zip(merged["ratios"], res["ratios"]):
        assert (m["drafter"], m["over"]) == (c["drafter"], c["over"])
        assert m["ratio"] == pytest.approx(c["ratio"]) and m["ci95"] == pytest.approx(c["ci95"])
    other = json.loads(paths[1].read_text().splitlines()[-1])
    other["settings"]["temperature"] = 1.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(other))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json")
    for args, needle in (([paths[0], bad], "different settings"), ([paths[0], paths[0]], "twice"),
                         ([garbage], "not a `dspark eval --json` output")):
        code, _, err = _run(["eval", "--merge", *map(str, args)])
        assert code == 2 and needle in err, err


@pytest.mark.parametrize("args,needle", [
    (["train", "--recipe", "nope"], "invalid choice"),
    (["train", "--cache", "/nonexistent/cache"], "not a dspark cache"),
    (["train", "--lr", "abc"], "expected a number"),
    (["cache", "--input", "/nonexistent/regen.jsonl"], "not found"),
    (["regenerate", "--prompts", "/nonexistent/p.jsonl", "--output", "/tmp/x.jsonl"], "not found"),
    (["eval", "--drafters", "eagle3", "--dataset", "gsm8k"], "dspark train --recipe eagle3"),
    (["eval", "--drafters", "ngram", "--dataset", "/nonexistent.jsonl"], "nonexistent"),
    (["prepare", "--mix", "chat=x"], "--mix"),
    (["calibrate", "--prompts", "/nonexistent/heldout.jsonl"], "not found"),
    (["calibrate", "--blocks", "0"], "--blocks"),
    (["calibrate", "--drafter", "dflash", "--prompts", str(Path(__file__).parent / "_calib_prompts.jsonl")], "no confidence head"),
    (["calibrate", "--rollouts", str(Path(__file__)), "--prompts", str(Path(__file__).parent / "_calib_prompts.jsonl")],
     "not a rollouts file"),
])
def test_training_commands_bad_input_exit_2(args, needle, tmp_path, target_fp32):
    env = None
    if args[0] == "eval":   # a cache without trained drafters, sharing the converted target (20 s to convert again)
        from dspark.runtime.loading import cache_dir
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "models").symlink_to(cache_dir() / "models", target_is_directory=True)
        env = {"DSPARK_CACHE": str(tmp_path / "cache")}
    code, out, err = _run(args, env=env)
    assert code == 2, (code, err)
    assert needle in err
