"""transformers integration on tiny models built from config (random weights, nothing downloaded).

Golden: the same model with transformers' "sdpa" implementation (float64), or "eager" where a
model has no "sdpa" (eager's softmax runs in float32, hence its looser tolerance). Under test:
attn_implementation="subquad" with subquad forced into many tiles.

A larger ``initializer_range`` than the default makes attention peaky enough that a wrong mask
or a wrong head mapping changes the logits by O(1), not by rounding.
"""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import subquad  # noqa: E402
from subquad.integrations import transformers as sqt  # noqa: E402

MANY_TILES = (7, 5)
VOCAB = 101


def _close(test, golden, *, tol=1e-10, what="output"):
    err = (test - golden).abs().max().item()
    scale = golden.abs().max().item() or 1.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.1e} x {scale:.3e}"


@pytest.fixture(autouse=True)
def registered():
    sqt.register(chunk_size=MANY_TILES)
    yield


def _llama(**overrides):
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        pad_token_id=0,
    )
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).double().eval()


def _mistral():
    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=6,
        max_position_embeddings=256,
        initializer_range=0.3,
        pad_token_id=0,
    )
    return MistralForCausalLM(cfg).double().eval()


def _batch(length, pads=(5, 0), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(pads), length), generator=g)
    mask = torch.ones_like(ids)
    for row, p in enumerate(pads):  # left padding
        ids[row, :p] = 0
        mask[row, :p] = 0
    return ids, mask


def _logits(model, impl, ids, mask=None):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def _generate(model, impl, ids, mask, n=12, cache="dynamic"):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, cache_implementation=cache
        )


@pytest.fixture
def calls(monkeypatch):
    seen = []
    real = subquad.attention

    def spy(query, key, value, **kwargs):
        seen.append(dict(kwargs, Lq=query.shape[-2], Lk=key.shape[-2], Hq=query.shape[1], Hk=key.shape[1]))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(subquad, "attention", spy)
    return seen


# ----------------------------------------------------------------------------- masks
def _padding(total, pads):
    keep = torch.ones(len(pads), total, dtype=torch.bool)
    for row, p in enumerate(pads):  # left padding
        keep[row, :p] = False
    return keep


def _packed():
    if not hasattr(mu, "remap_positions_for_packed_sequence"):
        pytest.skip(
            "this transformers has no masking_utils.remap_positions_for_packed_sequence (transformers 5.20 has not)"
        )
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))])
    fn = mu.and_masks(
        mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos),
        mu.packed_sequence_mask_function(mu.find_packed_sequence_indices(pos)),
    )
    return dict(q_length=9, kv_length=9, mask_function=fn, allow_is_causal_skip=False)


MASK_CASES = {
    "causal-square": lambda: dict(q_length=9, kv_length=9),
    "causal-left-padding": lambda: dict(q_length=9, kv_length=9, attention_mask=_padding(9, (3, 0))),
    "decode-one-query-long-cache": lambda: dict(
        q_length=1, kv_length=30, q_offset=29, attention_mask=_padding(30, (4, 0))
    ),
    "chunked-prefill": lambda: dict(q_length=5, kv_length=12, q_offset=7, attention_mask=_padding(12, (2, 1))),
    "sliding-window": lambda: dict(
        q_length=17, kv_length=17, local_size=5, mask_function=mu.sliding_window_causal_mask_function(5)
    ),
    "sliding-window-cache-offset": lambda: dict(
        q_length=3,
        kv_length=7,
        q_offset=9,
        kv_offset=5,
        local_size=5,
        mask_function=mu.sliding_window_causal_mask_function(5),
        attention_mask=_padding(12, (2, 0)),
    ),
    "static-cache-prefill": lambda: dict(q_length=6, kv_length=16, attention_mask=_padding(6, (0, 0))),
    "bidirectional-padding": lambda: dict(
        q_length=7,
        kv_length=7,
        mask_function=mu.bidirectional_mask_function,
        attention_mask=_padding(7, (2, 0)),
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=True,
    ),
    "chunked-attention": lambda: dict(
        q_length=11,
        kv_length=11,
        local_size=4,
        mask_function=mu.chunked_causal_mask_function(4, torch.tensor([2, 0])),
    ),
    "packed-sequences": _packed,
}


