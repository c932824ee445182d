"""The engine core: one model replica stepped by its owner (`EngineCore`), data-parallel
replicas behind the same contract (`ReplicaSet`), and the per-request state and counters they
keep. It joins the two layers below it: `jengine.scheduling` (host-side, no JAX) decides what
runs, `jengine.runtime` (the only JAX on the serving path, with `jengine.models`) runs it."""
