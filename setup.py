"""The compiled part of the package: the prefix cache's page pools (twin/sim/_pages.c).

Everything else is in pyproject.toml.  Building needs a C compiler and the Python headers; when
either is missing the build stops with one line saying so.
"""
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:                   # compiler missing, headers missing, compile error
            sys.exit(f"dspark-twin: cannot build {ext.sources[0]} ({type(e).__name__}: {e}); it needs a C "
                     "compiler (gcc or clang) and the Python headers (e.g. apt-get install gcc python3-dev)")


setup(ext_modules=[Extension("twin.sim._pages", ["twin/sim/_pages.c"])],
      cmdclass={"build_ext": BuildExt})
