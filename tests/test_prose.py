"""The kit's prose teaches and does not go stale: module docstrings fit on one screen, and no docstring or
comment of the kit's modules quotes a measured ratio, a time or a commit id (numbers live in results/ and
in commit messages). A target is a specification, not a measurement: "<= 1.10x" may stay."""

import ast
import io
import re
import tokenize

import pytest

from common import REPO

MODULES = sorted([*REPO.glob("*.py"), *(REPO / "dpkit").rglob("*.py")])
SCREEN = 26  # lines of a module docstring, its quotes included: about one screen

RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?!\w)")  # 0.89x, 3x
TIME = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ns|us|µs|ms|s|sec|seconds|min|minutes)(?!\w)")  # 12 ms, 2.4 s
COMMIT = re.compile(r"(?<![\w/])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w/])")  # 8bfd0cc
TARGET = re.compile(r"(?:<=|>=|<|>|at most|at least|under|within)\s*$")  # what precedes a target's number


def prose(path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a module."""
    source = path.read_text()
    lines = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                lines += [(node.body[0].lineno + i, text) for i, text in enumerate(doc.splitlines())]
    return lines


def measured_numbers(text: str) -> list[str]:
    """The ratio, time and commit-id literals of ``text`` that are not targets."""
    found = []
    for pattern in (RATIO, TIME, COMMIT):
        found += [m.group() for m in pattern.finditer(text) if not TARGET.search(text[:m.start()])]
    return found


def test_the_detector_finds_measurements_and_leaves_targets_and_names_alone():
    assert measured_numbers("ring/torch went from 1.2x to about 1.05x here") == ["1.2x", "1.05x"]
    assert measured_numbers("p50 63 ms per iteration (at 8bfd0cc), 7.7 ms with this") == ["63 ms", "7.7 ms", "8bfd0cc"]
    assert measured_numbers("about 2 s of CPU per process") == ["2 s"]
    assert measured_numbers("target: auto <= 1.10x torch, at most 0.45x at 10 MB") == []
    assert measured_numbers("resnet18, float32, bfloat16, 2x2 conv, f(x), 25M buckets, 1e4, seed 000") == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_module_docstring_fits_on_one_screen(path):
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    assert doc, f"{path.name} opens with no docstring: say what it is and the command that runs it"
    assert len(doc.splitlines()) <= SCREEN, (
        f"{path.name}'s docstring has {len(doc.splitlines())} lines: keep the contract and the command here "
        f"(at most {SCREEN} lines) and move the reasoning to the code it explains")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_docstring_or_comment_quotes_a_measured_number(path):
    stale = [f"{path.name}:{line}: {numbers}: {text.strip()}" for line, text in prose(path)
             if (numbers := measured_numbers(text))]
    assert not stale, ("measured numbers go stale in code: keep them in results/ (or a commit message) and say "
                       "what is measured and where:\n" + "\n".join(stale))
