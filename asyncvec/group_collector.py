"""Old home of :mod:`asyncvec.lm.groups` (``GroupCollector``, ``ScoredCompletion``, ``score_completions``).

``import asyncvec.group_collector`` gives that very module, so existing imports, patches and
pickles keep working.
"""

import sys

from asyncvec.lm import groups as _groups

sys.modules[__name__] = _groups
