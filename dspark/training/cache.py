"""The target cache: per training token, the chosen layers' features and the last hidden state.

O(d) bytes per token, never logits: the target distribution is recomputed from the last hidden
state (after the final norm) with the frozen LM head, only where the loss needs it.

Layout of a cache folder::

    index.json                 target, feature layers, sizes, shards (with sha256 per file), sequences
    shard-00000/features.npy   bf16 (stored as uint16) [T, len(layers) * d]
    shard-00000/hidden.npy     bf16 (stored as uint16) [T, d]
    shard-00000/ids.npy        int32 [T]
    shard-00000/loss_mask.npy  uint8 [T]   1 = a token of the answer (supervised)

Shards are written to a temporary folder and renamed, and the index is rewritten after each one,
so an interrupted build resumes after its last complete shard. Reading memory-maps the arrays and
checks every file's sha256 first: a damaged shard is a clear error, never silent garbage.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DsparkError, UsageError
from ..runtime.kv_cache import KVCache

FILES = ("features.npy", "hidden.npy", "ids.npy", "loss_mask.npy")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def sequence_tokens(row: dict, tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a regenerated row; text-only rows (from an endpoint) are
    tokenized with the chat template, the answer followed by the end-of-turn token."""
    if "prompt_ids" in row and "answer_ids" in row:
        return list(row["prompt_ids"]), list(row["answer_ids"])
    from .prompts import encode_row
    p = encode_row(tokenizer, row)
    a = tokenizer(row.get("answer") or "", add_special_tokens=False)["input_ids"]
    if row.get("finish_reason") == "stop" and tokenizer.eos_token_id is not None:
        a.append(tokenizer.eos_token_id)
    return p, a


def _index_path(folder: Path) -> Path:
    return folder / "index.json"


def _write_index(folder: Path, index: dict) -> None:
    tmp = folder / ".index.json.tmp"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, _index_path(folder))


