"""A package's docstring lists its modules, and the list stays true: ``dpkit/__init__.py``'s layer list names
every module and subpackage of ``dpkit/`` (``dpkit.name`` at the start of an indented line), and each
subpackage's ``__init__.py`` names every module file beside it as ``name``; nothing either names is missing
from the folder. Other code in those docstrings is written so that it cannot be read as a module name: with a
dot (``ddp_cifar100.py``, ``dpkit.comm``) or parentheses (``no_sync()``)."""

import ast
import re

import pytest

from common import REPO

PACKAGE = REPO / "dpkit"
SUBPACKAGES = sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))
MODULE_NAME = re.compile(r"``([A-Za-z_]\w*)``")  # ``measure``; not ``results.read_results`` nor ``no_sync()``
LAYER_LINE = re.compile(r"^\s+dpkit\.(\w+)\s", re.MULTILINE)  # "    dpkit.comm      process groups, ..."


def docstring(folder) -> str:
    return ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""


def modules_in(folder) -> set[str]:
    return {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}


def mismatch(named: set[str], on_disk: set[str]) -> dict[str, list[str]]:
    return {key: sorted(names) for key, names in (("not named", on_disk - named), ("not on disk", named - on_disk))
            if names}


def test_the_package_docstring_names_every_layer_on_disk():
    on_disk = modules_in(PACKAGE) | {p.name for p in SUBPACKAGES}
    assert mismatch(set(LAYER_LINE.findall(docstring(PACKAGE))), on_disk) == {}, "dpkit/__init__.py's layer list"


@pytest.mark.parametrize("folder", SUBPACKAGES, ids=lambda p: p.name)
def test_a_subpackage_docstring_names_every_module_beside_it(folder):
    named = set(MODULE_NAME.findall(docstring(folder)))
    assert mismatch(named, modules_in(folder)) == {}, f"dpkit/{folder.name}/__init__.py's docstring"


def test_the_rules_read_names_as_they_are_written_and_see_both_kinds_of_mismatch():
    text = '"""``data`` and ``step`` (``no_sync()``), as ``ddp_cifar100.py`` assembles them (``dpkit.comm``)"""'
    assert set(MODULE_NAME.findall(text)) == {"data", "step"}
    layers = "The layers:\n\n    dpkit.compat    torch\n    dpkit.comm      transports\n\n    from dpkit.comm import t"
    assert LAYER_LINE.findall(layers) == ["compat", "comm"]
    assert mismatch({"data", "gone"}, {"data", "new"}) == {"not named": ["new"], "not on disk": ["gone"]}
    assert SUBPACKAGES and all(modules_in(folder) for folder in SUBPACKAGES), "the folders hold modules"
