"""Triton kernels (triton_kernels/) against float64 torch recomputations.

CPU: the kernels run under the Triton interpreter (`TRITON_INTERPRET=1`, set by an autouse fixture for these
tests only, so Inductor's kernels elsewhere in the session stay compiled). CUDA: the same tests, compiled, when
a GPU is present. Every kernel test also runs the plain-torch fallback (`impl="torch"`), the path taken
where Triton cannot run.

Tolerances (fp32 unit roundoff u = 2**-24 ~ 6e-8):
- column norms: a sum of R <= 129 non-negative fp32 terms has relative error <= (R + 1) u ~ 8e-6; rtol 1e-5,
  atol 0 (measured: <= 3e-7).
- merge: a pure cast, so bit-exact against torch's `.to(dtype)` (round-to-nearest-even).
- AdamW vs float64: about ten fp32 roundings per element, each <= u relative to operands of magnitude <= ~3,
  so rtol 1e-5 / atol 1e-6 leaves a margin of >3x (measured on CPU: master <= 2.7e-7, exp_avg <= 1.4e-8,
  exp_avg_sq <= 1e-9 abs). Counts are exact integers.
  The parameter columns are bit-exact casts of the kernel's own fp32 master, and within 1 ulp of the float64
  result cast to the param dtype (a tie-near value may round the other way).
- AdamW vs torch.optim.AdamW over several steps (fp32): the same fp32 formula with different operation
  order / FMA contraction; rtol 1e-5 / atol 1e-6 (measured on CPU: <= 1.2e-7 abs).
"""

import pytest
import torch

pytest.importorskip("triton")

from zenflow_compile.triton_kernels import (  # noqa: E402
    adamw_selected_columns_,
    column_sq_norms,
    merge_host_columns_,
    triton_available,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]  # cuda: skipped without a GPU (conftest.py)
IMPLS = ["triton", "torch"]
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    # The kernels pick interpreted (CPU) or compiled (CUDA) per call; only this variable gates the CPU path.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _use_triton(impl, device):
    if impl == "torch":
        return False
    if not triton_available(device):
        pytest.skip(f"triton cannot run on {device}")
    return True


_MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of `x`'s dtype at |x| (as float64)."""
    a = x.double().abs().clamp_min(torch.finfo(x.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - _MANTISSA_BITS[x.dtype])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _noncontig(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as `t` [R, C], stored as a non-contiguous view."""
    if how == "t":  # transposed storage
        return t.t().contiguous().t()
    if how == "stride":  # every other column of a wider buffer
        buf = torch.full((t.shape[0], 2 * t.shape[1] + 1), float("nan"), dtype=t.dtype, device=t.device)
        buf[:, 1::2] = t
        return buf[:, 1::2]
    return t


# ------------------------------------------------------------------------------------------- column norms
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("R,C,dtype,layout,split", [
    (1, 1, torch.float32, "", None),
    (3, 17, torch.bfloat16, "t", None),
    (129, 3, torch.float16, "stride", 3),
    (17, 129, torch.float32, "t", 2),
    (129, 17, torch.bfloat16, "", None),
])
def test_column_sq_norms(device, impl, R, C, dtype, layout, split):
    use = _use_triton(impl, device)
    gen = torch.Generator().manual_seed(R * 1000 + C)
    g = (torch.randn(R, C, generator=gen) * 3).to(dtype).to(device)
    g = _noncontig(g, layout)
    out = torch.full((C,), float("nan"), device=device)  # poisoned output
    res = column_sq_norms(g, out=out, split_rows=split, use_triton=use)
    assert res.data_ptr() == out.data_ptr() and res.dtype == torch.float32
    expected = g.double().square().sum(0)
    torch.testing.assert_close(res.double(), expected, rtol=1e-5, atol=0)
    # The allocating form agrees bit for bit with the out= form.
    assert torch.equal(column_sq_norms(g, split_rows=split, use_triton=use), res)


# ------------------------------------------------------------------------------------------------ merge
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("R,C,n,dtype,layout", [
    (1, 1, 1, torch.float32, ""),
    (3, 17, 17, torch.bfloat16, "t"),      # n = C: every column
    (129, 3, 1, torch.float16, "stride"),  # n = 1
    (17, 129, 70, torch.bfloat16, "stride"),
    (129, 17, 9, torch.float32, "t"),
])
def test_merge_host_columns(device, impl, R, C, n, dtype, layout):
    use = _use_triton(impl, device)
    gen = torch.Generator().manual_seed(R * 1000 + C + n)
    param = _noncontig(torch.randn(R, C, generator=gen).to(dtype).to(device), layout)
    cols = torch.randperm(C, generator=gen)[:n].to(device)  # not sorted
    values = torch.randn(n, R, generator=gen).to(device)
    if layout:  # values as a transposed view too
        values = values.t().contiguous().t()
    before = param.clone()
    param[:, cols] = float("nan")  # poison the columns that must be written
    out = merge_host_columns_(param, cols, values, use_triton=use)
    assert out is param
    expected = before.clone()
    expected[:, cols] = values.t().to(dtype)  # torch's cast (round to nearest even)
    assert torch.equal(_bits(param), _bits(expected))  # written columns exact, the others untouched


# ------------------------------------------------------------------------------------------------ AdamW
HP = dict(lr=3e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)

# (R, C, k, param dtype, grad dtype (None: param's), gather from the full gradient?, grad layout, state layout)
PARAM_CASES = [
    (1, 1, 1, torch.float32, None, False, "", ""),
    (3, 17, 5, torch.bfloat16, None, True, "t", ""),          # gather variant, transposed full gradient
    (17, 3, 3, torch.float16, None, False, "stride", "t"),    # k = C, strided grad, transposed state
    (129, 17, 1, torch.float32, None, False, "t", ""),        # k = 1, many rows
    (33, 40, 40, torch.bfloat16, None, True, "", "stride"),   # gather, k = C, strided state
    (5, 7, 0, torch.float32, None, False, "", ""),            # nothing selected: skipped
    (4, 9, 2, torch.bfloat16, torch.float32, False, "", ""),  # fp32 gradient for a bf16 parameter
]


def _make_param(case, device, gen):
    R, C, k, dtype, gdtype, gather, g_layout, s_layout = case
    gdtype = gdtype or dtype
    param = torch.randn(R, C, generator=gen).to(dtype).to(device)
    cols = torch.randperm(C, generator=gen)[:k].to(device)
    master = _noncontig(param[:, cols].float() + 1e-3 * torch.randn(R, k, generator=gen).to(device), s_layout)
    exp_avg = _noncontig(0.1 * torch.randn(R, k, generator=gen).to(device), s_layout)
    exp_avg_sq = _noncontig(0.01 * torch.rand(R, k, generator=gen).to(device), s_layout)
    steps = torch.randint(0, 50, (k,), generator=gen).float().to(device)  # per-column counts that differ
    if gather:
        gcols = torch.randperm(C, generator=gen)[:k].to(device)
        grad = _noncontig(torch.randn(R, C, generator=gen).to(gdtype).to(device), g_layout)
    else:
        gcols = None
        grad = _noncontig(torch.randn(R, k, generator=gen).to(gdtype).to(device), g_layout)
    return dict(grad=grad, master=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=steps, param=param,
                cols=cols, gcols=gcols)


def _expected_f64(p, scale, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step in float64 from the inputs, per column count n (after the increment)."""
    g = p["grad"].double()
    g = (g[:, p["gcols"]] if p["gcols"] is not None else g) * scale
    n = p["step"].double() + 1
    w = p["master"].double() * (1 - lr * weight_decay)
    m = p["exp_avg"].double() + (1 - beta1) * (g - p["exp_avg"].double())
    v = beta2 * p["exp_avg_sq"].double() + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2 ** n).sqrt() + eps
    w = w - lr / (1 - beta1 ** n) * m / denom
    return dict(master=w, exp_avg=m, exp_avg_sq=v, step=n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_adamw_selected_columns_many_params(device, impl, scale_kind):
    use = _use_triton(impl, device)
    gen = torch.Generator().manual_seed(7)
    ps = [_make_param(case, device, gen) for case in PARAM_CASES]
    scale = 0.37
    grad_scale = scale if scale_kind == "float" else torch.tensor(scale, device=device)
    expected = [_expected_f64(p, scale, **HP) for p in ps]
    before = [p["param"].clone() for p in ps]
    for p in ps:
        p["param"][:, p["cols"]] = float("nan")  # poison the columns the kernel writes

    adamw_selected_columns_(
        [p["grad"] for p in ps], [p["master"] for p in ps], [p["exp_avg"] for p in ps],
        [p["exp_avg_sq"] for p in ps], [p["step"] for p in ps], [p["param"] for p in ps], [p["cols"] for p in ps],
        grad_scale=grad_scale, grad_columns=[p["gcols"] for p in ps], use_triton=use, **HP)

    for case, p, exp, b in zip(PARAM_CASES, ps, expected, before):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(p[key].double(), exp[key], rtol=1e-5, atol=1e-6, msg=f"{case} {key}")
        assert torch.equal(p["step"].double(), exp["step"]), case
        dtype, cols = p["param"].dtype, p["cols"]
        got = p["param"][:, cols]
        # The device copy is the cast of the master (bit-exact) ...
        assert torch.equal(_bits(got), _bits(p["master"].to(dtype))), case
        # ... and within 1 ulp of the float64 result cast.
        ref = exp["master"].to(dtype)
        ulp = torch.maximum(_ulp(ref), _ulp(got))
        assert ((got.double() - ref.double()).abs() <= ulp).all(), case
        # Columns not selected keep their exact bits.
        untouched = torch.ones(p["param"].shape[1], dtype=torch.bool, device=device)
        untouched[cols] = False
        assert torch.equal(_bits(p["param"][:, untouched]), _bits(b[:, untouched])), case


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("beta1,clip", [(0.9, False), (0.3, True)])  # beta1=0.3: lerp's weight >= 0.5 branch
def test_adamw_selected_columns_matches_torch_adamw(device, impl, beta1, clip):
    """fp32 params, all columns selected, several steps: the kernel == torch.optim.AdamW to fp32 rounding."""
    use = _use_triton(impl, device)
    gen = torch.Generator().manual_seed(11)
    shapes = [(17, 5), (3, 33), (1, 1)]
    hp = dict(HP, beta1=beta1)
    ref_params = [torch.randn(*s, generator=gen).to(device) for s in shapes]
    opt = torch.optim.AdamW(ref_params, lr=hp["lr"], betas=(beta1, hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=False)
    params = [p.detach().clone() for p in ref_params]
    masters = [p.clone() for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(p.shape[1], device=device) for p in params]
    cols = [torch.arange(p.shape[1], device=device) for p in params]
    for _ in range(4):
        grads = [torch.randn(*s, generator=gen).to(device) for s in shapes]
        coef = 1.0
        if clip:  # what clip_grad_norm_ does, with the coefficient left on the device
            norm = torch.sqrt(sum(g.square().sum() for g in grads))
            coef = torch.clamp(0.5 / (norm + 1e-6), max=1.0)
        for p, g in zip(ref_params, grads):
            p.grad = g * coef
        opt.step()
        adamw_selected_columns_(grads, masters, exp_avgs, exp_avg_sqs, steps, params, cols, grad_scale=coef,
                                use_triton=use, **hp)
    for p, w, m, v, ref in zip(params, masters, exp_avgs, exp_avg_sqs, ref_params):
        st = opt.state[ref]
        torch.testing.assert_close(w, ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m, st["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(s, torch.full_like(s, 4.0)) for s in steps)


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_selected_columns_one_launch_per_dtype_pair(device, monkeypatch):
    """The launch strategy: one kernel launch per (param dtype, grad dtype) group, however many parameters."""
    _use_triton("triton", device)
    from zenflow_compile.triton_kernels import adamw_columns

    launches = []
    real = adamw_columns._kernel

    class Counting:
        def on(self, dev):
            kernel = real.on(dev)

            class Launch:
                def __getitem__(self, grid):
                    launches.append(grid)
                    return kernel[grid]
            return Launch()

    monkeypatch.setattr(adamw_columns, "_kernel", Counting())
    gen = torch.Generator().manual_seed(3)
    ps = [_make_param(case, device, gen) for case in PARAM_CASES]
    args = [[p[key] for p in ps] for key in ("grad", "master", "exp_avg", "exp_avg_sq", "step", "param", "cols")]
    adamw_selected_columns_(*args, grad_columns=[p["gcols"] for p in ps], use_triton=True, **HP)
    # Groups: fp32/fp32, bf16/bf16, fp16/fp16, bf16/fp32; one program per 32-column tile of each parameter.
    assert len(launches) == 4
    k_tiles = sum(-(-case[2] // 32) for case in PARAM_CASES)
    assert sum(grid[0] for grid in launches) == k_tiles


def test_adamw_selected_columns_rejects_bad_shapes():
    p = torch.randn(4, 6)
    cols = torch.tensor([1, 3])
    z = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="master"):
        adamw_selected_columns_([z], [torch.zeros(4, 3)], [z], [z], [torch.zeros(2)], [p], [cols], **HP)
    with pytest.raises(ValueError, match="grad_columns"):
        adamw_selected_columns_([torch.zeros(4, 6)], [z], [z], [z], [torch.zeros(2)], [p], [cols],
                                grad_columns=[torch.tensor([0])], **HP)


def test_triton_available_cpu_follows_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available("cpu")
    assert not triton_available("meta")
