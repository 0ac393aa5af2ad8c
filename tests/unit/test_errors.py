"""The two error trees: every exception the runtime defines is a RuntimeFailure, every one
the operator defines an OperatorError; each is drawn in its errors module's docstring, and
no name is taken twice across the project."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

import distbelief.operator
import distbelief.runtime
from distbelief.operator import errors as operator_errors
from distbelief.runtime import errors as runtime_errors


def _modules(package: ModuleType) -> list[ModuleType]:
    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + ".")]


def _defined(package: ModuleType) -> dict[str, type[BaseException]]:
    """Every exception class defined in the package's modules, by qualified name."""
    found = {}
    for module in _modules(package):
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return found


RUNTIME = _defined(distbelief.runtime)
OPERATOR = _defined(distbelief.operator)


@pytest.mark.parametrize("defined, root", [(RUNTIME, runtime_errors.RuntimeFailure),
                                           (OPERATOR, operator_errors.OperatorError)], ids=["runtime", "operator"])
def test_every_exception_is_under_its_halfs_root(defined: dict[str, type], root: type) -> None:
    # a YAML parser's own subclass stays a parser error: the loader translates it into SpecError
    outside = [name for name, cls in defined.items() if not issubclass(cls, root) and not name.endswith("._DuplicateKey")]
    assert not outside, f"not under {root.__name__}: {outside}"


def test_no_exception_name_is_taken_twice() -> None:
    names = [name.rpartition(".")[2] for name in (*RUNTIME, *OPERATOR)]
    assert sorted(names) == sorted(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("module", [runtime_errors, operator_errors], ids=["runtime", "operator"])
def test_the_tree_in_the_docstring_names_every_error_of_the_module(module: ModuleType) -> None:
    classes = [name for name, value in vars(module).items()
               if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__]
    drawn = module.__doc__ or ""
    assert [name for name in classes if f" {name} " not in drawn.replace("\n", " ")] == []


def test_a_spec_error_is_still_a_value_error_with_one_line_per_problem() -> None:
    error = operator_errors.SpecError(["a: one", "b: two"])
    assert isinstance(error, ValueError) and str(error) == "a: one\nb: two" and error.errors == ["a: one", "b: two"]
