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


def _modules() -> list[str]:
    import pkgutil

    import megaegg
    import megaegg.interpreter
    import megaegg.lowering
    import megaegg.rewrite

    names = {"megaegg"}
    for pkg in (megaegg, megaegg.rewrite, megaegg.lowering, megaegg.interpreter):
        names |= {m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")}
    return sorted(n for n in names if not n.endswith("__main__"))


@pytest.mark.parametrize("module", _modules())
def test_module_doctests_run(module):
    """Every docstring example in the package runs as written."""
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
