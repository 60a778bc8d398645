"""Run a grid of simulations as Ray tasks: one tidy table (sweep.csv) and its plots.

A local Ray is started for the run (`--num-cpus` workers) unless `--address` names a running
cluster whose nodes have dspark-twin installed.  Points already done in `--out` are not rerun.
Grid format: twin/sim/sweep.py and docs/simulation.md#sweeps.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path

from twin.abi.errors import ConfigError
from twin.abi.outputs import atomic_path, write_text

from ._common import integer, out_dir


def add_arguments(p) -> None:
    p.add_argument("grid", metavar="GRID", help="the grid file, YAML or JSON (base / grid / slo)")
    p.add_argument("--out", default="sweep-out", help="sweep directory (default ./sweep-out)")
    p.add_argument("--address", help="a running Ray cluster (ray://host:10001 or host:6379); default: start one")
    p.add_argument("--num-cpus", type=integer, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--json", action="store_true", help="print the table as JSON records")


class _Strict(argparse.ArgumentParser):
    """simulate's parser, raising instead of exiting, so a bad point is one line naming it."""

    def error(self, message):
        raise ConfigError("point", self._point, f"simulate arguments ({message})")


def _check(points_argv) -> None:
    from . import simulate

    p = _Strict(prog="simulate", add_help=False)
    simulate.add_arguments(p)
    for pid, a in points_argv:
        p._point = pid
        p.parse_args(a)


def run_point(argv: list[str]) -> tuple[int, str]:
    """One point, in a Ray worker: `dspark-twin simulate ARGV`; (exit status, its stderr)."""
    from twin.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["simulate", *argv])
    return rc, err.getvalue().strip()


def _ray(args):
    from ._ray import connect

    return connect("--address", args.address, num_cpus=args.num_cpus, missing=("sweep", "ray"))


@contextlib.contextmanager
def ray_chatter_to_stderr():
    """Ray's driver (and the raylet it starts) may write warnings, such as its memory monitor's,
    straight to file descriptor 1; sweep's stdout carries its result (`--json`), so while Ray runs
    descriptor 1 points at stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def interrupted(args) -> str:
    return (f"the points finished so far are kept in {args.out}/points/ (each with its point.json marker); "
            "rerunning the same command resumes the sweep and runs only the others")


def run_points(args, grid, out: Path, todo) -> dict[str, str]:
    """The points not yet done, as Ray tasks; {point id: its one-line error} for those that failed."""
    from twin.sim import sweep

    failed: dict[str, str] = {}
    ray, started = _ray(args)
    try:
        task = ray.remote(num_cpus=1)(run_point)
        refs = {pid: (s, task.remote(sweep.argv(s, grid["slo"], out / "points" / pid))) for pid, s in todo}
        for pid, (s, ref) in refs.items():
            try:
                rc, err = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                rc, err = 70, str(e).strip().splitlines()[-1]
            if rc == 0:
                # the marker a resumed sweep trusts: written only after the point's files
                write_text(out / "points" / pid / "point.json", json.dumps({"point": pid, "settings": s}))
            else:
                failed[pid] = err.splitlines()[-1] if err else f"exit status {rc}"
    finally:
        if started:
            ray.shutdown()
    return failed


def run(args) -> int:
    import pandas as pd

    from twin.sim import sweep

    if args.num_cpus is not None and args.num_cpus < 1:
        raise ConfigError("--num-cpus", args.num_cpus, ">= 1")
    if args.address is not None and not args.address.strip():
        raise ConfigError("--address", args.address, "a Ray cluster address (ray://host:10001, host:6379 or auto)")
    grid = sweep.load_grid(args.grid)
    pts = [(sweep.point_id(s, grid["slo"]), s) for s in sweep.points(grid)]
    _check([(pid, sweep.argv(s, grid["slo"], Path(args.out) / "points" / pid)) for pid, s in pts])
    out = out_dir(args.out, "--out")          # made only for a grid whose every point is valid
    todo = [(pid, s) for pid, s in pts if not (out / "points" / pid / "point.json").is_file()]
    failed: dict[str, str] = {}
    if todo:
        with ray_chatter_to_stderr():
            failed = run_points(args, grid, out, todo)
    rows = [sweep.row(pid, s, grid["slo"], out / "points" / pid) for pid, s in pts if pid not in failed]
    rows += [{"point": pid, **s, "error": failed[pid]} for pid, s in pts if pid in failed]
    table = pd.DataFrame(rows)
    with atomic_path(out / "sweep.csv") as tmp:
        table.to_csv(tmp, index=False)
    files = ["sweep.csv"]
    ok = table[table["error"].isna()] if "error" in table else table
    if not args.no_plots and len(ok):
        files += sweep.plots(out, ok, grid)
    if args.json:
        json.dump(json.loads(table.to_json(orient="records")), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"sweep: {len(pts)} points ({len(pts) - len(todo)} already done, {len(todo) - len(failed)} run, "
              f"{len(failed)} failed); {out}/ ({', '.join(files)})")
    for pid, err in failed.items():
        print(f"dspark-twin sweep: point {pid} failed: {err}", file=sys.stderr)
    return 1 if failed else 0
