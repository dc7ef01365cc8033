"""Benchmarks that need more than `specbench run`: the client-overhead benchmark (client_overhead.py)
and the stub server it and the tests of --engine server share (stub_server.py)."""
