"""Tune: optuna studies over built variants, timed on a GPU, frozen into dispatch tables.

    space   which studies exist: (arch, GPU, kind, route, head dim [, causal], bucket) → candidates
    runner  Runner protocol; FakeRunner (tests); BundleRunner (kernels of a bundle, timed on a GPU)
    gpu     CUDA-event timing and per-kind hooks (imported only when a GPU runner is made)
    study   storage (SQLite by default, any SQLAlchemy URL), claims, worker loop, progress
    worker  `python -m flamia_gen.tune.worker`: one process per GPU
    freeze  studies → `tuning_db/<arch>-<gpu>.json` (format: `flamia_gen.dispatch.table`)
    cli     `flamia-gen tune`, `flamia-gen freeze`, `flamia-gen table show|check|untuned`

Importing this package imports neither optuna nor torch; docs/tuning.md is the guide.
"""
