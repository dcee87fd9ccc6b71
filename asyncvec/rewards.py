"""Old home of :mod:`asyncvec.lm.rewards` (reward plugins and the ``RewardService``).

``import asyncvec.rewards`` gives that very module (one plugin registry), so existing imports,
``@asyncvec.rewards.register`` and pickles keep working.
"""

import sys

from asyncvec.lm import rewards as _rewards

sys.modules[__name__] = _rewards
