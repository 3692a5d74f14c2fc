"""Service configuration: one TOML file, validated in full at start-up.

Every mistake is reported with the file and the dotted key it concerns, so an operator
never has to guess which line of a long config is wrong. `parts.py` holds the sections
(`engines.py` a model's engine ones), `root.py` the whole file and its loading.
"""

from llmd.config.cluster import ClusterConfig, WarmPoolConfig
from llmd.config.engines import EngineConfig, FakeEngineConfig
from llmd.config.parts import (
    DEFAULT_CONFIG_ENV,
    KEY_HASH,
    PII_KINDS,
    AuthConfig,
    BatchConfig,
    ConfigError,
    DegradationConfig,
    FilteringConfig,
    FilterSpec,
    ModelConfig,
    PIIKind,
    PricingConfig,
    PriorityClass,
    SchedulingConfig,
    ServerConfig,
    TenantConfig,
    TLSConfig,
)
from llmd.config.root import Config, load_config
from llmd.config.slo import SLO, SLOConfig, slo_for

__all__ = [
    "DEFAULT_CONFIG_ENV", "KEY_HASH", "PII_KINDS", "SLO", "AuthConfig", "BatchConfig", "ClusterConfig", "Config",
    "ConfigError",
    "DegradationConfig", "EngineConfig", "FakeEngineConfig", "FilterSpec", "FilteringConfig", "ModelConfig",
    "PIIKind", "PricingConfig", "PriorityClass", "SLOConfig", "SchedulingConfig", "ServerConfig", "TLSConfig",
    "TenantConfig", "WarmPoolConfig", "load_config", "slo_for",
]
