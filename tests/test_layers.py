"""The package's layers: what the scripts import lives in ``dpkit``, whose subpackages import only the layers
below them (comm, then the engines and the models, then measurement, then training, then the report), never a
script at the root; and no module, test or script reaches another module's private names, nor a script the
private attributes of another module's objects."""

import ast

import pytest

from common import REPO

LAYERS = {"dpkit.compat": 0, "dpkit.native": 0, "dpkit.comm": 1, "dpkit.engines": 2, "dpkit.models": 2,
          "dpkit.bench": 3, "dpkit.train": 4, "dpkit.report": 5}
PACKAGE = sorted((REPO / "dpkit").rglob("*.py"))
EVERY_MODULE = sorted([*REPO.glob("*.py"), *(REPO / "tests").glob("*.py"), *PACKAGE])


def module_name(path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def layer(name: str) -> int | None:
    return next((rank for prefix, rank in LAYERS.items() if name == prefix or name.startswith(prefix + ".")), None)


def imported(path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, functions' own imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if layer(f"{node.module}.{alias.name}") is not None]
    return found


def test_the_layer_table_covers_every_module_of_the_package():
    assert all(layer(module_name(p)) is not None for p in PACKAGE
               if p.name != "__init__.py" or p.parent.name != "dpkit")


@pytest.mark.parametrize("path", PACKAGE, ids=module_name)
def test_a_package_module_imports_only_its_own_layer_and_the_ones_below(path):
    mine = layer(module_name(path))
    wrong = []
    for line, name in imported(path):
        theirs = layer(name)
        top = name.split(".")[0]
        if theirs is not None and mine is not None and theirs > mine:
            wrong.append(f"line {line}: {name} (layer {theirs}) from layer {mine}")
        elif theirs is None and (REPO / f"{top}.py").exists():
            wrong.append(f"line {line}: {name}, a script at the root: the package must not depend on one")
    assert not wrong, f"{module_name(path)} imports up the layers:\n" + "\n".join(wrong)


def private_uses(path) -> list[str]:
    """``module._name`` and ``from module import _name`` for modules of this repository imported here."""
    tree = ast.parse(path.read_text())
    ours = {p.stem for p in REPO.glob("*.py")} | {"dpkit"}
    aliases, uses = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ours:
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in ours:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    uses.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                elif layer(f"{node.module}.{alias.name}") is not None or node.module == "dpkit":
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            uses.append(f"line {node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return uses


@pytest.mark.parametrize("path", EVERY_MODULE, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_reaches_another_modules_private_names(path):
    uses = private_uses(path)
    assert not uses, (f"{path.relative_to(REPO)} uses private names of other modules: make what it needs public "
                      "(a name without the underscore, with a docstring) or keep it inside its module:\n"
                      + "\n".join(uses))


# Private attributes of objects that are not ours, which a script may read because their owner offers no public
# way; each with the reason. Anything else ``x._name`` in a script must be the script's own.
THIRD_PARTY_PRIVATES = {
    "_get_zeros_like_grad_buckets": "PyTorch's DDP Reducer: tensors of its buckets' sizes, for memory accounting",
    "_actions": "argparse: a parser's subcommand parsers have no public accessor",
}
SCRIPTS = sorted(REPO.glob("*.py"))


def defined_here(tree) -> set[str]:
    """Every name the file defines: functions, classes, methods, class attributes, ``self.x``/``cls.x`` targets."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
              and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return names


def private_attributes(path) -> list[str]:
    """``x._name`` (read or assigned) in a script where ``x`` is not ``self``/``cls`` and the script does not define
    ``_name`` itself: another module's object reached through its private attribute (an engine's ``_flats``,
    a loaded module's ``_sum_across``). Cheap and syntactic: no types are inferred, so a script's own private
    name on any object passes, and a third-party private must be listed in THIRD_PARTY_PRIVATES."""
    tree = ast.parse(path.read_text())
    own = defined_here(tree) | set(THIRD_PARTY_PRIVATES)
    return [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) and node.attr not in own]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_script_reaches_the_private_attributes_of_another_modules_objects(path):
    uses = private_attributes(path)
    assert not uses, (f"{path.name} reads or sets private attributes of objects it did not define: give their class a "
                      "public read-only property or method (an engine's buckets, a module's seam):\n" + "\n".join(uses))


def test_the_private_attribute_rule_sees_what_it_is_for(tmp_path):
    """It flags an engine's private buffer and a loaded module's private function, and passes a script's own."""
    script = tmp_path / "script.py"
    script.write_text("class Mine:\n    def __init__(self):\n        self._own = 1\n\n"
                      "def f(model, module, mine, parser):\n"
                      "    module._sum_across = print\n    parser._actions\n    mine._own\n"
                      "    return len(model._flats)\n")
    assert private_attributes(script) == ["line 6: module._sum_across", "line 9: model._flats"]


def test_pyproject_installs_every_subpackage_and_the_homework_modules_the_package_does_not_hold():
    import tomllib

    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {module_name(p.parent) for p in (REPO / "dpkit").rglob("__init__.py")}
    assert set(setup["packages"]) == on_disk, "pyproject.toml's packages must be every directory of dpkit/"
    assert set(setup["py-modules"]) == {"syncbn", "allreduce"}, "the homework modules another project imports"


def _homework_modules() -> set[str]:
    import tomllib

    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["py-modules"])


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_script_imports_another_script(path):
    """A script is a command line over the package: what two scripts share lives in dpkit. The homework's modules
    (pyproject's py-modules, installed beside the package) are the only root files a script may import."""
    scripts = {p.stem for p in SCRIPTS} - _homework_modules()
    imports = [(line, name) for line, name in imported(path) if name.split(".")[0] in scripts]
    assert not imports, f"{path.name} imports another script: move what they share into dpkit ({imports})"


def test_readmes_script_table_lists_every_script_at_the_root():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| script | what it does |"):]
    table = table[:table.index("\n\n")]
    listed = {line.split("`")[1] for line in table.splitlines()[2:]}
    assert {p.name for p in SCRIPTS} <= listed, f"README's table lacks {sorted({p.name for p in SCRIPTS} - listed)}"
