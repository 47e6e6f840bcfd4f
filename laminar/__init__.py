"""laminar: asynchronous RL post-training of LLMs on Dask (components; see README)."""

from laminar.config import RunConfig, load_config
from laminar.errors import ConfigError, DataError, LaminarError, ModelError, RewardError

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "DataError",
    "LaminarError",
    "ModelError",
    "RewardError",
    "RunConfig",
    "load_config",
]
