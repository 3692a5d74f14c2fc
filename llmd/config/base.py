"""What every section of `config.toml` shares: strictness (an unknown key is an error)."""

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
