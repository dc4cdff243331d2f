"""Remove each synchronisation point of the device path in turn and see which tests on the emulated device fail.

    python tests/device_mutations.py                      # every mutation, the default test selection
    python tests/device_mutations.py --only M03 M07 --tests tests/test_transfers.py

Each mutation edits one line of the runtime (a wait, an event record, a keep-alive, a join, a double buffer),
runs the selected tests with `ZENFLOW_TEST_DEVICE=emulated`, restores the file and reports the tests that
failed: a mutation no test catches is a synchronisation point the suite does not guard, unless the schedule
orders that access another way too (said per mutation, `ordered_anyway`). Run it from a clean
checkout (it edits the runtime's files in place, and restores them even when interrupted).
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Mutation:
    key: str
    what: str
    path: str
    old: str
    new: str
    ordered_anyway: str = ""  # why the schedule stays ordered without it (then no test can fail)


MUTATIONS = [
    Mutation("M01", "copy down: its stream does not wait for the compute stream that produced the source",
             "runtime/transfers.py",
             "        stream.wait_stream(streams.current_stream())\n        with record_function(\"zenflow::copy_down\"):",
             "        with record_function(\"zenflow::copy_down\"):"),
    Mutation("M02", "copy down: no event recorded after the copy (readers wait for nothing)",
             "runtime/transfers.py", "        done.record(stream)\n        streams.keep_alive(sources, stream)\n",
             "        streams.keep_alive(sources, stream)\n"),
    Mutation("M03", "copy down: the source is not kept alive for the copy stream (record_stream)",
             "runtime/transfers.py", "        streams.keep_alive(sources, stream)\n", ""),
    Mutation("M04", "upload: its stream does not wait for the compute stream (the target's memory)",
             "runtime/transfers.py",
             "        stream.wait_stream(streams.current_stream())\n        if after is not None:",
             "        if after is not None:"),
    Mutation("M05", "upload: no event recorded after the copy",
             "runtime/transfers.py", "        done.record(stream)\n        streams.keep_alive([target], stream)",
             "        streams.keep_alive([target], stream)"),
    Mutation("M06", "upload: the compute stream does not wait for it before its kernels read the target (an upload "
                    "queued at the apply, or by the update worker when it finished)",
             "runtime/transfers.py",
             "        self.streams.current_stream().wait_event(done)\n        if self.traced:\n"
             "            self.streams.note_compute_access(reads=[target])",
             "        if self.traced:\n            self.streams.note_compute_access(reads=[target])"),
    Mutation("M07", "accumulate worker: reads the offloaded gradients without waiting for their copies",
             "runtime/host_work.py", "                        wait_events(copies)\n", ""),
    Mutation("M08", "accumulate task: submitted without this step's copy events",
             "runtime/host_work.py",
             "        work = [(slab, rows, intake.copies_in_flight(slab, grad_slot), slab.acc_slot) for slab, rows in stepped]",
             "        work = [(slab, rows, [], slab.acc_slot) for slab, rows in stepped]"),
    Mutation("M09", "a step's backward refills the gradient buffer the accumulate task of two steps ago reads, "
                    "without joining that task (a pinned buffer reused one step early)",
             "runtime/host_work.py", "        if pending is not None:\n            self.wait(pending)\n", ""),
    Mutation("M10", "gradient buffers single-buffered: every step's backward refills the buffer the previous "
                    "step's accumulate task reads", "runtime/engine.py", "        self.grad_slot ^= 1\n", "",
             ordered_anyway="the first backward of a step joins the accumulate task that last read its buffer, now "
                            "the previous step's: correct, but that wait is no longer overlapped"),
    Mutation("M11", "several backwards in a step: the extra gradients are summed without waiting for their copies",
             "runtime/state/slab.py",
             "        wait_events(self.offload_done[grad_slot])\n        target = self.host_grads[grad_slot]\n",
             "        target = self.host_grads[grad_slot]\n"),
    Mutation("M12", "a selection moving a step's gradient reads it without waiting for its copy",
             "runtime/state/slab.py",
             "        wait_events(self.offload_done[grad_slot])\n        if self.has_host_part:\n",
             "        if self.has_host_part:\n"),
    Mutation("M13", "CPU update: publishes new columns into a weights buffer an upload may still read",
             "runtime/state/update.py",
             "    wait_events([slab.upload_done[free]])  # (an upload may still read the buffer the update writes)\n", "",
             ordered_anyway="that buffer's upload was an interval earlier; the compute stream waited for it and every "
                            "step since read a device value (the norm), so the host is already past it"),
    Mutation("M14", "weights buffers single-buffered: the CPU update overwrites the buffer of the last upload",
             "runtime/state/update.py", "    free = slab.weights_slot ^ 1\n", "    free = slab.weights_slot\n"),
    Mutation("M15", "an upload's event is not kept (later writers of its host buffer wait for nothing)",
             "runtime/state/update.py",
             "        values, slab.upload_done[slab.weights_slot] = slab.transfers.to_device(",
             "        values, _ = slab.transfers.to_device("),
    Mutation("M16", "an offload's event is not kept (its reader waits for nothing)",
             "runtime/state/intake.py",
             "        slab.offload_done[grad_slot] = [*slab.offload_done[grad_slot], done]\n        return slab.u",
             "        return slab.u"),
    Mutation("M17", "hand-off of a whole slab: its offload event is not kept",
             "runtime/state/intake.py",
             "    slab.offload_done[grad_slot] = [*slab.offload_done[grad_slot], done]\n    return slab.host_grad_bytes",
             "    return slab.host_grad_bytes"),
    Mutation("M18", "values written into a parameter are adopted while an upload may still read the host weights",
             "runtime/state/watch.py",
             "        wait_events(slab.upload_done)  # an upload may still be reading the host weights\n"
             "        slab.transfers.host_access(writes=slab.host_weights)\n",
             "        slab.transfers.host_access(writes=slab.host_weights)\n"),
    Mutation("M22", "the CPU update starts without joining the accumulate task it follows",
             "runtime/host_work.py",
             "        self._updates[phase] = self.update_worker.submit(cpu_update, after=self._last_accumulate)",
             "        self._updates[phase] = self.update_worker.submit(cpu_update)"),
    Mutation("M23", "the CPU update is applied without waiting for it",
             "runtime/host_work.py",
             "        if launched is not None:  # (None right after a checkpoint load: already finished)\n"
             "            self.wait(launched)\n", ""),
    Mutation("M24", "a worker task seen finished does not order the caller after it",
             "runtime/worker.py", "            joined(future)  # (seen finished", "            pass  # (seen finished"),
    Mutation("M25", "a reselection in flight reads the arriving columns' accumulators before the step's "
                    "accumulation has finished",
             "runtime/engine.py", "            self.host_work.wait_for_accumulation()\n", ""),
    Mutation("M26", "departing columns' weights written into host rows an upload may still read",
             "runtime/state/columns.py",
             "    wait_events(slab.upload_done)  # an upload may still read the weights of these rows\n", ""),
    Mutation("M27", "device accumulation: the CPU update reads the accumulators without waiting for their copy down",
             "runtime/state/intake.py", "        wait_events([slab.acc_landed[acc_slot]])\n", ""),
    Mutation("M28", "device accumulation: the next interval empties the device sums without the compute stream "
                    "waiting for the copy that reads them",
             "runtime/transfers.py",
             "        self.streams.current_stream().wait_event(done)\n        if self.traced:\n"
             "            self.streams.note_compute_access(writes=sources)",
             "        if self.traced:\n            self.streams.note_compute_access(writes=sources)"),
    Mutation("M29", "an upload the update worker queued early is merged after the host weights it read were "
                    "rewritten (departing columns settled), instead of uploading them again",
             "runtime/state/columns.py",
             "    slab.uploaded = None  # (an upload made before these rows changed: the apply uploads them again)\n",
             ""),
    Mutation("M30", "departing columns' state settled into host rows before its copy down has completed",
             "runtime/state/columns.py", "    wait_events([copy.done])\n", ""),
    Mutation("M31", "a reselection's arriving columns are read on the device before their upload has landed",
             "runtime/state/columns.py", "    rows, _ = slab.transfers.to_device(pinned)\n",
             "    rows, _ = slab.transfers.upload_ahead(pinned)\n"),
    Mutation("M32", "host-made indices are read on the device before their upload has landed",
             "runtime/transfers.py", "        packed, _ = self.to_device(pinned)\n",
             "        packed, _ = self.upload_ahead(pinned)\n"),
    Mutation("M33", "a staggered phase's update lands without waiting for it (the wait looks up phase 0's)",
             "runtime/host_work.py", "        launched = self._updates.pop(phase, None)\n",
             "        launched = self._updates.pop(0, None)\n"),
    Mutation("M34", "offload: the selected columns' moments go up before their last copy down has landed",
             "runtime/state/slab.py",
             "        moments, _ = self.transfers.to_device(self.parked_moments, after=self.moments_parked)\n",
             "        moments, _ = self.transfers.to_device(self.parked_moments)\n"),
    Mutation("M35", "offload: a checkpoint reads the parked moments before their copy down has landed",
             "runtime/state/slab.py", "            wait_events([self.moments_parked])\n", ""),
]

# A mutated line is no longer in its file, so this check fails under every mutation: it would report each one as
# caught before the tests that guard the wait ran.
APPLICABILITY_TEST = "tests/test_device_path.py::test_every_device_mutation_still_applies_to_the_runtime"

DEFAULT_TESTS = ["tests/test_device_path.py", "tests/test_transfers.py", "tests/test_optimizer.py",
                 "tests/test_workflows.py", "tests/test_slab_workflows.py", "tests/test_overlap_reselect.py",
                 "tests/test_landing_lag.py", "tests/test_offload.py"]


def why_not_applicable(mutation: Mutation) -> Optional[str]:
    """None where the mutation edits its file's line once into code that still parses (a line re-indented
    since would otherwise match as a substring, break the module and look caught or not caught by accident);
    else why not."""
    source = (ROOT / mutation.path).read_text()
    if source.count(mutation.old) != 1:
        return f"the line is not in {mutation.path} once"
    try:
        ast.parse(source.replace(mutation.old, mutation.new))
    except SyntaxError as error:
        return f"the edited {mutation.path} does not parse ({error.msg}, line {error.lineno})"
    return None


def run_tests(tests: list[str], extra: list[str]) -> tuple[list[str], str]:
    """The failed test ids (errors included) and the tail of pytest's output."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "junit.xml"
        env = dict(os.environ, ZENFLOW_TEST_DEVICE="emulated")
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                                 f"--junitxml={report}", f"--deselect={APPLICABILITY_TEST}", *extra, *tests],
                                cwd=ROOT, env=env, capture_output=True, text=True)
        failed = []
        if report.exists():
            for case in ElementTree.parse(report).iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    failed.append(f"{case.get('classname')}::{case.get('name')}")
        return failed, (result.stdout + result.stderr)[-2000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="mutation keys to run (default: all)")
    parser.add_argument("--tests", nargs="*", default=DEFAULT_TESTS, help="test files or ids to run per mutation")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments (e.g. \"-k reference\")")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.key in args.only]
    uncaught = 0
    print("| mutation | what | first failing test |\n|---|---|---|")
    for mutation in chosen:
        path = ROOT / mutation.path
        original = path.read_text()
        why_not = why_not_applicable(mutation)
        if why_not is not None:
            print(f"| {mutation.key} | {mutation.what} | NOT APPLIED: {why_not} |")
            uncaught += 1
            continue
        try:
            path.write_text(original.replace(mutation.old, mutation.new))
            failed, _ = run_tests(args.tests, args.pytest_args.split())
        finally:
            path.write_text(original)
        if failed:
            verdict = failed[0]
        elif mutation.ordered_anyway:
            verdict = f"none (ordered anyway: {mutation.ordered_anyway})"
        else:
            verdict, uncaught = "NOT CAUGHT", uncaught + 1
        print(f"| {mutation.key} | {mutation.what} | {verdict} |", flush=True)
    return 1 if uncaught else 0


if __name__ == "__main__":
    sys.exit(main())
