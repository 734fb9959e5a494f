"""Triton's interpreter for the ``_*_interpret.py`` scripts: import this first, before Triton or torch.

It sets ``TRITON_INTERPRET=1``, which Triton reads when it is imported, and works around Triton 3.6's
interpreter turning a loop bound taken from an argument into a Python int with ``int()`` of a one-element
array, which NumPy 2.4 refuses (the GPU compiler is unaffected): the bound reads the element instead.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime import interpreter  # noqa: E402 - after the environment Triton reads on import

_patch_lang_tensor = interpreter._patch_lang_tensor


def _index_by_element(tensor, scope) -> None:  # noqa: ANN001
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _index_by_element
