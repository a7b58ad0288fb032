"""Scheduling policies: how many of its drafted tokens each request verifies this step.

base.py: the interface, the step outcome the engine reports, per-request state; policies.py: the
policies by name (plain, mtp1, fixed, threshold, ema; prefix.py and asynchronous.py for the
load-aware ones, on load_aware.py); algorithm1.py: Algorithm 1; profile.py: the acceptance a
policy expects of a draft; costs.py: the cost table and the cost model that prices steps.
"""

from .base import Policy, RequestOutcome, StepOutcome
from .policies import FixedPolicy, MTP1Policy, PlainPolicy, make_policy

__all__ = ["Policy", "PlainPolicy", "FixedPolicy", "MTP1Policy", "make_policy", "RequestOutcome", "StepOutcome"]
