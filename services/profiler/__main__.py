from services.profiler.main import main

raise SystemExit(main())
