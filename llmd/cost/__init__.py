"""What serving costs: engine uptime recorded by the node (uptime.py), GPU-hours split over
versions and time buckets (split.py), joined with the ledger's tokens (report.py). docs/cost.md."""
