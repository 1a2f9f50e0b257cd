"""``asyncslab bench``, a package of its own beside the loader: ``runner`` drives the
contenders and prints the tables, ``worker`` runs one contender in a fresh process. Run as
``asyncslab bench`` or ``python -m asyncslab.cli._bench``."""

from .runner import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
