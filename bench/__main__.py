"""``python -m bench``: see :mod:`bench.cli`. Help and mistakes in the arguments answer before torch is imported;
without a GPU, weights that need one are refused before the pipelines' libraries are imported."""

from .cli import main

raise SystemExit(main())
