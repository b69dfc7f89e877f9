"""Makes ``algos_reference`` (the naive loop implementations) importable from the tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
