from services.scheduler.main import main

raise SystemExit(main())
