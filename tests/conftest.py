import sys
from pathlib import Path

# Shared test helpers (tests/scored_rows.py, tests/tiny_models.py) are imported by plain name.
sys.path.insert(0, str(Path(__file__).parent))
