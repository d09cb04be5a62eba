"""Benchmarks behind ``afd bench``: each measures our code against the raw layer under it, in one run."""
