"""The Batch API tier: OpenAI-compatible files and batches, run in the `batch` class.

Read in order: `lines.py` (what an input line may be, what an output line is),
`store.py` (files on disk, batch and item state in SQLite), `runner.py` (a batch's life,
validating to completed, through the same admission, queue, scheduler, filters and
metering as interactive traffic), `http.py` (the routes).
"""
