"""The call's options as one record (issue 57, item 5): built once at the face, immutable, and
passed down with every option intact (each option set gives the float64 golden's result)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import subquad
from conftest import assert_close_to_golden, naive_attention
from subquad import _call, _compile, _fast
from subquad._options import CallOptions, Varlen, given
from subquad._validate import call_inputs, make_inputs

B, HQ, HK, LQ, LK, E = 2, 4, 2, 37, 53, 24  # awkward sizes: no length divides a chunk


def _qkv(heads_k=HQ, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, LQ, E, generator=g, dtype=dtype)
    k = torch.randn(B, heads_k, LK, E, generator=g, dtype=dtype)
    v = torch.randn(B, heads_k, LK, E, generator=g, dtype=dtype)
    return q, k, v


def _shift(score, b, h, q_idx, kv_idx):
    return score + 0.1 * (kv_idx - q_idx)


def _window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 8


def _count_records(monkeypatch) -> list:
    built: list = []
    init = CallOptions.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(CallOptions, "__init__", counting)
    return built


# ----------------------------------------------------------------- the record
def test_the_record_holds_the_faces_keywords_with_their_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(CallOptions)}
    for face in (subquad.attention, subquad.explain):
        keywords = {n: p.default for n, p in inspect.signature(face).parameters.items() if p.kind is p.KEYWORD_ONLY}
        assert fields == keywords, face.__name__


def test_the_record_is_immutable_and_slotted():
    options = CallOptions(scale=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.scale = 2.0  # type: ignore[misc]
    assert not hasattr(options, "__dict__")
    packed = Varlen([0, 3], [0, 3])
    with pytest.raises(dataclasses.FrozenInstanceError):
        packed.alignment = "bottom_right"  # type: ignore[misc]


def test_a_layer_takes_the_record_or_keywords_not_both():
    options = CallOptions(is_causal=True)
    assert given(options, {}) is options
    made = given(None, {"is_causal": True, "backend": "matmul"})
    assert (made.is_causal, made.backend, made.scale) == (True, "matmul", None)
    with pytest.raises(TypeError, match=r"not both \(got \['scale'\]\)"):
        given(options, {"scale": 0.5})
    with pytest.raises(TypeError, match="unexpected keyword argument 'causal'"):
        given(None, {"causal": True})


def test_the_face_builds_the_record_once_with_the_given_values(monkeypatch):
    q, k, v = _qkv(heads_k=HK)
    mask = torch.rand(LQ, LK, generator=torch.Generator().manual_seed(1)) > 0.2
    given_values = dict(
        attn_mask=mask,
        is_causal=False,
        score_mod=_shift,
        mask_mod=_window,
        scale=0.3,
        enable_gqa=True,
        dropout_p=0.0,
        memory_budget="8MiB",
        chunk_size=(16, 32),
        backend="matmul",
        return_lse=True,
        allow_compile=False,
    )
    seen = []
    real = _call.attention
    monkeypatch.setattr(_call, "attention", lambda *a, **kw: seen.append(a[3]) or real(*a, **kw))
    built = _count_records(monkeypatch)
    subquad.attention(q, k, v, **given_values)
    assert len(built) == 1, "one record per call, built at the face"
    (options,) = seen
    for name, value in given_values.items():
        assert getattr(options, name) is value, name


def test_explain_and_varlen_faces_hand_down_one_record(monkeypatch):
    q, k, v = _qkv()
    seen = {}
    real_explain, real_varlen = _call.explain, _call.varlen_attention
    monkeypatch.setattr(_call, "explain", lambda *a, **kw: seen.setdefault("explain", a) and real_explain(*a, **kw))
    monkeypatch.setattr(
        _call, "varlen_attention", lambda *a, **kw: seen.setdefault("varlen", a) and real_varlen(*a, **kw)
    )
    subquad.explain(q, k, v, is_causal=True, memory_budget="4MiB", backend="matmul")
    options = seen["explain"][3]
    assert (options.is_causal, options.memory_budget, options.backend) == (True, "4MiB", "matmul")

    packed = q[0].transpose(0, 1)  # (total, H, E)
    cu = torch.tensor([0, 10, LQ], dtype=torch.int32)
    subquad.varlen_attention(packed, packed, packed, cu, cu, max_seqlen_q=27, alignment="bottom_right", scale=0.2)
    options, varlen = seen["varlen"][3:5]
    assert options.scale == 0.2 and options.attn_mask is None
    assert varlen.cu_seqlens_q is cu and varlen.max_seqlen_q == 27 and varlen.alignment == "bottom_right"


def test_a_remembered_plan_builds_no_record(monkeypatch):
    _fast.clear()
    q = torch.randn(1, 2, 8, 16)
    built = _count_records(monkeypatch)
    with torch.no_grad():
        first = subquad.attention(q, q, q)
        assert len(built) == 1
        again = subquad.attention(q, q, q)
    assert len(built) == 1, "the fast path keys the loose arguments"
    assert torch.equal(first, again)


# ----------------------------------------------------------------- every option survives the trip down
OPTIONS = [
    pytest.param(dict(), id="defaults"),
    pytest.param(dict(attn_mask="bool"), id="attn_mask-bool"),
    pytest.param(dict(attn_mask="float"), id="attn_mask-float"),
    pytest.param(dict(is_causal=True), id="is_causal"),
    pytest.param(dict(score_mod=_shift), id="score_mod"),
    pytest.param(dict(mask_mod=_window), id="mask_mod"),
    pytest.param(dict(scale=0.37), id="scale"),
    pytest.param(dict(enable_gqa=True), id="enable_gqa"),
    pytest.param(dict(memory_budget="512KiB", is_causal=True), id="memory_budget"),
    pytest.param(dict(chunk_size=(16, 32), is_causal=True), id="chunk_size"),
    pytest.param(dict(backend="matmul", is_causal=True), id="backend"),
    pytest.param(dict(return_lse=True, is_causal=True), id="return_lse"),
    pytest.param(dict(allow_compile=False, score_mod=_shift), id="allow_compile"),
]


def _kwargs(kw, q, k):
    kw = dict(kw)
    g = torch.Generator().manual_seed(2)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(LQ, LK, generator=g) > 0.3
        kw["attn_mask"][:, 0] = True  # no fully masked row (the golden's 0 is checked elsewhere)
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(1, HQ, LQ, LK, generator=g, dtype=q.dtype)
    return kw


@pytest.mark.parametrize("kw", OPTIONS)
def test_each_option_reaches_the_engine(kw):
    q, k, v = _qkv(heads_k=HK if kw.get("enable_gqa") else HQ)
    kw = _kwargs(kw, q, k)
    golden_kw = {n: x for n, x in kw.items() if n not in ("memory_budget", "chunk_size", "backend", "allow_compile")}
    golden = naive_attention(q, k, v, **golden_kw)
    result = subquad.attention(q, k, v, **kw)
    if kw.get("return_lse"):
        (out, lse), (gold_out, gold_lse) = result, golden
        assert_close_to_golden(lse, gold_lse, name="lse")
    else:
        out, gold_out = result, golden
    assert_close_to_golden(out, gold_out)
    plan = subquad.explain(q, k, v, **kw)
    if "memory_budget" in kw:
        assert plan.budget_bytes == 512 << 10
    if "chunk_size" in kw:
        assert plan.chunk_size == (16, 32)
    if "backend" in kw:
        assert plan.backend == "matmul"


def test_dropout_p_reaches_the_engine():
    q, k, v = _qkv()
    assert torch.equal(subquad.attention(q, k, v, dropout_p=1.0), torch.zeros_like(q))
    torch.manual_seed(5)
    first = subquad.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    assert torch.equal(first, subquad.attention(q, k, v, dropout_p=0.5))
    assert not torch.allclose(first, naive_attention(q, k, v))


def test_allow_compile_reaches_the_planner(monkeypatch):
    q, k, v = _qkv()
    seen = []
    real = _call.make_plan
    monkeypatch.setattr(_call, "make_plan", lambda inp, opts, *a, **kw: seen.append(opts) or real(inp, opts, *a, **kw))
    for allow in (False, True):
        subquad.explain(q, k, v, score_mod=_shift, allow_compile=allow)
        assert seen[-1].allow_compile is allow


def test_packed_and_nested_calls_keep_their_options():
    q, k, v = _qkv()
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # (total, H, E): one sequence of each batch entry's rows
    cu_q = torch.tensor([0, 17, LQ], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, LK], dtype=torch.int32)
    out, lse = subquad.varlen_attention(*packed, cu_q, cu_k, is_causal=True, scale=0.4, return_lse=True)
    for s in range(2):
        rows, keys = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        gold_out, gold_lse = naive_attention(
            *(t[r].transpose(0, 1) for t, r in zip(packed, (rows, keys, keys))),
            is_causal=True,
            scale=0.4,
            return_lse=True,
        )
        assert_close_to_golden(out[rows].transpose(0, 1), gold_out)
        assert_close_to_golden(lse[rows].t(), gold_lse, name="lse")


def test_packed_sequences_refuse_a_dense_mask():
    t = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="attn_mask with packed sequences: pass the mask as a mask_mod"):
        subquad.varlen_explain(t, t, t, cu, cu, attn_mask=torch.ones(8, 8, dtype=torch.bool))


# ----------------------------------------------------------------- the layers below the face
def test_the_keyword_form_validates_as_the_record():
    q, k, v = _qkv(heads_k=HK)
    mask = torch.randn(HQ, LQ, LK, dtype=torch.float64)
    by_keywords = make_inputs(q, k, v, attn_mask=mask, scale=0.5, enable_gqa=True, dropout_p=0.1, mask_mod=_window)
    by_record = call_inputs(
        q, k, v, CallOptions(attn_mask=mask, scale=0.5, enable_gqa=True, dropout_p=0.1, mask_mod=_window)
    )
    for f in dataclasses.fields(by_keywords):
        a, b = getattr(by_keywords, f.name), getattr(by_record, f.name)
        assert (a is b or torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b, f.name


def test_prepare_takes_the_record_or_keywords():
    q, k, v = _qkv()
    by_record = _call.prepare(q, k, v, CallOptions(is_causal=True, memory_budget="1MiB", backend="matmul"))
    by_keywords = _call.prepare(q, k, v, is_causal=True, memory_budget="1MiB", backend="matmul")
    assert by_record.budget == by_keywords.budget == 1 << 20
    assert by_record.plan.chunk_size == by_keywords.plan.chunk_size
    assert by_record.inp.is_causal and by_keywords.inp.is_causal
    with pytest.raises(TypeError, match="not both"):
        _call.prepare(q, k, v, CallOptions(), is_causal=True)


def test_the_compiled_operator_runs_the_record_it_is_handed():
    q, k, v = _qkv(dtype=torch.float32)
    options = CallOptions(is_causal=True, scale=0.3, memory_budget=1 << 20, chunk_size=[16, 32], return_lse=True)
    out, lse = _compile.attention(q, k, v, options)
    by_keywords = _compile.compiled_attention(
        q, k, v, is_causal=True, scale=0.3, memory_budget=1 << 20, chunk_size=[16, 32], return_lse=True
    )
    eager = subquad.attention(
        q, k, v, is_causal=True, scale=0.3, memory_budget=1 << 20, chunk_size=(16, 32), return_lse=True
    )
    for a, b, c in zip((out, lse), by_keywords, eager):
        assert torch.equal(a, b) and torch.equal(a, c)
    # The operator's schema values back into a record: the budget travels as a string, tiles as a list.
    back = _compile._record(q, k, None, True, 0.3, False, "1048576", [16, 32], "auto", True)
    assert (back.memory_budget, back.chunk_size, back.return_lse, back.mask_mod is not None) == (
        1 << 20,
        (16, 32),
        True,
        True,
    )


def test_attention_block_takes_a_ring_steps_keywords():
    from subquad._inputs import BlockPositions

    q, k, v = _qkv()
    out, lse, plan = _call.attention_block(
        q, k, v, BlockPositions(0, 0, (LQ, LK)), is_causal=True, scale=0.25, memory_budget=1 << 20
    )
    gold_out, gold_lse = naive_attention(q, k, v, is_causal=True, scale=0.25, return_lse=True)
    assert_close_to_golden(out, gold_out)
    assert_close_to_golden(lse, gold_lse, name="lse")
    assert plan.budget_bytes == 1 << 20
