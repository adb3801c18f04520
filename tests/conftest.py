import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # shared helpers: op_cases, test_reference


@pytest.fixture(autouse=True, scope="session")
def _fresh_artifact_cache(tmp_path_factory):
    """Compiles in the tests go to a cache of their own: a stale home cache can't hide a rewrite bug."""
    os.environ["MEGAEGG_CACHE"] = str(tmp_path_factory.mktemp("megaegg-cache"))


def pytest_addoption(parser):
    parser.addoption("--update-snapshots", action="store_true", help="rewrite tests/snapshots from the current compiler")
