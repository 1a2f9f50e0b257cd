"""``asyncslab bench``, a package of its own beside the loader: ``runner`` drives the
contenders and prints the tables (with the modules its docstring lists), ``worker`` runs one
contender in a fresh process. Run as ``asyncslab bench`` or ``python -m asyncslab.cli._bench``."""

from .arguments import add_arguments
from .runner import main, run

__all__ = ["add_arguments", "main", "run"]
