"""The breakable-graph engine: usable alone, on any callable, and importing nothing of the rest of the
package (``tests/test_features.py`` checks it).

* :mod:`.graphs`: capture a function as graph segments separated by eager breaks (:func:`eager_break`,
  :func:`capture_breakable`, :class:`GraphPool`), and replay them;
* :mod:`.runner`: :class:`GraphRunner` replaces a callable with signature-keyed graphs (static inputs,
  warm-ups, capture, replay, fallbacks, branches, counters);
* :mod:`.tree`: call arguments as tensors plus a hashable signature; :mod:`.opaque`: stand-ins for
  arguments a signature cannot hold;
* :mod:`.hooks`: recorded, reversible method patches, what invalidates graphs, the pipeline lock;
* :mod:`.auto_breaks`, :mod:`.hostile`, :mod:`.python_data`: what a capture cannot hold, made an eager
  break or a graph constant; :mod:`.python_state`: the Python values a capture read, checked between calls;
* :mod:`.budget`: a least-recently-used limit on captured signatures.

>>> import torch
>>> from bcg_diffusion.core import GraphRunner, GraphPool
>>> runner = GraphRunner(model.forward, name="model", pool=GraphPool("cuda"), lock=threading.RLock())  # doctest: +SKIP
>>> out = runner(x)   # the first call of a signature captures, later ones replay   # doctest: +SKIP
"""

from .graphs import BreakableGraph, BreakResultMismatch, GraphPool, PeerCaptureFailed, capture_breakable, eager_break
from .runner import BCGWarning, GraphRunner, OuterState

__all__ = [
    "BCGWarning",
    "BreakResultMismatch",
    "BreakableGraph",
    "GraphPool",
    "GraphRunner",
    "OuterState",
    "PeerCaptureFailed",
    "capture_breakable",
    "eager_break",
]
