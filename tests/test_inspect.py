"""Inspection of the rewritten backward graphs: Python API, snapshots, debug files, structured trace/tlparse.

Snapshots (`assertExpectedInline`) are of `BackwardGraph.normalized_after_code()`: `print_readable` without
comment lines (source locations) and with each hand-off's slot shown as `slot[name]`. After an intended change to
the passes (or a torch upgrade), refresh them with `EXPECTTEST_ACCEPT=1 pytest tests/test_inspect.py`.
"""

import os
import shutil
import subprocess
import sys
import textwrap
import types

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zenflow_compile import inspect as zf_inspect
from zenflow_compile.config import ZenFlowConfig
from zenflow_compile.runtime import registry
import zenflow_compile.backend  # noqa: F401  (registers the backend)


class RecordingRuntime:
    def __init__(self, bucket_numel=25_000_000):
        self.config = ZenFlowConfig()
        self.bucket_numel = bucket_numel
        self.pids = []

    def take_grads(self, pids, grads, scores=None):
        self.pids.extend(pids)


class DataParallelRecordingRuntime(RecordingRuntime):
    """Looks like a runtime of a 2-rank data-parallel optimizer with 40-element gradient buckets."""

    def __init__(self):
        super().__init__(bucket_numel=40)
        self.data_parallel = types.SimpleNamespace(world_size=2)
        self.buckets = []

    def reduce_grads(self, pids, grads):
        self.buckets.append(list(pids))
        self.pids.extend(pids)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def rewrite(model, x, runtime=None, **compile_kwargs):
    """Compile and run forward + backward inside `capture()`; return the one rewritten backward graph."""
    runtime = runtime or RecordingRuntime()
    for p in model.parameters():
        registry.register_param(p, runtime)
    torch._dynamo.reset()
    with zf_inspect.capture() as graphs:
        torch.compile(model, backend="zenflow", **compile_kwargs)(x).sum().backward()
    torch._dynamo.reset()
    assert len(graphs) == 1 and len(runtime.pids) == len(list(model.parameters()))
    return graphs[0]


class TestSnapshots(expecttest.TestCase):
    def test_mlp_backward(self):
        torch.manual_seed(0)
        record = rewrite(MLP(), torch.randn(3, 6))
        self.assertExpectedInline(record.normalized_after_code(), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_3: "f32[3, 6]", primals_4: "f32[4, 8]", relu: "f32[3, 8]", tangents_1: "f32[3, 4]"):
        permute_1: "f32[8, 4]" = torch.ops.aten.permute.default(primals_4, [1, 0]);  primals_4 = None
        permute_2: "f32[4, 8]" = torch.ops.aten.permute.default(permute_1, [1, 0]);  permute_1 = None
        mm: "f32[3, 8]" = torch.ops.aten.mm.default(tangents_1, permute_2);  permute_2 = None
        permute_3: "f32[4, 3]" = torch.ops.aten.permute.default(tangents_1, [1, 0])
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(permute_3, relu);  permute_3 = None

        pow_tensor_scalar_2: "f32[4, 8]" = torch.ops.aten.pow.Tensor_Scalar(mm_1, 2)
        sum_dim_int_list_1: "f32[8]" = torch.ops.aten.sum.dim_IntList(pow_tensor_scalar_2, [0]);  pow_tensor_scalar_2 = None

        sum_1: "f32[1, 4]" = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True);  tangents_1 = None
        view: "f32[4]" = torch.ops.aten.reshape.default(sum_1, [4]);  sum_1 = None

        pow_tensor_scalar_3: "f32[4]" = torch.ops.aten.pow.Tensor_Scalar(view, 2)
        sum_default_1: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_3);  pow_tensor_scalar_3 = None
        reshape_default_1: "f32[1]" = torch.ops.aten.reshape.default(sum_default_1, [1]);  sum_default_1 = None

        le: "b8[3, 8]" = torch.ops.aten.le.Scalar(relu, 0);  relu = None
        full_default: "f32[]" = torch.ops.aten.full.default([], 0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
        where: "f32[3, 8]" = torch.ops.aten.where.self(le, full_default, mm);  le = full_default = mm = None
        permute_6: "f32[8, 3]" = torch.ops.aten.permute.default(where, [1, 0])
        mm_2: "f32[8, 6]" = torch.ops.aten.mm.default(permute_6, primals_3);  permute_6 = primals_3 = None

        pow_tensor_scalar: "f32[8, 6]" = torch.ops.aten.pow.Tensor_Scalar(mm_2, 2)
        sum_dim_int_list: "f32[6]" = torch.ops.aten.sum.dim_IntList(pow_tensor_scalar, [0]);  pow_tensor_scalar = None

        sum_2: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(where, [0], True);  where = None
        view_1: "f32[8]" = torch.ops.aten.reshape.default(sum_2, [8]);  sum_2 = None

        pow_tensor_scalar_1: "f32[8]" = torch.ops.aten.pow.Tensor_Scalar(view_1, 2)
        sum_default: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_1);  pow_tensor_scalar_1 = None
        reshape_default: "f32[1]" = torch.ops.aten.reshape.default(sum_default, [1]);  sum_default = None
        accumulate_grads_default = torch.ops.zenflow.accumulate_grads.default([mm_1, view, mm_2, view_1], [sum_dim_int_list_1, reshape_default_1, sum_dim_int_list, reshape_default], slots[fc2.weight, fc2.bias, fc1.weight, fc1.bias]);  mm_1 = view = mm_2 = view_1 = sum_dim_int_list_1 = reshape_default_1 = sum_dim_int_list = reshape_default = accumulate_grads_default = None
        return (None, None, None, None, None)
