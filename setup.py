# setuptools cannot declare cffi_modules in pyproject.toml; everything else lives there.
# The extension uses only Python's limited API (cffi builds it as _pdhal_c.abi3.so), so the
# wheel is tagged abi3 too: one wheel for every CPython from 3.10.
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


class BuildExtAndLibrary(build_ext):
    """The cffi extension, and next to it libpdhal.so: the same C core without Python, for
    C/C++ programs that run outside a Python process (pdhal.get_library(standalone=True))."""

    def run(self):
        super().run()
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))
        import build_ffi

        out_dir = os.path.dirname(self.get_ext_fullpath("pdhal._pdhal_c"))
        sources = [os.path.join("csrc", source) for source in build_ffi.SOURCES]
        objects = self.compiler.compile(
            sources,
            output_dir=os.path.join(self.build_temp, "lib"),
            include_dirs=[os.path.join("pdhal", "include")],
            extra_postargs=build_ffi.compile_args() + ["-fPIC"],
        )
        self.compiler.link_shared_object(
            objects,
            "libpdhal.so",
            output_dir=out_dir,
            libraries=["pthread"],
            extra_postargs=build_ffi.link_args(build_ffi.CDEF, python_module=False),
        )


setup(
    cffi_modules=["csrc/build_ffi.py:ffibuilder"],
    cmdclass={"build_ext": BuildExtAndLibrary},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
