"""transformers' common model tests (``ModelTesterMixin``) for a few families, from transformers' sdist alone.

`.ci/transformers-tests` copies this file into the ``tests/`` package of transformers' sdist when
the per-model test files (``tests/models/...``) and the generation mixin (``tests/generation``)
cannot be had: they are not in the sdist, only on GitHub. The sdist does ship
``tests/test_modeling_common.py``; what it lacks is the small "model tester" of each family (a
tiny config and its inputs), written here instead: tiny random models in the spirit of
transformers' own (a few layers, hidden size 32, batch 3, length 7, grouped-query heads where the
family has them), with left and right padding in the masks.
"""

import unittest

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BartForQuestionAnswering,
    BartModel,
    BertConfig,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertLMHeadModel,
    BertModel,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma2ForSequenceClassification,
    Gemma2ForTokenClassification,
    Gemma2Model,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MistralForQuestionAnswering,
    MistralForSequenceClassification,
    MistralForTokenClassification,
    MistralModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForQuestionAnswering,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2Model,
    T5Config,
    T5ForConditionalGeneration,
    T5ForQuestionAnswering,
    T5Model,
)
from transformers.testing_utils import require_torch, torch_device

from .test_modeling_common import ModelTesterMixin, ids_tensor


def _padded_mask(batch, length):
    """Row 0 left-padded by 2, row 1 right-padded by 2, the rest full (the last token always real)."""
    mask = torch.ones(batch, length, dtype=torch.long, device=torch_device)
    mask[0, :2] = 0
    if batch > 1:
        mask[1, -2:] = 0
        mask[1, -1] = 1
    return mask


class _Tester:
    batch_size = 3
    seq_length = 7
    is_training = True
    vocab_size = 99
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    intermediate_size = 37
    num_labels = 3
    num_choices = 4
    type_sequence_label_size = 2

    def __init__(self, parent, make_config):
        self.parent = parent
        self._make_config = make_config

    def get_config(self):
        return self._make_config(self)

    def input_ids(self):
        return ids_tensor([self.batch_size, self.seq_length], self.vocab_size)

    def prepare_config_and_inputs_for_common(self):
        inputs = {"input_ids": self.input_ids(), "attention_mask": _padded_mask(self.batch_size, self.seq_length)}
        return self.get_config(), inputs


class _DecoderOnlyTester(_Tester):
    pass


class _BertTester(_Tester):
    num_key_value_heads = None

    def prepare_config_and_inputs_for_common(self):
        config, inputs = super().prepare_config_and_inputs_for_common()
        inputs["token_type_ids"] = ids_tensor([self.batch_size, self.seq_length], 2)
        return config, inputs


class _Seq2SeqTester(_Tester):
    num_key_value_heads = None
    decoder_seq_length = 7
    encoder_seq_length = 7
    eos_token_id = 2
    first_free_id = 3

    def input_ids(self):
        ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(self.first_free_id)
        ids[:, -1] = self.eos_token_id
        return ids

    def prepare_config_and_inputs_for_common(self):
        config, inputs = super().prepare_config_and_inputs_for_common()
        inputs["decoder_input_ids"] = ids_tensor([self.batch_size, self.decoder_seq_length], self.vocab_size).clamp(
            self.first_free_id
        )
        inputs["decoder_attention_mask"] = _padded_mask(self.batch_size, self.decoder_seq_length)
        return config, inputs


def _decoder_config(config_class, **extra):
    def make(t):
        return config_class(
            vocab_size=t.vocab_size,
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_hidden_layers,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.num_key_value_heads,
            max_position_embeddings=512,
            initializer_range=0.02,
            pad_token_id=0,
            **extra,
        )

    return make


def _bert_config(t):
    return BertConfig(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        intermediate_size=t.intermediate_size,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=512,
        type_vocab_size=2,
        initializer_range=0.02,
        pad_token_id=0,
    )


