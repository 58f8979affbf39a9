"""Everything else is in pyproject.toml; this file only declares the one C extension (the MinHash kernels).

The kernels are built against the stable ABI of Python 3.11 (abi3), so one wheel per platform serves every CPython
from 3.11 on. The extension is optional: where no C compiler is found the install still succeeds, and
smolctl/data/minhash_fallback.py computes the same hashes in numpy (slower, with a warning).
"""

from setuptools import Extension, setup

STABLE_ABI = 0x030B0000  # Python 3.11: the first whose limited API has Py_buffer, which the kernels take

minhash_kernels = Extension(
    "smolctl.data._minhash",
    ["smolctl/data/_minhash.c"],
    extra_compile_args=["-O3", "-std=c11"],
    define_macros=[("Py_LIMITED_API", hex(STABLE_ABI))],
    py_limited_api=True,
    optional=True,
)

setup(ext_modules=[minhash_kernels], options={"bdist_wheel": {"py_limited_api": "cp311"}})
