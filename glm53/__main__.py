from glm53.cli import main

raise SystemExit(main())