@torch.inference_mode()
def _target_rows(model, kv, batch: list, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the batch's sequences (each in a cache slot of its own): the chosen
    layers' features [tokens, m*d] and the last hidden state [tokens, d], in bf16."""
    ids, segs = [], []
    for _rid, toks, _mask in batch:
        slot = kv.allocate()
        ids.extend(toks)
        segs.append((slot, len(toks)))
    o = model(torch.tensor(ids), segs, kv, feature_layers=tuple(layer_ids), logits_rows=None)
    for slot, _ in segs:
        kv.free(slot)
    return torch.cat(o.features, -1).to(torch.bfloat16), o.last_hidden.to(torch.bfloat16)


class _ShardWriter:
    """Sequences buffered into shards: each written whole (a hidden folder renamed into place, each
    file's SHA-256 in the index), then listed in the index, which is rewritten at once."""

    def __init__(self, out: Path, index: dict):
        self.out, self.index = out, index
        self._reset()

    def _reset(self) -> None:
        self.buf: dict[str, list] = {f: [] for f in FILES}
        self.seqs: list[tuple[int, int, str]] = []     # (offset in the shard, tokens, row id)
        self.tokens = 0

    def add(self, batch: list, feats: torch.Tensor, hidden: torch.Tensor) -> None:
        at = 0
        for rid, toks, mask in batch:
            n = len(toks)
            self.buf["features.npy"].append(feats[at:at + n].view(torch.uint16).cpu().numpy())
            self.buf["hidden.npy"].append(hidden[at:at + n].view(torch.uint16).cpu().numpy())
            self.buf["ids.npy"].append(np.asarray(toks, dtype=np.int32))
            self.buf["loss_mask.npy"].append(np.asarray(mask, dtype=np.uint8))
            self.seqs.append((self.tokens, n, rid))
            self.tokens += n
            at += n

    def flush(self) -> None:
        if not self.seqs:
            return
        index = self.index
        name = f"shard-{len(index['shards']):05d}"
        tmp = self.out / f".{name}"
        tmp.mkdir()
        sums = {}
        for f in FILES:
            np.save(tmp / f, np.concatenate(self.buf[f]))
            sums[f] = sha256_file(tmp / f)
        os.replace(tmp, self.out / name)
        shard_no = len(index["shards"])
        index["shards"].append({"name": name, "tokens": self.tokens, "sha256": sums})
        index["sequences"].extend([shard_no, off, n, rid] for off, n, rid in self.seqs)
        _write_index(self.out, index)
        self._reset()


def build_cache(rows: list[dict], target, out_dir, layer_ids: list[int], *, shard_tokens: int = 400_000,
                batch_tokens: int = 4096, max_len: int = 1024, progress: bool = True, log=print) -> dict:
    """Run the target over every regenerated row and store features, last hidden, ids, masks."""
    model, tok = target.model, target.tokenizer
    cfg = model.config
    if any(not 0 <= l < cfg.num_layers for l in layer_ids):
        raise UsageError(f"target layers must be in [0, {cfg.num_layers - 1}], got {layer_ids}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": target.name, "feature_layers": list(layer_ids), "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "dtype": "bf16"}
    index = {**meta, "version": 1, "shards": [], "sequences": []}
    if _index_path(out).exists():
        old = json.loads(_index_path(out).read_text())
        if {k: old.get(k) for k in meta} != meta:
            raise UsageError(f"{out} holds a cache for {old.get('target')} layers {old.get('feature_layers')}; "
                             "use another folder or delete it")
        index = old
    for stale in out.glob(".shard-*"):
        shutil.rmtree(stale, ignore_errors=True)     # a shard cut off mid-write
    done = {s[3] for s in index["sequences"]}
    todo = [r for r in rows if r["id"] not in done]
    log(f"cache: {len(rows)} sequences, {len(done)} already cached, {len(todo)} to go -> {out}")
    from tqdm import tqdm
    bar = tqdm(total=len(todo), unit="seq", disable=not progress, dynamic_ncols=True)
    kv = model.new_cache(16, max_len)
    shards = _ShardWriter(out, index)
    batch: list = []            # (row id, tokens, loss mask) of the rows of the next forward

    def run_batch():
        if batch:
            feats, hidden = _target_rows(model, kv, batch, layer_ids)
            shards.add(batch, feats, hidden)
            bar.update(len(batch))
            batch.clear()

    skipped = 0
    for row in todo:
        p, a = sequence_tokens(row, tok)
        toks = (p + a)[:max_len]
        mask = ([0] * len(p) + [1] * len(a))[:max_len]
        if sum(mask) < 2:
            skipped += 1
            bar.update(1)
            continue
        if batch and (sum(len(b[1]) for b in batch) + len(toks) > batch_tokens or len(batch) == kv.num_slots):
            run_batch()
            if shards.tokens >= shard_tokens:
                shards.flush()
        batch.append((row["id"], toks, mask))
    run_batch()
    shards.flush()
    bar.close()
    total = sum(s["tokens"] for s in index["shards"])
    per_token = 2 * (len(layer_ids) + 1) * cfg.hidden_size + 4 + 1
    index["bytes_per_token"] = per_token
    _write_index(out, index)
    log(f"cache: {len(index['sequences'])} sequences, {total} tokens, {per_token} bytes per token "
        f"({per_token * total / 2**30:.2f} GiB)" + (f", {skipped} rows without an answer skipped" if skipped else ""))
    return {"sequences": len(index["sequences"]), "tokens": total, "bytes_per_token": per_token}


@dataclass
class Sequence:
    features: torch.Tensor    # [L, m*d] bf16
    hidden: torch.Tensor      # [L, d] bf16 (after the final norm)
    ids: torch.Tensor         # [L] long
    loss_mask: torch.Tensor   # [L] bool
    target_written: bool = True   # the supervised tokens were sampled from the target (CE applies)
    source: str = "regen"


class CacheReader:
    """Memory-mapped, checksum-verified access to a cache folder."""

    def __init__(self, folder, verify: bool = True):
        self.folder = Path(folder)
        path = _index_path(self.folder)
        if not path.is_file():
            raise UsageError(f"{self.folder} is not a dspark cache (no index.json); run `dspark cache`")
        try:
            self.index = json.loads(path.read_text())
        except ValueError as e:
            raise DsparkError(f"{path} is corrupt: {e}") from None
        self.feature_layers = self.index["feature_layers"]
        self.hidden_size = self.index["hidden_size"]
        self.sequences = self.index["sequences"]
        self._arrays = []
        for shard in self.index["shards"]:
            arrs = {}
            for f in FILES:
                p = self.folder / shard["name"] / f
                if not p.is_file():
                    raise DsparkError(f"cache shard file {p} is missing; rebuild with `dspark cache`")
                if verify and sha256_file(p) != shard["sha256"][f]:
                    raise DsparkError(f"cache shard file {p} fails its checksum: the cache is damaged; "
                                      "delete that shard folder and rerun `dspark cache` to rebuild it")
                try:
                    arrs[f] = np.load(p, mmap_mode="r")
                except (ValueError, OSError) as e:
                    raise DsparkError(f"cannot read cache file {p}: {e}") from None
            self._arrays.append(arrs)

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(s[2] for s in self.sequences)

    def __getitem__(self, i: int) -> Sequence:
        shard, off, n, _ = self.sequences[i]
        a = self._arrays[shard]
        sl = slice(off, off + n)
        return Sequence(torch.from_numpy(np.array(a["features.npy"][sl])).view(torch.bfloat16),
                        torch.from_numpy(np.array(a["hidden.npy"][sl])).view(torch.bfloat16),
                        torch.from_numpy(a["ids.npy"][sl].astype(np.int64)),
                        torch.from_numpy(a["loss_mask.npy"][sl].astype(bool)))


class OnlineSource:
    """The same items as a cache, computed by running the target inside training: no disk, no
    rebuild on a new machine. ``prefetch(indices)`` runs the sequences of a whole step through the
    target in one ragged batch (one forward per ``batch_tokens``), which ``__getitem__`` then hands
    out; an index not prefetched runs alone."""

    def __init__(self, rows: list, target, layer_ids: list[int], max_len: int = 1024, batch_tokens: int = 8192):
        """``rows``: regenerated rows (dicts, as ``dspark regenerate`` writes them) or corpus
        ``Row``s (training/corpus.py)."""
        self.target, self.layer_ids, self.max_len = target, list(layer_ids), max_len
        self.batch_tokens = batch_tokens
        self.items: list[tuple[list[int], list[int], bool, str]] = []
        for r in rows:
            if isinstance(r, dict):
                p, a = sequence_tokens(r, target.tokenizer)
                toks, mask = (p + a)[:max_len], ([0] * len(p) + [1] * len(a))[:max_len]
                written, src = True, "regen"
            else:
                toks = list(r.ids)[:max_len]
                mask = ([0] * r.start + [1] * (len(r.ids) - r.start))[:max_len]
                written, src = r.target_written, r.group
            if sum(mask) >= 2:
                self.items.append((toks, mask, written, src))
        self.feature_layers = self.layer_ids
        self.hidden_size = target.model.config.hidden_size
        self._kv: KVCache | None = None
        self._ready: dict[int, Sequence] = {}

    def __len__(self) -> int:
        return len(self.items)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t, *_ in self.items)

    def token_rows(self):
        """(ids, loss_mask) of every sequence, without running the target."""
        for toks, mask, *_ in self.items:
            yield torch.tensor(toks), torch.tensor(mask, dtype=torch.bool)

    def prefetch(self, indices) -> None:
        self._ready.clear()
        group: list[int] = []
        for i in indices:
            if group and sum(len(self.items[j][0]) for j in group) + len(self.items[i][0]) > self.batch_tokens:
                self._run(group)
                group = []
            group.append(i)
        self._run(group)

    @torch.inference_mode()
    def _run(self, group: list[int]) -> None:
        if not group:
            return
        model = self.target.model
        if self._kv is None or self._kv.num_slots < len(group):
            self._kv = model.new_cache(max(len(group), 8), self.max_len)
        segs, ids = [], []
        for i in group:
            toks = self.items[i][0]
            segs.append((self._kv.allocate(), len(toks)))
            ids.extend(toks)
        try:
            o = model(torch.tensor(ids), segs, self._kv, feature_layers=tuple(self.layer_ids), logits_rows=None)
        finally:
            for slot, _ in segs:
                self._kv.free(slot)
        feats = torch.cat(o.features, -1).to(torch.bfloat16)
        hidden = o.last_hidden.to(torch.bfloat16)
        at = 0
        for i, (_, n) in zip(group, segs):
            toks, mask, written, src = self.items[i]
            self._ready[i] = Sequence(feats[at:at + n].clone(), hidden[at:at + n].clone(), torch.tensor(toks),
                                      torch.tensor(mask, dtype=torch.bool), written, src)
            at += n

    def __getitem__(self, i: int) -> Sequence:
        if i not in self._ready:
            self._run([i])
        return self._ready.pop(i)
