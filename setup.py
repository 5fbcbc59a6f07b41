"""Build hook for the optional C core (fast/_core.c); every other setting is in pyproject.toml.

``optional=True``: where no C compiler is available the build of the extension fails quietly
and the package installs without it; ``uniradix.fast`` then runs its pure-Python code
(``uniradix.fast.cache.NATIVE`` is False)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("uniradix.fast._core", ["fast/_core.c"], optional=True)])
