"""Tests that run or check the docs' code blocks."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root, where the docs are
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```$", re.S | re.M)  # a fenced bash or python block: (lang, body)
