"""Benchmarks (`make bench*`), each a script run as `python bench/NAME.py`. The tests import the
few whose functions they check as `bench.NAME`, from the repository root (`python -m pytest`,
as `make test` runs it); a script imports its neighbours by their bare names (`bench_env`,
`server_load`), which its own folder on the path provides."""
