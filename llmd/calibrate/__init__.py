"""`llmd plan calibrate`: the engine measured over a grid of steps, and the step-time model fitted to it."""
