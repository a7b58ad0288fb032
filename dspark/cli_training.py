"""The training-path commands of the ``dspark`` CLI: prepare -> regenerate -> cache -> train -> calibrate
-> eval.

Each command reads what the previous one wrote; the defaults chain through one work folder
(``--work``, default ``<user cache>/work/<target>``), so the whole pipeline is::

    dspark prepare && dspark regenerate && dspark cache && dspark train --recipe dspark
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .errors import UsageError

if TYPE_CHECKING:
    from .drafters.dspark import DSparkDrafter
    from .training.cache import CacheReader, OnlineSource

DEFAULT_MIX = "chat=0.3,code=0.2,regen=0.5"

RECIPES: dict[str, dict[str, Any]] = {   # name -> drafter settings; every recipe shares the data, token counts and steps
    "dspark": {"kind": "dspark", "num_hidden_layers": 2, "markov_head_type": "vanilla"},
    "dspark-rnn": {"kind": "dspark", "num_hidden_layers": 2, "markov_head_type": "rnn"},
    "dspark-gated": {"kind": "dspark", "num_hidden_layers": 2, "markov_head_type": "gated"},
    "dflash": {"kind": "dflash", "num_hidden_layers": 2},
    "dflash-5": {"kind": "dflash", "num_hidden_layers": 5},
    "eagle3": {"kind": "eagle3", "num_hidden_layers": 1},
}


def _work_dir(args) -> Path:
    if args.work:
        return Path(args.work).expanduser()
    from .runtime.loading import cache_dir, resolve_target
    name, _ = resolve_target(args.target)
    return cache_dir() / "work" / name


def add_parsers(sub, h) -> None:
    """``h`` holds the shared flag helpers of cli.py (types, model flags)."""
    def work(p):
        p.add_argument("--work", default=None, help="pipeline folder (default: <user cache>/work/<target>)")

    p = sub.add_parser("prepare", help="build the training prompt mix (chat, multi-turn, code, math) and a "
                                       "held-out split")
    p.add_argument("--num-prompts", type=h._positive_int, default=8000)
    p.add_argument("--mix", default="chat=0.2,multi-turn=0.1,code=0.35,math=0.35")
    p.add_argument("--heldout", type=h._float, default=0.05)
    p.add_argument("--seed", type=h._int, default=0)
    p.add_argument("--target", default=None)
    work(p)

    r = sub.add_parser("regenerate", help="the target writes the answers (resumable)")
    r.add_argument("--split", default="train", choices=["train", "heldout"])
    r.add_argument("--prompts", default=None, help="prompts JSONL (default: <work>/prompts/<split>.jsonl)")
    r.add_argument("--output", default=None, help="answers JSONL (default: <work>/regen/<split>.jsonl)")
    r.add_argument("--limit", type=h._positive_int, default=None, help="only the first N prompts")
    r.add_argument("--max-new-tokens", type=h._positive_int, default=384)
    r.add_argument("--max-prompt-tokens", type=h._positive_int, default=512)
    r.add_argument("--concurrency", type=h._positive_int, default=32)
    r.add_argument("--temperature", type=h._float, default=0.7)
    r.add_argument("--top-p", type=h._float, default=0.8)
    r.add_argument("--top-k", type=h._int, default=20)
    r.add_argument("--seed", type=h._int, default=0)
    r.add_argument("--endpoint", default=None, help="OpenAI-compatible base URL (e.g. http://host:8000/v1)")
    r.add_argument("--model", default=None, help="model name at the endpoint (default: its first)")
    h._add_model_flags(r)
    r.set_defaults(threads=2)
    work(r)

    c = sub.add_parser("cache", help="store target features + last hidden state per token (sharded)")
    c.add_argument("--split", default="train", choices=["train", "heldout"])
    c.add_argument("--input", default=None, help="regenerated JSONL (default: <work>/regen/<split>.jsonl)")
    c.add_argument("--output", default=None, help="cache folder (default: <work>/cache/<split>)")
    c.add_argument("--layers", type=h._int_list(0), default=None,
                   help="target layers (default: 5 spread from 1 to L-3)")
    c.add_argument("--max-len", type=h._positive_int, default=1024)
    c.add_argument("--shard-tokens", type=h._positive_int, default=200_000)
    h._add_model_flags(c)
    c.set_defaults(threads=2)
    work(c)

    t = sub.add_parser("train", help="train a drafter (resumes from <out>/checkpoint)")
    t.add_argument("--recipe", default="dspark", choices=sorted(RECIPES))
    t.add_argument("--cache", default=None, help="cache folder (default: <work>/cache/train)")
    t.add_argument("--online", action="store_true",
                   help="run the target inside training instead of reading a cache (small targets)")
    t.add_argument("--input", default=None, help="with --online or --corpus: regenerated JSONL "
                   "(default: <work>/regen/train.jsonl)")
    t.add_argument("--corpus", action="store_true",
                   help="distill on the corpus of --mix (ShareGPT answers, the Python standard library, the "
                        "target's own answers), the target running inside training; held-out rows of each "
                        "source are set apart and scored every --eval-every steps")
    t.add_argument("--mix", default=DEFAULT_MIX,
                   help="with --corpus: each source's share of the supervised positions (chat, code, regen)")
    t.add_argument("--positions", type=h._positive_int, default=4_000_000,
                   help="with --corpus: supervised answer positions to draw (before the held-out split)")
    t.add_argument("--max-len", type=h._positive_int, default=512, help="with --corpus: tokens per sequence")
    t.add_argument("--regimes", default=None, metavar="NAMES",
                   help="with --corpus: train only on the target's answers sampled in these regimes (comma list "
                        "of greedy, t1, deepspec; default: every one); the held-out rows keep them all")
    t.add_argument("--loss", default=None, choices=["tv", "kl", "kl+tv", "ce"],
                   help="tv: 0.1 CE + 0.9 TV (the paper's), kl: 0.1 CE + forward KL, kl+tv: both, ce: CE only "
                        "(default: tv; ce for dflash recipes without --corpus)")
    t.add_argument("--schedule", default="cosine", choices=["cosine", "wsd"],
                   help="learning rate after warmup: cosine to 0, or warmup-stable-decay (extendable)")
    t.add_argument("--decay", type=h._float, default=0.2, help="wsd: the last fraction of steps that decays")
    t.add_argument("--save-minutes", type=h._float, default=10.0, help="also checkpoint every N minutes")
    t.add_argument("--eval-every", type=h._non_negative_int, default=None,
                   help="held-out signal every N steps (default: 50 with --corpus, else never)")
    t.add_argument("--init-weights", default=None, metavar="DIR",
                   help="start from a saved drafter's weights (same recipe and layers) with a fresh optimizer")
    t.add_argument("--no-qk-norm", action="store_true",
                   help="drafter layers without q/k RMSNorm (the layout drafters had before the engines' one)")
    t.add_argument("--out", default=None,
                   help="output folder (default: <user cache>/drafters/<target>/<recipe>, "
                        "where `--drafter <recipe>` finds it)")
    t.add_argument("--lr", type=h._float, default=6e-4)
    t.add_argument("--epochs", type=h._float, default=1.0)
    t.add_argument("--batch-size", type=h._positive_int, default=16)
    t.add_argument("--anchors", type=h._non_negative_int, default=128,
                   help="anchor positions per sequence (0: every answer position)")
    t.add_argument("--max-steps", type=h._positive_int, default=None)
    t.add_argument("--block-size", type=h._positive_int, default=7)
    t.add_argument("--layers", type=h._positive_int, default=None, help="drafter layers (default: the recipe's)")
    t.add_argument("--markov-rank", type=h._positive_int, default=256)
    t.add_argument("--draft-vocab", type=h._non_negative_int, default=8192,
                   help="draft vocabulary: the N most frequent answer tokens (0 = the full vocabulary)")
    t.add_argument("--save-every", type=h._positive_int, default=10, help="checkpoint every N steps")
    t.add_argument("--loss-decay", type=h._float, default=4.0,
                   help="position weights exp(-(k-1)/decay); 0: weighted by the held-out acceptance of the "
                        "positions before (needs --corpus)")
    t.add_argument("--seed", type=h._int, default=0)
    t.add_argument("--init-from-target", type=h._int_list(0), default=None, metavar="IDS",
                   help="start drafter layer i from the target's layer IDS[i] and the final norm from the "
                        "target's (comma list, one id per drafter layer; default: random)")
    h._add_model_flags(t)
    t.set_defaults(threads=2)
    work(t)

    rc = sub.add_parser("recipe", help="train, calibrate, evaluate and export DSpark and DFlash drafters for a "
                                       "target within a time budget (resumable: rerun the same command)")
    from .training.recipe import Plan
    d = Plan(target="")
    rc.add_argument("--budget-hours", type=h._float, default=d.budget_hours,
                    help="wall-clock hours for the whole recipe, split across its stages (printed at the start)")
    rc.add_argument("--out", default=None,
                    help="where the drafters and the report go (default: <user cache>/drafters/<target>/recipe)")
    rc.add_argument("--prompts", default=None, help="a JSONL of {\"prompt\"} rows to answer and train on "
                    "(default: `dspark prepare`'s chat / code / math mix)")
    rc.add_argument("--num-prompts", type=h._non_negative_int, default=0,
                    help="prompts to prepare (default: 4,000 per budget hour)")
    rc.add_argument("--regimes", default=d.regimes,
                    help="the sampling the target answers at: each regime's share of the prompts (greedy, t1, "
                         "deepspec = T 0.7 / top-p 0.8 / top-k 20)")
    rc.add_argument("--mix", default=d.mix, help="the corpus: each source's share of the supervised positions "
                    "(regen: the target's answers; chat: ShareGPT answers; code: the standard library)")
    rc.add_argument("--max-len", type=h._positive_int, default=d.max_len, help="tokens of prompt + answer")
    rc.add_argument("--answer-tokens", type=h._positive_int, default=d.answer_tokens,
                    help="new tokens per regenerated answer at most")
    rc.add_argument("--concurrency", type=h._positive_int, default=d.concurrency,
                    help="prompts the target answers at once")
    rc.add_argument("--batch-size", type=h._positive_int, default=d.batch_size)
    rc.add_argument("--lr", type=h._float, default=d.lr)
    rc.add_argument("--layers", type=h._positive_int, default=d.layers, help="drafter layers (from scratch)")
    rc.add_argument("--markov-rank", type=h._positive_int, default=d.markov_rank)
    rc.add_argument("--draft-vocab", type=h._non_negative_int, default=d.draft_vocab)
    rc.add_argument("--loss-decay", type=h._float, default=d.loss_decay,
                    help="position weights exp(-(k-1)/decay); 0 (default): each position weighted by the "
                         "held-out acceptance of the positions before it, re-measured as training goes")
    rc.add_argument("--init", default=d.init,
                    help="auto (the package's drafters for this target where they exist, else scratch), "
                         "scratch, or a folder holding dspark/ and dflash/ to start from")
    rc.add_argument("--eval-prompts", type=h._non_negative_int, default=0,
                    help="prompts per benchmark in the evaluation (default: 4 per budget hour, 1 - 16)")
    rc.add_argument("--eval-tokens", type=h._positive_int, default=d.eval_tokens)
    rc.add_argument("--calib-blocks", type=h._non_negative_int, default=0,
                    help="verified blocks per split and regime in the calibration (default: from the budget)")
    rc.add_argument("--seed", type=h._int, default=0)
    rc.add_argument("--json", action="store_true", help="print the report as one JSON line at the end")
    h._add_model_flags(rc)
    rc.set_defaults(threads=2)
    work(rc)

    e = sub.add_parser("eval", help="accepted length tau and per-position acceptance per benchmark")
    e.add_argument("--drafters", default="dspark,dflash", help="comma list of names or folders")
    e.add_argument("--dataset", nargs="+", default=None,
                   help="benchmark names (file stems) or JSONL paths (default: all 7)")
    e.add_argument("--num-prompts", type=h._positive_int, default=16)
    e.add_argument("--max-new-tokens", type=h._positive_int, default=256)
    e.add_argument("--temperature", type=h._float, default=1.0)
    e.add_argument("--seed", type=h._int, default=0)
    e.add_argument("--num-draft", type=h._positive_int, default=7, help="tokens drafted per round")
    e.add_argument("--block", type=h._positive_int, dest="num_draft", help=argparse.SUPPRESS)
    e.add_argument("--concurrency", type=h._positive_int, default=8, help="prompts decoded at once")
    e.add_argument("--exact-seeds", action="store_true",
                   help="verify as seeded requests are served (drafts as point masses at the verifier's draws: "
                        "the text is plain decoding's); default: rejection sampling, the method's acceptance")
    e.add_argument("--markdown", default=None, help="write the tau table here")
    e.add_argument("--plot", default=None, help="write the conditional-acceptance PNG here")
    e.add_argument("--json", action="store_true")
    e.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="compare drafters from earlier `dspark eval --json` outputs (files holding that "
                        "JSON as their last line) instead of running: same settings required")
    h._add_model_flags(e)
    e.set_defaults(threads=2)

    cb = sub.add_parser("calibrate", help="fit the confidence head's STS temperatures on held-out rollouts")
    cb.add_argument("--drafter", default="dspark", help="trained drafter name or folder (needs a confidence head)")
    cb.add_argument("--prompts", default=None, help="held-out prompts JSONL (default: <work>/prompts/heldout.jsonl)")
    cb.add_argument("--blocks", type=h._positive_int, default=20000,
                    help="verified blocks per split (fit, eval); at 5,000 the ECE's sampling noise alone is "
                         "about 1.7 %% at position 1, at 20,000 under 1 %%")
    cb.add_argument("--max-new-tokens", type=h._positive_int, default=256)
    cb.add_argument("--concurrency", type=h._positive_int, default=16)
    cb.add_argument("--seed", type=h._int, default=0)
    cb.add_argument("--bins", type=h._positive_int, default=20, help="ECE bins (equal width)")
    cb.add_argument("--reliability", default=None, help="write the reliability diagram PNG here")
    cb.add_argument("--sweep", default=None, help="write the threshold-sweep PNG here")
    cb.add_argument("--markdown", default=None, help="write the per-position table here")
    cb.add_argument("--no-save", action="store_true", help="report only; leave the drafter's config as is")
    cb.add_argument("--shift", action="store_true",
                    help="also fit a logit shift per position (c = sigmoid(z / T + b)): for a head that is "
                         "over- or under-confident by a constant, which no temperature removes; off: the "
                         "paper's STS")
    cb.add_argument("--regime", default="sampled", choices=["sampled", "greedy"],
                    help="the requests the calibration is for: sampled (rollouts at temperature 1, the "
                         "paper's) or greedy (greedy rollouts; saved apart and applied to greedy requests)")
    cb.add_argument("--rollouts", default=None, metavar="NPZ",
                    help="reuse the rollouts in this file if it exists (same drafter), else record them there")
    cb.add_argument("--json", action="store_true")
    h._add_model_flags(cb)
    cb.set_defaults(threads=2)
    work(cb)

    x = sub.add_parser("export", help="write a trained drafter in an engine's checkpoint layout "
                                      "(DeepSpec, DFlash, speculators: vLLM, SGLang, llama.cpp)")
    x.add_argument("drafter", help="a trained drafter's folder, or a name as for --drafter (dspark, dflash)")
    x.add_argument("--format", required=True, choices=["deepspec", "dflash", "speculators"])
    x.add_argument("--out", required=True, help="folder to write (config.json, model.safetensors, ...)")
    x.add_argument("--target", default=None, help="the drafter's target (default: the one it was trained for)")
    x.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="tensor dtype; fp32 (default) is the exact one (the folded fc)")
    x.add_argument("--allow-inexact", action="store_true",
                   help="export a drafter without q/k norms with norms of ones (changes what it drafts; "
                        "the report says so)")
    x.add_argument("--json", action="store_true", help="print the report as one JSON line")


def cmd_prepare(args) -> int:
    from .training.prompts import DOMAINS, parse_shares, prepare
    out = prepare(_work_dir(args) / "prompts", args.num_prompts, parse_shares(args.mix, DOMAINS, "--mix"),
                  args.heldout, args.seed,
                  log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(out))
    return 0


def cmd_regenerate(args) -> int:
    from .training.regenerate import regenerate
    w = _work_dir(args)
    out = regenerate(args.prompts or w / "prompts" / f"{args.split}.jsonl",
                     args.output or w / "regen" / f"{args.split}.jsonl", target=args.target, dtype=args.dtype,
                     device=args.device, endpoint=args.endpoint, model_name=args.model,
                     max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                     concurrency=args.concurrency, temperature=args.temperature, top_p=args.top_p,
                     top_k=args.top_k, seed=args.seed, limit=args.limit,
                     log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(out))
    return 0


def cmd_cache(args) -> int:
    from .drafters.config import default_layer_ids
    from .runtime.loading import target_from_args
    from .training.cache import build_cache
    from .training.regenerate import read_regenerated
    w = _work_dir(args)
    rows = read_regenerated(args.input or w / "regen" / f"{args.split}.jsonl")
    target = target_from_args(args)
    layers = args.layers or default_layer_ids(target.model.config.num_layers)
    out = build_cache(rows, target, args.output or w / "cache" / args.split, layers, max_len=args.max_len,
                      shard_tokens=args.shard_tokens, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(out))
    return 0


def _regimes(text: str | None) -> set[str] | None:
    from .training.regenerate import REGIMES
    if text is None:
        return None
    names = {n.strip() for n in text.split(",") if n.strip()}
    if not names or names - set(REGIMES):
        raise UsageError(f"--regimes {text!r}: a comma list of {', '.join(REGIMES)}")
    return names


def cmd_train(args) -> int:
    from .drafters.config import DrafterConfig, pick_mask_token
    from .runtime.loading import cache_dir, target_from_args
    from .training.trainer import TrainConfig, build_draft_vocab, train
    w = _work_dir(args)
    target = target_from_args(args)
    tc = target.model.config
    heldout = None
    rows: list                      # corpus Rows or regenerated dicts: OnlineSource takes both
    source: OnlineSource | CacheReader
    if args.corpus:
        from .drafters.config import default_layer_ids
        from .training import corpus
        from .training.cache import OnlineSource
        mix = corpus.parse_mix(args.mix)
        rows, held, report = corpus.build(target.tokenizer, mix, args.positions,
                                          regen_path=args.input or w / "regen" / "train.jsonl",
                                          max_len=args.max_len, seed=args.seed, regimes=_regimes(args.regimes),
                                          log=lambda m: print(m, file=sys.stderr))
        print(f"corpus: {json.dumps(report)}", file=sys.stderr)
        layers = default_layer_ids(tc.num_layers)
        source = OnlineSource(rows, target, layers, max_len=args.max_len)
        heldout = OnlineSource(held, target, layers, max_len=args.max_len)
    elif args.online:
        from .drafters.config import default_layer_ids
        from .training.cache import OnlineSource
        from .training.regenerate import read_regenerated
        rows = read_regenerated(args.input or w / "regen" / "train.jsonl")
        source = OnlineSource(rows, target, default_layer_ids(tc.num_layers))
    else:
        from .training.cache import CacheReader
        source = CacheReader(args.cache or w / "cache" / "train")
    recipe = dict(RECIPES[args.recipe])
    if args.layers:
        recipe["num_hidden_layers"] = args.layers
    if recipe["kind"] == "eagle3" and recipe["num_hidden_layers"] != 1:
        raise UsageError("the EAGLE-3-style drafter has one layer")
    cfg = DrafterConfig(**recipe, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                        num_attention_heads=tc.num_heads, num_key_value_heads=tc.num_kv_heads,
                        head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps, block_size=args.block_size,
                        target_layer_ids=list(source.feature_layers),
                        mask_token_id=pick_mask_token(target.tokenizer), markov_rank=args.markov_rank,
                        vocab_size=tc.vocab_size, target=target.name, target_hidden_size=tc.hidden_size,
                        final_logit_softcap=tc.final_logit_softcap, embed_scale=tc.embed_scale,
                        qk_norm=recipe["kind"] != "eagle3" and not args.no_qk_norm)
    out = Path(args.out) if args.out else cache_dir() / "drafters" / target.name / args.recipe
    vocab = None
    if not (out / "checkpoint").exists():
        vocab = build_draft_vocab(source, args.draft_vocab, tc.vocab_size, always=target.eos_token_ids)
    loss = args.loss or ("tv" if args.corpus else None)
    tcfg = TrainConfig(lr=args.lr, epochs=args.epochs, batch_size=args.batch_size, anchors=args.anchors,
                       max_steps=args.max_steps, save_every=args.save_every, seed=args.seed,
                       loss_decay=args.loss_decay,
                       init_layers=args.init_from_target, loss=loss, schedule=args.schedule, decay=args.decay,
                       save_minutes=args.save_minutes, init_weights=args.init_weights,
                       eval_every=args.eval_every if args.eval_every is not None else (50 if args.corpus else 0))
    res = train(source, cfg, out, target, tcfg, draft_vocab=vocab, heldout=heldout,
                log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({"out": str(out), **res}))
    return 0


def cmd_recipe(args) -> int:
    from dataclasses import fields

    from .runtime.loading import cache_dir, resolve_target
    from .training.recipe import Plan, Recipe
    if args.budget_hours <= 0:
        raise UsageError("--budget-hours must be > 0")
    if args.answer_tokens >= args.max_len:
        raise UsageError("--answer-tokens must be below --max-len (the prompt needs room)")
    name, _ = resolve_target(args.target)
    plan = Plan(target=args.target or name,
                **{f.name: getattr(args, f.name) for f in fields(Plan) if f.name != "target" and hasattr(args, f.name)})
    out = Path(args.out).expanduser() if args.out else cache_dir() / "drafters" / name / "recipe"
    rep = Recipe(plan, _work_dir(args), out, log=lambda m: print(m, file=sys.stderr)).run()
    print((out / "report.md").read_text(), file=sys.stderr)
    if args.json:
        print(json.dumps(rep))
    return 0


def _read_eval_json(path: str) -> dict:
    try:
        lines = Path(path).read_text().strip().splitlines()
        return json.loads(lines[-1])
    except (OSError, IndexError, ValueError) as e:
        raise UsageError(f"--merge {path}: not a `dspark eval --json` output ({e})") from None


def cmd_eval(args) -> int:
    from .evaluation import acceptance
    if args.merge:
        out = acceptance.merge([_read_eval_json(p) for p in args.merge])
    else:
        from .drafters import load_drafter
        from .runtime.loading import target_from_args
        target = target_from_args(args)
        names = [d.strip() for d in args.drafters.split(",") if d.strip()]
        if not names:
            raise UsageError("--drafters: give at least one drafter")
        from .data import benchmark_names
        datasets = args.dataset or benchmark_names()
        drafters = {n: load_drafter(n, target, num_draft=args.num_draft) for n in names}
        out = acceptance.evaluate(target, drafters, datasets, num_prompts=args.num_prompts,
                                  max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  seed=args.seed, block=args.num_draft, concurrency=args.concurrency,
                                  log=lambda m: print(m, file=sys.stderr), exact_seed=args.exact_seeds)
    table = acceptance.markdown(out)
    print(table, file=sys.stderr)
    for c in out["ratios"]:
        print(f"{c['drafter']} / {c['over']}: {c['ratio']:.3f} (95% CI {c['ci95'][0]:.3f}-{c['ci95'][1]:.3f})",
              file=sys.stderr)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.plot:
        acceptance.plot(out, args.plot)
    if args.json:
        print(json.dumps(out))
    return 0


def _calibration_rollouts(args, target, drafter, fit_rows, eval_rows, meta: dict) -> dict:
    """The fit and eval splits' rollouts: read back from ``--rollouts`` where it holds this drafter's,
    else recorded (and saved there)."""
    from tqdm import tqdm
    from .training import calibrate as cal
    from .training.prompts import encode_row
    if args.rollouts and Path(args.rollouts).is_file():
        splits, saved = cal.load_rollouts(args.rollouts)
        if (saved.get("drafter") != meta["drafter"] or saved.get("block_size") != meta["block_size"]
                or saved.get("regime", "sampled") != args.regime):
            raise UsageError(f"--rollouts {args.rollouts} was recorded with drafter {saved.get('drafter')}, "
                             f"not {meta['drafter']}: pass another path to record new rollouts")
        print(f"reusing the rollouts in {args.rollouts}", file=sys.stderr)
    else:
        splits = {}
        for name, part in (("fit", fit_rows), ("eval", eval_rows)):
            prompts = [encode_row(target.tokenizer, r) for r in part]
            with tqdm(total=args.blocks, desc=f"rollouts ({name})", unit="block", file=sys.stderr) as bar:
                splits[name] = cal.collect(target, drafter, prompts, [r["domain"] for r in part], blocks=args.blocks,
                                           max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
                                           seed=args.seed, progress=lambda n: bar.update(n - bar.n),
                                           temperature=0.0 if args.regime == "greedy" else 1.0)
        if args.rollouts:
            cal.save_rollouts(args.rollouts, splits, meta)
    return splits


def cmd_calibrate(args) -> int:
    from .drafters import load_drafter
    from .runtime.loading import target_from_args
    from .training import calibrate as cal
    from .training.prompts import read_prompts
    rows = read_prompts(args.prompts or _work_dir(args) / "prompts" / "heldout.jsonl")
    fit_rows, eval_rows = cal.split_rows(rows)
    target = target_from_args(args)
    drafter = load_drafter(args.drafter, target)
    folder = getattr(drafter, "folder", None)      # collect() refuses drafters without a confidence head
    meta = {"drafter": str(folder), "block_size": drafter.block_size, "blocks": args.blocks,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed, "regime": args.regime}
    splits = _calibration_rollouts(args, target, drafter, fit_rows, eval_rows, meta)
    if args.shift:
        temps, shifts = cal.fit_sts_shift(splits["fit"], args.bins)
    else:
        temps, shifts = cal.fit_sts(splits["fit"], args.bins), None
    rep = cal.report(splits["eval"], temps, args.bins, shifts)
    table = cal.markdown(rep)
    print(table, file=sys.stderr)
    sweep = cal.threshold_sweep(splits["eval"], temps, shifts=shifts)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.reliability:
        cal.plot_reliability(splits["eval"], temps, args.reliability, args.bins, shifts)
    if args.sweep:
        cal.plot_sweep(sweep, args.sweep)
    if not args.no_save and folder is not None:
        cfg = cast("DSparkDrafter", drafter).model.config      # folder: set by load_trained on DSpark drafters
        fitted = [round(t, 4) for t in temps], [round(b, 4) for b in shifts] if shifts is not None else None
        if args.regime == "greedy":
            cfg.sts_greedy_temperatures, cfg.sts_greedy_shifts = fitted
        else:
            cfg.sts_temperatures, cfg.sts_shifts = fitted
        try:
            cfg.save(folder)
        except OSError as e:
            raise UsageError(f"cannot write {folder}/config.json ({e}); rerun with --no-save") from None
        print(f"saved the calibration ({'temperatures and shifts' if shifts is not None else 'STS temperatures'}) "
              f"to {folder}/config.json", file=sys.stderr)
    if args.json:
        print(json.dumps({"drafter": str(folder), "temperatures": temps, "shifts": shifts,
                          "blocks": {k: len(v) for k, v in splits.items()}, "positions": rep, "sweep": sweep}))
    return 0


def cmd_export(args) -> int:
    from dataclasses import asdict

    from .interop.export import export_drafter
    from .runtime.loading import parse_dtype
    rep = export_drafter(args.drafter, args.format, Path(args.out).expanduser(), target=args.target,
                         allow_inexact=args.allow_inexact, dtype=parse_dtype(args.dtype))
    print(f"wrote {rep.format} ({rep.architecture}, {rep.tensors} tensors) to {rep.folder}; target layer ids "
          f"{rep.target_layer_ids} (engines: {rep.engine_layer_ids})", file=sys.stderr)
    for line in rep.notes:
        print(f"note: {line}", file=sys.stderr)
    for line in rep.inexact:
        print(f"INEXACT: {line}", file=sys.stderr)
    if not rep.inexact:
        print("exact: importing it gives the drafter's proposals bit for bit", file=sys.stderr)
    if args.json:
        print(json.dumps(asdict(rep)))
    return 0


COMMANDS = {"prepare": cmd_prepare, "regenerate": cmd_regenerate, "cache": cmd_cache, "train": cmd_train,
            "recipe": cmd_recipe,
            "eval": cmd_eval, "calibrate": cmd_calibrate,
            "export": cmd_export}
