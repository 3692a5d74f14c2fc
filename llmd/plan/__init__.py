"""`llmd plan`: capacity planning from first principles.

`llmd plan math` derives a fleet's size and cost from a model's config.json, a GPU table and a
workload, printing every number with the formula that gives it. Pure Python: no engine, no HTTP.
"""
