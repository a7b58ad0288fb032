"""What a simulated step costs: from `dspark profile`'s cost table, or from a roofline of a
described accelerator running a described target and drafter.

A step is described by ``StepShape`` (the rows each decoding request sends, their contexts, the
prompt tokens prefilled beside them, the drafter's call); a ``StepCosts`` prices its two parts,
the target's forward (with verification and the engine's own work) and the drafter's call. The
policies price their decisions with a ``CostTable`` (scheduling/costs.py), as in the engine: the
profile's own table, or the roofline's, tabulated on the policies' usual axes (``table``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..errors import UsageError
from ..scheduling.costs import CostTable


@dataclass(frozen=True)
class StepShape:
    """What a step's price depends on."""

    blocks: tuple[int, ...]      # per decoding request: the rows it sends (its anchor + verified drafts)
    contexts: tuple[int, ...]    # per decoding request: its context (prompt and output so far)
    prefill: int = 0             # prompt tokens prefilled beside them
    prefill_attended: int = 0    # sum over those tokens of the positions each attends to
    drafting: int = 0            # requests the drafter's call drafted for
    depth: float = 0.0           # their mean draft length
    draft_rows: int = 0          # context rows the call took in beyond its requests' steady rounds

    @property
    def context(self) -> int:
        """The decoding requests' mean context (what the policies price a step at)."""
        return int(sum(self.contexts) / max(1, len(self.contexts)))


class StepCosts:
    """Seconds of a step's two parts."""

    table: CostTable    # what the policies price their decisions with

    def forward_seconds(self, s: StepShape) -> float:
        raise NotImplementedError

    def draft_seconds(self, s: StepShape) -> float:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError


class TableCosts(StepCosts):
    """Prices from `dspark profile`'s table: the target's part of a step of R requests verifying
    v drafted tokens each on average (its ragged blocks priced at their mean), the drafter's call
    over the requests that drafted and the context rows it took in, and prompt rows at the
    profile's prefill fit (seconds = a + b x tokens for a step that only prefills; b x tokens
    beside decoding requests). A step is priced at its longest context: the runtime's batched
    attention reads every request's keys up to it (runtime/attention.py), and the profile measured
    steps whose requests share one context. Between the table's contexts a price is interpolated
    linearly (the policies price at the nearest measured context)."""

    def __init__(self, table: CostTable):
        self.table = table

    @staticmethod
    def _context(s: StepShape) -> int:
        return max(s.contexts, default=0)

    def _between(self, price, context: int) -> float:
        """``price(column context)`` interpolated at ``context`` (clamped to the measured ones)."""
        cs = self.table.contexts
        if context <= cs[0] or len(cs) == 1:
            return price(cs[0])
        if context >= cs[-1]:
            return price(cs[-1])
        i = next(k for k in range(1, len(cs)) if cs[k] >= context)
        f = (context - cs[i - 1]) / (cs[i] - cs[i - 1])
        return (1 - f) * price(cs[i - 1]) + f * price(cs[i])

    def forward_seconds(self, s: StepShape) -> float:
        t = self.table
        a, b = t.prefill_fit()
        R = len(s.blocks)
        out = b * s.prefill
        if R:
            v = (sum(s.blocks) - R) / R
            out += self._between(lambda c: t.target_seconds(R, v, c), self._context(s))
        elif s.prefill:
            out += a
        return out

    def draft_seconds(self, s: StepShape) -> float:
        if not s.drafting:
            return 0.0
        t = self.table
        return (self._between(lambda c: t.drafter_seconds(s.drafting, s.depth, c), self._context(s))
                + t.context_row * s.draft_rows)

    def describe(self) -> dict:
        t = self.table
        return {"kind": "cost table", "key": t.key, "machine": t.machine, "requests": t.requests,
                "verified": t.verified, "contexts": t.contexts, "prefill": list(t.prefill_fit())}


