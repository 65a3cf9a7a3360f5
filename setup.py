"""Build the C core and its Cython binding.

Only the extension and the PyPI description are described here; the rest of
the metadata lives in pyproject.toml.
-O3 without -march=native: the wheel must run on any x86-64 (or other) CPU;
the reduction kernels pick SIMD paths at run time (target_clones).
"""
import glob
import os
import re

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

csrc = sorted(glob.glob(os.path.join("csrc", "*.c")))
CFLAGS = ["-O3", "-std=gnu11", "-pthread", "-fvisibility=hidden", "-Wall",
          "-Wno-unused-function"]
LDFLAGS = ["-pthread"]
# Opt-in sanitizer build for testing (docs/security.md, "Fuzzing"), e.g.
# RINGLET_SANITIZE=address,undefined; the default build is unchanged.
SANITIZE = os.environ.get("RINGLET_SANITIZE", "").strip()
if SANITIZE:
    san = ["-fsanitize=" + SANITIZE, "-fno-omit-frame-pointer", "-g"]
    if "undefined" in SANITIZE.split(","):
        san.append("-fno-sanitize-recover=undefined")  # UB fails the test run
    CFLAGS = ["-O1" if f == "-O3" else f for f in CFLAGS] + san
    LDFLAGS += ["-fsanitize=" + SANITIZE]
ext = Extension(
    "ringlet._core",
    sources=[os.path.join("src", "ringlet", "_core.pyx")] + csrc,
    include_dirs=["csrc", numpy.get_include()],
    depends=glob.glob(os.path.join("csrc", "*.h")),
    extra_compile_args=CFLAGS,
    extra_link_args=LDFLAGS,
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                   ("RL_BUILD_FLAGS", '"%s"' % " ".join(CFLAGS))],
)


def long_description():
    """README.md with its relative docs/*.md links pointed at the docs site.

    PyPI shows the README without docs/, so relative links would break there;
    in the repository they stay relative.  The site is mkdocs.yml's site_url.
    """
    with open("mkdocs.yml") as f:
        site = re.search(r"(?m)^site_url:\s*(\S+)", f.read()).group(1).rstrip("/") + "/"
    with open("README.md", encoding="utf-8") as f:
        text = f.read()
    return re.sub(r"\]\(docs/([\w-]+)\.md(#[\w-]+)?\)",
                  lambda m: "](%s%s/%s)" % (site, m.group(1), m.group(2) or ""), text)


setup(
    long_description=long_description(),
    long_description_content_type="text/markdown",
    ext_modules=cythonize([ext], language_level=3,
                          compiler_directives={"boundscheck": False, "wraparound": False}),
)
