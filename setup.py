# setuptools cannot declare cffi_modules in pyproject.toml; everything else lives there.
# The extension uses only Python's limited API (cffi builds it as _pdhal_c.abi3.so), so the
# wheel is tagged abi3 too: one wheel for every CPython from 3.10.
from setuptools import setup

setup(cffi_modules=["csrc/build_ffi.py:ffibuilder"],
      options={"bdist_wheel": {"py_limited_api": "cp310"}})
