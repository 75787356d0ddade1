"""Helpers shared by the tuning tests (a plain module: `from tune_helpers import ...`)."""

from flamia_gen.dispatch.defaults import Group
from flamia_gen.tune.space import StudySpec, Workload


def synth_spec(name="s", n=6, budget=None, gpu="Fake GPU", workload=None):
    """A study over n synthetic candidates (the fake runner does not care about names)."""
    g = Group("sm90", "quant", "synthetic", 128, None, tuple(f"v{i}" for i in range(n)))
    w = workload or Workload("4x1024", (1024,) * 4, 16)
    return StudySpec(f"test/{name}", "sm90", gpu, g, {"tokens": 4096}, w, n if budget is None else budget)


def read_log(path):
    """Rows (pid, variant, workload) that the fake runner logged."""
    if not path.exists():
        return []
    return [tuple(line.split("\t")) for line in path.read_text().splitlines()]
