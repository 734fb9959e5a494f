"""The Gradio demo's logic (``app.py`` lays out the page): :mod:`.session` runs requests, the reference and
the accelerated image side by side; :mod:`.record` saves one request for a replay without a GPU. The names
of :mod:`.session`'s ``__all__`` are importable from here."""

from . import session
from .session import *  # noqa: F403 - the package's names are the session's, listed once in its __all__

__all__ = list(session.__all__)
