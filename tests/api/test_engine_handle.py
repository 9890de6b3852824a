"""The API's handle on the engine (engine/api/handle.py): one engine core, data-parallel
replicas and prefill/decode pools each implement every member of ``EngineHandle``, so the
routes and the server use them without asking which one they hold."""

from __future__ import annotations

import inspect

import pytest

from tokenmill.engine.api.disaggregated import PDPool
from tokenmill.engine.api.handle import EngineHandle
from tokenmill.engine.api.replicas import ReplicaPool
from tokenmill.engine.api.worker import EngineWorker
from tokenmill.engine.config import EngineConfig


def _members() -> dict[str, object]:
    names = set(EngineHandle.__annotations__)
    names |= {n for n, v in vars(EngineHandle).items() if not n.startswith("_") and callable(v)}
    names |= {n for n, v in vars(EngineHandle).items() if isinstance(v, property)}
    return {n: getattr(EngineHandle, n, None) for n in sorted(names)}


def _handles():
    one = EngineWorker(EngineConfig())
    pool = ReplicaPool(EngineConfig(data_parallel_size=2), cpu_count=2)
    cfg = EngineConfig(disaggregation="prefill=1,decode=1")
    pd = PDPool(cfg, cfg.pd_spec(), cpu_count=2)
    return {"one core": one, "replicas": pool, "prefill/decode pools": pd}


def test_the_protocol_names_what_the_routes_use():
    members = _members()
    for name in ("generate", "stop_streams", "can_serve", "workers", "stall", "health", "pids"):
        assert name in members, name
    assert len(members) >= 20, sorted(members)


@pytest.mark.parametrize("kind", ["one core", "replicas", "prefill/decode pools"])
def test_each_engine_shape_implements_every_member(kind):
    handle = _handles()[kind]
    assert isinstance(handle, EngineHandle)
    for name, declared in _members().items():
        assert hasattr(handle, name), f"{kind}: no {name}"
        got = getattr(type(handle), name, None)
        if inspect.isfunction(declared):  # methods: async where declared async, same arity
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(declared), (
                kind,
                name,
            )
            want = [p for p in inspect.signature(declared).parameters.values()]
            have = inspect.signature(got).parameters
            for p in want:
                if p.kind in (p.POSITIONAL_OR_KEYWORD,) and p.name != "self":
                    assert p.name in have or any(
                        q.kind in (q.VAR_POSITIONAL, q.VAR_KEYWORD) for q in have.values()
                    ), (kind, name, p.name)
    # nothing started: no core serves yet, and each shape says so the same way
    assert handle.ready is False and handle.can_serve is False
    assert handle.pids == [] and handle.heartbeat_age_s is None
    assert len(handle.workers) == (1 if kind == "one core" else 2)
    assert handle.stop_streams("test") == 0 and handle.closing is True
