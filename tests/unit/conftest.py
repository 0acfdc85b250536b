"""Every test under tests/unit is in the fast tier (`make test-fast`, run first by `make test`):
the marker comes from the folder, so a new file cannot leave the tier by forgetting it."""

from pathlib import Path

import pytest

UNIT_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if UNIT_DIR in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.unit)