def _t5_config(t):
    return T5Config(
        vocab_size=t.vocab_size,
        d_model=t.hidden_size,
        d_ff=t.intermediate_size,
        d_kv=t.hidden_size // t.num_attention_heads,
        num_layers=t.num_hidden_layers,
        num_decoder_layers=t.num_hidden_layers,
        num_heads=t.num_attention_heads,
        relative_attention_num_buckets=8,
        dropout_rate=0.1,
        initializer_factor=0.002,
        eos_token_id=t.eos_token_id,
        pad_token_id=0,
        decoder_start_token_id=0,
    )


def _bart_config(t):
    return BartConfig(
        vocab_size=t.vocab_size,
        d_model=t.hidden_size,
        encoder_layers=t.num_hidden_layers,
        decoder_layers=t.num_hidden_layers,
        encoder_attention_heads=t.num_attention_heads,
        decoder_attention_heads=t.num_attention_heads,
        encoder_ffn_dim=t.intermediate_size,
        decoder_ffn_dim=t.intermediate_size,
        dropout=0.1,
        attention_dropout=0.1,
        max_position_embeddings=64,
        eos_token_id=t.eos_token_id,
        pad_token_id=1,
        bos_token_id=0,
        decoder_start_token_id=t.eos_token_id,
    )


class _Common(ModelTesterMixin):
    family_tester = _DecoderOnlyTester
    make_config = None
    # The generation tests (GenerationTesterMixin) are not in the sdist; () says so to the test that
    # checks a generative model's test class runs them.
    all_generative_model_classes = ()

    def setUp(self):
        self.model_tester = self.family_tester(self, type(self).make_config)


@require_torch
class LlamaCommonTest(_Common, unittest.TestCase):
    make_config = _decoder_config(LlamaConfig)
    all_model_classes = (
        LlamaModel,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        LlamaForQuestionAnswering,
        LlamaForTokenClassification,
    )


@require_torch
class MistralCommonTest(_Common, unittest.TestCase):
    make_config = _decoder_config(MistralConfig, sliding_window=4)
    all_model_classes = (
        MistralModel,
        MistralForCausalLM,
        MistralForSequenceClassification,
        MistralForQuestionAnswering,
        MistralForTokenClassification,
    )


@require_torch
class Qwen2CommonTest(_Common, unittest.TestCase):
    make_config = _decoder_config(Qwen2Config)
    all_model_classes = (
        Qwen2Model,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
        Qwen2ForQuestionAnswering,
        Qwen2ForTokenClassification,
    )


@require_torch
class Gemma2CommonTest(_Common, unittest.TestCase):
    make_config = _decoder_config(Gemma2Config, head_dim=8, sliding_window=4)
    all_model_classes = (Gemma2Model, Gemma2ForCausalLM, Gemma2ForSequenceClassification, Gemma2ForTokenClassification)


@require_torch
class BertCommonTest(_Common, unittest.TestCase):
    family_tester = _BertTester
    make_config = _bert_config
    all_model_classes = (
        BertModel,
        BertLMHeadModel,
        BertForMaskedLM,
        BertForMultipleChoice,
        BertForNextSentencePrediction,
        BertForPreTraining,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertForTokenClassification,
    )

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class is BertForPreTraining:  # two heads, two labels
            batch, length = inputs["input_ids"].shape
            inputs["labels"] = torch.zeros(batch, length, dtype=torch.long, device=torch_device)
            inputs["next_sentence_label"] = torch.zeros(batch, dtype=torch.long, device=torch_device)
        return inputs


@require_torch
class T5CommonTest(_Common, unittest.TestCase):
    family_tester = type("_T5Tester", (_Seq2SeqTester,), {"eos_token_id": 1, "first_free_id": 2})
    make_config = _t5_config
    is_encoder_decoder = True
    # No *ForSequenceClassification: it wants as many <eos> in each row as in the others, which the
    # common tests' extra random rows do not have (and no inputs_embeds, for T5's).
    all_model_classes = (T5Model, T5ForConditionalGeneration, T5ForQuestionAnswering)


@require_torch
class BartCommonTest(_Common, unittest.TestCase):
    family_tester = _Seq2SeqTester
    make_config = _bart_config
    is_encoder_decoder = True
    all_model_classes = (BartModel, BartForConditionalGeneration, BartForQuestionAnswering)  # as T5's
