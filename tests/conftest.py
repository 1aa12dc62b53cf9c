import sys
from pathlib import Path

# Test helpers (tests/<pkg>/helpers.py) are imported by plain name from their own folder.
for sub in Path(__file__).parent.iterdir():
    if sub.is_dir() and (sub / "helpers.py").exists():
        sys.path.insert(0, str(sub))
