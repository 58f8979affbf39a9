"""Everything else is in pyproject.toml; this file only declares the C extensions (the MinHash and packing kernels).

The kernels are built against the stable ABI of Python 3.11 (abi3), so one wheel per platform serves every CPython
from 3.11 on. The extensions are optional: where no C compiler is found the install still succeeds,
smolctl/data/minhash_fallback.py computes the same hashes in numpy (slower, with a warning) and
smolctl/data/pack_rows.py packs the same rows in Python and numpy (a slower end of each pack).
"""

from setuptools import Extension, setup

STABLE_ABI = 0x030B0000  # Python 3.11: the first whose limited API has Py_buffer, which the kernels take


def kernels(name: str) -> Extension:
    """smolctl/data/NAME.c as the optional abi3 extension smolctl.data.NAME (both share _buffers.h)."""
    return Extension(
        f"smolctl.data.{name}",
        [f"smolctl/data/{name}.c"],
        depends=["smolctl/data/_buffers.h"],
        extra_compile_args=["-O3", "-std=c11"],
        define_macros=[("Py_LIMITED_API", hex(STABLE_ABI))],
        py_limited_api=True,
        optional=True,
    )


setup(ext_modules=[kernels("_minhash"), kernels("_pack")], options={"bdist_wheel": {"py_limited_api": "cp311"}})
