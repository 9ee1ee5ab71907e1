"""The YAML presets, shipped as package data (kubealign.configs) so an installed kubealign finds them
by name (`--config tiny-cpu`) wherever it runs."""
