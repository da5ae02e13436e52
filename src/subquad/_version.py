"""The package's version: the one place it is written (pyproject reads it, ``subquad --version`` prints it)."""

__version__ = "0.2.0"
"""subquad's version (``subquad.__version__``), a PEP 440 string."""
