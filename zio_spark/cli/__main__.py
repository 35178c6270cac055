"""``python -m zio_spark.cli``: the ``zio-spark`` command."""

import sys

from zio_spark.cli.main import main

sys.exit(main())
