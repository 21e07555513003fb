"""safetensors files with the process's usual permissions: the one checkpoint-specific piece of writing a
folder whole (staged folders, fsync and the rest live in hopperlm/files.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hopperlm.files import usual_permissions

if TYPE_CHECKING:
    import torch


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """safetensors.torch.save_file with the process's usual file permissions (see files.usual_permissions)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    usual_permissions(Path(path))
