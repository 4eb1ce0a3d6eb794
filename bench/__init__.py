"""Benchmarks of the pipeline's stages and of whole iterations (against TRL's own trainers).

Each runs as a module from the project root, in the environment its usage line names, e.g.
``.venv-train/bin/python -m bench.roofline RUN_DIR``; tests/test_bench_scripts.py runs each at its
smallest size.
"""
