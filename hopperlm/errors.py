"""Errors a user can fix. The CLI prints them as one line and exits with code 2 (no traceback unless --debug)."""


class HopperError(Exception):
    """Base class: the message names the field or file at fault and the fix."""


class ConfigError(HopperError):
    """A config value, override or preset is unknown, mistyped or impossible."""


class DataError(HopperError):
    """A data file, token shard, manifest or tokenizer is missing, corrupt or does not match."""


class CheckpointError(HopperError):
    """A checkpoint is missing, incomplete or does not match the model."""
