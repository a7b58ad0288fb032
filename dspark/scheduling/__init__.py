"""Scheduling policies: how many of its drafted tokens each request verifies this step."""

from .policies import FixedPolicy, MTP1Policy, PlainPolicy, Policy, make_policy

__all__ = ["Policy", "PlainPolicy", "FixedPolicy", "MTP1Policy", "make_policy"]
