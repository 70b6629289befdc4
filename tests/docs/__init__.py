"""Tests that run or check the docs' code blocks."""

import re

FENCE = re.compile(r"^```(bash|python)\n(.*?)^```$", re.S | re.M)  # a fenced bash or python block: (lang, body)