""")

    def test_mlp_backward_in_buckets(self):
        # Buckets of >= 40 elements in production order: fc2.weight (32) + fc2.bias (4) + fc1.weight (48),
        # then fc1.bias; each op right after its bucket's last gradient and that gradient's scores.
        torch.manual_seed(0)
        record = rewrite(MLP(), torch.randn(3, 6), runtime=RecordingRuntime(bucket_numel=40))
        self.assertExpectedInline(record.normalized_after_code(), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_3: "f32[3, 6]", primals_4: "f32[4, 8]", relu: "f32[3, 8]", tangents_1: "f32[3, 4]"):
        permute_1: "f32[8, 4]" = torch.ops.aten.permute.default(primals_4, [1, 0]);  primals_4 = None
        permute_2: "f32[4, 8]" = torch.ops.aten.permute.default(permute_1, [1, 0]);  permute_1 = None
        mm: "f32[3, 8]" = torch.ops.aten.mm.default(tangents_1, permute_2);  permute_2 = None
        permute_3: "f32[4, 3]" = torch.ops.aten.permute.default(tangents_1, [1, 0])
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(permute_3, relu);  permute_3 = None

        pow_tensor_scalar_2: "f32[4, 8]" = torch.ops.aten.pow.Tensor_Scalar(mm_1, 2)
        sum_dim_int_list_1: "f32[8]" = torch.ops.aten.sum.dim_IntList(pow_tensor_scalar_2, [0]);  pow_tensor_scalar_2 = None

        sum_1: "f32[1, 4]" = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True);  tangents_1 = None
        view: "f32[4]" = torch.ops.aten.reshape.default(sum_1, [4]);  sum_1 = None

        pow_tensor_scalar_3: "f32[4]" = torch.ops.aten.pow.Tensor_Scalar(view, 2)
        sum_default_1: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_3);  pow_tensor_scalar_3 = None
        reshape_default_1: "f32[1]" = torch.ops.aten.reshape.default(sum_default_1, [1]);  sum_default_1 = None

        le: "b8[3, 8]" = torch.ops.aten.le.Scalar(relu, 0);  relu = None
        full_default: "f32[]" = torch.ops.aten.full.default([], 0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
        where: "f32[3, 8]" = torch.ops.aten.where.self(le, full_default, mm);  le = full_default = mm = None
        permute_6: "f32[8, 3]" = torch.ops.aten.permute.default(where, [1, 0])
        mm_2: "f32[8, 6]" = torch.ops.aten.mm.default(permute_6, primals_3);  permute_6 = primals_3 = None

        pow_tensor_scalar: "f32[8, 6]" = torch.ops.aten.pow.Tensor_Scalar(mm_2, 2)
        sum_dim_int_list: "f32[6]" = torch.ops.aten.sum.dim_IntList(pow_tensor_scalar, [0]);  pow_tensor_scalar = None
        accumulate_grads_default = torch.ops.zenflow.accumulate_grads.default([mm_1, view, mm_2], [sum_dim_int_list_1, reshape_default_1, sum_dim_int_list], slots[fc2.weight, fc2.bias, fc1.weight]);  mm_1 = view = mm_2 = sum_dim_int_list_1 = reshape_default_1 = sum_dim_int_list = accumulate_grads_default = None

        sum_2: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(where, [0], True);  where = None
        view_1: "f32[8]" = torch.ops.aten.reshape.default(sum_2, [8]);  sum_2 = None

        pow_tensor_scalar_1: "f32[8]" = torch.ops.aten.pow.Tensor_Scalar(view_1, 2)
        sum_default: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_1);  pow_tensor_scalar_1 = None
        reshape_default: "f32[1]" = torch.ops.aten.reshape.default(sum_default, [1]);  sum_default = None
        accumulate_grads_default_1 = torch.ops.zenflow.accumulate_grads.default([view_1], [reshape_default], slots[fc1.bias]);  view_1 = reshape_default = accumulate_grads_default_1 = None
        return (None, None, None, None, None)
""")

    def test_mlp_backward_data_parallel(self):
        # Buckets of >= 40 elements in production order: fc2.weight (32) + fc2.bias (4) + fc1.weight (48),
        # then fc1.bias; no norm proxy (the runtime scores the averaged gradient).
        torch.manual_seed(0)
        runtime = DataParallelRecordingRuntime()
        record = rewrite(MLP(), torch.randn(3, 6), runtime=runtime)
        self.assertEqual([len(bucket) for bucket in runtime.buckets], [3, 1])
        self.assertExpectedInline(record.normalized_after_code(), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_3: "f32[3, 6]", primals_4: "f32[4, 8]", relu: "f32[3, 8]", tangents_1: "f32[3, 4]"):
        permute_1: "f32[8, 4]" = torch.ops.aten.permute.default(primals_4, [1, 0]);  primals_4 = None
        permute_2: "f32[4, 8]" = torch.ops.aten.permute.default(permute_1, [1, 0]);  permute_1 = None
        mm: "f32[3, 8]" = torch.ops.aten.mm.default(tangents_1, permute_2);  permute_2 = None
        permute_3: "f32[4, 3]" = torch.ops.aten.permute.default(tangents_1, [1, 0])
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(permute_3, relu);  permute_3 = None
        sum_1: "f32[1, 4]" = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True);  tangents_1 = None
        view: "f32[4]" = torch.ops.aten.reshape.default(sum_1, [4]);  sum_1 = None
        le: "b8[3, 8]" = torch.ops.aten.le.Scalar(relu, 0);  relu = None
        full_default: "f32[]" = torch.ops.aten.full.default([], 0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
        where: "f32[3, 8]" = torch.ops.aten.where.self(le, full_default, mm);  le = full_default = mm = None
        permute_6: "f32[8, 3]" = torch.ops.aten.permute.default(where, [1, 0])
        mm_2: "f32[8, 6]" = torch.ops.aten.mm.default(permute_6, primals_3);  permute_6 = primals_3 = None

        reduce_grads_default = torch.ops.zenflow.reduce_grads.default([mm_1, view, mm_2], slots[fc2.weight, fc2.bias, fc1.weight]);  mm_1 = view = mm_2 = reduce_grads_default = None

        sum_2: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(where, [0], True);  where = None
        view_1: "f32[8]" = torch.ops.aten.reshape.default(sum_2, [8]);  sum_2 = None

        reduce_grads_default_1 = torch.ops.zenflow.reduce_grads.default([view_1], slots[fc1.bias]);  view_1 = reduce_grads_default_1 = None
        return (None, None, None, None, None)
""")

    def test_transformer_block_backward(self):
        torch.manual_seed(0)
        record = rewrite(Block(), torch.randn(2, 4, 8))
        self.assertExpectedInline(record.normalized_after_code(), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 4, 8]", primals_4: "f32[24, 8]", primals_6: "f32[8, 8]", primals_8: "f32[8]", primals_10: "f32[32, 8]", primals_12: "f32[8, 32]", view: "f32[8, 8]", permute_1: "f32[2, 2, 4, 4]", permute_2: "f32[2, 2, 4, 4]", permute_3: "f32[2, 2, 4, 4]", getitem_5: "f32[2, 2, 4, 4]", getitem_6: "f32[2, 2, 4]", addmm_1: "f32[8, 8]", view_8: "f32[8, 8]", addmm_2: "f32[8, 32]", view_10: "f32[8, 32]", tangents_1: "f32[2, 4, 8]"):
        view_12: "f32[8, 8]" = torch.ops.aten.reshape.default(tangents_1, [8, 8])
        permute_7: "f32[32, 8]" = torch.ops.aten.permute.default(primals_12, [1, 0]);  primals_12 = None
        permute_8: "f32[8, 32]" = torch.ops.aten.permute.default(permute_7, [1, 0]);  permute_7 = None
        mm: "f32[8, 32]" = torch.ops.aten.mm.default(view_12, permute_8);  permute_8 = None
        permute_9: "f32[8, 8]" = torch.ops.aten.permute.default(view_12, [1, 0])
        mm_1: "f32[8, 32]" = torch.ops.aten.mm.default(permute_9, view_10);  permute_9 = view_10 = None

        pow_tensor_scalar_10: "f32[8, 32]" = torch.ops.aten.pow.Tensor_Scalar(mm_1, 2)
        sum_dim_int_list_3: "f32[32]" = torch.ops.aten.sum.dim_IntList(pow_tensor_scalar_10, [0]);  pow_tensor_scalar_10 = None

        sum_1: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(view_12, [0], True);  view_12 = None
        view_13: "f32[8]" = torch.ops.aten.reshape.default(sum_1, [8]);  sum_1 = None

        pow_tensor_scalar_11: "f32[8]" = torch.ops.aten.pow.Tensor_Scalar(view_13, 2)
        sum_default_7: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_11);  pow_tensor_scalar_11 = None
        reshape_default_7: "f32[1]" = torch.ops.aten.reshape.default(sum_default_7, [1]);  sum_default_7 = None

        view_14: "f32[2, 4, 32]" = torch.ops.aten.reshape.default(mm, [2, 4, 32]);  mm = None
        view_9: "f32[2, 4, 32]" = torch.ops.aten.reshape.default(addmm_2, [2, 4, 32]);  addmm_2 = None
        mul_5: "f32[2, 4, 32]" = torch.ops.aten.mul.Tensor(view_9, 0.7071067811865476)
        erf: "f32[2, 4, 32]" = torch.ops.aten.erf.default(mul_5);  mul_5 = None
        add_5: "f32[2, 4, 32]" = torch.ops.aten.add.Tensor(erf, 1);  erf = None
        mul_8: "f32[2, 4, 32]" = torch.ops.aten.mul.Tensor(add_5, 0.5);  add_5 = None
        mul_9: "f32[2, 4, 32]" = torch.ops.aten.mul.Tensor(view_9, view_9)
        mul_10: "f32[2, 4, 32]" = torch.ops.aten.mul.Tensor(mul_9, -0.5);  mul_9 = None
        exp: "f32[2, 4, 32]" = torch.ops.aten.exp.default(mul_10);  mul_10 = None
        mul_11: "f32[2, 4, 32]" = torch.ops.aten.mul.Tensor(exp, 0.3989422804014327);  exp = None
        mul_12: "f32[2, 4, 32]" = torch.ops.aten.mul.Tensor(view_9, mul_11);  view_9 = mul_11 = None
        add_8: "f32[2, 4, 32]" = torch.ops.aten.add.Tensor(mul_8, mul_12);  mul_8 = mul_12 = None
        mul_13: "f32[2, 4, 32]" = torch.ops.aten.mul.Tensor(view_14, add_8);  view_14 = add_8 = None
        view_15: "f32[8, 32]" = torch.ops.aten.reshape.default(mul_13, [8, 32]);  mul_13 = None
        permute_6: "f32[8, 32]" = torch.ops.aten.permute.default(primals_10, [1, 0]);  primals_10 = None
        permute_12: "f32[32, 8]" = torch.ops.aten.permute.default(permute_6, [1, 0]);  permute_6 = None
        mm_2: "f32[8, 8]" = torch.ops.aten.mm.default(view_15, permute_12);  permute_12 = None
        permute_13: "f32[32, 8]" = torch.ops.aten.permute.default(view_15, [1, 0])
        mm_3: "f32[32, 8]" = torch.ops.aten.mm.default(permute_13, view_8);  permute_13 = view_8 = None

        pow_tensor_scalar_8: "f32[32, 8]" = torch.ops.aten.pow.Tensor_Scalar(mm_3, 2)
        sum_dim_int_list_2: "f32[8]" = torch.ops.aten.sum.dim_IntList(pow_tensor_scalar_8, [0]);  pow_tensor_scalar_8 = None

        sum_2: "f32[1, 32]" = torch.ops.aten.sum.dim_IntList(view_15, [0], True);  view_15 = None
        view_16: "f32[32]" = torch.ops.aten.reshape.default(sum_2, [32]);  sum_2 = None

        pow_tensor_scalar_9: "f32[32]" = torch.ops.aten.pow.Tensor_Scalar(view_16, 2)
        sum_default_6: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_9);  pow_tensor_scalar_9 = None
        reshape_default_6: "f32[1]" = torch.ops.aten.reshape.default(sum_default_6, [1]);  sum_default_6 = None

        view_17: "f32[2, 4, 8]" = torch.ops.aten.reshape.default(mm_2, [2, 4, 8]);  mm_2 = None
        mul_15: "f32[2, 4, 8]" = torch.ops.aten.mul.Tensor(view_17, primals_8);  primals_8 = None
        mul_16: "f32[2, 4, 8]" = torch.ops.aten.mul.Tensor(mul_15, 8)
        sum_3: "f32[2, 4, 1]" = torch.ops.aten.sum.dim_IntList(mul_15, [2], True)

        view_7: "f32[2, 4, 8]" = torch.ops.aten.reshape.default(addmm_1, [2, 4, 8]);  addmm_1 = None
        add_2: "f32[2, 4, 8]" = torch.ops.aten.add.Tensor(primals_1, view_7);  view_7 = None

        var_mean_1 = torch.ops.aten.var_mean.correction(add_2, [2], correction = 0, keepdim = True)
        getitem_7: "f32[2, 4, 1]" = var_mean_1[0]
        getitem_8: "f32[2, 4, 1]" = var_mean_1[1];  var_mean_1 = None
        add_3: "f32[2, 4, 1]" = torch.ops.aten.add.Tensor(getitem_7, 1e-05);  getitem_7 = None
        rsqrt_1: "f32[2, 4, 1]" = torch.ops.aten.rsqrt.default(add_3);  add_3 = None
        sub_1: "f32[2, 4, 8]" = torch.ops.aten.sub.Tensor(add_2, getitem_8);  add_2 = getitem_8 = None
        mul_2: "f32[2, 4, 8]" = torch.ops.aten.mul.Tensor(sub_1, rsqrt_1);  sub_1 = None
        mul_17: "f32[2, 4, 8]" = torch.ops.aten.mul.Tensor(mul_15, mul_2);  mul_15 = None
        sum_4: "f32[2, 4, 1]" = torch.ops.aten.sum.dim_IntList(mul_17, [2], True);  mul_17 = None
        mul_18: "f32[2, 4, 8]" = torch.ops.aten.mul.Tensor(mul_2, sum_4);  sum_4 = None
        sub_3: "f32[2, 4, 8]" = torch.ops.aten.sub.Tensor(mul_16, sum_3);  mul_16 = sum_3 = None
        sub_4: "f32[2, 4, 8]" = torch.ops.aten.sub.Tensor(sub_3, mul_18);  sub_3 = mul_18 = None
        div: "f32[2, 4, 1]" = torch.ops.aten.div.Tensor(rsqrt_1, 8);  rsqrt_1 = None
        mul_19: "f32[2, 4, 8]" = torch.ops.aten.mul.Tensor(div, sub_4);  div = sub_4 = None
        mul_20: "f32[2, 4, 8]" = torch.ops.aten.mul.Tensor(view_17, mul_2);  mul_2 = None
        sum_5: "f32[8]" = torch.ops.aten.sum.dim_IntList(mul_20, [0, 1]);  mul_20 = None

        pow_tensor_scalar_6: "f32[8]" = torch.ops.aten.pow.Tensor_Scalar(sum_5, 2)
        sum_default_4: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_6);  pow_tensor_scalar_6 = None
        reshape_default_4: "f32[1]" = torch.ops.aten.reshape.default(sum_default_4, [1]);  sum_default_4 = None

        sum_6: "f32[8]" = torch.ops.aten.sum.dim_IntList(view_17, [0, 1]);  view_17 = None

        pow_tensor_scalar_7: "f32[8]" = torch.ops.aten.pow.Tensor_Scalar(sum_6, 2)
        sum_default_5: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_7);  pow_tensor_scalar_7 = None
        reshape_default_5: "f32[1]" = torch.ops.aten.reshape.default(sum_default_5, [1]);  sum_default_5 = None

        add_9: "f32[2, 4, 8]" = torch.ops.aten.add.Tensor(tangents_1, mul_19);  tangents_1 = mul_19 = None

        view_18: "f32[8, 8]" = torch.ops.aten.reshape.default(add_9, [8, 8]);  add_9 = None
        permute_5: "f32[8, 8]" = torch.ops.aten.permute.default(primals_6, [1, 0]);  primals_6 = None
        permute_16: "f32[8, 8]" = torch.ops.aten.permute.default(permute_5, [1, 0]);  permute_5 = None
        mm_4: "f32[8, 8]" = torch.ops.aten.mm.default(view_18, permute_16);  permute_16 = None
        permute_17: "f32[8, 8]" = torch.ops.aten.permute.default(view_18, [1, 0])
        permute_4: "f32[2, 4, 2, 4]" = torch.ops.aten.permute.default(getitem_5, [0, 2, 1, 3])
        view_5: "f32[2, 4, 8]" = torch.ops.aten.reshape.default(permute_4, [2, 4, 8]);  permute_4 = None
        view_6: "f32[8, 8]" = torch.ops.aten.reshape.default(view_5, [8, 8]);  view_5 = None
        mm_5: "f32[8, 8]" = torch.ops.aten.mm.default(permute_17, view_6);  permute_17 = view_6 = None

        pow_tensor_scalar_4: "f32[8, 8]" = torch.ops.aten.pow.Tensor_Scalar(mm_5, 2)
        sum_dim_int_list_1: "f32[8]" = torch.ops.aten.sum.dim_IntList(pow_tensor_scalar_4, [0]);  pow_tensor_scalar_4 = None

        sum_7: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(view_18, [0], True);  view_18 = None
        view_19: "f32[8]" = torch.ops.aten.reshape.default(sum_7, [8]);  sum_7 = None

        pow_tensor_scalar_5: "f32[8]" = torch.ops.aten.pow.Tensor_Scalar(view_19, 2)
        sum_default_3: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_5);  pow_tensor_scalar_5 = None
        reshape_default_3: "f32[1]" = torch.ops.aten.reshape.default(sum_default_3, [1]);  sum_default_3 = None

        view_20: "f32[2, 4, 8]" = torch.ops.aten.reshape.default(mm_4, [2, 4, 8]);  mm_4 = None
        view_21: "f32[2, 4, 2, 4]" = torch.ops.aten.reshape.default(view_20, [2, 4, 2, 4]);  view_20 = None
        permute_20: "f32[2, 2, 4, 4]" = torch.ops.aten.permute.default(view_21, [0, 2, 1, 3]);  view_21 = None

        _scaled_dot_product_flash_attention_for_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(permute_20, permute_1, permute_2, permute_3, getitem_5, getitem_6, 0.0, True);  permute_20 = permute_1 = permute_2 = permute_3 = getitem_5 = getitem_6 = None
        getitem_9: "f32[2, 2, 4, 4]" = _scaled_dot_product_flash_attention_for_cpu_backward[0]
        getitem_10: "f32[2, 2, 4, 4]" = _scaled_dot_product_flash_attention_for_cpu_backward[1]
        getitem_11: "f32[2, 2, 4, 4]" = _scaled_dot_product_flash_attention_for_cpu_backward[2];  _scaled_dot_product_flash_attention_for_cpu_backward = None

        permute_21: "f32[2, 4, 2, 4]" = torch.ops.aten.permute.default(getitem_11, [0, 2, 1, 3]);  getitem_11 = None
        view_22: "f32[2, 4, 8]" = torch.ops.aten.reshape.default(permute_21, [2, 4, 8]);  permute_21 = None
        permute_22: "f32[2, 4, 2, 4]" = torch.ops.aten.permute.default(getitem_10, [0, 2, 1, 3]);  getitem_10 = None
        view_23: "f32[2, 4, 8]" = torch.ops.aten.reshape.default(permute_22, [2, 4, 8]);  permute_22 = None
        permute_23: "f32[2, 4, 2, 4]" = torch.ops.aten.permute.default(getitem_9, [0, 2, 1, 3]);  getitem_9 = None
        view_24: "f32[2, 4, 8]" = torch.ops.aten.reshape.default(permute_23, [2, 4, 8]);  permute_23 = None

        cat: "f32[2, 4, 24]" = torch.ops.aten.cat.default([view_24, view_23, view_22], 2);  view_24 = view_23 = view_22 = None
        view_25: "f32[8, 24]" = torch.ops.aten.reshape.default(cat, [8, 24]);  cat = None
        permute: "f32[8, 24]" = torch.ops.aten.permute.default(primals_4, [1, 0]);  primals_4 = None
        permute_24: "f32[24, 8]" = torch.ops.aten.permute.default(permute, [1, 0]);  permute = None
        mm_6: "f32[8, 8]" = torch.ops.aten.mm.default(view_25, permute_24);  permute_24 = None
        permute_25: "f32[24, 8]" = torch.ops.aten.permute.default(view_25, [1, 0])
        mm_7: "f32[24, 8]" = torch.ops.aten.mm.default(permute_25, view);  permute_25 = view = None

        pow_tensor_scalar_2: "f32[24, 8]" = torch.ops.aten.pow.Tensor_Scalar(mm_7, 2)
        sum_dim_int_list: "f32[8]" = torch.ops.aten.sum.dim_IntList(pow_tensor_scalar_2, [0]);  pow_tensor_scalar_2 = None

        sum_8: "f32[1, 24]" = torch.ops.aten.sum.dim_IntList(view_25, [0], True);  view_25 = None
        view_26: "f32[24]" = torch.ops.aten.reshape.default(sum_8, [24]);  sum_8 = None

        pow_tensor_scalar_3: "f32[24]" = torch.ops.aten.pow.Tensor_Scalar(view_26, 2)
        sum_default_2: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_3);  pow_tensor_scalar_3 = None
        reshape_default_2: "f32[1]" = torch.ops.aten.reshape.default(sum_default_2, [1]);  sum_default_2 = None

        view_27: "f32[2, 4, 8]" = torch.ops.aten.reshape.default(mm_6, [2, 4, 8]);  mm_6 = None
        var_mean = torch.ops.aten.var_mean.correction(primals_1, [2], correction = 0, keepdim = True)
        getitem: "f32[2, 4, 1]" = var_mean[0]
        getitem_1: "f32[2, 4, 1]" = var_mean[1];  var_mean = None
        add: "f32[2, 4, 1]" = torch.ops.aten.add.Tensor(getitem, 1e-05);  getitem = None
        rsqrt: "f32[2, 4, 1]" = torch.ops.aten.rsqrt.default(add);  add = None
        sub: "f32[2, 4, 8]" = torch.ops.aten.sub.Tensor(primals_1, getitem_1);  primals_1 = getitem_1 = None
        mul: "f32[2, 4, 8]" = torch.ops.aten.mul.Tensor(sub, rsqrt);  sub = rsqrt = None
        mul_26: "f32[2, 4, 8]" = torch.ops.aten.mul.Tensor(view_27, mul);  mul = None
        sum_11: "f32[8]" = torch.ops.aten.sum.dim_IntList(mul_26, [0, 1]);  mul_26 = None

        pow_tensor_scalar: "f32[8]" = torch.ops.aten.pow.Tensor_Scalar(sum_11, 2)
        sum_default: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar);  pow_tensor_scalar = None
        reshape_default: "f32[1]" = torch.ops.aten.reshape.default(sum_default, [1]);  sum_default = None

        sum_12: "f32[8]" = torch.ops.aten.sum.dim_IntList(view_27, [0, 1]);  view_27 = None

        pow_tensor_scalar_1: "f32[8]" = torch.ops.aten.pow.Tensor_Scalar(sum_12, 2)
        sum_default_1: "f32[]" = torch.ops.aten.sum.default(pow_tensor_scalar_1);  pow_tensor_scalar_1 = None
        reshape_default_1: "f32[1]" = torch.ops.aten.reshape.default(sum_default_1, [1]);  sum_default_1 = None
        accumulate_grads_default = torch.ops.zenflow.accumulate_grads.default([mm_1, view_13, mm_3, view_16, sum_5, sum_6, mm_5, view_19, mm_7, view_26, sum_11, sum_12], [sum_dim_int_list_3, reshape_default_7, sum_dim_int_list_2, reshape_default_6, reshape_default_4, reshape_default_5, sum_dim_int_list_1, reshape_default_3, sum_dim_int_list, reshape_default_2, reshape_default, reshape_default_1], slots[fc2.weight, fc2.bias, fc1.weight, fc1.bias, ln2.weight, ln2.bias, proj.weight, proj.bias, qkv.weight, qkv.bias, ln1.weight, ln1.bias]);  mm_1 = view_13 = mm_3 = view_16 = sum_5 = sum_6 = mm_5 = view_19 = mm_7 = view_26 = sum_11 = sum_12 = sum_dim_int_list_3 = reshape_default_7 = sum_dim_int_list_2 = reshape_default_6 = reshape_default_4 = reshape_default_5 = sum_dim_int_list_1 = reshape_default_3 = sum_dim_int_list = reshape_default_2 = reshape_default = reshape_default_1 = accumulate_grads_default = None
        return (None, None, None, None, None, None, None, None, None, None, None, None, None)
""")