@pytest.mark.parametrize("case", list(MASK_CASES), ids=list(MASK_CASES))
def test_lazy_mask_equals_sdpa_mask(case):
    kw = dict(batch_size=2, **MASK_CASES[case]())
    golden = mu.sdpa_mask(**kw)
    got = sqt.subquad_mask(**kw)
    if golden is None:
        assert got is None
    else:
        assert isinstance(got, sqt.LazyMask) and got.shape == golden.shape
        assert torch.equal(got.materialize(), golden)


# ----------------------------------------------------------------------------- models
def test_llama_gqa_left_padding_matches_sdpa(calls):
    model = _llama()
    ids, mask = _batch(23)
    golden = _logits(model, "sdpa", ids, mask)
    eager = _logits(model, "eager", ids, mask)
    out = _logits(model, "subquad", ids, mask)
    _close(out, golden, what="logits vs sdpa")
    # eager turns fully masked float64 rows into NaN (its float32 softmax of finfo(float64).min),
    # which then leaks through the padded positions; its unpadded row is still a fair check.
    _close(out[1], eager[1], tol=1e-5, what="logits vs eager (unpadded row)")
    assert len(calls) == 2
    for c in calls:
        assert c["enable_gqa"] and (c["Hq"], c["Hk"]) == (4, 2)
        assert c["chunk_size"] == MANY_TILES
        assert c["mask_mod"] is not None and c["attn_mask"] is None and not c["is_causal"]


def test_llama_without_padding_uses_is_causal(calls):
    model = _llama()
    ids, _ = _batch(23, pads=(0, 0))
    _close(_logits(model, "subquad", ids), _logits(model, "sdpa", ids), what="logits")
    assert calls and all(c["is_causal"] and c["mask_mod"] is None for c in calls)


def test_from_pretrained_with_attn_implementation(tmp_path):
    _llama().save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="subquad", dtype=torch.float64).eval()
    assert model.config._attn_implementation == "subquad"
    ids, mask = _batch(17)
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
    _close(out, _logits(model, "sdpa", ids, mask), what="logits")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_is_identical(calls, cache):
    model = _llama()
    ids, mask = _batch(24, pads=(6, 0))
    golden = _generate(model, "sdpa", ids, mask, cache=cache)
    calls.clear()
    out = _generate(model, "subquad", ids, mask, cache=cache)
    assert torch.equal(out, golden), f"\n{out[:, 24:]}\n{golden[:, 24:]}"
    decode = [c for c in calls if c["Lq"] == 1]
    assert decode and all(c["mask_mod"] is not None for c in decode)  # the left padding rides along
    if cache == "dynamic":  # one query against the whole cache
        assert max(c["Lk"] for c in decode) == 24 + 12 - 1


def test_sliding_window_model_matches_sdpa(calls):
    model = _mistral()
    ids, mask = _batch(19, pads=(3, 0))
    golden = _logits(model, "sdpa", ids, mask)
    out = _logits(model, "subquad", ids, mask)
    _close(out, golden, what="logits")
    assert all(c["mask_mod"] is not None for c in calls)
    # The window matters here: without it the logits move by O(1).
    model.config.sliding_window = None
    assert (_logits(model, "sdpa", ids, mask) - golden).abs().max() > 1e-3
    model.config.sliding_window = 6
    assert torch.equal(_generate(model, "subquad", ids, mask), _generate(model, "sdpa", ids, mask))


def test_training_gradients_match():
    model = _llama()
    model.train()
    ids, mask = _batch(15)
    grads = {}
    for impl in ("sdpa", "subquad"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if "self_attn" in n}
    for n, g in grads["sdpa"].items():
        _close(grads["subquad"][n], g, tol=1e-8, what=f"grad of {n}")


