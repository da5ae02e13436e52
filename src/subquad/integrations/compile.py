"""``subquad::attention``, the operator that ``torch.compile`` sees: the documented names.

The operator lives in the core, below the public function (:mod:`subquad._compile`):
``subquad.attention`` switches to it by itself while compiling. Import
:func:`compiled_attention` from here to call it where a graph must not break
(``torch.compile(fullgraph=True)``, ``torch.export``).
"""

from .._for_wings import attention_backward_op, attention_op, compiled_attention, supports

__all__ = ["compiled_attention", "supports", "attention_op", "attention_backward_op"]
