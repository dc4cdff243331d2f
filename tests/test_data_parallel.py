"""Data parallel across 2 ranks (gloo on CPU): ranks vs one process on the concatenated batch.

Each launch starts two processes (`tests/dp_worker.py`, one per rank, a FileStore rendezvous), which run a
list of scenarios and save, per rank, the parameters and the selections after every step. The tests compare:
- every rank against ZenFlowAdamW in this process trained on the concatenated batch (mean loss), to fp32
  reduction-order rounding, for the configs of the single-process parity tests, compiled and eager;
- the two ranks against each other: the same selection and the same parameter bytes after every step;
- checkpoints: a rank's own state_dict resumes exactly at world size 2; the consolidated export loads at world
  size 1; torch.distributed.checkpoint resumes exactly at 2 and 3 ranks and loads at the other;
- faults: a config mismatch is a ValueError on every rank; a rank that dies makes the other raise.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zenflow_compile
from dp_worker import mask_first_rows
from helpers import TEST_DEVICES, launch_ranks, loss_fn, make_batches, max_param_diff, model_for, tiny_model

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dp_worker.py"
WORLD_SIZE = 2
ATOL = 1e-5  # fp32: the ranks' averaged gradient is summed in another order than one process's batch mean

BASE = dict(topk_ratio=0.25, update_interval=2, overlap_step=False, select_strategy="step", select_interval=3)
PARITY = {
    "reselect": dict(steps=8, keys=BASE),
    "overlap": dict(steps=8, keys=dict(BASE, overlap_step=True)),
    "zen_auto": dict(steps=8, keys=dict(topk_ratio=0.25, update_interval="auto", overlap_step=True)),
    "clipping": dict(steps=8, clip=0.05, keys=dict(BASE, overlap_step=True)),
    "accumulation": dict(steps=6, backwards_per_step=2, keys=dict(BASE, overlap_step=True)),
    "second_moment": dict(steps=6, backwards_per_step=2, keys=dict(BASE, overlap_step=True,
                                                                  interval_aware_update=True,
                                                                  interval_second_moment=True)),
    "warm_up_auto_select": dict(steps=8, keys=dict(topk_ratio=0.25, update_interval=2, full_warm_up_rounds=2,
                                                   overlap_step=True, select_strategy="auto",
                                                   select_interval="auto")),
    # Layers of equal shapes: stacked state (matrices of one group owned by different ranks), reselections
    # written in place, the hand-off buckets of the reducer beside them.
    "repeated_layers": dict(steps=8, model="repeated", keys=dict(BASE, overlap_step=True, select_interval=2)),
    # A tensor hook freezing embedding rows: what it returns is what gets averaged (compiled: the hooked
    # parameter's gradient goes through autograd and .grad, the others through the graph).
    "row_mask_hook": dict(steps=6, row_mask=True, keys=dict(BASE, overlap_step=True)),
    # The CPU update lands one step after its boundary: the owners' broadcast at that step on every rank.
    "landing_lag": dict(steps=8, keys=dict(BASE, update_interval=3, select_interval=6, overlap_step=True,
                                           landing_lag=1)),
    # A reselection at every boundary made while its CPU update runs on: the owners broadcast the arriving
    # columns' state; one boundary's update lands a step later.
    "incoming": dict(steps=8, keys=dict(BASE, update_interval=3, select_interval=3, overlap_step=True,
                                        overlap_reselect="incoming", landing_lag=1)),
    # Staggered boundaries over stacked layers: each phase's slabs, owned by either rank, at their own steps.
    "stagger": dict(steps=8, model="repeated", keys=dict(BASE, update_interval=3, select_interval=3,
                                                         overlap_step=True, overlap_reselect="incoming",
                                                         landing_lag=1, stagger_boundaries=True)),
    # offload=True: the selected columns' moments between their device trips, reselections in flight
    "offload": dict(steps=8, keys=dict(BASE, update_interval=3, select_interval=3, overlap_step=True,
                                       overlap_reselect="incoming", landing_lag=1, offload=True)),
}
MODES = ("eager", "compiled")
CHECKPOINT = dict(name="checkpoint", compiled=True, steps=5, resume_steps=4, keys=dict(BASE, overlap_step=True))


def launch(scenarios: list[dict], out_dir: Path, timeout: float = 600, env: dict | None = None) -> list[int]:
    return launch_ranks(WORKER, WORLD_SIZE, scenarios, out_dir, timeout, env)


def load(out_dir: Path, name: str) -> list[dict]:
    return [torch.load(out_dir / f"{name}.rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module", params=[d for d in TEST_DEVICES if d != "cuda"])
def runs(request, tmp_path_factory):
    """One launch for every scenario of this module (process start-up and compiles dominate the time), per
    test device: the ranks' optimizers on the host, or on the emulated asynchronous device (gloo runs on
    CPU tensors: cuda is not covered here)."""
    out_dir = tmp_path_factory.mktemp(f"data_parallel_{request.param}")
    scenarios = [dict(name=f"{name}_{mode}", compiled=mode == "compiled", **spec)
                 for name, spec in PARITY.items() for mode in MODES]
    # A one-process checkpoint, resumed on 2 ranks (test_a_full_state_dict_resumes_at_world_size_two).
    _, _, opt, model = one_process(CHECKPOINT, with_model=True)
    torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict()), out_dir / "one_process.pt")
    scenarios += [dict(name="load_full", compiled=False, steps=CHECKPOINT["resume_steps"], keys=CHECKPOINT["keys"],
                       load_from=str(out_dir / "one_process.pt"), first_step=CHECKPOINT["steps"])]
    scenarios += [CHECKPOINT,
                  dict(name="mismatch", compiled=False, steps=1, keys=BASE, mismatch_rank=1,
                       mismatch=dict(topk_ratio=0.5), expect_error=True),
                  dict(name="different_init", compiled=False, steps=1, keys=BASE, differ_init=True),
                  dict(name="grad_after_backward", compiled=False, steps=1, keys=BASE, grad_after_backward=True,
                       expect_error=True),
                  dict(name="accumulate_on_device", compiled=False, steps=1, expect_error=True,
                       keys=dict(BASE, accumulate_on="device")),
                  dict(name="accumulate_on_auto", compiled=False, steps=2, keys=dict(BASE, accumulate_on="auto"))]
    assert launch(scenarios, out_dir, env=dict(ZENFLOW_WORKER_DEVICE=request.param)) == [0] * WORLD_SIZE
    return out_dir


def one_process(spec: dict, steps: int | None = None, state_dict=None, model_state=None, first_step: int = 0,
                with_model: bool = False):
    """ZenFlowAdamW in this process on the concatenated batches (what the ranks must equal)."""
    model = model_for(spec.get("model", "tiny"), seed=0)
    if spec.get("row_mask"):
        mask_first_rows(model)
    # DeepSpeed's defaults for the keys the spec leaves out, as the rank workers (also outside a test's pin)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-2, max_grad_norm=spec.get("clip"), preset="deepspeed",
                                       **spec["keys"])
    if model_state is not None:
        model.load_state_dict(model_state)
        opt.load_state_dict(state_dict)
    batches = make_batches(64, batch=8)
    backwards = spec.get("backwards_per_step", 1)
    params, selected = [], []
    for step in range(first_step, first_step + (steps or spec["steps"])):
        for k in range(backwards):
            loss_fn(model, batches[step * backwards + k]).backward()
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
        selected.append([opt.selected_columns(p) for p in model.parameters() if p.dim() >= 2])
    if with_model:  # a checkpoint of the run as it stands (nothing applied by synchronize)
        return params, selected, opt, model
    opt.synchronize()
    return params, selected, opt


def same_selection(a: list, b: list) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(PARITY))
def test_ranks_equal_one_process_on_the_concatenated_batch(runs, name, mode):
    ranks = load(runs, f"{name}_{mode}")
    expected_params, expected_selected, _ = one_process(PARITY[name])
    for rank, record in enumerate(ranks):
        assert record["error"] is None
        assert len(record["params"]) == len(expected_params)
        for step, (got, want) in enumerate(zip(record["params"], expected_params)):
            assert max_param_diff(got, want) <= ATOL, (rank, step)
            assert same_selection(record["selected"][step], expected_selected[step]), (rank, step)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(PARITY))
def test_every_step_both_ranks_hold_the_same_selection_and_bytes(runs, name, mode):
    rank0, rank1 = load(runs, f"{name}_{mode}")
    for step in range(len(rank0["params"])):
        assert same_selection(rank0["selected"][step], rank1["selected"][step]), step
        assert all(torch.equal(a, b) for a, b in zip(rank0["params"][step], rank1["params"][step])), step
    assert rank0["stats"]["steps"] == rank1["stats"]["steps"] == PARITY[name]["steps"]


def test_a_reselection_in_flight_overlaps_every_boundary_on_every_rank(runs):
    for mode in MODES:
        for record in load(runs, f"incoming_{mode}"):
            stats = record["stats"]
            assert stats["reselections"] == stats["cpu_updates"] == stats["overlapped_boundaries"] == 2, stats
            assert stats["selection_churn"] > 0


def test_the_ranks_ran_on_the_test_device(runs):
    emulated = runs.name.startswith("data_parallel_emulated")
    assert [r["device_is_host"] for r in load(runs, "overlap_compiled")] == [not emulated] * WORLD_SIZE


def test_host_state_is_partitioned_and_bytes_are_counted_per_collective(runs):
    rank0, rank1 = (r["stats"] for r in load(runs, "overlap_compiled"))
    _, _, single = one_process(PARITY["overlap"])
    whole = single.stats()["host_state_bytes"]
    # Every matrix's host state lives on exactly one rank.
    assert rank0["host_state_bytes"] + rank1["host_state_bytes"] == whole
    assert 0 < rank0["host_state_bytes"] < whole and 0 < rank1["host_state_bytes"] < whole
    # Payload accounting: what one rank sends into the other's reduce / broadcast, the other receives.
    assert rank0["comm_bytes_sent"]["reduce"] == rank1["comm_bytes_received"]["reduce"] > 0
    assert rank1["comm_bytes_sent"]["reduce"] == rank0["comm_bytes_received"]["reduce"] > 0
    assert rank0["comm_bytes_sent"]["broadcast"] == rank1["comm_bytes_received"]["broadcast"] > 0
    assert rank0["comm_bytes_sent"]["all_reduce"] == rank1["comm_bytes_sent"]["all_reduce"] > 0
    # Only the owner offloads (and uploads) a matrix's unselected columns. At the first step data parallel lays
    # a matrix out with no column selected (its owner takes every column of that step's gradient), one process
    # lays it out selected (state/pending.py).
    matrices = [p for group in single.param_groups for p in group["params"] if p.dim() >= 2]
    first_selected = sum(p.shape[0] * single.selected_columns(p).numel() * p.element_size() for p in matrices)
    assert (rank0["bytes_device_to_host"] + rank1["bytes_device_to_host"]
            == single.stats()["bytes_device_to_host"] + first_selected)


def test_a_ranks_share_resumes_exactly_at_the_same_world_size(runs):
    for rank, record in enumerate(load(runs, "checkpoint")):
        continued = record["params"][CHECKPOINT["steps"]:]
        resumed = record["resumed"]["params"]
        assert len(continued) == len(resumed) == CHECKPOINT["resume_steps"]
        for step, (a, b) in enumerate(zip(continued, resumed)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (rank, step)
        saved = record["share"]["zenflow"]["data_parallel"]
        assert saved["world_size"] == WORLD_SIZE
        # This rank's entries are those of the parameters it owns; the others' are empty.
        owned = {i for i, owner in enumerate(saved["owners"].tolist()) if owner == rank}
        assert owned and {i for i, entry in record["share"]["state"].items() if entry} == owned


def test_the_consolidated_export_resumes_at_world_size_one(runs):
    rank0, rank1 = load(runs, "checkpoint")
    assert rank1["consolidated"] is None
    full = rank0["consolidated"]
    assert "data_parallel" not in full["zenflow"]
    # Every parameter's full state (the host columns too), whichever rank owned it.
    assert sorted(full["state"]) == list(range(len(rank0["initial"])))
    assert all("master" in entry for entry in full["state"].values())
    params, _, _ = one_process(CHECKPOINT, steps=CHECKPOINT["resume_steps"], state_dict=copy.deepcopy(full),
                               model_state=rank0["model_at_save"], first_step=CHECKPOINT["steps"])
    for step, (got, want) in enumerate(zip(params, rank0["params"][CHECKPOINT["steps"]:])):
        assert max_param_diff(got, want) <= ATOL, step


def test_a_full_state_dict_resumes_at_world_size_two(runs):
    """One process's state_dict (world-size-free, like a consolidated one) loaded on 2 ranks: each keeps the
    host state of its own matrices and the run goes on like the one process."""
    expected, expected_selected, _ = one_process(CHECKPOINT, steps=CHECKPOINT["steps"] + CHECKPOINT["resume_steps"])
    expected, expected_selected = expected[CHECKPOINT["steps"]:], expected_selected[CHECKPOINT["steps"]:]
    rank0, rank1 = load(runs, "load_full")
    assert rank0["error"] is None and rank1["error"] is None
    for step in range(CHECKPOINT["resume_steps"]):
        assert all(torch.equal(a, b) for a, b in zip(rank0["params"][step], rank1["params"][step])), step
        assert max_param_diff(rank0["params"][step], expected[step]) <= ATOL, step
        assert same_selection(rank0["selected"][step], expected_selected[step]), step
    assert 0 < rank0["stats"]["host_state_bytes"] and 0 < rank1["stats"]["host_state_bytes"]


def test_a_share_cannot_be_loaded_as_a_full_state_dict(runs):
    share = load(runs, "checkpoint")[1]["share"]
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), **CHECKPOINT["keys"])
    with pytest.raises(ValueError, match=r"has no state for parameter \d \(shape .*\), which rank 0 of the 2 ranks "
                                         r"that saved it held.*Fix: .*torch.distributed.checkpoint.*"
                                         r"consolidated_state_dict"):
        opt.load_state_dict(share)


def test_a_config_mismatch_is_a_clear_error_on_every_rank(runs):
    for record in load(runs, "mismatch"):
        assert record["error"] is not None and record["error"].startswith("ValueError: ZenFlowAdamW differs across")
        assert "rank 1 has 0.5 where rank 0 has 0.25 (config key topk_ratio)" in record["error"]


def test_device_accumulation_is_refused_and_auto_sums_on_the_host(runs):
    """ZenFlow's own data parallelism sums each matrix's host columns on the rank that owns them."""
    for record in load(runs, "accumulate_on_device"):
        assert record["error"] is not None and record["error"].startswith(
            "ValueError: ZenFlowConfig.accumulate_on='device' is not implemented with ZenFlow's own data "
            "parallelism")
    for record in load(runs, "accumulate_on_auto"):
        assert record["error"] is None and record["stats"]["accumulate_on"] == "host"


def test_a_grad_written_after_the_backward_is_refused_on_each_rank(runs):
    for record in load(runs, "grad_after_backward"):
        assert record["error"] is not None and record["error"].startswith("ValueError: ZenFlowAdamW (data parallel)")
        assert "parameter 1 of param group 0 (shape (24, 16)) has a .grad at step()" in record["error"]
        assert "register_hook" in record["error"] and "max_grad_norm" in record["error"]


# DistributedDataParallel around a ZenFlow model, at world sizes 1 and 2: "outside" the compiled model
# (torch.compile(DDP(model))) or "inside" (DDP(torch.compile(model))); "sequential": Tiny as an nn.Sequential,
# whose forward Dynamo leaves to run eagerly inside DDP's; "plain": no DDP, what one process trains.
DDP_SCENARIOS = dict(
    ddp_compiled_outside=dict(compiled=True, ddp="outside"),
    ddp_compiled_inside=dict(compiled=True, ddp="inside"),
    ddp_eager=dict(compiled=False, ddp="outside"),
    ddp_sequential_compiled=dict(compiled=True, ddp="outside", model="sequential"),
    plain_eager=dict(compiled=False),
)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> dict[int, Path]:
    """One launch per world size (1 and 2) of the DDP scenarios, on the host."""
    out = {}
    for world_size in (1, 2):
        out[world_size] = tmp_path_factory.mktemp(f"ddp_world_{world_size}")
        scenarios = [dict(name=name, steps=2, keys=BASE, expect_error=True, **spec)
                     for name, spec in DDP_SCENARIOS.items()]
        assert launch_ranks(WORKER, world_size, scenarios, out[world_size]) == [0] * world_size
    return out


def load_ddp(ddp_runs, world_size: int, name: str) -> list[dict]:
    return [torch.load(ddp_runs[world_size] / f"{name}.rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_compiled_model_in_ddp_is_refused_when_it_is_compiled(ddp_runs, world_size, where):
    """Compiled, the graph would hand each gradient to ZenFlowAdamW before DDP could average it: refused when
    the graph is compiled (the first forward, before any backward), whichever way DDP wraps the compiled model,
    in one process too, with the fix named."""
    for record in load_ddp(ddp_runs, world_size, f"ddp_compiled_{where}"):
        error = record["error"] or ""
        assert error.startswith("BackendCompilerFailed") and record["phase"] == "forward 0", (record["phase"], error)
        assert "compiled a model wrapped in torch.nn.parallel.DistributedDataParallel" in error, error
        assert "do not wrap the model in DDP" in error and record["params"] == []


def test_an_eager_model_in_ddp_is_refused_at_the_first_step_on_two_ranks_and_trains_as_without_it_on_one(ddp_runs):
    """Eagerly (and where Dynamo compiles nothing inside DDP: an nn.Sequential model, whose forward it leaves to
    run eagerly) DDP refills the `.grad` that the data-parallel hooks took: refused at the first step, naming
    DDP. In one process ZenFlowAdamW is not data parallel and DDP's average over one rank is the gradient itself:
    nothing tells its `.grad` from a plain backward's, and it trains exactly as without DDP."""
    for name in ("ddp_eager", "ddp_sequential_compiled"):
        for record in load_ddp(ddp_runs, 2, name):
            error = record["error"] or ""
            assert error.startswith("ValueError: ZenFlowAdamW (data parallel)") and record["phase"] == "step 0", \
                (name, record["phase"], error)
            assert "wrapped in DistributedDataParallel" in error and "do not wrap the model in DDP" in error
        (record,) = load_ddp(ddp_runs, 1, name)
        (plain,) = load_ddp(ddp_runs, 1, "plain_eager")
        assert record["error"] is None and plain["error"] is None, (record["error"], plain["error"])
        assert len(record["params"]) == 2 and max_param_diff(record["params"][-1], plain["params"][-1]) == 0.0


