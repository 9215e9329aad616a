"""``python -m outbox_dispatch.ops.cli``: the ``outbox-dispatch`` command."""

import sys

from outbox_dispatch.ops.cli import main

if __name__ == "__main__":
    sys.exit(main())
