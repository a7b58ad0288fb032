"""Graphs built beside serving (dspark/compiling.py): nothing is used until every graph is built,
then all at once; a failed build leaves the eager forwards serving. And the KV cache's lazily
committed zeros (runtime/kv_cache.py)."""

import threading

import torch

from dspark.compiling import GraphBuilder, trained_part
from dspark.runtime.kv_cache import KVCache


class _Part:
    def __init__(self, name, gate=None, fail=False, disabled=None):
        self.name, self.gate, self.fail, self.disabled = name, gate, fail, disabled
        self.used = None

    def build_graphs(self):
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail:
            raise RuntimeError("no compiler")
        graphs = type("G", (), {"disabled": self.disabled})()
        return graphs, f"built {self.name}"

    def use_graphs(self, graphs):
        self.used = graphs


class _Hybrid:      # a lookup beside a trained drafter (drafters/hybrid.py)
    def __init__(self, model):
        self.model = model


def test_graphs_are_used_only_once_all_are_built():
    gate = threading.Event()
    target, drafter = _Part("target"), _Part("drafter", gate)
    lines = []
    b = GraphBuilder(target, _Hybrid(drafter), say=lines.append).start()
    b.thread.join(0.2)
    assert b.state == "building" and target.used is None and drafter.used is None   # the target's alone: not yet
    gate.set()
    b.thread.join(5)
    assert b.state == "compiled" and target.used is not None and drafter.used is not None
    assert lines[:2] == ["built target", "built drafter"] and "in use" in lines[-1]


def test_the_build_gives_way_to_the_engine_and_restores_the_lock_interval():
    """The build's thread runs at the lowest priority (raising one's own nice is always allowed)
    and hands Python's lock over more often while it builds; the interval is restored after."""
    import os
    import sys
    seen = {}

    class Probe(_Part):
        def build_graphs(self):
            seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            seen["switch"] = sys.getswitchinterval()
            return super().build_graphs()
    before = sys.getswitchinterval()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    b = GraphBuilder(Probe("target"), None, say=lambda line: None).start()
    b.thread.join(5)
    assert b.state == "compiled" and seen["nice"] == 19 and seen["switch"] < before
    assert sys.getswitchinterval() == before
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine     # only the build's thread


def test_a_failed_build_leaves_the_eager_forwards():
    target, drafter = _Part("target"), _Part("drafter", fail=True)
    lines = []
    b = GraphBuilder(target, drafter, say=lines.append).start()
    b.thread.join(5)
    assert b.state == "eager" and target.used is None and drafter.used is None
    assert "compiling failed" in lines[-1]
    off = _Part("target", disabled="a model it does not take")
    b = GraphBuilder(off, None, say=lines.append).start()
    b.thread.join(5)
    assert b.state == "eager" and off.used is None
    assert trained_part(object()) is None


def test_cache_zeros_are_aligned_views_committed_only_where_written():
    cache = KVCache(3, 2, 4, num_slots=5, max_len=40, dtype=torch.float32, device="cpu")
    assert all(t.data_ptr() % 64 == 0 for t in cache.k + cache.v)
    assert all(t.shape == (5, 2, 48, 4) and t.is_contiguous() and not t.any() for t in cache.k + cache.v)
    cache.k[1][2, 0, 3] = 1.0               # the layers are separate views: one write stays in its own
    assert int(sum(t.count_nonzero() for t in cache.k + cache.v)) == 4
    with torch.inference_mode():            # made in inference mode, still plain tensors
        made = KVCache(1, 1, 2, num_slots=1, max_len=8, dtype=torch.float32)
    assert not made.k[0].is_inference()
