"""What binds first when a replay misses its SLO (``plan/capacity.py``'s ``binding``)."""

from tokenmill.plan.capacity import binding
from tokenmill.plan.predict import Prediction
from tokenmill.plan.whatif import WhatIf


def _pred(preemptions=0, kv=0.5, running=4.0, waiting=0.0, seqs=8) -> Prediction:
    replay = {"preemptions": preemptions, "kv_usage_max": kv, "running_mean": running,
              "waiting_mean": waiting}  # fmt: skip
    return Prediction(WhatIf("rate=2", {"rate": 2.0}), {}, replay, {"max_num_seqs": seqs})


def test_preemptions_or_a_full_pool_bind_the_kv_cache():
    assert binding(_pred(preemptions=3))[0] == "kv"
    assert binding(_pred(kv=0.97, running=8.0, waiting=5.0))[0] == "kv"


def test_every_slot_taken_with_requests_waiting_binds_the_queue():
    resource, why = binding(_pred(running=7.5, waiting=3.2))
    assert resource == "queue" and "7.5 of 8" in why and "3.2 requests waiting" in why


def test_slots_and_kv_to_spare_leave_compute():
    assert binding(_pred(running=7.5, waiting=0.0))[0] == "compute"
    assert binding(_pred(running=3.0, waiting=2.0))[0] == "compute"
