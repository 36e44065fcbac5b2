"""pipemem against published measurements of real runs: `pipemem.validation.published`.

python bench/validate_published.py [--json] [--out docs/published_runs.md] [--traced] [--ids A,B]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipemem.validation.published import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