def test_a_checkpoint_of_other_shapes_is_refused_on_every_rank_and_training_goes_on(tmp_path):
    """A full state_dict of a model whose head is wider, loaded on 2 ranks: whichever rank owns the head finds it,
    every rank raises the same ValueError naming it (no hang in a collective), and training then goes on on
    both ranks exactly as without the attempt."""
    wide = model_for("repeated", seed=0)
    opt = zenflow_compile.ZenFlowAdamW(wide.parameters(), lr=1e-2, preset="deepspeed", **BASE)
    batches = make_batches(2, batch=8)
    for batch in batches:
        wide(batch[0]).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.save(opt.state_dict(), tmp_path / "wide.pt")
    narrow = dict(compiled=False, steps=3, keys=BASE, model="repeated", head=8, expect_error=True)
    scenarios = [dict(narrow, name="refused", load_optimizer_from=str(tmp_path / "wide.pt")),
                 dict(narrow, name="untouched")]
    assert launch(scenarios, tmp_path / "out") == [0] * WORLD_SIZE
    refused, untouched = load(tmp_path / "out", "refused"), load(tmp_path / "out", "untouched")
    for rank, (record, twin) in enumerate(zip(refused, untouched)):
        assert record["error"] is None and twin["error"] is None, (record["error"], twin["error"])
        assert "holds state of shape (16, 16) for parameter 13 of param group 0, which has shape (8, 16)" in \
            record.get("load_error", ""), (rank, record.get("load_error"))
        assert len(record["params"]) == 3 and max_param_diff(record["params"][-1], twin["params"][-1]) == 0.0