def test_capture_gives_graphs_before_and_after():
    torch.manual_seed(0)
    model = MLP()
    record = rewrite(model, torch.randn(3, 6))
    assert isinstance(record.before, torch.fx.GraphModule) and isinstance(record.after, torch.fx.GraphModule)
    before_out = record.before.graph.output_node().args[0]
    after_out = record.after.graph.output_node().args[0]
    assert sorted(record.param_names.values()) == sorted(n for n, _ in model.named_parameters())
    for index in record.param_names:
        assert before_out[index] is not None and after_out[index] is None
    assert "zenflow.accumulate_grads" not in record.before_code
    assert record.after_code.count("torch.ops.zenflow.accumulate_grads.default(") == 1  # one bucket
    assert zf_inspect.backward_graphs()[-1] is record


def test_debug_dir_option_and_env(tmp_path, monkeypatch):
    torch.manual_seed(0)
    rewrite(MLP(), torch.randn(3, 6), options={"debug_dir": str(tmp_path / "opt")})
    monkeypatch.setenv("ZENFLOW_DEBUG_DIR", str(tmp_path / "env"))
    rewrite(MLP(), torch.randn(3, 6))
    for sub in ("opt", "env"):
        files = sorted(p.name for p in (tmp_path / sub).iterdir())
        assert len(files) == 2 and files[0].endswith("_after.py") and files[1].endswith("_before.py"), files
        after = (tmp_path / sub / files[0]).read_text()
        assert "torch.ops.zenflow.accumulate_grads.default(" in after and "fc1.weight" in after
        compile(after.split("\n", 1)[1].replace("class GraphModule", "class G", 1), files[0], "exec")


