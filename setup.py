"""Package discovery for setuptools (the rest of the metadata is in pyproject.toml).

The repository root is the ``tessera`` package (``package-dir``), so its layer folders import
as ``tessera.spec``, ``tessera.compiler`` and ``tessera.runtime``. Sub-packages are found
here rather than listed by hand, so moving or adding a folder can never drop a package from
the wheel; data-only folders (spec/stdlib) are namespace packages."""

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

LAYERS = ("spec", "compiler", "runtime", "models")


class BuildPy(build_py):
    """Leave this file out of the wheel: the root folder is the package, but setup.py is not part of it."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("tessera", "setup")]


setup(
    packages=["tessera"] + [f"tessera.{p}" for p in find_namespace_packages(
        ".", include=[*LAYERS, *(f"{layer}.*" for layer in LAYERS)], exclude=["*.__pycache__"])],
    cmdclass={"build_py": BuildPy},
)
