"""Fixtures shared by the test modules, and the thread count of the workers of `make test`."""

from __future__ import annotations

import os

import pytest

# `make test` runs pytest-xdist workers side by side (-n 2 on the project's 2-core machines). Each
# worker's torch would start a thread per core: with both workers in a torch run at once, 4 spinning
# OpenMP threads on 2 cores made the tiny model's training steps ~100 times slower (measured: 30 steps
# 0.5 s alone, 57 s each with two such processes side by side; with 1 thread each, 0.6 s). So a
# worker takes its share of the cores (`lib.runtime.available_cores`), fixed here before torch is
# imported, so that a test's numbers do not follow the machine's load; what it starts (servers,
# training runs, notebook kernels, benchmarks) inherits it. A variable already set is left as it is.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    from lib.runtime import THREAD_VARIABLES, available_cores

    _THREADS = str(max(1, available_cores() // _WORKERS))
    for _variable in THREAD_VARIABLES:
        os.environ.setdefault(_variable, _THREADS)


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
    """`once_per_run(name, compute)`: `compute()`'s value, computed once in a `make test` run. Under
    pytest-xdist the first worker to ask computes it and leaves it (pickled) beside the workers'
    temporary folders, and the other reads it, waiting for it if need be: xdist splits a module
    between the workers where one takes the other's last tests, and each would build that module's
    fixtures. Only for values that are the same whichever process computes them."""

    def value(name: str, compute):
        if "PYTEST_XDIST_WORKER" not in os.environ:
            return compute()
        import fcntl
        import pickle

        path = tmp_path_factory.getbasetemp().parent / f"{name}.pickle"  # one folder per run
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.is_file():
                return pickle.loads(path.read_bytes())
            computed = compute()
            path.write_bytes(pickle.dumps(computed))
            return computed

    return value


@pytest.fixture(scope="session")
def tokenizer():
    """The project's tokenizer (trained on the environment's text, cached in .cache/)."""
    from lib.training.tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer):
    """The stand-in's architecture with random weights (no warm start: fast)."""
    from lib.training.policy_model import build_tiny_model

    return build_tiny_model(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """The same random model (a fresh copy: no test's changes to `model`) and the tokenizer, saved as
    any Hugging Face model is and loaded by its folder's name."""
    from lib.training.policy_model import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def no_evidence_figures(monkeypatch):
    """`lib.training.run.train` writing every evidence file but its figures (PNGs), for the runs of
    tests that check something else (a resume, an adapter): drawing them was more than half of such a
    run (the resumed-run test's two runs: 17.6 s with them, 7.7 s without). The figures are drawn from
    the CSV files these tests check anyway, by the same functions whatever the run; `render_all` logs
    a failure and never raises. The smoke run of tests/test_training.py draws them all and checks that
    they are written, and its resumed runs draw each step's; a renamed function fails here
    (monkeypatch), not silently."""
    import lib.training.callbacks as callbacks
    import lib.training.run as run

    monkeypatch.setattr(run, "render_all", lambda paths: {})
    for name in ("render_training_curve", "render_reward_components", "render_checkpoint_progression"):
        monkeypatch.setattr(callbacks, name, lambda *args, **kwargs: None)
