"""``python -m llmkernels.bench``: see ``llmkernels.bench``."""
import sys

from . import main

sys.exit(main())
