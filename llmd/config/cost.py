"""`[cost]`: what each model's hardware costs, so llmd can say what serving costs (GPU-hours x
price, split over the tokens served), beside what tenants are billed (`[models.pricing]`).

```toml
[cost]
currency = "USD"
[cost.models.smollm2]
gpu_hour_price = 2.5   # currency per GPU-hour
gpus = 1               # GPUs this model holds on a node (a fraction for a shared or MIG slice)
```

Prices are applied when a report is made, to the engine uptime the node recorded, so a changed
price applies to the whole window reported (docs/cost.md)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from llmd.config.parts import _Strict


class ModelCost(_Strict):
    """One model's hardware on one node."""

    gpu_hour_price: Annotated[float, Field(ge=0)]
    gpus: Annotated[float, Field(gt=0)] = 1.0


class CostConfig(_Strict):
    currency: Annotated[str, Field(min_length=1, max_length=16)] = "USD"
    # How often the node records which engines are loaded: the resolution of the GPU-hours
    # (an engine's start and a crash each cost at most this much of its uptime).
    sample_s: Annotated[float, Field(gt=0, le=300)] = 10.0
    models: dict[str, ModelCost] = Field(default_factory=dict)

    def unknown(self, names: set[str]) -> str | None:
        """Why this section does not fit the configured models, or None."""
        extra = sorted(set(self.models) - names)
        return f"cost.models.{extra[0]}: {extra[0]!r} is not a configured model" if extra else None
