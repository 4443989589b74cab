"""Benchmark suites (``jaxdist bench``): GPT, MoE and Wide-ResNet under every method,
against hand-written expert plans. See :mod:`jaxdist.bench.run`."""
