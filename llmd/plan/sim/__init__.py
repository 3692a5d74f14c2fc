"""`llmd plan sim`: a discrete-event simulation of a fleet of llmd replicas serving a workload.

Virtual time, llmd's own policy modules (llmd/policy/) in the loop with a virtual clock, each
replica's engine advanced by a step-time model (llmd/stepmodel.py).
"""
