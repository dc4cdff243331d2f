"""Small shared helpers for the tests: a tiny model, deterministic batches, a training loop, comparisons.

Generic on purpose (any torch.optim.Optimizer-like object works: torch.optim.AdamW, ZenFlowReference,
ZenFlowAdamW eager or compiled), so every test file can reuse them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import pytest
import torch
from torch import nn


def _test_devices() -> list[str]:
    chosen = os.environ.get("ZENFLOW_TEST_DEVICE")
    if chosen:
        names = [name.strip() for name in chosen.split(",") if name.strip()]
        unknown = sorted(set(names) - {"cpu", "emulated", "cuda"})
        if unknown:
            raise ValueError(f"ZENFLOW_TEST_DEVICE: unknown device(s) {unknown}; use cpu, emulated, cuda")
        return names
    return ["cpu", "emulated"] + (["cuda"] if torch.cuda.is_available() else [])


# The devices the value tests run on (the `device` fixture): ZENFLOW_TEST_DEVICE, comma-separated, or by default
# cpu and the emulated device, plus cuda when one is present.
TEST_DEVICES = _test_devices()


__all__ = ["TEST_DEVICES", "seeded_generator", "skip_where_dynamo_misses_parameter_changes", "value_tolerance",
           "launch_ranks", "Tiny", "tiny_model", "TinyRepeated", "tiny_sequential", "model_for", "make_batches",
           "loss_fn", "train_steps", "TrainLog", "max_param_diff", "snapshot", "bf16_ulp_distance"]


class Tiny(nn.Module):
    """Embedding(32, 16) -> Linear(16, 24) -> tanh -> LayerNorm(24) -> Linear(24, 16).

    Matrices: emb.weight [32, 16], fc1.weight [24, 16], fc2.weight [16, 24]; vectors: the biases and the norm.
    """

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc1 = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.fc2 = nn.Linear(24, 16)

    def forward(self, x):
        return self.fc2(self.norm(torch.tanh(self.fc1(self.emb(x)))))


def tiny_model(dtype: torch.dtype = torch.float32, seed: int = 0,
               device: Union[str, torch.device, None] = None) -> Tiny:
    """The same Tiny model (same initial weights) for the same seed, cast to `dtype`, on `device` (default:
    torch's default device, which the `device` fixture sets for cuda)."""
    torch.manual_seed(seed)
    with torch.device("cpu"):  # (initial weights drawn on the CPU: the same on every device)
        model = Tiny()
    return model.to(device=device or torch.get_default_device(), dtype=dtype)


class TinyRepeated(nn.Module):
    """Tiny's interface (tokens < 32 in, 16 features out by default) with layers of equal shapes, the case
    the runtime stacks: Embedding(32, 16) -> three (Linear(16, 16), LayerNorm(16)) with residuals ->
    Linear(16, out_features)."""

    def __init__(self, out_features: int = 16):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(3))
        self.head = nn.Linear(16, out_features)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = torch.tanh(block(h)) + h
        return self.head(h)


def tiny_sequential() -> nn.Sequential:
    """Tiny as an `nn.Sequential`: the same layers, built in the same order (the same weights for a seed), in
    one of torch.nn's own modules, whose forward Dynamo does not trace where eager code such as
    DistributedDataParallel's forward calls it."""
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 24), nn.Tanh(), nn.LayerNorm(24), nn.Linear(24, 16))


def model_for(kind: str = "tiny", seed: int = 0) -> nn.Module:
    """"tiny" (`Tiny`), "repeated" (`TinyRepeated`) or "sequential" (`tiny_sequential`), same initial weights for
    the same seed."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = {"tiny": Tiny, "repeated": TinyRepeated, "sequential": tiny_sequential}[kind]()
    return model.to(torch.get_default_device())


# On CUDA, ZenFlow's compiled device update and its rewritten backward round differently from the eager ops
# and the plain Inductor graphs of an oracle (fused multiply-adds, other reduction orders, atomic adds in an
# embedding's backward), and Adam's normalisation magnifies that where a gradient is near zero. Seen on an H100
# (torch 2.11): up to 1.9e-6 after 12 steps of Tiny, 1.4e-5 (relative 6.9e-4) on one element of a Llama layer
# after one step; on the CPU the same comparisons hold to 1e-6.
CUDA_ATOL, CUDA_RTOL = 5e-5, 1e-4


def value_tolerance(atol: float, rtol: float) -> dict:
    """`atol` / `rtol` for comparing fp32 values with an oracle's, relaxed on CUDA (above)."""
    if torch.get_default_device().type == "cuda":
        return dict(atol=max(atol, CUDA_ATOL), rtol=max(rtol, CUDA_RTOL))
    return dict(atol=atol, rtol=rtol)


