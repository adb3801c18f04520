"""The runnable examples in docs/ and README.md run as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page):
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
        exec(compile(block, str(page), "exec"), {})
