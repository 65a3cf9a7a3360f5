"""The version of ringlet: the one place it is written.

pyproject.toml reads it (``[tool.setuptools.dynamic]``), ``ringlet.__version__``
and ``ringlet --version`` report it; CHANGELOG.md has a section per version.
"""

__version__ = "0.1.0"
