"""``run_trainer.py`` with test faults: ``python tests/faulty_peer.py --faults nan_loss@3 [trainer flags]``.

The faults (tests/faults.py) are hooked into this process's training run before the real ``run_trainer.main``.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # tests/faults.py: this script's folder comes first on sys.path
    from faults import inject_training_faults, run_with_faults

    import run_trainer

    sys.exit(run_with_faults("faulty_peer.py", sys.argv[1:], inject_training_faults, run_trainer.main))
