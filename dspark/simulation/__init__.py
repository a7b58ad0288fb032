"""``dspark simulate``: a serving deployment predicted step by step, the engine's own policies
deciding on simulated drafts and priced steps.

costs.py: what a step costs (`dspark profile`'s table, or a roofline of a described accelerator);
acceptance.py: what a drafter's proposals look like (confidences, accepted tokens), from `dspark
eval` or a description; simulator.py: the engine's step loop over simulated requests, closed and
open loops; run.py: sweeps, the SLA point, the Pareto plot, the command; validate.py: the
simulation against `dspark bench concurrency` on this machine.
"""