def test_normalize_code_names_slots_and_hides_comments():
    code = ("    # File: /some/where.py:12 in forward\n"
            "    accumulate_grads_default = torch.ops.zenflow.accumulate_grads.default([mm, view], [sum_1, sum_2], "
            "[17, 18]);  mm = None\n")
    assert zf_inspect.normalize_code(code, {17: "fc1.weight", 18: "fc1.bias"}) == (
        "    accumulate_grads_default = torch.ops.zenflow.accumulate_grads.default([mm, view], [sum_1, sum_2], "
        "slots[fc1.weight, fc1.bias]);  mm = None\n")


@pytest.mark.skipif(shutil.which("tlparse") is None, reason="tlparse CLI not installed")
def test_structured_trace_and_logs_show_the_rewritten_graph(tmp_path):
    script = textwrap.dedent("""
        import torch, zenflow_compile
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-2)
        from zenflow_compile.backend import zenflow_backend
        torch.compile(model, backend=zenflow_backend)(torch.randn(3, 6)).sum().backward()
        opt.step()
    """)
    env = dict(os.environ, TORCH_TRACE=str(tmp_path / "trace"), TORCHINDUCTOR_FX_GRAPH_CACHE="0",
               TORCHINDUCTOR_AUTOGRAD_CACHE="0",
               TORCH_LOGS="post_grad_graphs,+zenflow_compile")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ZenFlow rewritten backward graph" in result.stderr  # TORCH_LOGS=post_grad_graphs
    assert "ZenFlow: rewrote a backward graph" in result.stderr  # TORCH_LOGS=+zenflow_compile

    (log,) = list((tmp_path / "trace").iterdir())
    out = tmp_path / "tl_out"
    parsed = subprocess.run(["tlparse", str(log), "-o", str(out), "--no-browser", "--overwrite"],
                            capture_output=True, text=True, timeout=120)
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    artifacts = {p.name: p for p in out.rglob("*") if "zenflow_backward" in p.name}
    after = [p for name, p in artifacts.items() if "zenflow_backward_after" in name]
    before = [p for name, p in artifacts.items() if "zenflow_backward_before" in name]
    assert after and before, sorted(p.name for p in out.rglob("*"))
    assert "torch.ops.zenflow.accumulate_grads.default(" in after[0].read_text()
    assert "zenflow" not in before[0].read_text().replace("zenflow_backward_before", "")
    assert "zenflow_backward_after" in (out / "index.html").read_text() or any(
        "zenflow_backward_after" in p.read_text(errors="ignore") for p in out.rglob("*.html"))
