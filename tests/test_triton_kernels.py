"""Triton kernels (triton_kernels/) against float64 torch recomputations.

CPU: the kernels run under the Triton interpreter (`TRITON_INTERPRET=1`, set by an autouse fixture for these
tests only, so Inductor's kernels elsewhere in the session stay compiled). CUDA: the same tests, compiled, when
a GPU is present. Every kernel test also runs the plain-torch fallback (`impl="torch"`), the path taken
where Triton cannot run.

Tolerances (fp32 unit roundoff u = 2**-24 ~ 6e-8):
- column norms: a sum of R <= 129 non-negative fp32 terms has relative error <= (R + 1) u ~ 8e-6; rtol 1e-5,
  atol 0 (measured: <= 3e-7).
- AdamW vs float64: about ten fp32 roundings per element, each <= u relative to operands of magnitude <= ~3,
  so rtol 1e-5 / atol 1e-6 leaves a margin of >3x (measured on CPU: master <= 2.7e-7, exp_avg <= 1.4e-8,
  exp_avg_sq <= 1e-9 abs). Counts are exact integers. Members a step leaves out keep every bit.
- AdamW kernel vs its torch twin: the same fp32 formula (lerp's formula, IEEE division and square root), up to
  FMA contraction: rtol 1e-6 / atol 1e-7.
- AdamW vs torch.optim.AdamW over several steps (fp32): the same fp32 formula with different operation
  order / FMA contraction; rtol 1e-5 / atol 1e-6 (measured on CPU: <= 1.2e-7 abs).
"""

import pytest
import torch

pytest.importorskip("triton")

from zenflow_compile.triton_kernels import adamw_slab_, column_sq_norms, triton_available  # noqa: E402

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


# ------------------------------------------------------------------------------------------------ AdamW
HP = dict(lr=3e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)

# (n, R, k, grad dtype, rows): slabs of n members, [R, k] selected columns each
SLAB_CASES = [
    (1, 1, 1, torch.float32, None),
    (3, 17, 5, torch.bfloat16, None),
    (4, 129, 1, torch.float32, [0, 2, 3]),   # k = 1, many rows, some members
    (2, 33, 40, torch.float16, [1]),         # two column tiles, one member
    (5, 4, 2, torch.bfloat16, [4, 0]),       # members in any order
]


def _make_slab(case, device, gen):
    n, R, k, gdtype, rows = case
    return dict(grad=torch.randn(n, R, k, generator=gen).to(gdtype).to(device),
                master=torch.randn(n, R, k, generator=gen).to(device),
                exp_avg=0.1 * torch.randn(n, R, k, generator=gen).to(device),
                exp_avg_sq=0.01 * torch.rand(n, R, k, generator=gen).to(device),
                counts=torch.randint(0, 50, (n, k), generator=gen).float().to(device))  # counts that differ