def test_parameters_are_broadcast_from_rank_zero_at_construction(runs):
    rank0, rank1 = load(runs, "different_init")
    assert all(torch.equal(a, b) for a, b in zip(rank0["initial"], rank1["initial"]))
    assert all(torch.equal(a, b) for a, b in zip(rank0["initial"], tiny_model(seed=0).parameters()))


def test_a_rank_that_dies_makes_the_other_raise(tmp_path):
    scenario = dict(name="dies", compiled=False, steps=6, keys=dict(BASE, overlap_step=True), die_rank=1,
                    die_after_step=1, expect_error=True)
    start = time.monotonic()
    codes = launch([scenario], tmp_path, timeout=180, env=dict(ZENFLOW_TEST_TIMEOUT="30"))
    assert codes[1] == 3  # the rank that died
    assert time.monotonic() - start < 150
    survivor = torch.load(tmp_path / "dies.rank0.pt", weights_only=False)
    assert survivor["error"] is not None
    assert "collective across the data-parallel group failed" in survivor["error"], survivor["traceback"]
    assert len(survivor["params"]) == 2  # it got past the steps both ranks ran, and no further


def test_torchrun_example(tmp_path):
    checkpoint = tmp_path / "full.pt"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "examples" / "data_parallel.py"), "--steps", "12", "--checkpoint", str(checkpoint)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ranks agree: True  (world size 2)" in result.stdout
    full = torch.load(checkpoint, weights_only=False)
    assert "data_parallel" not in full["zenflow"] and len(full["state"]) == 9  # every parameter of TinyLM


