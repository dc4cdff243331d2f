"""Exploration, not library code: other schedules of the unselected columns' interval update, on the reference.

    python benchmarks/accuracy_variants.py --variant next-step --runs reference:iau=1 --seed 0 --eval-size 2000 \\
        --eval-steps 200 250 300 --out variants_seed0.json      # then any other benchmarks/accuracy.py flag

Each variant is run by `ZenFlowReference` (eager, synchronous, docs/semantics.md plus the variant) under the run
name `reference[<variant>]:...`:

  next-step        with overlap_step, a boundary's CPU update lands at the start of the next step() instead of
                   at the next boundary: the forward and backward of one step see the unselected columns stale,
                   instead of a whole interval's (a schedule that stalls wherever the CPU update takes longer
                   than one step's device work). The key landing_lag=1 (accuracy.py run setting lag=1) is
                   this schedule with overlap_reselect "wait" or "incoming": the same values, the update
                   landing at the end of the next step().
  stagger-after-N  with stagger_boundaries (run setting stagger=1), the phases run together (unstaggered) for
                   the first N steps and staggered from step N on (N one of STAGGER_AFTER): phase q's interval
                   in progress at step N ends at its first staggered boundary. Staggering costs accuracy early
                   in a fine-tune, with the landing lag (benchmarks/README.md, "Staggered boundaries"); this
                   asks whether it costs anything once the early steps are past.
  stagger-spaced   with stagger_boundaries and an even S: S / 2 phases, phase q's boundaries 2q steps after
                   phase 0's, so with landing_lag=1 no other phase's update lands between a phase's boundary
                   and its landing (with S phases one does). Asks whether that is what staggering costs.

The sizings first explored here are keys now: exp_avg_sq fed the mean of the per-step squared gradients,
`interval_second_moment` (benchmarks/accuracy.py run setting sm=1), and lr x sqrt(m) instead of lr x m,
`interval_aware_update="sqrt"` (iau=sqrt).

Each is made by patching the reference's source at import (asserting the patched lines are found), so a
change to zenflow_compile/reference.py fails here loudly instead of silently measuring something else.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy  # noqa: E402  (benchmarks/accuracy.py)

import zenflow_compile.reference  # noqa: E402

STAGGER_AFTER = (100, 200)
VARIANTS = ("next-step", *(f"stagger-after-{n}" for n in STAGGER_AFTER), "stagger-spaced")
_STAGGER_BOUNDARIES = "if (t + q - W + 1) % cfg.update_interval == 0]"
_STAGGER_CLOCK = 'zp, tq = z["phases"][q], t + q'

_STEP_START = '        self._adopt_external_writes()\n        live = ['


def _patch(source: str, old: str, new: str) -> str:
    if source.count(old) != 1:
        raise RuntimeError(f"zenflow_compile/reference.py changed: {old!r} is not there exactly once; "
                           "update benchmarks/accuracy_variants.py")
    return source.replace(old, new)


def variant_reference(variant: str) -> type:
    """ZenFlowReference with the schedule of ``variant``."""
    source = Path(zenflow_compile.reference.__file__).read_text()
    if variant == "next-step":
        source = _patch(source, _STEP_START, '        self._adopt_external_writes()\n'
                        '        for q in range(len(self.zf["phases"])):  # next-step: what is in flight lands\n'
                        '            self._land(q)\n'
                        '        live = [')
    elif variant.startswith("stagger-after-") and variant in VARIANTS:
        after = int(variant.rsplit("-", 1)[1])
        offset = f"(q if t >= {after} else 0)"
        source = _patch(source, _STAGGER_BOUNDARIES, f"if (t + {offset} - W + 1) % cfg.update_interval == 0]")
        source = _patch(source, _STAGGER_CLOCK, f'zp, tq = z["phases"][q], t + {offset}')
    elif variant == "stagger-spaced":
        source = _patch(source, _STAGGER_BOUNDARIES, "if (t + 2 * q - W + 1) % cfg.update_interval == 0]")
        source = _patch(source, _STAGGER_CLOCK, 'zp, tq = z["phases"][q], t + 2 * q')
        for old, new in (("[0] * config.num_phases", "[0] * (config.num_phases // 2)"),
                         ("for _ in range(config.num_phases)", "for _ in range(config.num_phases // 2)"),
                         ("for q in range(self.config.num_phases)", "for q in range(self.config.num_phases // 2)")):
            source = _patch(source, old, new)
    else:
        raise ValueError(f"variant {variant!r}: expected one of {VARIANTS}")
    module = types.ModuleType(f"reference_{variant.replace('-', '_')}")
    exec(compile(source, zenflow_compile.reference.__file__ + f" [{variant}]", "exec"), module.__dict__)
    return module.ZenFlowReference


def main(argv=None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--variant", required=True, choices=VARIANTS)
    known, rest = p.parse_known_args(argv)
    tag = f"reference[{known.variant}]"
    zenflow_compile.reference.ZenFlowReference = variant_reference(known.variant)  # what train_one builds

    parse_run, run_name = accuracy.parse_run, accuracy.run_name

    def parse_variant_run(name):
        if not name.startswith(("reference:", tag + ":")):
            raise ValueError(f"run {name!r}: this script runs reference:<settings> runs only")
        return parse_run(name.replace(tag, "reference", 1))

    accuracy.parse_run = parse_variant_run
    accuracy.run_name = lambda spec: run_name(spec).replace("reference", tag, 1)
    return accuracy.main(rest)


if __name__ == "__main__":
    sys.exit(main())
