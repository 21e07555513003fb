"""Where the real test data lives: $HOPPERLM_DATA_DIR, else ../shared/data beside the repository."""

import os
from pathlib import Path

DATA_DIR = Path(os.environ.get("HOPPERLM_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))
