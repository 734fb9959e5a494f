from .e2e import main

raise SystemExit(main())
