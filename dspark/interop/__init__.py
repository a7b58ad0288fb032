"""Drafters in the checkpoint layouts the serving engines load (DeepSpec, DFlash / SpecForge,
speculators): ``export`` writes one from a drafter of ours, ``foreign`` reads one back into our
drafter class so that the engine serves it. ``layouts`` holds what both sides share: the tensor
names, the architecture names and the target-layer convention. See docs/interop.md."""

from .layouts import FORMATS

__all__ = ["FORMATS"]
