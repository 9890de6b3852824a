"""What-if planning from a recorded store: a step-cost model fitted on its ``engine_steps``
(:mod:`.step_cost`), its requests as a replayable workload (:mod:`.workload`), a replay through
the engine's own scheduler, KV block pool and data-parallel router with modelled step times
(:mod:`.simulate`), what-ifs and SLOs (:mod:`.whatif`), predictions with their own error
estimate (:mod:`.predict`), a search for the cheapest setting that meets an SLO
(:mod:`.recommend`) and ``tokenmill plan`` (:mod:`.cli`)."""