@dataclass(frozen=True)
class Accelerator:
    """An accelerator by its published figures, and what a serving step achieves of them."""

    name: str
    memory_bandwidth: float          # bytes/s (datasheet)
    peak_flops: float                # dense FLOP/s at the serving dtype (datasheet)
    step_overhead: float = 1e-3      # seconds a target step costs beyond its reads and products
    drafter_overhead: float = 3e-4   # the same for a drafter call
    bandwidth_efficiency: float = 0.8   # share of the bandwidth a decoding step's reads achieve
    flops_efficiency: float = 0.6       # share of the peak its products achieve


@dataclass(frozen=True)
class ModelShape:
    """A model as a forward's roofline sees it (per forward: bytes read and products per row)."""

    name: str
    weight_bytes: float              # weights read once per forward
    flops_per_token: float           # 2 x the parameters a row multiplies by
    kv_bytes_per_token: float        # cache bytes per context position (every layer, K and V)
    attention_flops: float           # products per (query row, attended position): 4 x layers x heads x head_dim

    @classmethod
    def from_config(cls, cfg: dict, name: str = "", dtype_bytes: float = 2.0, layers: int | None = None,
                    head: bool = True, markov_rank: int = 0) -> ModelShape:
        """From a Hugging Face decoder's config.json (Llama, Qwen2, Qwen3, Mistral and kin: dense
        attention and MLP). ``layers``: that many of its layers (a drafter built on its shape);
        ``head``: with the LM head; ``markov_rank``: plus a DSpark Markov head of that rank (its
        V x r table is gathered, its r x V product read and run)."""
        try:
            d = int(cfg["hidden_size"])
            n_layers = int(cfg["num_hidden_layers"]) if layers is None else layers
            heads = int(cfg["num_attention_heads"])
            kv = int(cfg.get("num_key_value_heads") or heads)
            hd = int(cfg.get("head_dim") or d // heads)
            inter = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"model config lacks {e}: need hidden_size, num_hidden_layers, num_attention_heads, "
                             "intermediate_size, vocab_size") from None
        per_layer = d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * inter
        params = n_layers * per_layer + (d * vocab if head else 0) + markov_rank * vocab
        return cls(name or str(cfg.get("_name_or_path", "model")), params * dtype_bytes, 2.0 * params,
                   n_layers * 2 * kv * hd * dtype_bytes, 4.0 * n_layers * heads * hd)

    @classmethod
    def load(cls, spec: str) -> ModelShape:
        """A preset name, a config.json, or a JSON of the fields themselves."""
        if spec in MODELS:
            return cls.from_config(MODELS[spec], spec)
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"model {spec!r}: not a preset ({', '.join(MODELS)}) nor a readable JSON ({e})") from None
        numbers = [f.name for f in fields(cls) if f.name != "name"]
        if set(numbers) <= set(d):
            try:
                vals = [float(d[k]) for k in numbers]
            except (TypeError, ValueError) as e:
                raise UsageError(f"model {spec!r}: {e}") from None
            return cls(str(d.get("name", path.stem)), *vals)
        return cls.from_config(d, d.get("_name_or_path") or path.parent.name)


# Published figures (datasheets): HBM bandwidth, dense BF16 tensor FLOP/s (without sparsity).
ACCELERATORS = {
    "h100-sxm": Accelerator("NVIDIA H100 SXM", 3.35e12, 989e12),
    "h200": Accelerator("NVIDIA H200 SXM", 4.8e12, 989e12),
    "a100-80gb": Accelerator("NVIDIA A100 80GB SXM", 2.039e12, 312e12),
    "mi300x": Accelerator("AMD Instinct MI300X", 5.3e12, 1307.4e12),
}

# The shapes of the models' published config.json files.
MODELS = {
    "qwen3-32b": {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936},
    "qwen3-8b": {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936},
    "llama-3.1-70b": {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 28672, "vocab_size": 128256},
}


