"""The planner reaches the engine's scheduler, block pool and requests through their declared
seams only: it overrides no ``_`` method of an engine class and sets no attribute a
:class:`Request` does not declare."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import pytest
from test_simulate import model, setup, workload

import tokenmill.plan
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams


def _plan_classes():
    for info in pkgutil.iter_modules(tokenmill.plan.__path__):
        module = importlib.import_module(f"tokenmill.plan.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                yield cls


def test_no_planner_class_overrides_a_private_method_of_an_engine_class():
    bad = []
    for cls in _plan_classes():
        engine_bases = [b for b in cls.__mro__[1:] if b.__module__.startswith("tokenmill.engine")]
        for name in vars(cls):
            if not name.startswith("_") or name.startswith("__"):
                continue
            bad += [
                f"{cls.__name__}.{name} ({b.__name__})" for b in engine_bases if name in vars(b)
            ]
    assert not bad, bad


@pytest.mark.parametrize("fast", [True, False])
def test_a_replay_sets_no_attribute_a_request_does_not_declare(monkeypatch, fast):
    import tokenmill.plan.simulate as simulation

    declared = set(vars(Request("x", [1, 2], SamplingParams())))
    made: list[Request] = []

    class _Strict(Request):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def __setattr__(self, name, value):
            if name not in declared:
                raise AttributeError(
                    f"the replay set Request.{name}, which Request does not declare"
                )
            super().__setattr__(name, value)

    monkeypatch.setattr(simulation, "Request", _Strict)
    rng = np.random.default_rng(5)
    n = 40
    hashes = [[1, 2, 3] if i % 2 else [1, 4] for i in range(n)]  # shared heads, then own blocks
    w = workload(
        np.cumsum(rng.exponential(0.03, n)), rng.integers(40, 200, n), rng.integers(20, 90, n),
        hashes=hashes,
    )  # fmt: skip
    r = simulation.simulate(w, setup(num_blocks=70), model(attn=2.0, kv=40.0), fast_forward=fast)
    assert r.preemptions.sum() > 0 and r.prefix_hit_tokens > 0  # every path of the pool
    assert len(made) == n
    assert all(set(vars(q)) <= declared | {"generator"} for q in made)
    # the replay's tokens went in through Request.append_token: output counted, no times kept
    assert all(q.stats.output_tokens == len(q.output_token_ids) > 0 for q in made)
    assert not any(q.token_ns for q in made)
