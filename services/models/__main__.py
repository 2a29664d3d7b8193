from .prepare import main

raise SystemExit(main())
