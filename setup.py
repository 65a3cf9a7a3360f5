"""Build the C core and its Cython binding.

Only the extension is described here; metadata lives in pyproject.toml.
-O3 without -march=native: the wheel must run on any x86-64 (or other) CPU;
the reduction kernels pick SIMD paths at run time (target_clones).
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

csrc = sorted(glob.glob(os.path.join("csrc", "*.c")))
CFLAGS = ["-O3", "-std=gnu11", "-pthread", "-fvisibility=hidden", "-Wall",
          "-Wno-unused-function"]
ext = Extension(
    "ringlet._core",
    sources=[os.path.join("src", "ringlet", "_core.pyx")] + csrc,
    include_dirs=["csrc", numpy.get_include()],
    depends=glob.glob(os.path.join("csrc", "*.h")),
    extra_compile_args=CFLAGS,
    extra_link_args=["-pthread"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                   ("RL_BUILD_FLAGS", '"%s"' % " ".join(CFLAGS))],
)

setup(
    ext_modules=cythonize([ext], language_level=3,
                          compiler_directives={"boundscheck": False, "wraparound": False}),
)