def test_softcap_runs_as_score_mod():
    # Gemma 2: logit soft-capping and alternating sliding/full layers; "sdpa" refuses it.
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        attn_logit_softcapping=2.0,
        initializer_range=0.3,
        pad_token_id=0,
    )
    model = Gemma2ForCausalLM(cfg).double().eval()
    ids, mask = _batch(19, pads=(0, 0))
    golden = _logits(model, "eager", ids, mask)
    _close(_logits(model, "subquad", ids, mask), golden, tol=1e-5, what="logits vs eager")


def test_attention_sinks_renormalise_by_the_lse():
    # gpt-oss: one learned sink logit per head joins the softmax. Its experts need float32.
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.3,
        pad_token_id=0,
    )
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_(0.0, 2.0)
    ids, mask = _batch(19, pads=(3, 0))
    golden = _logits(model, "eager", ids, mask)
    out = _logits(model, "subquad", ids, mask)
    _close(out[1], golden[1], tol=1e-5, what="logits vs eager (unpadded row)")
    _close(out[0, 3:], golden[0, 3:], tol=1e-5, what="logits vs eager (padded row, real tokens)")
    # Training: gradients (sinks included) flow through the differentiable lse, as in eager.
    grads = {}
    for impl in ("eager", "subquad"):
        model.zero_grad()
        model.set_attn_implementation(impl)
        logits = model(ids, attention_mask=mask).logits
        (logits[1].square().mean() + logits[0, 3:].square().mean()).backward()
        grads[impl] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "sinks" in n or "q_proj" in n}
    for name, g in grads["eager"].items():
        _close(grads["subquad"][name], g, tol=1e-4, what=f"grad of {name}")


def test_compiled_model_has_no_graph_break():
    # Under torch.compile the mask is built as a tensor and subquad runs as one operator.
    model = _llama()
    ids, mask = _batch(13, pads=(4, 0))
    golden = _logits(model, "sdpa", ids, mask)
    model.set_attn_implementation("subquad")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(ids, attention_mask=mask).logits
    _close(out, golden, what="compiled logits")


@pytest.fixture
def transformers_warnings():
    """What transformers' loggers print, with ``warning_once``'s memory cleared before and after."""
    import io
    import logging

    from transformers.utils import logging as tf_logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = tf_logging.get_logger()
    tf_logging.warning_once.cache_clear()
    root.addHandler(handler)
    yield stream
    root.removeHandler(handler)
    tf_logging.warning_once.cache_clear()


def _attention_outputs(outputs):
    return {k: v for k, v in outputs.items() if "attentions" in k}


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_output_attentions_behaves_as_under_sdpa(transformers_warnings, family):
    # transformers 5's "sdpa" warns once and returns no weights (empty tuples); so does "subquad".
    ids, mask = _batch(7, pads=(2, 0))
    model = _llama() if family == "llama" else _bart()
    extra = {} if family == "llama" else {"decoder_input_ids": ids[:, :4]}
    runs = {}
    for impl in ("sdpa", "subquad"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            first = model(ids, attention_mask=mask, output_attentions=True, **extra)
            model(ids, attention_mask=mask, output_attentions=True, **extra)
        runs[impl] = first
    printed = transformers_warnings.getvalue().splitlines()
    for impl in ("sdpa", "subquad"):
        assert sum(f"`{impl}` attention does not support `output_attentions=True`" in line for line in printed) == 1
        assert runs[impl].keys() == runs["sdpa"].keys()
        assert _attention_outputs(runs[impl]) == _attention_outputs(runs["sdpa"])
        assert all(v == () for v in _attention_outputs(runs[impl]).values())
    _close(runs["subquad"].logits, runs["sdpa"].logits, what="logits")
    model.set_attn_implementation("subquad")
    with torch.no_grad():  # return_dict=False keeps the (empty) attentions in the tuple, as "sdpa" does
        as_tuple = model(ids, attention_mask=mask, output_attentions=True, return_dict=False, **extra)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        golden = model(ids, attention_mask=mask, output_attentions=True, return_dict=False, **extra)
    assert [type(x) for x in as_tuple] == [type(x) for x in golden]


def test_register_rejects_unknown_options():
    with pytest.raises(TypeError, match=r"unexpected option.*'mask_mod'"):
        sqt.register(mask_mod=lambda b, h, q, k: q >= k)


# ----------------------------------------------------------------------------- static caches
# A StaticCache hands the mask its query offset as a tensor that each layer's update() increases in
# place. The LazyMask is evaluated inside the layer, after that update: it must use the offset as
# it was when the mask was made, as "sdpa" (which builds the tensor at once) does. Where no 2-D mask
# covers the empty slots past the offset, a mask reading the live tensor lets each query see the
# next, still empty, slot.
def test_lazy_mask_keeps_the_static_cache_offset_it_was_made_with():
    from transformers import StaticCache

    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=4)
    cache = StaticCache(config=cfg, max_cache_len=6)
    kv = torch.zeros(1, 4, 3, 8)
    cache.update(kv, kv, 0)
    masks = {}
    for impl in ("sdpa", "subquad"):
        cfg._attn_implementation = impl
        masks[impl] = mu.create_causal_mask(cfg, torch.zeros(1, 1, 32), None, cache)
    assert isinstance(masks["subquad"], sqt.LazyMask)
    new = torch.zeros(1, 4, 1, 8)
    cache.update(new, new, 0)  # the layer writes before it attends
    assert masks["sdpa"][0, 0, 0].tolist() == [True] * 4 + [False] * 2
    assert torch.equal(masks["subquad"].materialize(), masks["sdpa"])


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).double().eval()


