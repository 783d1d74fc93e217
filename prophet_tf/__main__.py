"""`python -m prophet_tf COMMAND` is `prophet-tf COMMAND`."""
import sys

from prophet_tf.cli import main

sys.exit(main())