def _expected_f64(slab, scale, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step in float64 from the inputs, per column count c (after the increment)."""
    g = slab["grad"].double() * scale
    c = (slab["counts"].double() + 1).unsqueeze(1)
    w = slab["master"].double() * (1 - lr * weight_decay)
    m = slab["exp_avg"].double() + (1 - beta1) * (g - slab["exp_avg"].double())
    v = beta2 * slab["exp_avg_sq"].double() + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2 ** c).sqrt() + eps
    w = w - lr / (1 - beta1 ** c) * m / denom
    return dict(master=w, exp_avg=m, exp_avg_sq=v, counts=c.squeeze(1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("case", SLAB_CASES, ids=lambda c: f"n{c[0]}-R{c[1]}-k{c[2]}-{c[3]}-rows{c[4]}")
def test_adamw_slab_against_float64(device, impl, scale_kind, case):
    """The members in `rows` take one step (to fp32 rounding of the float64 math); the others keep every bit."""
    use = _use_triton(impl, device)
    slab = _make_slab(case, device, torch.Generator().manual_seed(7))
    rows = case[4]
    scale = 0.37
    grad_scale = scale if scale_kind == "float" else torch.tensor(scale, device=device)
    expected = _expected_f64(slab, scale, **HP)
    before = {key: t.clone() for key, t in slab.items()}
    adamw_slab_(slab["grad"], slab["master"], slab["exp_avg"], slab["exp_avg_sq"], slab["counts"],
                rows=None if rows is None else torch.tensor(rows, device=device), grad_scale=grad_scale,
                use_triton=use, **HP)
    stepped = list(range(case[0])) if rows is None else rows
    for i in range(case[0]):
        for key in ("master", "exp_avg", "exp_avg_sq", "counts"):
            if i not in stepped:
                assert torch.equal(slab[key][i], before[key][i]), f"member {i} {key} changed"
            elif key == "counts":
                assert torch.equal(slab[key][i].double(), expected[key][i])
            else:
                torch.testing.assert_close(slab[key][i].double(), expected[key][i], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"member {i} {key}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SLAB_CASES[1:], ids=lambda c: f"n{c[0]}-R{c[1]}-k{c[2]}-{c[3]}-rows{c[4]}")
def test_adamw_slab_kernel_equals_its_torch_twin(device, case):
    """The Triton kernel and the torch twin agree to fp32 rounding, step after step, with per-column counts
    that differ (the twin's per-column path: the fused CPU AdamW needs equal counts)."""
    _use_triton("triton", device)
    gen = torch.Generator().manual_seed(3)
    slabs = [_make_slab(case, device, torch.Generator().manual_seed(9)) for _ in range(2)]
    for _ in range(3):
        grad = torch.randn(slabs[0]["grad"].shape, generator=gen).to(slabs[0]["grad"].dtype).to(device)
        for slab, use in zip(slabs, (True, False)):
            adamw_slab_(grad, slab["master"], slab["exp_avg"], slab["exp_avg_sq"], slab["counts"],
                        rows=None if case[4] is None else torch.tensor(case[4], device=device), use_triton=use, **HP)
    for key in ("master", "exp_avg", "exp_avg_sq", "counts"):
        torch.testing.assert_close(slabs[0][key], slabs[1][key], rtol=1e-6, atol=1e-7, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("beta1,clip", [(0.9, False), (0.3, True)])  # beta1=0.3: lerp's weight >= 0.5 branch
def test_adamw_slab_matches_torch_adamw(device, impl, beta1, clip):
    """A slab of three [17, 5] parameters, every column selected, several steps: == torch.optim.AdamW to fp32
    rounding (the clip coefficient left on the device)."""
    use = _use_triton(impl, device)
    gen = torch.Generator().manual_seed(11)
    hp = dict(HP, beta1=beta1)
    ref_params = [torch.randn(17, 5, generator=gen).to(device) for _ in range(3)]
    opt = torch.optim.AdamW(ref_params, lr=hp["lr"], betas=(beta1, hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=False)
    master = torch.stack([p.detach() for p in ref_params])
    exp_avg, exp_avg_sq, counts = torch.zeros_like(master), torch.zeros_like(master), torch.zeros(3, 5, device=device)
    for _ in range(4):
        grad = torch.randn(3, 17, 5, generator=gen).to(device)
        coef = 1.0
        if clip:  # what clip_grad_norm_ does
            coef = torch.clamp(0.5 / (grad.square().sum().sqrt() + 1e-6), max=1.0)
        for p, g in zip(ref_params, grad):
            p.grad = g * coef
        opt.step()
        adamw_slab_(grad, master, exp_avg, exp_avg_sq, counts, grad_scale=coef, use_triton=use, **hp)
    for i, ref in enumerate(ref_params):
        st = opt.state[ref]
        torch.testing.assert_close(master[i], ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(exp_avg[i], st["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(exp_avg_sq[i], st["exp_avg_sq"], rtol=1e-5, atol=1e-6)
    assert torch.equal(counts, torch.full_like(counts, 4.0))


def test_adamw_slab_rejects_bad_shapes():
    z = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match=r"exp_avg must be a contiguous \[2, 4, 3\] tensor"):
        adamw_slab_(z, z, torch.zeros(2, 4, 2), z, torch.zeros(2, 3), **HP)
    with pytest.raises(ValueError, match=r"counts must be contiguous fp32 \[2, 3\]"):
        adamw_slab_(z, z, z, z, torch.zeros(3), **HP)
    with pytest.raises(ValueError, match="master must be a contiguous"):
        adamw_slab_(z, z.transpose(1, 2).contiguous().transpose(1, 2), z, z, torch.zeros(2, 3), **HP)


def test_triton_available_cpu_follows_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available("cpu")
    assert not triton_available("meta")