DCP = dict(compiled=False, steps=6, more_steps=4, global_batch=12, unused_param=True,
           keys=dict(BASE, overlap_step=True))  # (overlap: a CPU update is pending at the save)


@pytest.mark.parametrize("saved_at,loaded_at", [(2, 3), (3, 2), (2, 1), (1, 2)], ids=["2to3", "3to2", "2to1", "1to2"])
def test_dcp_checkpoint_resumes_exactly_and_at_another_world_size(tmp_path, saved_at, loaded_at):
    """torch.distributed.checkpoint with the state_dict functions (get_state_dict / set_state_dict): saved on
    `saved_at` ranks after 6 steps, resumed by as many fresh ranks exactly (bitwise, every step, the same
    owners), and loaded by `loaded_at` ranks: the same consolidated state, bitwise, and the run goes on like the
    saving ranks' (to fp32 reduction-order rounding). A trainable parameter that never got a gradient stays
    without state through it, and the fresh optimizers giving DCP its template are not stepped. One rank's
    torch.save'd state_dict loaded at the other world size is refused on every rank (one of a one-rank launch
    is whole and loads). One rank is one process of a launch (no data parallelism): it saves and loads the
    same form."""
    checkpoint = str(tmp_path / "checkpoint")
    codes = launch_ranks(WORKER, saved_at, [dict(DCP, name="save", dcp_save=checkpoint)], tmp_path / "saved")
    assert codes == [0] * saved_at
    scenarios = [dict(DCP, name="load", dcp_load=checkpoint, first_step=DCP["steps"], steps=DCP["more_steps"]),
                 dict(DCP, name="rank_state", load_rank_state=checkpoint, saved_at=saved_at, steps=0,
                      expect_error=True)]
    assert launch_ranks(WORKER, loaded_at, scenarios, tmp_path / "loaded") == [0] * loaded_at
    saving = [torch.load(tmp_path / "saved" / f"save.rank{r}.pt", weights_only=False) for r in range(saved_at)]
    loading = [torch.load(tmp_path / "loaded" / f"load.rank{r}.pt", weights_only=False) for r in range(loaded_at)]
    steps, more = DCP["steps"], DCP["more_steps"]
    for rank, record in enumerate(saving):
        continued, resumed = record["params"][steps:], record["resumed"]["params"]
        assert len(continued) == len(resumed) == more
        for step, (a, b) in enumerate(zip(continued, resumed)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (rank, step)
            assert same_selection(record["selected"][steps + step], record["resumed"]["selected"][step])
        assert record["resumed"]["owners"] == record["owners"]
        assert record["resumed"]["unused_has_state"] is False
    saved = saving[0]["consolidated"]
    assert saved["zenflow"]["update_pending"]  # (the checkpoint holds a pending CPU update)
    assert len(saved["state"]) == len(saving[0]["initial"]) - 1  # every parameter but the unused one
    worst = 0.0
    for rank, record in enumerate(loading):
        assert record["template_steps"] == 0 and record["unused_has_state"] is False
        got = record["consolidated"]
        if rank != 0:
            assert got is None
            continue
        assert got["zenflow"] == saved["zenflow"]
        assert sorted(got["state"]) == sorted(saved["state"])
        for i, entry in saved["state"].items():
            assert sorted(got["state"][i]) == sorted(entry), i
            for key, value in entry.items():
                other = got["state"][i][key]
                assert (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other), (i, key)
    for record in loading:
        assert len(record["params"]) == more
        for step, (a, b) in enumerate(zip(record["params"], saving[0]["params"][steps:])):
            worst = max(worst, max_param_diff(a, b))
            assert max_param_diff(a, b) <= ATOL, step
            assert same_selection(record["selected"][step], saving[0]["selected"][steps + step]), step
    for rank in range(loaded_at):
        refused = torch.load(tmp_path / "loaded" / f"rank_state.rank{rank}.pt", weights_only=False)
        if saved_at == 1:
            assert refused["error"] is None
            continue
        assert re.search(r"ValueError: ZenFlowAdamW.load_state_dict: this state_dict has no state for parameter "
                         rf"\d+ .*of the {saved_at} ranks that saved it.*Fix: load it on the rank that saved it",
                         refused["error"] or "", flags=re.S), refused["error"]
    print(f"DCP {saved_at} -> {loaded_at} ranks: max |param - the saving run's| over {more} steps = {worst:.3g}")
