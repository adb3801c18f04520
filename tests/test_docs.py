"""The runnable examples in docs/ and README.md run as written.

Every ```python block of a page runs, each in a namespace of its own, in this process; the blocks
that start with the same ``# process: NAME`` line run together instead, in order, as one script
in a Python process of their own (an example that registers a block op: docs/pipeline.md, "Adding
a block op"; nothing it registers outlives it)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OWN_PROCESS = re.compile(r"# process: (\S+)\n")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path):
    scripts: dict[str, list[str]] = {}
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
        own = OWN_PROCESS.match(block)
        if own:
            scripts.setdefault(own.group(1), []).append(block)
            continue
        exec(compile(block, str(page), "exec"), {})
    for name, blocks in scripts.items():
        script = tmp_path / f"{page.stem}_{name}.py"
        script.write_text("\n".join(blocks))
        run = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"{page.name}, blocks '# process: {name}':\n{run.stdout[-2000:]}{run.stderr[-4000:]}"


def _modules() -> list[str]:
    import pkgutil

    import megaegg
    import megaegg.interpreter
    import megaegg.lowering
    import megaegg.rewrite

    names = {"megaegg", "megaegg.rewrite", "megaegg.lowering", "megaegg.interpreter"}  # (the stages' front doors)
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
