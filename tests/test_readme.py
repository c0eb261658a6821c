"""The code examples of the README and of the user guide run as written.

Every ```python block runs, offline, each in a fresh namespace. A block that needs the network
(the hub) is fenced ```py instead, and says so in its first line; it is not run here."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/guide.md"]


def python_blocks(page: str) -> list[tuple[int, str]]:
    """Each ```python block of the page, with the line its code starts on."""
    text = (ROOT / page).read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


@pytest.mark.parametrize("page", PAGES)
def test_python_examples_run(page):
    blocks = python_blocks(page)
    assert blocks, f"{page} has no python example"
    for line, block in blocks:
        # Pad with blank lines so that a traceback names the page's own line numbers.
        exec(compile("\n" * (line - 1) + block, str(ROOT / page), "exec"), {})


def test_network_blocks_are_marked():
    """A ```py block is not run, so its first line must say that it needs the network."""
    for page in PAGES:
        text = (ROOT / page).read_text()
        for block in re.findall(r"```py\n(.*?)```", text, re.S):
            assert block.startswith("# fetches"), f"{page}: a py block that does not say it needs the network"
