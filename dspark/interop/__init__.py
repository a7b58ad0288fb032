"""Drafters in the checkpoint layouts the serving engines load (DeepSpec, DFlash / SpecForge,
speculators): ``export`` writes one from a drafter of ours. Reading one back into our drafter
class, so that `--drafter DIR` serves it, is the drafters' own (drafters/foreign.py); what both
sides share, the tensor names, the architecture names and the target-layer convention, is in
drafters/layouts.py. See docs/interop.md."""

from ..drafters.layouts import FORMATS

__all__ = ["FORMATS"]