def float64_twin_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`loss_fn` for a float64 copy of the model (its output not rounded to fp32)."""
    x, y = batch
    return ((model(x) - y.double()) ** 2).mean()


def assert_fp32_decides_the_comparison(fp32_model: nn.Module, float64_model: nn.Module, what: str, atol: float,
                                       rtol: float) -> None:
    """The premise of comparing two fp32 optimizers at (atol, rtol): the workflow is conditioned well enough that
    fp32 rounding moves its result by less than half of that (the fp32 reference against its float64
    recomputation: the same reference over a float64 copy, whose state is float64 too); then two correct fp32
    implementations, each that far from the exact result, agree within it. Where AdamW divides a gradient that
    is rounding noise (saturated activations, a sum that cancels to near eps) by its own size, this fails, and no
    fp32 comparison at that tolerance means anything on another machine."""
    for (name, p), q in zip(fp32_model.named_parameters(), float64_model.parameters()):
        torch.testing.assert_close(p.double(), q, atol=atol / 2, rtol=rtol / 2,
                                   msg=lambda m: f"{what}: fp32 rounding alone moves {name} this far, so no "
                                                 f"fp32 comparison at atol={atol}, rtol={rtol} can hold: {m}")


def skip_where_dynamo_misses_parameter_changes() -> None:
    """torch 2.11's Dynamo keeps running a compiled graph after a parameter starts or stops requiring grad or
    changes memory format (plain `torch.compile` too), and, with two backends compiled over one module class,
    after a cast; torch 2.13 recompiles (docs/compiling.md, "Which torch"). A compiled test of such a change
    skips there."""
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 13):
        pytest.skip(f"torch {torch.__version__}: Dynamo does not recompile after this parameter change")


def seeded_generator(seed: int) -> torch.Generator:
    """A generator on torch's default device (the device fixture sets it to cuda there), so tests draw their
    inputs where their model lives."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def make_batches(n: int, dtype: torch.dtype = torch.float32, seed: int = 1000, batch: int = 8, seq: int = 6,
                 device: Union[str, torch.device, None] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` deterministic (tokens, target) micro-batches for `Tiny` (drawn on the CPU, then moved to `device`,
    default: torch's default device)."""
    device = device or torch.get_default_device()
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(seed + i)
        x = torch.randint(0, 32, (batch, seq), generator=g, device="cpu")
        y = torch.randn(batch, seq, 16, generator=g, device="cpu")
        out.append((x.to(device), y.to(device=device, dtype=dtype)))
    return out


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x).float() - y.float()) ** 2).mean()


@dataclass
class TrainLog:
    """What `train_steps` saw: parameters after every step and, with `clip`, the pre-clip global norms."""

    params: list[list[torch.Tensor]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


def snapshot(model_or_params) -> list[torch.Tensor]:
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    return [p.detach().clone() for p in params]


def train_steps(model: nn.Module, opt, batches: Sequence, backwards_per_step: Union[int, Sequence[int]] = 1,
                clip: Optional[float] = None, *, scheduler=None,
                after_backward: Optional[Callable[[int], None]] = None,
                loss: Callable = loss_fn) -> TrainLog:
    """Train: for each step, `backwards_per_step` backward passes (one micro-batch each), then `opt.step()`,
    `opt.zero_grad()` and `scheduler.step()` if given.

    `backwards_per_step` is an int (every step; the number of steps is len(batches) // it) or one int per
    step (gradient accumulation on some steps only). `clip` calls `clip_grad_norm_(model.parameters(), clip)`
    before the step (what a torch.optim.AdamW baseline does for ZenFlow's `max_grad_norm`) and records the
    returned norm. `after_backward(step)` runs between the last backward and `opt.step()`.
    Returns a TrainLog with a clone of every parameter after every step.
    """
    if isinstance(backwards_per_step, int):
        counts = [backwards_per_step] * (len(batches) // backwards_per_step)
    else:
        counts = list(backwards_per_step)
    if sum(counts) > len(batches):
        raise ValueError(f"{sum(counts)} backward passes need as many batches, got {len(batches)}")
    log, i = TrainLog(), 0
    for step, k in enumerate(counts):
        for _ in range(k):
            loss(model, batches[i]).backward()
            i += 1
        if clip is not None:
            log.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if after_backward is not None:
            after_backward(step)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        log.params.append(snapshot(model))
    return log


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, nn.Module):
        return [p.detach() for p in x.parameters()]
    if isinstance(x, torch.Tensor):
        return [x.detach()]
    return [t.detach() for t in x]


def max_param_diff(a, b) -> float:
    """Max absolute difference (in fp32) between two models, or two lists of tensors, of the same layout."""
    ta, tb = _tensors(a), _tensors(b)
    if len(ta) != len(tb):
        raise ValueError(f"different numbers of tensors: {len(ta)} vs {len(tb)}")
    diff = 0.0
    for x, y in zip(ta, tb):
        if x.shape != y.shape:
            raise ValueError(f"shape mismatch {tuple(x.shape)} vs {tuple(y.shape)}")
        if x.numel():
            diff = max(diff, (x.float() - y.float()).abs().max().item())
    return diff


def bf16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max number of representable bf16 values between a and b (elementwise, 0 = bitwise equal)."""

    def ordered(t):
        i = t.detach().to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)  # monotonic in the float value; +0 and -0 both map to 0

    if a.numel() == 0:
        return 0
    return int((ordered(a) - ordered(b)).abs().max())


class CompiledFunction(torch.autograd.Function):
    """Named like AOTAutograd's autograd.Function, so `registry.bind_param_ids` finds its node. Its backward
    runs `body()`: a rewritten backward graph called by hand then resolves its slots as in a real backward."""

    @staticmethod
    def forward(ctx, x, body, result):
        ctx.body, ctx.result = body, result
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        ctx.result.append(ctx.body())
        return grad, None, None


def run_bound(body: Callable, param_ids: Sequence) -> object:
    """Run `body()` inside the backward of a node bound to `param_ids` (one per slot, None for non-params)."""
    from zenflow_compile.runtime import registry

    result: list = []
    y = CompiledFunction.apply(torch.zeros(1, requires_grad=True), body, result)
    registry.bind_param_ids(y, tuple(param_ids))
    y.sum().backward()
    return result[0]


def slot_ids(ctx, pid_of_name: dict) -> tuple:
    """The per-slot parameter ids of a ZenFlowPassContext, from parameter names."""
    return tuple(pid_of_name.get(ctx.name(i)) if ctx.is_param(i) else None for i in range(ctx.num_inputs))


# -- DeepSpeed in the test process -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forget_deepspeed_groups() -> None:
    """deepspeed.utils.groups caches process groups module-wide; after a destroy_process_group they are dead."""
    from deepspeed.utils import groups

    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                 "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()


def deepspeed_on_cpu() -> Iterator:
    """For a module-scoped fixture (`yield from`): deepspeed on its CPU accelerator with a one-rank gloo group,
    its shm_comm op never built in the test process; afterwards the group is destroyed, DeepSpeed's cached
    groups and communication backend are forgotten and the environment is restored."""
    import pytest

    env = dict(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deepspeed = pytest.importorskip("deepspeed")
        import deepspeed.comm.comm as ds_comm
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            pytest.skip(f"DeepSpeed's accelerator was already chosen in this process: "
                        f"{get_accelerator().device_name()}")
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        _forget_deepspeed_groups()  # an earlier module's destroyed group must not be reused
        yield deepspeed
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        ds_comm.cdb = None  # so a later in-process user starts DeepSpeed's communication from scratch
        _forget_deepspeed_groups()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_ranks_scenarios(run: Callable[[dict, int, int, Path], None]) -> None:
    """The rank side of `launch_ranks` (a worker script's main): join the gloo group, then `run(scenario, rank,
    world_size, out_dir)` for each scenario, on the emulated asynchronous device when ZENFLOW_WORKER_DEVICE
    says so (the optimizers' device path over the CPU tensors gloo reduces; an ordering violation fails the
    rank). A scenario in which a rank dies has no barrier after it, and the group is then not torn down."""
    import contextlib
    import datetime
    import gc

    import torch.distributed as dist

    from emulated_device import emulated_async_device

    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    scenarios = torch.load(spec_path, weights_only=False)
    timeout = datetime.timedelta(seconds=float(os.environ.get("ZENFLOW_TEST_TIMEOUT", "60")))
    dist.init_process_group("gloo", init_method=f"file://{os.environ['ZENFLOW_TEST_INIT']}", rank=rank,
                            world_size=world_size, timeout=timeout)
    emulated = os.environ.get("ZENFLOW_WORKER_DEVICE") == "emulated"
    try:
        with emulated_async_device() if emulated else contextlib.nullcontext():
            for scenario in scenarios:
                run(scenario, rank, world_size, out_dir)
                if scenario.get("die_rank") is None:
                    dist.barrier()
    finally:
        if not any(s.get("die_rank") is not None for s in scenarios):
            # Whatever the scenarios left in reference cycles (an optimizer holds the group) is freed while the
            # interpreter is whole: gloo's teardown during finalization can abort the process.
            gc.collect()
            dist.destroy_process_group()


def launch_ranks(worker: Path, world_size: int, scenarios: list[dict], out_dir: Path, timeout: float = 600,
                 env: Optional[dict] = None) -> list[int]:
    """Run `worker` (a script taking the scenarios file and `out_dir`) on `world_size` fresh processes, ranks
    of one gloo group; return their exit codes. A rank that hangs past `timeout` fails the test (TimeoutExpired),
    and every rank still running is killed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "scenarios.pt"
    torch.save(scenarios, spec)
    init = out_dir / "rendezvous"
    procs = []
    for rank in range(world_size):
        rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), ZENFLOW_TEST_INIT=str(init),
                        OMP_NUM_THREADS="1", **(env or {}))
        procs.append(subprocess.Popen([sys.executable, str(worker), str(spec), str(out_dir)], env=rank_env))
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return codes
