from services.kvstore.main import main

raise SystemExit(main())
