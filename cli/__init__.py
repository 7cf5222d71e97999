"""infergate: a priority-tiered inference gateway.

The architecture lives in the sibling packages: ``gateway`` (HTTP),
``dispatcher`` (the Redis data model and batch forming), ``gpu`` (workers and
backends) and ``policies`` (the YAML policy). This package holds what every
process shares: the clock, logging, settings and the ``infergate`` command.
"""

__version__ = "0.1.0"
