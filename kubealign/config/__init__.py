"""Configuration: typed sections (schema) and the YAML loader with --set overrides (load)."""

from kubealign.config.load import (
    config_from_json,
    config_to_json,
    config_to_yaml,
    flatten,
    load_config,
    preset_names,
    section_sha256,
)
from kubealign.config.schema import DataConfig, DataSource, KubealignConfig

__all__ = [
    "DataConfig",
    "DataSource",
    "KubealignConfig",
    "config_from_json",
    "config_to_json",
    "config_to_yaml",
    "flatten",
    "load_config",
    "preset_names",
    "section_sha256",
]
