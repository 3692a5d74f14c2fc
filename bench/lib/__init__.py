"""What every benchmark (and tests/conftest.py) shares, so there is one copy of each:

- servers: start and stop servers (in-process gateway, `llmd serve` subprocesses), find tools;
- engines: real-engine servers for load benches (`llmd serve` with tenants, `vllm serve`);
- streams: one streamed request as the client saw it, and figures over many;
- load: load shapes (closed loop, open loop), request bodies, the /admin/engines sampler;
- stats: the one percentile definition and the other summary statistics;
- report: the one writer of docs/benchmarks.md, tables, verdicts and the run stamp;
- lean_client: a raw-socket load client in its own process, to saturate a server's core;
- cputime: CPU-time instruments (a process's CPU, timed calls, a coroutine's steps).
"""
