"""A small, faithful simulator of vLLM 0.33.0's prefill/decode side (tests and benchmarks only).

Run one engine per process: ``python -m disagg_bench.vllm_sim --role prefill|decode --mode push|pull ...``
(see ``sim.py`` for the protocol, the failure behaviour and the timing model, and ``harness.py`` for the
helpers that tests and benchmarks use to start engines and routers on loopback).
"""
