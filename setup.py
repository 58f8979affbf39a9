"""Everything else is in pyproject.toml; this file only declares the one C extension (the MinHash kernels)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("smolctl.data._minhash", ["smolctl/data/_minhash.c"], extra_compile_args=["-O3", "-std=c11"])])
