"""The package list, computed: every package under autopar/, passes/ and runtime/ is installed,
so a new subpackage cannot be forgotten (tests/test_packaging.py builds a wheel and checks).
passes/ and runtime/ install as autopar.passes and autopar.runtime; the rest of the metadata is
in pyproject.toml."""

from setuptools import find_namespace_packages, setup

#: Import name -> directory in the repository.
ROOTS = {"autopar": "autopar", "autopar.passes": "passes", "autopar.runtime": "runtime"}


def packages() -> list[str]:
    out = []
    for name, path in ROOTS.items():
        out.append(name)
        # namespace packages too: data folders (autopar/data) are packages for setuptools
        out += [f"{name}.{sub}" for sub in find_namespace_packages(path, exclude=["*__pycache__*"])]
    return sorted(out)


setup(package_dir=ROOTS, packages=packages())
