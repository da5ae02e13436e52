"""pytest plugin for `.ci/transformers-tests`: transformers' own tests with "subquad" wherever they get "sdpa".

Loaded with ``-p transformers_tests_plugin`` (the script puts ``.ci`` on ``PYTHONPATH``, so xdist's
workers load it too). In each process it

- registers subquad (``subquad.integrations.transformers.register``), with the options the script
  passes in ``SUBQUAD_TT_OPTIONS`` (JSON);
- makes transformers resolve ``"sdpa"`` to ``"subquad"``: ``PreTrainedModel.get_correct_attn_implementation``
  is where an explicit ``attn_implementation="sdpa"`` (``from_pretrained``, ``from_config``,
  ``set_attn_implementation``) and the default (none asked for, ``"sdpa"`` if the model supports it)
  are both decided, so one wrapper there covers both without touching transformers' test files;
- lets the models that refuse "sdpa" only because it cannot soft-cap the scores (Gemma 2) take it,
  so that their "sdpa" tests run too: subquad soft-caps as a ``score_mod``;
- counts the calls that reach subquad's attention function, written to ``SUBQUAD_TT_COUNTS/<worker>``,
  so the script can show that subquad, not torch's SDPA, ran;
- skips, with the reason, the tests listed in ``KNOWN``: failures that are transformers' own or not
  about attention.
"""

import importlib
import json
import os
import re

import pytest

# test id pattern (re.search on the node id) -> why it is skipped.
_READS_THE_NAME_BACK = (
    'asserts that a model asked for "sdpa" reports config._attn_implementation == "sdpa"; in this run '
    '"sdpa" resolves to "subquad" on purpose'
)
KNOWN = {
    r"::test_can_set_attention_dynamically\b": _READS_THE_NAME_BACK,
    r"::test_can_set_attention_dynamically_composite_model\b": _READS_THE_NAME_BACK,
    r"::test_sdpa_can_dispatch_non_composite_models\b": _READS_THE_NAME_BACK,
    r"::test_sdpa_can_dispatch_composite_models\b": _READS_THE_NAME_BACK,
    r"::test_attn_implementation_composite_models\b": _READS_THE_NAME_BACK,
}

# module -> its PreTrainedModel base, whose _supports_sdpa is False for softcap alone.
SOFTCAP_ONLY = {"transformers.models.gemma2.modeling_gemma2": "Gemma2PreTrainedModel"}

_calls = 0


def _options():
    return json.loads(os.environ.get("SUBQUAD_TT_OPTIONS") or "{}")


def pytest_configure(config):
    from transformers import AttentionInterface, PreTrainedModel

    import subquad.integrations.transformers as sqt

    options = _options()
    if "chunk_size" in options and isinstance(options["chunk_size"], list):
        options["chunk_size"] = tuple(options["chunk_size"])
    sqt.register(**options)

    def counted(*args, **kwargs):
        global _calls
        _calls += 1
        return sqt.subquad_attention_forward(*args, **kwargs)

    AttentionInterface.register(sqt.NAME, counted)

    for module, name in SOFTCAP_ONLY.items():
        getattr(importlib.import_module(module), name)._supports_sdpa = True

    resolve = PreTrainedModel.get_correct_attn_implementation
    if getattr(resolve, "_subquad", False):
        return

    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        applicable = resolve(self, requested_attention, is_init_check)
        return sqt.NAME if applicable == "sdpa" else applicable

    get_correct_attn_implementation._subquad = True
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def pytest_collection_modifyitems(config, items):
    for item in items:
        for pattern, reason in KNOWN.items():
            if re.search(pattern, item.nodeid):
                item.add_marker(pytest.mark.skip(reason=f"subquad run: {reason}"))
                break


def pytest_unconfigure(config):
    folder = os.environ.get("SUBQUAD_TT_COUNTS")
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(folder, worker), "w") as f:
            f.write(str(_calls))