def _decode_loop(model, impl, ids, n=7):
    """transformers' recipe for a StaticCache by hand: prefill, then one token at a time, no mask.
    The logits of the last position at each step ``(B, n + 1, V)``."""
    from transformers import StaticCache

    model.set_attn_implementation(impl)
    # transformers 5.24 renamed the argument past_key_values -> cache (the old name warns).
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {name: StaticCache(config=model.config, max_cache_len=ids.shape[1] + n + 3)}
    steps = []
    with torch.no_grad():
        logits = model(ids, **cache, use_cache=True).logits[:, -1]
        for _ in range(n):
            steps.append(logits)
            logits = model(logits.argmax(-1, keepdim=True), **cache, use_cache=True).logits[:, -1]
    return torch.stack(steps + [logits], dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_cache_decode_loop_without_a_mask_matches_eager(calls, family):
    model = _llama() if family == "llama" else _qwen2()
    ids, _ = _batch(9, pads=(0, 0))
    golden = _decode_loop(model, "eager", ids)
    calls.clear()
    out = _decode_loop(model, "subquad", ids)
    # eager's softmax runs in float32; the mask bug moved these logits by 1e-2 to 1.
    _close(out, golden, tol=1e-6, what="decode-loop logits vs eager")
    _close(out, _decode_loop(model, "sdpa", ids), what="decode-loop logits vs sdpa")
    assert any(c["Lq"] == 1 and c["mask_mod"] is not None for c in calls)  # the LazyMask path ran


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        initializer_factor=3.0,
    )
    return T5ForConditionalGeneration(cfg).double().eval()


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    cfg = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=0,
        decoder_start_token_id=2,
        init_std=0.3,
    )
    return BartForConditionalGeneration(cfg).double().eval()


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_generate_with_a_static_cache_matches_eager(calls, family):
    model = _t5() if family == "t5" else _bart()
    ids, mask = _batch(11, pads=(3, 0))
    scores = {}
    for impl in ("eager", "subquad"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            result = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                cache_implementation="static",
                output_logits=True,
                return_dict_in_generate=True,
            )
        scores[impl] = (result.sequences, torch.stack(result.logits, dim=1))
    assert torch.equal(scores["subquad"][0], scores["eager"][0])
    _close(scores["subquad"][1], scores["eager"][1], tol=1e-6, what="generate logits vs eager")
    assert any(c["Lq"] == 1 and c["mask_mod"] is not None for c in calls)


