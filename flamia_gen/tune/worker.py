"""One tuning worker process: `python -m flamia_gen.tune.worker CONFIG.json [INDEX N_WORKERS]`.

CONFIG holds the storage URL, the studies (`StudySpec.to_dict()`) and the runner config
(`flamia_gen.tune.runner.make_runner`). The launcher pins each worker to one GPU with
`CUDA_VISIBLE_DEVICES` before the process starts, so the worker always uses its device 0.
Workers on other hosts run the same command against a shared (PostgreSQL) storage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from .space import StudySpec


def write_config(path: Path | str, storage: str, specs: list[StudySpec], runner: dict) -> Path:
    path = Path(path)
    path.write_text(json.dumps({"storage": storage, "studies": [s.to_dict() for s in specs], "runner": runner}))
    return path


def launch(config: Path, n_workers: int, device_ids: list[int] | None, log_dir: Path) -> list[tuple]:
    """Start `n_workers` processes; worker i sees only GPU `device_ids[i % len]`.
    Returns [(Popen, log path, device)]."""
    procs = []
    pkg_root = str(Path(__file__).resolve().parents[2])
    for i in range(n_workers):
        env = dict(os.environ)
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        dev = None
        if device_ids:
            dev = device_ids[i % len(device_ids)]
            env["CUDA_VISIBLE_DEVICES"] = str(dev)
        log = Path(log_dir) / f"worker-{i}.log"
        fh = open(log, "w")
        p = subprocess.Popen([sys.executable, "-m", "flamia_gen.tune.worker", str(config), str(i), str(n_workers)],
                             stdout=fh,
                             stderr=subprocess.STDOUT, env=env)
        fh.close()
        procs.append((p, log, dev))
    return procs


def tail(path: Path, n: int = 8) -> str:
    try:
        lines = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 3):
        print("usage: python -m flamia_gen.tune.worker CONFIG.json [INDEX N_WORKERS]", file=sys.stderr)
        return 2
    from .runner import make_runner
    from .study import run_worker

    cfg = json.loads(Path(argv[0]).read_text())
    specs = [StudySpec.from_dict(d) for d in cfg["studies"]]
    runner = make_runner(cfg["runner"])
    dev = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    index, n = (int(argv[1]), int(argv[2])) if len(argv) == 3 else (0, 1)
    rep = run_worker(specs, cfg["storage"], runner, device=f"cuda:{dev}" if dev else "", index=index, n_workers=n)
    print(json.dumps({"worker_report": asdict(rep)}))
    return 0


__all__ = ["write_config", "launch", "tail", "main"]

if __name__ == "__main__":
    sys.exit(main())
