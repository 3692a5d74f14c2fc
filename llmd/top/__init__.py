"""`llmd top`: a live terminal view of a node for people on a headless box. fetch.py polls the
node's HTTP views, frame.py turns two polls into the numbers (pure), render.py draws them."""