def accelerator(spec: str, **overrides) -> Accelerator:
    """A preset name or a JSON of Accelerator's fields; ``overrides`` (not None) replace fields."""
    if spec in ACCELERATORS:
        acc = ACCELERATORS[spec]
    else:
        try:
            acc = Accelerator(**json.loads(Path(spec).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"accelerator {spec!r}: not a preset ({', '.join(ACCELERATORS)}) nor a JSON of "
                             f"{[f.name for f in fields(Accelerator)]} ({e})") from None
    d = asdict(acc)
    d.update({k: v for k, v in overrides.items() if v is not None})
    return Accelerator(**d)


class Roofline(StepCosts):
    """A step on an accelerator: each forward takes its overhead plus the longer of its reads
    (weights, and the cache of every position its rows attend to) at the achieved bandwidth and
    its products (every row through the weights, every query row against its positions) at the
    achieved FLOP/s. The drafter's call is a forward of the drafter over the drafted rows and the
    context rows it takes in, reading its own weights and cache."""

    def __init__(self, acc: Accelerator, target: ModelShape, drafter: ModelShape,
                 requests=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), verified=(0, 1, 2, 3, 4, 5, 7),
                 contexts=(512, 1024, 2048, 4096, 8192)):
        self.acc, self.target, self.drafter = acc, target, drafter
        self.table = self._tabulate(list(requests), list(verified), list(contexts))

    def _forward(self, m: ModelShape, overhead: float, rows: int, read_positions: float, attended: float) -> float:
        a = self.acc
        reads = (m.weight_bytes + m.kv_bytes_per_token * read_positions) / (a.memory_bandwidth * a.bandwidth_efficiency)
        products = (m.flops_per_token * rows + m.attention_flops * attended) / (a.peak_flops * a.flops_efficiency)
        return overhead + max(reads, products)

    def forward_seconds(self, s: StepShape) -> float:
        rows = sum(s.blocks) + s.prefill
        if not rows:
            return 0.0
        read = sum(s.contexts) + s.prefill_attended / max(1, s.prefill) if s.prefill else sum(s.contexts)
        attended = sum(b * c for b, c in zip(s.blocks, s.contexts)) + s.prefill_attended
        return self._forward(self.target, self.acc.step_overhead, rows, read, attended)

    def draft_seconds(self, s: StepShape) -> float:
        if not s.drafting:
            return 0.0
        rows = s.drafting * s.depth + s.draft_rows
        ctx = s.context
        return self._forward(self.drafter, self.acc.drafter_overhead, math.ceil(rows), s.drafting * ctx,
                             rows * ctx)

    def _tabulate(self, requests: list[int], verified: list[int], contexts: list[int]) -> CostTable:
        seconds, draft = [], []
        for c in contexts:
            sc, dc = [], []
            for R in requests:
                sr, dr = [], []
                for v in verified:
                    shape = StepShape((1 + v,) * R, (c,) * R, drafting=R if v else 0, depth=float(v))
                    d = self.draft_seconds(shape)
                    sr.append(self.forward_seconds(shape) + d)
                    dr.append(d)
                sc.append(sr)
                dc.append(dr)
            seconds.append(sc)
            draft.append(dc)
        row = self._forward(self.drafter, 0.0, 1, 0, contexts[0]) - self._forward(self.drafter, 0.0, 0, 0, 0)
        a, b = self._prefill_line(contexts[0])
        return CostTable(f"roofline|{self.target.name}|{self.drafter.name}|{self.acc.name}", requests, verified,
                         contexts, seconds, machine=self.acc.name, draft=draft, context_row=max(0.0, row),
                         prefill=[a, b])

    def _prefill_line(self, prompt: int) -> tuple[float, float]:
        """(seconds of a step prefilling no prompt, seconds per prompt token) at this prompt length."""
        one = self.forward_seconds(StepShape((), (), prefill=prompt, prefill_attended=prompt * prompt // 2))
        two = self.forward_seconds(StepShape((), (), prefill=2 * prompt, prefill_attended=prompt * prompt))
        b = two - one
        return max(0.0, one - b * prompt), b / prompt

    def describe(self) -> dict:
        return {"kind": "roofline", "accelerator": asdict(self.acc), "target": asdict(self.target),
                "drafter": asdict(self.drafter)}

