"""hvdlite's benchmarks: ``python -m benchmarks`` runs them (benchmarks/__main__.py) from the table in
benchmarks/registry.py; each script also runs on its own (see benchmarks/README.md)."""