# ----------------------------------------------------------------------------- padding-free batches
def _flattened(lengths, seed=0):
    """A padding-free batch as transformers' collator makes it (flash-attn kwargs included), and its sequences."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
    batch.pop("labels")
    return batch, [torch.tensor([f["input_ids"]]) for f in features]


@pytest.fixture
def varlen_calls(monkeypatch):
    seen = []
    real = subquad.varlen_attention

    def spy(query, key, value, cu_seqlens_q, cu_seqlens_k, **kwargs):
        seen.append(
            dict(kwargs, cu_q=cu_seqlens_q.tolist(), cu_k=cu_seqlens_k.tolist(), Hq=query.shape[1], Hk=key.shape[1])
        )
        return real(query, key, value, cu_seqlens_q, cu_seqlens_k, **kwargs)

    monkeypatch.setattr(subquad, "varlen_attention", spy)
    return seen


def _packed_vs_separate(model, batch, sequences, golden_impl):
    """Logits and parameter gradients of a weighted sum of the logits: the padding-free batch with
    "subquad", and each sequence on its own with ``golden_impl`` (gradients summed over them)."""
    cu = batch["cu_seq_lens_q"].tolist()
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(1, cu[-1], VOCAB, generator=g, dtype=next(model.parameters()).dtype)
    model.train()  # dropout is 0 in these configs: training mode, same numbers
    results = {}
    for impl in ("subquad", golden_impl):
        model.set_attn_implementation(impl)
        model.zero_grad()
        if impl == "subquad":
            logits = model(**batch).logits
            (logits * weights).sum().backward()
        else:
            parts = []
            for s, ids in enumerate(sequences):
                part = model(ids).logits
                (part * weights[:, cu[s] : cu[s + 1]]).sum().backward()
                parts.append(part)
            logits = torch.cat(parts, dim=1)
        results[impl] = (
            logits.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
    return results["subquad"], results[golden_impl]


def test_padding_free_batch_runs_packed_and_matches_separate_sequences(calls, varlen_calls):
    model = _llama()  # float64, GQA 4/2 heads
    batch, sequences = _flattened((7, 1, 12, 5))
    (logits, grads), (golden_logits, golden_grads) = _packed_vs_separate(model, batch, sequences, "sdpa")
    _close(logits, golden_logits, what="packed logits vs each sequence with sdpa")
    assert grads.keys() == golden_grads.keys()
    for name, g in golden_grads.items():
        _close(grads[name], g, tol=1e-8, what=f"grad of {name}")
    # The packed engine ran (one call per layer), never a mask over the flattened row.
    assert not calls and len(varlen_calls) == 2
    for c in varlen_calls:
        assert c["cu_q"] == c["cu_k"] == [0, 7, 8, 20, 25] and (c["max_seqlen_q"], c["max_seqlen_k"]) == (12, 12)
        assert c["is_causal"] and c["alignment"] == "bottom_right" and c["window"] is None
        assert c["enable_gqa"] and (c["Hq"], c["Hk"]) == (4, 2) and c["chunk_size"] == MANY_TILES


def test_padding_free_batch_sliding_window_softcap_and_scaling(varlen_calls):
    # Gemma 2: alternating sliding (window 6) and full layers, logit soft-capping, its own scaling.
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        initializer_range=0.3,
        pad_token_id=0,
    )
    model = Gemma2ForCausalLM(cfg).double()
    batch, sequences = _flattened((9, 3, 14), seed=2)
    (logits, grads), (golden_logits, golden_grads) = _packed_vs_separate(model, batch, sequences, "eager")
    # eager takes its softmax in float32, hence the tolerance.
    _close(logits, golden_logits, tol=1e-5, what="packed logits vs each sequence with eager")
    for name, g in golden_grads.items():
        _close(grads[name], g, tol=1e-4, what=f"grad of {name}")
    assert sorted(c["window"] is not None for c in varlen_calls) == [False, True]
    for c in varlen_calls:
        assert c["window"] in (None, (5, 5)) and c["score_mod"] is not None and c["scale"] == 24**-0.5
