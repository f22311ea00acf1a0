import sys

from agent_loop.cli.inspect import main

sys.exit(main())
