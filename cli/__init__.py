"""infergate: a priority-tiered inference gateway.

This package is the composition root: the ``infergate`` command
(``infergate.main``) and ``infergate up`` (``infergate.up``). The layers and
roles live in its subpackages: ``base`` (what every process shares),
``policies``, ``gateway``, ``dispatcher`` and ``gpu`` (docs/architecture.md).
Nothing imports this package's modules.
"""

__version__ = "0.1.0"
