"""Errors a user can fix. The CLI prints them as one line and exits with code 2 (no traceback unless --debug)."""


class HopperError(Exception):
    """Base class: the message names the field or file at fault and the fix."""


class ConfigError(HopperError):
    """A config value, override or preset is unknown, mistyped or impossible."""


class DataError(HopperError):
    """A data file, token shard, manifest or tokenizer is missing, corrupt or does not match."""


class CheckpointError(HopperError):
    """A checkpoint is missing, incomplete or does not match the model."""


class FolderBusy(HopperError):
    """Another hopperlm process is writing the folder (it holds the folder's lock: folder_lock.py)."""


def last_line(output: str) -> str:
    """A process's output as one line for a message: its last non-empty line, stripped (a traceback's ends in
    the error itself); "" where it printed nothing."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def first_line(error: BaseException, *, type_name: bool = True) -> str:
    """An exception as one line for a log or a message: `RuntimeError: <first non-empty line of its text>`, or
    the type name alone when the text is empty (enough to tell a missing kernel from a bug; DCP's and CUDA's
    messages run to many lines). With `type_name=False`, the first line alone (the type name when empty)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0]}" if type_name else lines[0]
