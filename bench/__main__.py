"""``python -m bench``. Without a GPU, weights that need one are refused before the pipelines' libraries are
imported (``bench.runs.refuse_early``), so the message comes in seconds."""

import sys

from .runs import refuse_early

if refuse_early(sys.argv[1:]):
    raise SystemExit(2)

from .cli import main  # noqa: E402 - after the early refusal, which needs only torch

raise SystemExit(main())
