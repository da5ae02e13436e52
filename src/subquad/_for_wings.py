"""What the core exports for its wings: the one private module ``integrations/`` and ``compat/`` import.

A wing hands the core a public call (``subquad.attention``, ``subquad.sdpa``, ...) and raises the
public exceptions (``subquad.ArgumentError``); where it needs more than the face, it takes it from
here, so the names the core owes its wings stand in one list (``tests/test_wings_use_exported_names.py``
checks that no wing reaches past it). It defines nothing; the names, by what they are for:

- ``Budget``, ``parse_budget``, ``format_bytes``: a memory budget read and printed as every front end does it.
- ``setting_on``, ``setting_text``: a ``SUBQUAD_*`` variable read the core's way (``_settings.switch``, ``.text``).
- ``build_native_in_background``: a host starts the C++ kernel's build beside itself (``_native``).
- ``prepare``, ``Varlen``, ``backward_grads``: the eager call, planned once and run by torch's own operators.
- ``compiled_attention``, ``supports``, ``attention_op``, ``attention_backward_op``: the ``torch.compile`` operator.
- ``TORCH_SDPA``: torch's ``scaled_dot_product_attention`` as it was before anything patched it.
- ``compare_paired``, ``PRACTICAL``, ``SAME``: the verdict ``subquad bench`` names a winner by.
- ``synchronize``, ``CudaPeak``, ``RssPeak``, ``MpsAfter``: the memory meters ``subquad bench`` reads.
"""

from ._autograd import backward_grads
from ._backends import TORCH_SDPA
from ._budget import Budget, format_bytes, parse_budget
from ._call import Varlen, prepare
from ._compile import attention_backward_op, attention_op, compiled_attention, supports
from ._meters import CudaPeak, MpsAfter, RssPeak, synchronize
from ._native import build_in_background as build_native_in_background
from ._settings import switch as setting_on
from ._settings import text as setting_text
from ._verdicts import PRACTICAL, SAME, compare_paired

__all__ = [
    "Budget",
    "parse_budget",
    "format_bytes",
    "setting_on",
    "setting_text",
    "build_native_in_background",
    "prepare",
    "Varlen",
    "backward_grads",
    "compiled_attention",
    "supports",
    "attention_op",
    "attention_backward_op",
    "TORCH_SDPA",
    "compare_paired",
    "PRACTICAL",
    "SAME",
    "synchronize",
    "CudaPeak",
    "RssPeak",
    "MpsAfter",
]
