"""What a signal family is.

A :class:`Family` is one group of signals with one job (request latencies, the KV pool, the
roofline, ...): the store columns it reads (``needs``: without any of them it cannot run;
``optional``: read when the store has them, the family adapts otherwise), the keys it yields per
window (``Window.values``) and over the whole range (``Signals.overall``), and ``compute``, its
SQL over a :class:`~.scope.Scope`. :func:`tokenmill.diagnose.signals.load` runs every family of
:data:`tokenmill.diagnose.signals.FAMILIES`; a family whose ``needs`` the store lacks (a store
written before its columns, another engine's store) yields its keys as None instead of running
(:func:`unavailable`).

A family may name a ``fallback``: another family yielding some of its keys from another table
(``samples.py``: the engine's scraped metrics in ``engine_samples``). Where the store has no
rows for the family's own tables in the whole store (another engine's store has no
``engine_steps``), :func:`~tokenmill.diagnose.signals.load` runs the fallback instead and the
keys it does not yield are None; ``Signals.sources`` names the family it ran.

Rules declare the families they read (``Rule.reads``); ``tests/diagnose/test_signal_families.py`` checks
that every key a rule reads is yielded by one of them, that each family yields exactly the keys
it declares and reads only the columns it declares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .scope import Scope


@dataclass
class Yield:
    """What a family computed: per window index its values, and its overall values."""

    windows: dict[int, dict] = field(default_factory=dict)
    overall: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """One signal family: see the module docstring."""

    name: str
    # what the family reads: table -> columns; a store without one of them: keys None
    needs: Mapping[str, tuple[str, ...]]
    # the keys of Window.values it yields, and those of Signals.overall
    window_keys: tuple[str, ...]
    overall_keys: tuple[str, ...]
    compute: Callable[[Scope], Yield]
    # columns it reads when the store has them (the family adapts when it does not)
    optional: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # the same meaning from another table, for a store without rows in this family's tables
    fallback: Family | None = None

    def missing(self, scope: Scope) -> tuple[str, ...]:
        """The ``table.column`` names of ``needs`` the store lacks."""
        return tuple(
            f"{table}.{col}"
            for table, cols in self.needs.items()
            for col in cols
            if not scope.has(table, col)
        )


def unavailable(family: Family, n_windows: int) -> Yield:
    """A family that cannot run on this store: every key None, in every window."""
    return Yield(
        windows={i: dict.fromkeys(family.window_keys) for i in range(n_windows)},
        overall=dict.fromkeys(family.overall_keys),
    )
